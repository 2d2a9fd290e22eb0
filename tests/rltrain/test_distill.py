"""On-policy distillation (algorithm.distill), both estimators: a run through Ray in which a peaked student distils a
uniform teacher, where the reverse KL is exact from the student's entropy, KL(π ‖ u) = log V − H(π), which the actor
logs (actor/entropy) from the full distribution; with a constant reward the GRPO advantages are 0, so the distillation
term alone moves the policy. kl=exact's gradient against dense float64 logits, from a teacher of another width,
packed and padded. The teacher's checks, by key. (The sampled estimator's advantage term: tests/rltrain/algorithms.)"""

import json
import math

import pytest
import ray
import torch

from rltrain.algorithms.config import DistillConfig, LossConfig
from rltrain.config import ConfigError
from rltrain.embedded.tokenizer import build_char_tokenizer
from rltrain.job import load_job_config
from rltrain.main_grpo import run
from rltrain.workers.actor import ActorWorker
from rltrain.workers.actor_config import ActorConfig
from rltrain.workers.reference import check_teacher
from tests.rltrain.tiny_job import TINY, merge, metric_records, record_started_roles, save_tiny_policy, tiny_job


def _policy(path, head_scale: float) -> str:
    """The tiny embedded Qwen3 with its LM head scaled: 0 gives the uniform distribution, > 1 a peaked one."""
    import transformers as tf

    save_tiny_policy(path)
    model = tf.AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    model.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("kl", ["sampled", "exact"])
def test_a_peaked_student_distils_a_uniform_teacher(tmp_path, monkeypatch, kl):
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        student, teacher = _policy(tmp_path / "student", 15.0), _policy(tmp_path / "teacher", 0.0)
        plugin = tmp_path / "zero.py"
        plugin.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
        out = tmp_path / "run"
        job = tiny_job(out, trainer={"total_steps": 10}, actor={"lr": 1e-2}, model={"path": student},
                       reward={"path": str(plugin), "name": "score"},
                       algorithm={"distill": {"teacher_path": teacher, "coef": 1.0, "kl": kl}})
        started = record_started_roles(monkeypatch)
        run(job)
    finally:
        ray.shutdown()
    train = [r for r in metric_records(out) if "train/reward_mean" in r]
    assert len(train) == 10
    log_vocab = math.log(json.loads((tmp_path / "teacher" / "config.json").read_text())["vocab_size"])
    exact = [log_vocab - r["actor/entropy"] for r in train]   # KL(π ‖ uniform) of each step's policy
    assert exact[0] > 0.8, exact       # the student starts far from the teacher ...
    # ... and distillation closes most of the gap: measured 1.17 -> 0.40 (sampled), 1.17 -> 0.08 (exact, no noise)
    assert max(exact[-2:]) < (0.6 if kl == "sampled" else 0.2) * exact[0], exact
    if kl == "sampled":
        assert started == ["ActorWorker", "RolloutWorker×1", "ReferenceWorker"]  # the teacher (kl_coef 0: no ref)
        assert all(r["time/teacher_s"] > 0 for r in train)
        sampled = [r["train/distill_reverse_kl"] for r in train]
        # the logged sample of the reverse KL estimates the exact one (a step's noise averages out over the run)
        assert sum(sampled) / len(sampled) == pytest.approx(sum(exact) / len(exact), abs=0.25), (sampled, exact)
    else:
        assert started == ["ActorWorker", "RolloutWorker×1"]  # the teacher lives in the actor's process
        assert "train/distill_reverse_kl" not in train[0] and "time/teacher_s" not in train[0]
        # the actor's exact KL, from the teacher's hidden states, is log V − H(π) to rounding
        assert [r["actor/distill_kl"] for r in train] == pytest.approx(exact, abs=1e-4)


def _scored_batch(model_dir: str):
    """3 prompts × 4 responses sampled from the model, zero advantages (so only a distillation term moves it)."""
    from transformers import AutoTokenizer

    from rltrain.data.sampler import encode_prompts
    from rltrain.embedded.task import make_rows
    from rltrain.workers.rollout import RolloutConfig, RolloutWorker

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids, mask = encode_prompts(make_rows(load_job_config(TINY).data.task)[0][:3], tokenizer)
    rollout = RolloutWorker(RolloutConfig(n=4, max_new_tokens=5, torch_threads=1), model_dir, "float32", None)
    batch = rollout.generate(ids, mask, 4, 0.7, seed=0)
    batch["advantages"] = torch.zeros(batch["response_mask"].shape)
    batch["old_logprobs"] = torch.zeros(batch["response_mask"].shape)
    return batch


def _dense_reverse_kl(student, teacher, batch, temperature: float) -> torch.Tensor:
    """Σ over response tokens of KL(π ‖ π_teacher) at `temperature`, each sequence run alone without padding, with
    the full logits (the ground truth for linear_kl_div's)."""
    total = 0.0
    for row in range(batch.batch_size[0]):
        prompt = batch["prompt_ids"][row][batch["prompt_mask"][row] != 0]
        response = batch["response_ids"][row][batch["response_mask"][row] != 0]
        if len(response) == 0:
            continue
        ids = torch.cat([prompt, response]).unsqueeze(0)
        at = slice(len(prompt) - 1, ids.shape[1] - 1)   # the positions that predict the response tokens
        log_p = torch.log_softmax(student(ids).logits[0, at] / temperature, -1)
        log_q = torch.log_softmax(teacher(ids).logits[0, at] / temperature, -1)
        total = total + (log_p.exp() * (log_p - log_q)).sum()
    return total


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_exact_kl_gradient_matches_dense_float64(tmp_path, packed):
    """algorithm.distill.kl=exact: the actor's gradient is coef × that of the mean reverse KL over the mini-batch's
    response tokens, from a teacher of another width (hidden 64 against the student's 32), packed or padded."""
    import transformers as tf

    student = save_tiny_policy(tmp_path / "student")
    teacher = save_tiny_policy(tmp_path / "teacher", hidden_size=64, head_dim=32)
    batch = _scored_batch(student)
    actor = ActorWorker(ActorConfig(torch_threads=1, micro_batch_size=5, grad_clip=1e9, use_remove_padding=packed),
                        LossConfig(), student, "float32", None, temperature=0.7,
                        distill=DistillConfig(teacher_path=teacher, coef=0.5, kl="exact"))
    actor.optimizer.step = lambda: None   # keep the gradients of one update
    metrics = actor._optimizer_step(batch)
    reference = tf.AutoModelForCausalLM.from_pretrained(student, dtype=torch.float64)
    frozen = tf.AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float64).requires_grad_(False)
    tokens = int(batch["response_mask"].sum())
    kl = _dense_reverse_kl(reference, frozen, batch, 0.7) / tokens
    (0.5 * kl).backward()
    assert metrics["distill_kl"] == pytest.approx(kl.item(), rel=1e-5)
    expected = dict(reference.named_parameters())
    for name, param in actor.model.named_parameters():
        want = expected[name].grad
        error = (param.grad.double() - want).norm() / want.norm().clamp(min=1e-30)
        assert error < 1e-4, f"{name}: relative error {error:.2e}"


def test_the_teacher_must_share_the_policy_tokenizer(tmp_path):
    policy = build_char_tokenizer()
    check_teacher(save_tiny_policy(tmp_path / "same"), policy)   # the embedded model's own tokenizer: accepted
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text((tmp_path / "same" / "config.json").read_text())
    with pytest.raises(ConfigError, match=r"algorithm.distill.teacher_path: the teacher's tokenizer .* is not the"):
        check_teacher(str(tmp_path / "bare"), policy)   # no tokenizer files: transformers' empty one, refused
    save_tiny_policy(tmp_path / "broken")
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"'.*broken' holds no tokenizer to compare with the policy's \(JSONDecode"):
        check_teacher(str(tmp_path / "broken"), policy)
    other = build_char_tokenizer()
    other.add_tokens(["<extra>"])
    save_tiny_policy(tmp_path / "other", tokenizer=other)
    with pytest.raises(ConfigError, match=r"teacher's tokenizer \(\d+ tokens\) is not the policy's"):
        check_teacher(str(tmp_path / "other"), policy)
    config = json.loads((tmp_path / "same" / "config.json").read_text())
    (tmp_path / "same" / "config.json").write_text(json.dumps(dict(config, vocab_size=len(policy) - 3)))
    with pytest.raises(ConfigError, match=rf"vocab_size {len(policy) - 3} has no row for token ids"):
        check_teacher(str(tmp_path / "same"), policy)


def test_distill_config_is_checked_by_key(tmp_path):
    teacher = save_tiny_policy(tmp_path / "teacher")
    with pytest.raises(ConfigError, match=r"algorithm.distill.coef: must be > 0 \(got 0.0\)"):
        load_job_config(merge(TINY, {"algorithm": {"distill": {"teacher_path": teacher, "coef": 0.0}}}))
    with pytest.raises(ConfigError, match=r"algorithm.distill.teacher_path: must be a transformers model directory"):
        load_job_config(merge(TINY, {"algorithm": {"distill": {"teacher_path": str(tmp_path)}}}))
    with pytest.raises(ConfigError, match=r"algorithm.distill.kl: must be one of sampled, exact \(got 'full'\)"):
        load_job_config(merge(TINY, {"algorithm": {"distill": {"teacher_path": teacher, "kl": "full"}}}))
    with pytest.raises(ConfigError, match=r"algorithm.distill.kl: 'exact' needs actor.strategy=single"):
        load_job_config(merge(TINY, {"actor": {"strategy": "fsdp2"},
                                     "algorithm": {"distill": {"teacher_path": teacher, "kl": "exact"}}}))
