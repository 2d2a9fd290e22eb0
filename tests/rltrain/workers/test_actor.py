"""The actor's update in process (no Ray), on the tiny embedded model: Dr.GRPO's constant normaliser
(algorithm.loss.norm_len), against the loss hand-computed at the first update (ratio 1); the learning-rate schedule
against hand-computed factors, applied to the optimizer and resumed from its saved position exactly; ppo_epochs
passes over reshuffled, seeded mini-batches; mixed precision (actor.mixed_precision, rltrain/workers/precision.py):
one bf16 update at lr 1e-6 moves the fp32 masters' elements where training bf16 in place loses them, and its
gradients are an fp32 actor's to bf16's precision; on a GPU (@pytest.mark.gpu) the same on a Qwen3-shaped model
with the registry's kernels."""

import math

import pytest
import torch
from rltrain_kernels.registry import KernelConfig
from tensordict import TensorDict

from rltrain.algorithms.advantages import compute_advantages
from rltrain.algorithms.config import LossConfig
from rltrain.data.sampler import encode_prompts
from rltrain.embedded.model import embedded_policy_dir
from rltrain.embedded.task import make_rows
from rltrain.workers.actor import ActorWorker
from rltrain.workers.actor_config import ActorConfig, LRSchedule
from rltrain.workers.lora import LoraConfig
from rltrain.workers.rollout import RolloutConfig, RolloutWorker
from tests.helpers import rel_error
from tests.model_factory import tiny_causal_lm
from tests.rltrain.tiny_job import tiny_job


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(model dir, a scored batch of 3 prompts × 4 responses with grpo advantages)."""
    from transformers import AutoTokenizer

    job = tiny_job(tmp_path_factory.mktemp("actor"))
    model_dir = str(embedded_policy_dir(job.trainer.output_dir, job.model.embedded, job.data.task, 0))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids, mask = encode_prompts(make_rows(job.data.task)[0][:3], tokenizer)
    rollout = RolloutWorker(RolloutConfig(n=4, max_new_tokens=5, torch_threads=1), model_dir, "float32", None)
    batch = rollout.generate(ids, mask, 4, 1.0, seed=0)
    batch["rewards"] = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    batch["advantages"] = compute_advantages("drgrpo", batch["rewards"], batch["response_mask"],
                                             batch["group_ids"])
    return model_dir, batch


def _actor(model_dir, loss: LossConfig, dtype: str = "float32", **config) -> ActorWorker:
    return ActorWorker(ActorConfig(**{"torch_threads": 1, "micro_batch_size": 5, **config}), loss, model_dir,
                       dtype, None, temperature=1.0)


def _pad_responses(batch, extra: int):
    """The batch with `extra` more response columns, all masked out (a wider batch, the same sequences)."""
    padded = batch.clone()
    for key in ("response_ids", "response_mask", "advantages", "old_logprobs"):
        padded[key] = torch.nn.functional.pad(batch[key], (0, extra))
    return padded


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_drgrpo_divides_by_the_configured_constant_length(setup, packed):
    """seq-mean-token-sum-norm: loss = Σ_b Σ_t m·pg / (B·norm_len). At the first update the ratio is 1, so pg = −A
    and loss = −Σ_b A_b·|y_b| / (B·norm_len); a batch padded wider gives the same loss (the padded width, the old
    normaliser, would change it by 5/(5+3))."""
    model_dir, batch = setup
    B, norm_len = batch.batch_size[0], 16
    lengths = batch["response_mask"].sum(1).double()
    expected = -(batch["advantages"][:, 0].double() * lengths).sum().item() / (B * norm_len)
    assert abs(expected) > 1e-3
    losses = {}
    for extra in (0, 3):
        for constant in (norm_len, None):
            actor = _actor(model_dir, LossConfig(loss_agg="seq-mean-token-sum-norm", norm_len=constant),
                           use_remove_padding=packed)
            wide = batch.clone()
            wide["old_logprobs"] = actor.compute_logprobs(batch)
            wide = _pad_responses(wide, extra)
            losses[extra, constant] = actor.update(wide)["actor/loss"]
    assert losses[0, norm_len] == pytest.approx(expected, rel=1e-5)
    assert losses[3, norm_len] == pytest.approx(expected, rel=1e-5)
    width = batch["response_mask"].shape[1]
    assert losses[0, None] == pytest.approx(expected * norm_len / width, rel=1e-5)   # the fallback: padded width
    assert losses[3, None] == pytest.approx(expected * norm_len / (width + 3), rel=1e-5)


@pytest.mark.parametrize("kind, expected", [
    ("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
    # after 2 warm-up updates, from 1 at update 2 down to 0.1 at update 5 (the last of 6), then held
    ("linear", [0.5, 1.0, 1.0, 0.1 + 0.9 * 2 / 3, 0.1 + 0.9 / 3, 0.1, 0.1]),
    ("cosine", [0.5, 1.0, 1.0, 0.1 + 0.9 * 0.75, 0.1 + 0.9 * 0.25, 0.1, 0.1]),
])
def test_lr_schedule_factors(kind, expected):
    schedule = LRSchedule.of(ActorConfig(lr_scheduler=kind, lr_warmup_steps=2, min_lr_ratio=0.1), total_steps=6)
    assert [schedule.factor(u) for u in range(7)] == pytest.approx(expected, rel=1e-12)
    ratio = LRSchedule.of(ActorConfig(lr_scheduler=kind, lr_warmup_ratio=0.25), total_steps=12)
    assert ratio.warmup == 3 and ratio.factor(0) == pytest.approx(1 / 3)
    assert LRSchedule.of(ActorConfig(lr_scheduler="cosine"), total_steps=5).factor(0) == 1.0  # no warm-up
    assert math.isclose(LRSchedule.of(ActorConfig(lr_scheduler="cosine"), total_steps=5).factor(4), 0.0,
                        abs_tol=1e-12)


def test_lr_schedule_is_applied_and_resumes_exactly(setup, tmp_path):
    """6 updates with a linear schedule and warm-up: actor/lr and the optimizer's rate follow the factors; a second
    actor loaded after 3 updates (weights, optimizer state, schedule position) continues exactly as the first."""
    model_dir, batch = setup
    batch = batch.clone()
    config = dict(lr=1e-3, lr_scheduler="linear", lr_warmup_steps=2, min_lr_ratio=0.1)
    schedule = LRSchedule.of(ActorConfig(**config), total_steps=6)

    def train(actor, steps):
        lrs = []
        for step in steps:
            batch["old_logprobs"] = actor.compute_logprobs(batch)
            lrs.append(actor.update(batch, step)["actor/lr"])
            assert actor.optimizer.param_groups[0]["lr"] == lrs[-1]
        return lrs

    through = ActorWorker(ActorConfig(torch_threads=1, **config), LossConfig(), model_dir, "float32", None, 1.0,
                          total_steps=6)
    lrs = train(through, range(1, 7))
    assert lrs == pytest.approx([1e-3 * schedule.factor(u) for u in range(6)], rel=1e-12)
    first = ActorWorker(ActorConfig(torch_threads=1, **config), LossConfig(), model_dir, "float32", None, 1.0,
                        total_steps=6)
    train(first, range(1, 4))
    assert first.lr_scheduler_state() == {"updates": 3}
    resumed = ActorWorker(ActorConfig(torch_threads=1, **config), LossConfig(), model_dir, "float32", None, 1.0,
                          total_steps=6)
    first.save_checkpoint(str(tmp_path))
    resumed.load_checkpoint(str(tmp_path))
    resumed.load_lr_scheduler_state(first.lr_scheduler_state())
    assert train(resumed, range(4, 7)) == lrs[3:]
    for name, tensor in through.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], tensor), name


def test_ppo_epochs_pass_over_reshuffled_seeded_mini_batches(setup, monkeypatch):
    """ppo_epochs=2, mini-batches of 4 of the 12 rows: 6 optimizer steps, each pass covering every row once in its
    own order; the same step replays the same orders, another step draws others."""
    model_dir, batch = setup
    batch = batch.clone()
    batch["row"] = torch.arange(batch.batch_size[0])
    batch["old_logprobs"] = torch.zeros_like(batch["advantages"])
    orders = []
    actor = _actor(model_dir, LossConfig(), ppo_epochs=2, mini_batch_size=4)
    optimizer_step = actor._optimizer_step
    monkeypatch.setattr(actor, "_optimizer_step", lambda mini: (orders.append(mini["row"].tolist()),
                                                                   optimizer_step(mini))[1])
    actor.update(batch, step=3)
    assert len(orders) == 6 and all(len(rows) == 4 for rows in orders)
    passes = [sum(orders[:3], []), sum(orders[3:], [])]
    assert sorted(passes[0]) == sorted(passes[1]) == list(range(12))
    assert passes[0] != passes[1] and passes[0] != list(range(12))
    state = next(iter(actor.optimizer.state.values()))
    assert state["step"].item() == 6
    orders.clear()
    actor.update(batch, step=3)
    assert sum(orders, []) == passes[0] + passes[1]
    orders.clear()
    actor.update(batch, step=4)
    assert sum(orders, []) != passes[0] + passes[1]


@pytest.mark.parametrize("loss", [LossConfig(), LossConfig(importance_level="sequence", loss_agg="seq-mean-token-mean"),
                                  LossConfig(kl_coef=0.1)], ids=["grpo", "gspo", "kl"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_on_policy_update_equals_the_recomputed_old_logprobs(setup, loss, packed):
    """algorithm.old_logprobs=update: a batch without old_logprobs trains as one whose old_logprobs the actor
    recomputed first (same weights after the step, same metrics), and hands back those log-probs."""
    model_dir, batch = setup
    batch = batch.clone()
    batch["ref_logprobs"] = -torch.rand(batch["response_mask"].shape) * batch["response_mask"]
    recomputing, on_policy = (_actor(model_dir, loss, use_remove_padding=packed) for _ in range(2))
    given = batch.clone()
    given["old_logprobs"] = recomputing.compute_logprobs(batch)
    expected = recomputing.update(given, step=1)
    result = on_policy.update(batch, step=1)
    assert rel_error(result.pop("old_logprobs"), given["old_logprobs"]) < 1e-6
    assert result.keys() == expected.keys()
    for key, value in expected.items():
        assert result[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert result["actor/clipfrac"] == 0.0 and result["actor/ppo_kl"] == 0.0
    weights = recomputing.state_dict()
    for name, tensor in on_policy.state_dict().items():
        assert rel_error(tensor, weights[name]) < 1e-5, name
    with pytest.raises(ValueError, match=r"actor.ppo_epochs=1 and actor.mini_batch_size=4 over 12 responses"):
        _actor(model_dir, loss, mini_batch_size=4).update(batch)


def _trained_weights(actor: ActorWorker) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """name -> (the weight the optimizer trains, its gradient): the fp32 masters where the actor keeps them, else
    the model's trainable parameters."""
    if actor.master is not None:
        return {name: (master, master.grad) for name, master in actor.master.masters.items()}
    return {name: (p, p.grad) for name, p in actor.model.named_parameters() if p.requires_grad}


def _update_at_lr_1e6(actor: ActorWorker, batch: TensorDict) -> float:
    """One update; the share of the trained elements with a non-zero gradient whose value changed (embedding rows of
    tokens absent from the batch get no gradient, so no Adam step, in any precision)."""
    before = {name: weight.detach().clone() for name, (weight, _) in _trained_weights(actor).items()}
    batch = batch.clone()
    batch["old_logprobs"] = actor.compute_logprobs(batch)
    actor.update(batch)
    changed = moved = 0
    for name, (weight, grad) in _trained_weights(actor).items():
        stepped = grad != 0
        changed += int((stepped & (weight != before[name])).sum())
        moved += int(stepped.sum())
    assert moved > 0
    return changed / moved


def _check_model_is_masters_rounded(actor: ActorWorker, dtype: torch.dtype) -> None:
    params = dict(actor.model.named_parameters())
    assert actor.master is not None and actor.master.masters
    for name, master in actor.master.masters.items():
        assert master.dtype == torch.float32 and params[name].dtype == dtype, name
        assert torch.equal(params[name], master.to(dtype)), name


@pytest.mark.parametrize("mixed_precision, lora", [(True, 0), (False, 0), (True, 4)],
                         ids=["mixed", "in-place", "mixed-lora"])
def test_bf16_update_at_lr_1e6_moves_the_fp32_masters(setup, mixed_precision, lora):
    """model.dtype=bfloat16, one AdamW update at lr 1e-6 (Adam's first step moves each element by about lr): with
    actor.mixed_precision >= 99% of the trained elements change (fp32 masters; with LoRA the adapters') and the bf16
    model holds the masters rounded; trained in place, bf16's 8-bit mantissa loses the update of every element above
    ~5e-4 in magnitude (about 2% move here)."""
    model_dir, batch = setup
    actor = _actor(model_dir, LossConfig(), dtype="bfloat16", lr=1e-6, mixed_precision=mixed_precision,
                   lora=LoraConfig(rank=lora))
    changed = _update_at_lr_1e6(actor, batch)
    if mixed_precision:
        assert changed >= 0.99
        _check_model_is_masters_rounded(actor, torch.bfloat16)
        trained = {name for name, p in actor.model.named_parameters() if p.requires_grad}
        assert set(actor.master.masters) == trained and all(p.grad is None for p in actor.model.parameters())
    else:
        assert actor.master is None and changed < 0.1
        assert all(p.dtype == torch.bfloat16 for p in actor.model.parameters())


def test_mixed_precision_computes_exactly_as_bf16_in_place(setup):
    """The fp32 masters sit beside the model, which is the bf16 model training in place would hold (transformers'
    bf16 load: RoPE's inv_freq stays fp32), so the log-probs are bit for bit the same; only the masters are fp32."""
    model_dir, batch = setup
    mixed = _actor(model_dir, LossConfig(), dtype="bfloat16")
    in_place = _actor(model_dir, LossConfig(), dtype="bfloat16", mixed_precision=False)
    assert {n: b.dtype for n, b in mixed.model.named_buffers()} == \
        {n: b.dtype for n, b in in_place.model.named_buffers()}
    assert torch.equal(mixed.compute_logprobs(batch), in_place.compute_logprobs(batch))


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_mixed_precision_gradients_match_fp32(setup, packed):
    """The fp32 masters' gradients after a bf16 update (micro-batches of 5 rows, accumulated in fp32) against an fp32
    actor's on the same batch and old log-probs: every parameter's within bf16 compute's error (measured: at most
    1.2e-2, packed and padded; a micro-batch's gradient lost or counted twice would be off by tens of percent)."""
    model_dir, batch = setup
    batch = batch.clone()
    rows = dict(use_remove_padding=packed, max_tokens_per_micro_batch=0)  # micro-batches of 5, 5 and 2 rows
    fp32 = _actor(model_dir, LossConfig(), **rows)
    bf16 = _actor(model_dir, LossConfig(), dtype="bfloat16", **rows)
    batch["old_logprobs"] = fp32.compute_logprobs(batch)
    fp32.update(batch)
    bf16.update(batch)
    expected = dict(fp32.model.named_parameters())
    assert set(bf16.master.masters) == set(expected)
    for name, master in bf16.master.masters.items():
        assert master.grad.dtype == torch.float32
        assert rel_error(master.grad, expected[name].grad) < 3e-2, name


def _random_batch(vocab: int, device: str = "cpu", rows: int = 12, seed: int = 0) -> TensorDict:
    """`rows` responses of random tokens after 5-token prompts, in groups of 4, a few masked; GRPO advantages."""
    generator = torch.Generator().manual_seed(seed)
    response_mask = torch.ones(rows, 6, dtype=torch.long)
    response_mask[1, 4:] = 0
    batch = TensorDict({"prompt_ids": torch.randint(4, vocab, (rows, 5), generator=generator),
                        "prompt_mask": torch.ones(rows, 5, dtype=torch.long),
                        "response_ids": torch.randint(4, vocab, (rows, 6), generator=generator),
                        "response_mask": response_mask, "group_ids": torch.arange(rows) // 4}, batch_size=[rows])
    rewards = torch.rand(rows, generator=generator)
    batch["advantages"] = compute_advantages("grpo", rewards, response_mask, batch["group_ids"])
    return batch


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bf16_update_of_a_qwen3_shaped_model_moves_every_trained_element(tmp_path, device):
    """A Qwen3-shaped model (GQA, q/k norms, tied embeddings as Qwen3-0.6B's) in bf16 on `device` with the registry's
    kernels (on cuda: Triton's), packed micro-batches: one update at lr 1e-6 changes >= 99% of the elements that
    have a gradient, the tied embedding / LM head one fp32 master; on cuda it leaves no cached GPU blocks behind."""
    model = tiny_causal_lm("qwen3", vocab_size=256, hidden_size=128, intermediate_size=256, head_dim=32,
                           max_position_embeddings=128, tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    actor = ActorWorker(ActorConfig(lr=1e-6, torch_threads=2, max_tokens_per_micro_batch=64), LossConfig(),
                        str(tmp_path), "bfloat16", KernelConfig(), temperature=1.0, device=device)
    assert "lm_head.weight" not in actor.master.masters  # the tied head: the embedding's master
    assert _update_at_lr_1e6(actor, _random_batch(256, rows=16)) >= 0.99
    _check_model_is_masters_rounded(actor, torch.bfloat16)
    if device == "cuda":   # the update hands its cached blocks back (release_cached_memory): a colocated engine wakes
        batch = _random_batch(256, rows=16)
        batch["old_logprobs"] = actor.compute_logprobs(batch)
        actor.update(batch)
        assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() < 4 * 2**20
