"""RolloutWorker: generates response groups for a batch of prompts and takes the actor's new weights in place.
One worker is one process of one rollout replica; rltrain/workers/rollout_group.py starts the replicas, splits the
prompts across them and pushes the weights to all of them.

Engines (rollout.engine): "hf" = transformers' generate with a KV cache, batched over prompts × n (left-padded
prompts), below; "vllm" = a `vllm.LLM` (rltrain/workers/vllm_engine.py, imported only when chosen), which also
reports the sampled tokens' log-probs (`rollout_logprobs`). Both take weights in buckets: begin_weight_update,
load_weights (or load_bucket: an actor's export, rltrain/workers/weight_sync.py) per bucket, finish_weight_update.
With actor.lora on, the buckets hold only the adapter tensors (rltrain/workers/lora.py) and neither engine's base
weights ever change: the hf engine holds the policy wrapped with the same LoRA adapters (unmerged), the vllm engine
loads each push as a vLLM LoRA adapter (rltrain/workers/vllm_lora.py).

Seeds: generate(..., seed, first_prompt) gets the step's seed and the index of its first prompt in the step's
batch, so a replica given prompts [first_prompt, ...) draws the same seeds whatever the split (`response_seeds`).
vLLM seeds every response with its own (a response's draw does not depend on which replica ran it); transformers'
generate draws from one stream per call, seeded with the step's seed for the run from prompt 0 and with its first
response's seed for a run further in, so the hf engine replays exactly for a fixed replica layout, and a different
layout draws different responses.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import torch
from rltrain_kernels.registry import KernelConfig
from tensordict import TensorDict

from rltrain.config import require
from rltrain.tools.config import MultiTurnConfig
from rltrain.workers.lora import LoraConfig, attach_lora
from rltrain.workers.policy import load_policy, set_threads
from rltrain.workers.weight_sync import ExportedBucket, device_info, receive

ENGINES = ("hf", "vllm")
PLACEMENTS = ("colocated", "separate")


@dataclass
class RolloutConfig:
    engine: str = "hf"
    n: int = 16                    # responses per prompt (the GRPO group size)
    temperature: float = 1.0
    top_p: float = 1.0
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
    partial: bool = False          # trainer.mode=async: a weight push interrupts generations (rltrain/async_rollout.py)
    partial_segment_tokens: int = 16  # partial: new tokens per segment; newer weights load between segments

    def validate(self):
        require(self.engine in ENGINES, "engine", f"must be one of {', '.join(ENGINES)}", self.engine)
        require(self.partial_segment_tokens >= 1, "partial_segment_tokens", "must be >= 1",
                self.partial_segment_tokens)
        require(not (self.partial and self.stop), "partial", "cannot be combined with rollout.stop (a stop string "
                "could straddle two segments and go unseen)", self.partial)
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


def response_seeds(seed: int, first: int, count: int) -> torch.Tensor:
    """The sampling seeds of responses first .. first + count - 1 of a step's batch (prompt-major, n per prompt):
    the same for a response whichever replica generates it."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**31 - 1, (first + count,), generator=generator)[first:]


class RolloutWorker:
    """One process of a rollout replica. `tensor_parallel` (vllm, tensor_parallel_size > 1): this process's rank in
    its replica and the replica's rendezvous, {rank, world_size, master_addr, master_port}. `lora`: actor.lora (the
    engine serves its adapters, zero until the first push). `logprobs`: the hf engine reports the sampled tokens'
    log-probs too (vllm always does)."""

    def __init__(self, config: RolloutConfig, model_path: str, dtype: str, kernel_config: KernelConfig | None,
                 device: str = "cpu", attn_implementation: str = "auto", tensor_parallel: dict | None = None,
                 lora: LoraConfig | None = None, logprobs: bool = False):
        set_threads(config.torch_threads)
        self.device = device
        if config.engine == "vllm":
            from rltrain.workers.vllm_engine import VLLMEngine

            self.engine = VLLMEngine(config, model_path, dtype, device, tensor_parallel, lora)
        else:
            self.engine = HFEngine(config, model_path, dtype, kernel_config, device, attn_implementation, lora,
                                   logprobs)
        self.agent_loop = None
        if config.multi_turn.enabled:  # tool-using episodes through the same engine (rltrain/workers/agent_loop.py)
            from rltrain.workers.agent_loop import AgentLoop, HFTurns
            from rltrain.workers.policy import load_tokenizer

            if config.engine == "vllm":
                from rltrain.workers.vllm_engine import VLLMTurns as turns
            else:
                turns = HFTurns
            self.agent_loop = AgentLoop(config.multi_turn, turns(self.engine), load_tokenizer(model_path),
                                        config.max_new_tokens)

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, n: int, temperature: float,
                 seed: int, first_prompt: int = 0, max_new_tokens: int | None = None) -> TensorDict:
        """n responses per prompt, grouped consecutively; group_ids[i] = index of the prompt (in this call).
        first_prompt: where these prompts start in the step's batch (their seeds: response_seeds). max_new_tokens:
        this call's limit instead of rollout.max_new_tokens (a segment of a partial rollout)."""
        if max_new_tokens is not None:
            return self.engine.generate(prompt_ids, prompt_mask, n, temperature, seed, first_prompt, max_new_tokens)
        return (self.agent_loop or self.engine).generate(prompt_ids, prompt_mask, n, temperature, seed, first_prompt)

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

    def finish_weight_update(self) -> None:
        self.engine.finish_weight_update()

    def sleep(self) -> None:
        """Colocated mode: free the engine's memory while the actor trains (vLLM on GPU; a no-op otherwise)."""
        self.engine.sleep()


class HFEngine:
    """transformers' generate. With `logprobs` it also returns rollout_logprobs: the log-softmax of generate's
    processed scores (after temperature and top_p, the distribution each token was drawn from, like vLLM's
    processed_logprobs) at the sampled tokens, 0 past a response's end. generate keeps every step's scores until it
    returns, micro_batch_size × max_new_tokens × vocab fp32 values (256 × 1024 × 152k: 160 GB), so with a real
    vocabulary cut rollout.micro_batch_size, or use vllm."""

    keeps_loaded_tensors = False  # load_weights copies into the parameters at once

    def __init__(self, config: RolloutConfig, model_path: str, dtype: str, kernel_config: KernelConfig | None,
                 device: str, attn_implementation: str = "auto", lora: LoraConfig | None = None,
                 logprobs: bool = False):
        self.config, self.logprobs = config, logprobs
        self.model = load_policy(model_path, dtype, kernel_config, device, attn_implementation)
        if lora is not None and lora.enabled:  # the actor's adapters, zero until the first push: the base's outputs
            attach_lora(self.model, lora)
        self.model.eval().requires_grad_(False)
        self.device = device
        generation = self.model.generation_config
        self.eos_token_id = generation.eos_token_id if generation.eos_token_id is not None \
            else self.model.config.eos_token_id
        self.pad_token_id = generation.pad_token_id if generation.pad_token_id is not None else self.eos_token_id
        self.state = None

    def begin_weight_update(self) -> None:
        self.state = self.model.state_dict()  # views of the live parameters: copy_ writes into the model

    def load_weights(self, named_tensors) -> None:
        for name, tensor in named_tensors:
            self.state[name].copy_(tensor)

    def finish_weight_update(self) -> None:
        self.state = None

    def sleep(self) -> None:
        pass

    @torch.no_grad()
    def sampling(self, temperature: float) -> dict:
        """generate's sampling arguments: temperature and rollout.top_p (no top-k), or greedy at temperature 0."""
        if temperature > 0:
            return dict(do_sample=True, temperature=temperature, top_p=self.config.top_p, top_k=0)
        return dict(do_sample=False)

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, n: int, temperature: float,
                 seed: int, first_prompt: int = 0, max_new_tokens: int | None = None) -> TensorDict:
        # one stream per call: the step's seed for the run from prompt 0 (what a single engine has always drawn, so
        # earlier runs resume and replay unchanged), the seed of its first response for a run further in
        torch.manual_seed(seed if first_prompt == 0 else int(response_seeds(seed, first_prompt * n, 1)))
        prompt_ids = prompt_ids.repeat_interleave(n, dim=0).to(self.device)
        prompt_mask = prompt_mask.repeat_interleave(n, dim=0).to(self.device)
        outputs, logprobs = [], []
        report = self.logprobs and temperature > 0
        for start in range(0, prompt_ids.shape[0], self.config.micro_batch_size):
            ids = prompt_ids[start:start + self.config.micro_batch_size]
            mask = prompt_mask[start:start + self.config.micro_batch_size]
            out = self.model.generate(input_ids=ids, attention_mask=mask,
                                      max_new_tokens=max_new_tokens or self.config.max_new_tokens,
                                      eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id,
                                      output_scores=report, return_dict_in_generate=True,
                                      **self.sampling(temperature))
            outputs.append(out.sequences[:, ids.shape[1]:])
            if report:
                scores = torch.stack(out.scores, 1).float().log_softmax(-1)   # [b, generated, V]
                logprobs.append(scores.gather(-1, outputs[-1].unsqueeze(-1)).squeeze(-1))
        width = max(o.shape[1] for o in outputs)
        response_ids = torch.cat([torch.nn.functional.pad(o, (0, width - o.shape[1]), value=self.pad_token_id)
                                  for o in outputs])
        response_mask, truncated = response_mask_and_truncation(response_ids, self.eos_token_id)
        groups = torch.arange(prompt_ids.shape[0] // n).repeat_interleave(n)
        fields = {"prompt_ids": prompt_ids.cpu(), "prompt_mask": prompt_mask.cpu(),
                  "response_ids": response_ids.cpu(), "response_mask": response_mask.cpu(),
                  "group_ids": groups, "truncated": truncated.cpu()}
        if report:  # past <eos> a finished row's pad token may lie outside top_p (-inf): zeroed, never read
            logp = torch.cat([torch.nn.functional.pad(lp, (0, width - lp.shape[1])) for lp in logprobs])
            fields["rollout_logprobs"] = torch.where(response_mask.bool(), logp, 0.0).cpu()
        return TensorDict(fields, batch_size=[prompt_ids.shape[0]])


def response_mask_and_truncation(response_ids: torch.Tensor, eos_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(response_mask [B,R]: 1 up to and including the first <eos>; truncated [B]: no <eos> at all, i.e. the
    response hit max_new_tokens and is kept whole in the mask; algorithm.overlong_filter masks those out)."""
    is_eos = response_ids == eos_token_id
    before_eos = (is_eos.long().cumsum(1) - is_eos.long()) == 0
    return before_eos.long(), ~is_eos.any(1)
