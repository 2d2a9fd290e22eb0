"""On-policy distillation (algorithm.distill): the teacher worker's checks, and a run through Ray in which a peaked
student distils a uniform teacher. Against a uniform teacher the reverse KL is exact from the student's entropy,
KL(π‖u) = log V − H(π), which the actor logs (actor/entropy) from the full distribution; with a constant reward the
GRPO advantages are 0, so the distillation term alone moves the policy. (advantages: tests/rltrain/algorithms.)"""

import json
import math

import pytest
import ray
import torch

from rltrain.config import ConfigError
from rltrain.embedded.tokenizer import build_char_tokenizer
from rltrain.job import load_job_config
from rltrain.main_grpo import run
from rltrain.workers.reference import check_teacher
from tests.rltrain.test_trainer_e2e import _record_started_roles, _records
from tests.rltrain.tiny_job import TINY, merge, save_tiny_policy, tiny_job


def _policy(path, head_scale: float) -> str:
    """The tiny embedded Qwen3 with its LM head scaled: 0 gives the uniform distribution, > 1 a peaked one."""
    import transformers as tf

    save_tiny_policy(path)
    model = tf.AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    model.save_pretrained(path)
    return str(path)


def test_a_peaked_student_distils_a_uniform_teacher(tmp_path, monkeypatch):
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        student, teacher = _policy(tmp_path / "student", 15.0), _policy(tmp_path / "teacher", 0.0)
        plugin = tmp_path / "zero.py"
        plugin.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
        out = tmp_path / "run"
        job = tiny_job(out, trainer={"total_steps": 10}, actor={"lr": 1e-2}, model={"path": student},
                       reward={"path": str(plugin), "name": "score"},
                       algorithm={"distill": {"teacher_path": teacher, "coef": 1.0}})
        started = _record_started_roles(monkeypatch)
        run(job)
    finally:
        ray.shutdown()
    assert started == ["ActorWorker", "RolloutWorker×1", "ReferenceWorker"]  # the teacher; no reference (kl_coef 0)
    train = [r for r in _records(out) if "train/reward_mean" in r]
    assert len(train) == 10 and all(r["time/teacher_s"] > 0 for r in train)
    log_vocab = math.log(json.loads((tmp_path / "teacher" / "config.json").read_text())["vocab_size"])
    exact = [log_vocab - r["actor/entropy"] for r in train]   # KL(π ‖ uniform) of each step's policy
    sampled = [r["train/distill_reverse_kl"] for r in train]
    assert exact[0] > 0.8, exact       # the student starts far from the teacher ...
    assert max(exact[-2:]) < 0.6 * exact[0], exact   # ... and distillation closes most of the gap (1.17 -> 0.40)
    # the logged sample of the reverse KL estimates the exact one (1 - 2 steps' noise averages out over the run)
    assert sum(sampled) / len(sampled) == pytest.approx(sum(exact) / len(exact), abs=0.25), (sampled, exact)


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
