"""The transformers rollout engine (rollout.engine=hf): `HFEngine`, transformers' generate with a KV cache, batched
over prompts × n (left-padded prompts), held by the RolloutWorker (rltrain/workers/rollout.py, which describes the
seeds and the weight updates of both engines); and `HFTurns`, the same engine as the multi-turn agent loop's Turns API
(rltrain/workers/agent_loop.py).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from rltrain_kernels.registry import KernelConfig
from tensordict import TensorDict
from transformers import GenerationConfig

from rltrain.workers.agent_loop import Turn
from rltrain.workers.batch import group_ids, left_pad
from rltrain.workers.lora import LoraConfig, attach_lora
from rltrain.workers.policy import load_policy
from rltrain.workers.router import ROUTING, RoutingRecorder
from rltrain.workers.sampling import (
    SampledLogprobs, end_of_sequence, log_ignored_defaults, response_mask_and_truncation, response_seeds,
)


class HFEngine:
    """transformers' generate. With `logprobs` it also returns rollout_logprobs: log softmax(logits / temperature)
    at the sampled tokens (rltrain/workers/sampling.py SampledLogprobs, one step's scores held at a time), 0 past a
    response's end. The checkpoint's generation config keeps only its special-token ids: sampling is rollout.*'s.
    `config`: the rollout section (RolloutConfig, rltrain/workers/rollout.py)."""

    keeps_loaded_tensors = False  # load_weights copies into the parameters at once

    def __init__(self, config, model_path: str, dtype: str, kernel_config: KernelConfig | None,
                 device: str, attn_implementation: str = "auto", lora: LoraConfig | None = None,
                 logprobs: bool = False, routing: bool = False):
        self.config, self.logprobs = config, logprobs
        self.model = load_policy(model_path, dtype, kernel_config, device, attn_implementation)
        # actor.router_replay.mode=R3: every token's chosen experts (rltrain/workers/router.py)
        self.routing = RoutingRecorder.of(self.model) if routing else None
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

    def finish_weight_update(self, version: int | None = None) -> None:
        """version: unused here (only the async vLLM engine stamps resumed partial rollouts with it)."""
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
                      report: bool) -> tuple[torch.Tensor, torch.Tensor | None, dict | None]:
        """One generate call on left-padded rows: (generated tokens [b, g], their log-probs [b, g] if `report`, the
        routers' choices (RoutingRecorder.fields) where recorded)."""
        recorder = SampledLogprobs(temperature) if report else None
        with self.routing.recording() if self.routing is not None else nullcontext():
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      max_new_tokens=max_new_tokens, logits_processor=[recorder] if report else None,
                                      **self.sampling(temperature))
            tokens = out[:, ids.shape[1]:]
            routed = None if self.routing is None else self.routing.fields(*ids.shape, tokens.shape[1])
        return tokens, recorder.finish(tokens) if report else None, routed

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, n: int, temperature: float,
                 seed: int, first_prompt: int = 0, max_new_tokens: int | None = None) -> TensorDict:
        # one stream per call: the step's seed for the run from prompt 0 (what a single engine has always drawn, so
        # earlier runs resume and replay unchanged), the seed of its first response for a run further in
        torch.manual_seed(seed if first_prompt == 0 else int(response_seeds(seed, first_prompt * n, 1)))
        prompt_ids = prompt_ids.repeat_interleave(n, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(n, dim=0)
        outputs, logprobs, routing = [], [], []
        report = self.logprobs and temperature > 0
        size = self.config.micro_batch_size
        for start in range(0, prompt_ids.shape[0], size):
            tokens, logp, routed = self.sample_tokens(prompt_ids[start:start + size], prompt_mask[start:start + size],
                                                      max_new_tokens or self.config.max_new_tokens, temperature,
                                                      report)
            outputs.append(tokens.cpu())
            if report:
                logprobs.append(logp.cpu())
            if routed is not None:
                routing.append(routed)
        width = max(o.shape[1] for o in outputs)
        response_ids = torch.cat([torch.nn.functional.pad(o, (0, width - o.shape[1]), value=self.pad_token_id)
                                  for o in outputs])
        response_mask, truncated = response_mask_and_truncation(response_ids, self.eos_token_ids)
        fields = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
                  "response_mask": response_mask, "group_ids": group_ids(prompt_ids.shape[0], n),
                  "truncated": truncated}
        if report:  # past a finished row's end its pad tokens' values are zeroed, never read
            logp = torch.cat([torch.nn.functional.pad(lp, (0, width - lp.shape[1])) for lp in logprobs])
            fields["rollout_logprobs"] = torch.where(response_mask.bool(), logp, 0.0)
        if routing:   # [b, g, L, k] per call, padded to the batch's width with -1 (nothing recorded)
            fields[ROUTING[0]] = torch.cat([r[ROUTING[0]] for r in routing])
            fields[ROUTING[1]] = torch.cat([torch.nn.functional.pad(r[ROUTING[1]], (0, 0, 0, 0, 0, width - g), value=-1)
                                            for r in routing for g in [r[ROUTING[1]].shape[1]]])
        return TensorDict(fields, batch_size=[prompt_ids.shape[0]])


class HFTurns:
    """HFEngine as the agent loop's Turns API (rltrain/workers/agent_loop.py): left-pads the contexts, runs
    transformers' generate for the largest budget, then cuts each row at its own budget and first end-of-sequence
    id; the sampled tokens' log-probs where the engine reports them (HFEngine.logprobs)."""

    def __init__(self, engine):
        self.engine = engine
        self.eos_ids = set(engine.eos_token_ids)

    def generate(self, contexts: list[list[int]], budgets: list[int], temperature: float,
                 seeds: list[int]) -> list[Turn]:
        engine, size = self.engine, self.engine.config.micro_batch_size
        report = engine.logprobs and temperature > 0
        turns = []
        for start in range(0, len(contexts), size):
            chunk, limits = contexts[start:start + size], budgets[start:start + size]
            ids, mask = left_pad(chunk, engine.pad_token_id)
            tokens, logprobs, _ = engine.sample_tokens(ids, mask, max(limits), temperature, report)
            tokens = tokens.cpu().tolist()
            logprobs = logprobs.cpu().tolist() if report else [None] * len(tokens)
            for row, row_logprobs, limit in zip(tokens, logprobs, limits):
                row = row[:limit]
                end = next((i for i, t in enumerate(row) if t in self.eos_ids), None)
                kept = len(row) if end is None else end + 1
                turns.append(Turn(row[:kept], None if row_logprobs is None else row_logprobs[:kept], end is not None))
        return turns
