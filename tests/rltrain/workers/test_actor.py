"""The actor's update in process (no Ray), on the tiny embedded model: Dr.GRPO's constant normaliser
(algorithm.loss.norm_len), against the loss hand-computed at the first update (ratio 1)."""

import pytest
import torch

from rltrain.algorithms.advantages import compute_advantages
from rltrain.algorithms.config import LossConfig
from rltrain.data.sampler import encode_prompts
from rltrain.embedded.model import embedded_policy_dir
from rltrain.embedded.task import make_rows
from rltrain.workers.actor import ActorConfig, ActorWorker
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
