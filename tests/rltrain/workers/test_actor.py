"""The actor's update in process (no Ray), on the tiny embedded model: Dr.GRPO's constant normaliser
(algorithm.loss.norm_len), against the loss hand-computed at the first update (ratio 1); the learning-rate schedule
against hand-computed factors, applied to the optimizer and resumed from its saved position exactly; ppo_epochs
passes over reshuffled, seeded mini-batches."""

import math

import pytest
import torch

from rltrain.algorithms.advantages import compute_advantages
from rltrain.algorithms.config import LossConfig
from rltrain.data.sampler import encode_prompts
from rltrain.embedded.model import embedded_policy_dir
from rltrain.embedded.task import make_rows
from rltrain.workers.actor import ActorConfig, ActorWorker, LRSchedule
from rltrain.workers.rollout import RolloutConfig, RolloutWorker
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


def _actor(model_dir, loss: LossConfig, **config) -> ActorWorker:
    return ActorWorker(ActorConfig(**{"torch_threads": 1, "micro_batch_size": 5, **config}), loss, model_dir,
                       "float32", None, temperature=1.0)


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


def test_lr_schedule_is_applied_and_resumes_exactly(setup):
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
    resumed.load_checkpoint(first.state_dict(), first.optimizer_state())
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
