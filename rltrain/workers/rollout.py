"""RolloutWorker: generates response groups for a batch of prompts and takes the actor's new weights in place.
One worker is one process of one rollout replica; rltrain/workers/rollout_group.py starts the replicas, splits the
prompts across them and pushes the weights to all of them.

Engines (rollout.engine): "hf" = transformers' generate with a KV cache, batched over prompts × n (left-padded
prompts; rltrain/workers/hf_engine.py); "vllm" = a `vllm.LLM` (rltrain/workers/vllm_engine.py), which also reports the
sampled tokens' log-probs (`rollout_logprobs`). rollout.mode=async puts the vllm engine on vLLM's async engine
(rltrain/workers/vllm_async.py): every request, and every multi-turn episode, runs at its own pace; there a black-box
agent may be the episode (rollout.multi_turn.agent), served by an OpenAI-compatible endpoint
(rltrain/workers/agents.py). Both take weights in buckets: begin_weight_update, load_weights (or load_bucket: an
actor's export, rltrain/workers/weight_sync.py) per bucket, finish_weight_update.
With actor.lora on, the buckets hold only the adapter tensors (rltrain/workers/lora.py) and neither engine's base
weights ever change: the hf engine holds the policy wrapped with the same LoRA adapters (unmerged), the vllm engine
loads each push as a vLLM LoRA adapter (rltrain/workers/vllm_lora.py).

Seeds: generate(..., seed, first_prompt) gets the step's seed and the index of its first prompt in the step's
batch, so a replica given prompts [first_prompt, ...) draws the same seeds whatever the split (`response_seeds`).
vLLM seeds every response with its own (a response's draw does not depend on which replica ran it); transformers'
generate draws from one stream per call, seeded with the step's seed for the run from prompt 0 and with its first
response's seed for a run further in, so the hf engine replays exactly for a fixed replica layout, and a different
layout draws different responses.

Sampling (both engines): exactly rollout.*'s settings, never a checkpoint's generation defaults, and a response ends
at the first of the checkpoint's end-of-sequence ids, a set (rltrain/workers/sampling.py).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import torch
from rltrain_kernels.registry import KernelConfig
from tensordict import TensorDict

from rltrain.config import require
from rltrain.tools.config import MultiTurnConfig
from rltrain.workers.agent_loop import AgentLoop
from rltrain.workers.agents import AgentEpisodes
from rltrain.workers.group import PLACEMENTS
from rltrain.workers.hf_engine import HFEngine, HFTurns
from rltrain.workers.lora import LoraConfig
from rltrain.workers.policy import load_tokenizer, set_threads
from rltrain.workers.vllm_async import AsyncVLLMEngine, AsyncVLLMTurns
from rltrain.workers.vllm_engine import VLLMEngine, VLLMTurns
from rltrain.workers.weight_sync import ExportedBucket, device_info, receive

ENGINES = ("hf", "vllm")
MODES = ("sync", "async")


@dataclass
class RolloutConfig:
    engine: str = "hf"
    mode: str = "sync"             # async: vLLM's async engine, each multi-turn episode at its own pace (vllm_async.py)
    n: int = 16                    # responses per prompt (the GRPO group size)
    temperature: float = 1.0
    top_p: float = 1.0             # nucleus sampling; 1 = off
    top_k: int = -1                # keep the k most likely tokens; -1 = off
    min_p: float = 0.0             # drop tokens below min_p × the top token's probability; 0 = off
    repetition_penalty: float = 1.0   # > 1 discourages tokens already in the context; 1 = off
    max_new_tokens: int = 8
    stop: list[str] = field(default_factory=list)  # vllm: stop strings (the response keeps the stopping token)
    val_temperature: float = 0.0   # 0 = greedy decoding for validation
    micro_batch_size: int = 256    # hf: sequences per generate() call
    torch_threads: int = 0
    gpu_memory_utilization: float = 0.5   # vllm: share of the GPU for its weights + KV cache (colocated roles)
    kv_cache_gb: float | None = None      # vllm: KV cache size; null = from gpu_memory_utilization
    enforce_eager: bool = False           # vllm: no CUDA graphs / torch.compile (faster start, slower decode)
    sleep_while_training: bool = True     # vllm: free its memory while the actor trains, where it has sleep mode
    tensor_parallel_size: int = 1  # vllm on GPU: GPUs per engine; replicas = trainer.nnodes × n_gpus_per_node / this
    replicas: int = 1              # CPU runs: rollout engines, each a process with its own CPU (GPU: set by the above)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)  # tool-using episodes: agent_loop.py
    placement: str = "colocated"   # colocated (share the actor's GPUs, take turns) | separate (devices of their own)
    partial: bool = False          # trainer.mode=async: a weight push interrupts generations (vllm: interruptible.py)
    partial_segment_tokens: int = 16  # partial with engine=hf: new tokens per segment; newer weights load between them

    def validate(self):
        require(self.engine in ENGINES, "engine", f"must be one of {', '.join(ENGINES)}", self.engine)
        require(self.mode in MODES, "mode", f"must be one of {', '.join(MODES)}", self.mode)
        require(self.mode == "sync" or self.engine == "vllm", "mode", "'async' needs rollout.engine=vllm (vLLM's "
                "async engine; the hf engine runs the turn-synchronous loop: rollout.mode=sync)", self.mode)
        # AsyncLLM runs its engine core in a process of its own; external_launcher runs it in the rollout's processes
        require(self.mode == "sync" or self.tensor_parallel_size == 1, "mode", "'async' needs "
                "rollout.tensor_parallel_size=1 (vLLM's async engine cannot run under the tensor-parallel "
                "external_launcher; scale with replicas)", self.mode)
        # the endpoint serves each request as it comes, which only the async engine does (rltrain/workers/agents.py)
        require(not self.multi_turn.agent.enabled or (self.engine == "vllm" and self.mode == "async"),
                "multi_turn.agent", "needs rollout.engine=vllm and rollout.mode=async (the agent's requests are "
                "served one by one as they arrive, on vLLM's async engine)",
                f"engine={self.engine}, mode={self.mode}")
        require(self.partial_segment_tokens >= 1, "partial_segment_tokens", "must be >= 1",
                self.partial_segment_tokens)
        # vLLM aborts and resumes requests only on its async engine; the segment loop stays the hf engine's
        require(not (self.partial and self.engine == "vllm" and self.mode != "async"), "partial", "with "
                "rollout.engine=vllm needs rollout.mode=async (a weight push aborts the requests in flight on vLLM's "
                "async engine and resumes them on the new weights)", self.partial)
        require(not (self.partial and self.stop), "partial", "cannot be combined with rollout.stop (a stop string "
                "could straddle an interruption, two segments or an abort and its resumption, and go unseen)",
                self.partial)
        require(not (self.partial and self.multi_turn.enabled), "partial", "cannot be combined with "
                "rollout.multi_turn.enabled (an episode's turns are not split into segments)", self.partial)
        # vllm: a turn that ends at a stop string has no <eos>, and tensor-parallel ranks would each call the tools
        # (an answer that differs between ranks, e.g. a timeout on one, would split their schedules)
        require(not (self.multi_turn.enabled and self.stop), "stop", "must be empty with rollout.multi_turn.enabled "
                "(a turn ends at <eos>)", self.stop)
        require(not (self.multi_turn.enabled and self.tensor_parallel_size > 1), "tensor_parallel_size",
                "must be 1 with rollout.multi_turn.enabled (every rank would run the tools)", self.tensor_parallel_size)
        require(self.engine != "vllm" or importlib.util.find_spec("vllm") is not None, "engine",
                "'vllm' needs the vllm package, which is not installed: pip install rltrain[vllm]", self.engine)
        require(self.n >= 1, "n", "must be >= 1", self.n)
        require(self.temperature > 0, "temperature", "must be > 0 for sampling", self.temperature)
        require(0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        require(self.top_k == -1 or self.top_k >= 1, "top_k", "must be -1 (off) or >= 1", self.top_k)
        require(0 <= self.min_p < 1, "min_p", "must be in [0, 1)", self.min_p)
        require(self.repetition_penalty > 0, "repetition_penalty", "must be > 0 (1 = off)", self.repetition_penalty)
        require(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1", self.max_new_tokens)
        require(not self.stop or self.engine == "vllm", "stop", "needs rollout.engine=vllm", self.stop)
        require(all(self.stop), "stop", "entries must be non-empty strings", self.stop)
        require(self.val_temperature >= 0, "val_temperature", "must be >= 0", self.val_temperature)
        require(self.micro_batch_size >= 1, "micro_batch_size", "must be >= 1", self.micro_batch_size)
        require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "must be in (0, 1]",
                self.gpu_memory_utilization)
        require(self.kv_cache_gb is None or self.kv_cache_gb > 0, "kv_cache_gb", "must be null or > 0",
                self.kv_cache_gb)
        require(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be >= 1", self.tensor_parallel_size)
        require(self.tensor_parallel_size == 1 or self.engine == "vllm", "tensor_parallel_size",
                "must be 1 with rollout.engine=hf (one process per replica; rollout.engine=vllm shards a replica "
                "over GPUs)", self.tensor_parallel_size)
        require(self.replicas >= 1, "replicas", "must be >= 1", self.replicas)
        require(self.placement in PLACEMENTS, "placement", f"must be one of {', '.join(PLACEMENTS)}", self.placement)


class RolloutWorker:
    """One process of a rollout replica. `tensor_parallel` (vllm, tensor_parallel_size > 1): this process's rank in
    its replica and the replica's rendezvous, {rank, world_size, master_addr, master_port}. `lora`: actor.lora (the
    engine serves its adapters, zero until the first push). `logprobs`: the hf engine reports the sampled tokens'
    log-probs too (vllm always does). `routing`: the hf engine records an MoE policy's routing (R3: router.py)."""

    def __init__(self, config: RolloutConfig, model_path: str, dtype: str, kernel_config: KernelConfig | None,
                 device: str = "cpu", attn_implementation: str = "auto", tensor_parallel: dict | None = None,
                 lora: LoraConfig | None = None, logprobs: bool = False, routing: bool = False):
        set_threads(config.torch_threads)
        self.device = device
        if config.engine == "vllm":
            engine = AsyncVLLMEngine if config.mode == "async" else VLLMEngine
            self.engine = engine(config, model_path, dtype, device, tensor_parallel, lora)
        else:
            self.engine = HFEngine(config, model_path, dtype, kernel_config, device, attn_implementation, lora,
                                   logprobs, routing)
        self.agent_loop = None
        if config.multi_turn.enabled:  # tool-using episodes through the same engine (rltrain/workers/agent_loop.py)
            turns = HFTurns if config.engine == "hf" else AsyncVLLMTurns if config.mode == "async" else VLLMTurns
            loop = AgentEpisodes if config.multi_turn.agent.enabled else AgentLoop   # a black-box agent: agents.py
            self.agent_loop = loop(config.multi_turn, turns(self.engine), load_tokenizer(model_path),
                                   config.max_new_tokens)

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, n: int, temperature: float,
                 seed: int, first_prompt: int = 0, max_new_tokens: int | None = None,
                 rows: list[dict] | None = None) -> TensorDict:
        """n responses per prompt, grouped consecutively; group_ids[i] = index of the prompt (in this call).
        first_prompt: where these prompts start in the step's batch (their seeds: response_seeds). max_new_tokens:
        this call's limit instead of rollout.max_new_tokens (the hf engine's segments of a partial rollout; vllm's
        abort and resume instead: generate_partial). rows: the prompts' data rows, for an environment or agent
        (rollout.multi_turn.env, .agent)."""
        if max_new_tokens is not None:
            if not isinstance(self.engine, HFEngine):
                raise ValueError("generate(max_new_tokens=...): segments are the hf engine's partial rollouts; the "
                                 "vllm engine's are generate_partial (rollout.mode=async)")
            return self.engine.generate(prompt_ids, prompt_mask, n, temperature, seed, first_prompt, max_new_tokens)
        if self.agent_loop is not None:
            return self.agent_loop.generate(prompt_ids, prompt_mask, n, temperature, seed, first_prompt, rows)
        return self.engine.generate(prompt_ids, prompt_mask, n, temperature, seed, first_prompt)

    def generate_partial(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, n: int, temperature: float,
                         seed: int, first_prompt: int, version: int) -> TensorDict:
        """rollout.partial on the async engine: generate()'s responses, each token stamped with the version that
        sampled it (token_versions); a weight update meanwhile (another thread of this actor) aborts and resumes
        them (rltrain/workers/interruptible.py). version: what the engine holds now."""
        return self.engine.generate_partial(prompt_ids, prompt_mask, n, temperature, seed, first_prompt, version)

    def device_info(self):
        """This process's GPU (uuid, name), or None on CPU: the weight push pairs it with an actor rank by uuid."""
        return device_info(self.device)

    def begin_weight_update(self) -> None:
        self.engine.begin_weight_update()

    def load_weights(self, named_tensors: dict[str, torch.Tensor]) -> None:
        """One bucket of what the actor pushes (ActorWorker.pushed_weights: full tensors of its state_dict, HF
        names, or its LoRA adapters)."""
        self.engine.load_weights(named_tensors.items())

    def load_bucket(self, bucket: ExportedBucket) -> str:
        """One bucket as an actor rank exported it: opened through CUDA IPC when it lies on this process's GPU,
        else its host copy. Returns the route taken, "ipc" or "host"."""
        tensors, route = receive(bucket, own=self.engine.keeps_loaded_tensors, device=self.device)
        self.engine.load_weights(tensors.items())
        if route == "ipc":  # the copies out of the sender's memory are done before it frees or reuses it
            torch.cuda.synchronize()
        return route

    def finish_weight_update(self, version: int | None = None) -> None:
        """version (trainer.mode=async's snapshots): the weights' version, which the async engine stamps on the tokens
        of the partial rollouts it resumes."""
        self.engine.finish_weight_update(version)

    def sleep(self) -> None:
        """Colocated mode: free the engine's memory while the actor trains (vLLM on GPU; a no-op otherwise)."""
        self.engine.sleep()
