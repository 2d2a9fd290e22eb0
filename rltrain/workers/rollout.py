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
from rltrain.workers.lora import LoraConfig, attach_lora
from rltrain.workers.policy import load_policy, set_threads
from rltrain.workers.sampling import (
    SampledLogprobs, end_of_sequence, log_ignored_defaults, response_mask_and_truncation, response_seeds,
)
from rltrain.workers.weight_sync import ExportedBucket, device_info, receive

ENGINES = ("hf", "vllm")
PLACEMENTS = ("colocated", "separate")


@dataclass
class RolloutConfig:
    engine: str = "hf"
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
    """transformers' generate. With `logprobs` it also returns rollout_logprobs: log softmax(logits / temperature)
    at the sampled tokens (rltrain/workers/sampling.py SampledLogprobs, one step's scores held at a time), 0 past a
    response's end. The checkpoint's generation config keeps only its special-token ids: sampling is rollout.*'s."""

    keeps_loaded_tensors = False  # load_weights copies into the parameters at once

    def __init__(self, config: RolloutConfig, model_path: str, dtype: str, kernel_config: KernelConfig | None,
                 device: str, attn_implementation: str = "auto", lora: LoraConfig | None = None,
                 logprobs: bool = False):
        from transformers import GenerationConfig

        self.config, self.logprobs = config, logprobs
        self.model = load_policy(model_path, dtype, kernel_config, device, attn_implementation)
        if lora is not None and lora.enabled:  # the actor's adapters, zero until the first push: the base's outputs
            attach_lora(self.model, lora)
        self.model.eval().requires_grad_(False)
        self.device = device
        eos = end_of_sequence(model_path)
        self.eos_token_ids, self.pad_token_id = list(eos.ids), eos.pad_id
        log_ignored_defaults(model_path)
        # generate fills every argument it is not given from model.generation_config: keep none of the checkpoint's
        self.model.generation_config = GenerationConfig(
            bos_token_id=self.model.generation_config.bos_token_id, eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id)
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

    def sampling(self, temperature: float) -> dict:
        """generate's sampling arguments: exactly rollout.*'s (top_k -1 = off, transformers' 0), or greedy at
        temperature 0."""
        config = self.config
        common = dict(repetition_penalty=config.repetition_penalty, eos_token_id=self.eos_token_ids,
                      pad_token_id=self.pad_token_id)
        if temperature > 0:
            return dict(common, do_sample=True, temperature=temperature, top_p=config.top_p,
                        top_k=max(config.top_k, 0), min_p=config.min_p or None)
        return dict(common, do_sample=False)

    @torch.no_grad()
    def sample_tokens(self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, temperature: float,
                      report: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One generate call on left-padded rows: (generated tokens [b, g], their log-probs [b, g] if `report`)."""
        recorder = SampledLogprobs(temperature) if report else None
        out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                  max_new_tokens=max_new_tokens, logits_processor=[recorder] if report else None,
                                  **self.sampling(temperature))
        tokens = out[:, ids.shape[1]:]
        return tokens, recorder.finish(tokens) if report else None

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, n: int, temperature: float,
                 seed: int, first_prompt: int = 0, max_new_tokens: int | None = None) -> TensorDict:
        # one stream per call: the step's seed for the run from prompt 0 (what a single engine has always drawn, so
        # earlier runs resume and replay unchanged), the seed of its first response for a run further in
        torch.manual_seed(seed if first_prompt == 0 else int(response_seeds(seed, first_prompt * n, 1)))
        prompt_ids = prompt_ids.repeat_interleave(n, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(n, dim=0)
        outputs, logprobs = [], []
        report = self.logprobs and temperature > 0
        size = self.config.micro_batch_size
        for start in range(0, prompt_ids.shape[0], size):
            tokens, logp = self.sample_tokens(prompt_ids[start:start + size], prompt_mask[start:start + size],
                                              max_new_tokens or self.config.max_new_tokens, temperature, report)
            outputs.append(tokens.cpu())
            if report:
                logprobs.append(logp.cpu())
        width = max(o.shape[1] for o in outputs)
        response_ids = torch.cat([torch.nn.functional.pad(o, (0, width - o.shape[1]), value=self.pad_token_id)
                                  for o in outputs])
        response_mask, truncated = response_mask_and_truncation(response_ids, self.eos_token_ids)
        groups = torch.arange(prompt_ids.shape[0] // n).repeat_interleave(n)
        fields = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
                  "response_mask": response_mask, "group_ids": groups, "truncated": truncated}
        if report:  # past a finished row's end its pad tokens' values are zeroed, never read
            logp = torch.cat([torch.nn.functional.pad(lp, (0, width - lp.shape[1])) for lp in logprobs])
            fields["rollout_logprobs"] = torch.where(response_mask.bool(), logp, 0.0)
        return TensorDict(fields, batch_size=[prompt_ids.shape[0]])
