"""The hf engine's rollout_logprobs (RolloutWorker(logprobs=True): the behaviour policy for the asynchronous modes,
algorithm.old_logprobs=rollout and the decoupled objective): equal to the actor's recomputed log-probs of the same
tokens with the same weights at the same temperature, 0 past each response's end; with top_p < 1 still those of
softmax(logits / temperature), the distribution the actor scores (not the renormalised nucleus); absent unless asked
for and for greedy decoding.

    .venv/bin/python -m pytest tests/rltrain/workers/test_rollout_logprobs.py -q   # ~15 s on 2 cores
"""

import pytest
import torch
from transformers import AutoTokenizer

from rltrain.algorithms.config import LossConfig
from rltrain.data.sampler import encode_prompts
from rltrain.embedded.model import embedded_policy_dir
from rltrain.embedded.task import make_rows
from rltrain.workers.actor import ActorWorker
from rltrain.workers.actor_config import ActorConfig
from rltrain.workers.rollout import RolloutConfig, RolloutWorker
from tests.rltrain.tiny_job import tiny_job

TEMPERATURE = 1.3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    job = tiny_job(tmp_path_factory.mktemp("logprobs"))
    model_dir = str(embedded_policy_dir(job.trainer.output_dir, job.model.embedded, job.data.task, 0))
    ids, mask = encode_prompts(make_rows(job.data.task)[0][:4], AutoTokenizer.from_pretrained(model_dir))
    actor = ActorWorker(ActorConfig(torch_threads=1), LossConfig(), model_dir, "float32", None,
                        temperature=TEMPERATURE)
    return model_dir, ids, mask, actor


def _rollout(model_dir, logprobs=True, **config):
    config = RolloutConfig(n=3, max_new_tokens=16, torch_threads=1, micro_batch_size=5, **config)
    return RolloutWorker(config, model_dir, "float32", None, logprobs=logprobs)


def test_rollout_logprobs_equal_the_actors(setup):
    model_dir, ids, mask, actor = setup
    batch = _rollout(model_dir).generate(ids, mask, 3, TEMPERATURE, seed=3)   # 12 responses in 3 generate calls
    reported, response_mask = batch["rollout_logprobs"], batch["response_mask"]
    assert reported.shape == batch["response_ids"].shape and reported.dtype == torch.float32
    assert (response_mask.sum(1) < response_mask.shape[1]).any()   # some responses end early: padding is zero
    assert torch.all(reported[response_mask == 0] == 0) and torch.all(reported[response_mask != 0] < 0)
    torch.testing.assert_close(reported, actor.compute_logprobs(batch), rtol=0, atol=2e-5)


def test_top_p_reports_the_temperature_distribution(setup):
    model_dir, ids, mask, actor = setup
    batch = _rollout(model_dir, top_p=0.6).generate(ids, mask, 3, TEMPERATURE, seed=3)
    torch.testing.assert_close(batch["rollout_logprobs"], actor.compute_logprobs(batch), rtol=0, atol=2e-5)


def test_no_log_probs_unless_asked_or_greedy(setup):
    model_dir, ids, mask, _ = setup
    assert "rollout_logprobs" not in _rollout(model_dir, logprobs=False).generate(ids, mask, 3, 1.0, 0).keys()
    assert "rollout_logprobs" not in _rollout(model_dir).generate(ids, mask, 1, 0.0, 0).keys()
