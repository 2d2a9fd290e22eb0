"""The routers of a mixture-of-experts policy: in the actor, the load-balancing auxiliary loss
(`actor.router_aux_loss_coef`, off by default as in verl), the routing metrics (actor/router_aux_loss,
actor/router_load_imbalance) and routing replay (`actor.router_replay.mode=R3`); in the hf rollout engine, the
recording of each token's chosen experts that R3 replays.

Routers are the modules transformers records `router_logits` from (the model's `_can_record_outputs`: Qwen3-MoE's,
Qwen3-Next's and Mixtral's top-k routers, returning (logits, top-k weights, top-k expert ids)). For each router forward of the update,
over its T tokens, E experts and top-k:

    f_e = (assignments to e) / (T·k),   P_e = mean softmax probability of e,   loss = E · Σ_e f_e · P_e

(Switch Transformer's loss; 1 when balanced), averaged over the model's routers and weighted over the micro-batches by
their share of the mini-batch's tokens. The loss's gradient enters the graph through the router's top-k weights
(`AttachAuxLoss`: identity forward; backward adds coef × weight × dloss): it then flows while the backward is inside
that layer — under FSDP2, after the layer's parameters are gathered again — and a checkpointed layer's recomputation
repeats the same operations. The load imbalance is max_e f_e · E (1 = every expert takes its share). Padded
micro-batches mask their padding out of f and P; a packed row has none.

Routing replay, R3 (as verl's and slime's "rollout routing replay"): the engine that sampled a response may route a
token to other experts than the actor's forward of the same weights does (other kernels, batching, precision: a
near-tie in the router flips), and the log-prob gap that follows makes MoE RL unstable. `RoutingRecorder` records,
in the hf engine, the experts every router chose for every token it processed — the prompt in the prefill, each
response token in the decode step that reads it — as the batch fields `prompt_routed_experts` [B, P, L, k] and
`response_routed_experts` [B, R, L, k] (int16, layer by router order; -1 where nothing was recorded: padding, the
last sampled token, which no forward reads). The actor's old log-probs and update then route every recorded token to
those experts, their weights still the actor's router's softmax at them (renormalised where the router normalises its
top-k), so the gradient reaches the router as before; actor/router_replay_mismatch is the share of (token, router)
choices the actor's own routing would have changed.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from tensordict import TensorDict

from rltrain.workers.packing import response_lengths, sequence_lengths

ROUTING = ("prompt_routed_experts", "response_routed_experts")   # the batch fields R3 replays


def scored_tokens(batch: TensorDict) -> int:
    """Tokens (prompt + kept response) of the sequences with response tokens: what a micro-batch's routers weigh by."""
    return int(sequence_lengths(batch)[response_lengths(batch) > 0].sum())


def scored_token_mask(batch: TensorDict) -> torch.Tensor:
    """[B, P + R] of padded rows: the tokens scored_tokens counts (the tokens a packed row would hold)."""
    lengths = response_lengths(batch)
    kept = torch.arange(batch["response_ids"].shape[1], device=lengths.device)[None] < lengths[:, None]
    return torch.cat([batch["prompt_mask"] != 0, kept], dim=1) & (lengths > 0)[:, None]


class AttachAuxLoss(torch.autograd.Function):
    """Returns `weights` unchanged; its backward also sends `scale` as the gradient of the scalar `loss`."""

    @staticmethod
    def forward(ctx, weights, loss, scale: float):
        ctx.scale = scale
        return weights.view_as(weights)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


def replay_tokens(micro: TensorDict, packed: bool) -> torch.Tensor:
    """The recorded experts of a micro-batch's tokens in the order its forward runs them: [T, L, k] of the packed row
    (Packing.of's tokens: each row's prompt, then its kept response), or [B·(P + R), L, k] of the padded rows."""
    routed = torch.cat([micro[ROUTING[0]], micro[ROUTING[1]]], dim=1)
    if not packed:
        return routed.flatten(0, 1)
    kept = torch.arange(micro["response_ids"].shape[1], device=routed.device)[None] < \
        response_lengths(micro).to(routed.device)[:, None]
    return routed[torch.cat([micro["prompt_mask"].to(routed.device) != 0, kept], dim=1)]


def router_classes(model) -> tuple[type, ...]:
    """The router module classes of `model` (empty for a dense model)."""
    recorder = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    target = getattr(recorder, "target_class", None)
    return (target,) if isinstance(target, type) else ()


class RouterBalance:
    """Forward hooks on every router of an MoE model (`of` gives None for a dense one)."""

    def __init__(self, routers: list[torch.nn.Module], coef: float):
        self.coef, self.count = coef, len(routers)
        self.weight, self.mask, self.recording, self.replay = 0.0, None, None, None
        self.layer = {id(router): i for i, router in enumerate(routers)}
        for router in routers:
            router.register_forward_hook(self._hook)

    @classmethod
    def of(cls, model, coef: float) -> "RouterBalance | None":
        classes = router_classes(model)
        routers = [m for m in model.modules() if classes and isinstance(m, classes)]
        return cls(routers, coef) if routers else None

    def _hook(self, module, args, output):
        if not (isinstance(output, tuple) and len(output) == 3):
            return None
        training = torch.is_grad_enabled() and self.coef > 0
        logits, weights, experts = output
        if self.replay is not None and self.replay.shape[0] == logits.shape[0]:
            weights, experts = self._replayed(module, logits, weights, experts)
        elif not training and self.recording is None:
            return None
        # the same operations in a checkpointed layer's recomputation (which records nothing): metrics alone save
        # no tensors for backward
        with torch.enable_grad() if training else torch.no_grad():
            loss, share = self._balance(logits, experts)
        if self.recording is not None:
            self.recording["router_aux_loss"] += loss.item() / self.count
            self.recording["router_load_imbalance"] += (share.max() * len(share)).item() / self.count
        if training:
            weights = AttachAuxLoss.apply(weights, loss, self.coef * self.weight / self.count)
        return logits, weights, experts

    def _replayed(self, module, logits, weights, experts) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k weights, expert ids) with every recorded token's experts replaced by the recorded ones."""
        chosen = self.replay[:, self.layer[id(module)]].to(experts.device, torch.long)
        recorded = chosen[:, 0] >= 0
        if self.recording is not None:
            changed = (chosen.sort(-1).values != experts.sort(-1).values).any(-1) & recorded
            self.recording["router_replay_mismatch"] = self.recording.get("router_replay_mismatch", 0.0) + \
                changed.sum().item() / max(int(recorded.sum()), 1) / self.count
        experts = torch.where(recorded[:, None], chosen, experts)
        top = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, experts)
        if getattr(module, "norm_topk_prob", True):
            top = top / top.sum(-1, keepdim=True)
        return top.to(weights.dtype), experts

    def _balance(self, logits: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(E·Σ_e f_e·P_e, f) of one router's forward over the tokens the mask keeps."""
        probs = torch.softmax(logits.float(), dim=-1)
        tokens, count, k = probs.shape[0], probs.shape[-1], experts.shape[-1]
        keep = torch.ones(tokens, device=probs.device) if self.mask is None or self.mask.numel() != tokens \
            else self.mask.to(probs.device, torch.float32)
        total = keep.sum().clamp(min=1)
        assigned = torch.zeros(count, device=probs.device).scatter_add_(
            0, experts.reshape(-1), keep.repeat_interleave(k))
        share = assigned / (total * k)
        return count * (share * (probs * keep[:, None]).sum(0) / total).sum(), share

    @contextmanager
    def micro_batch(self, weight: float, mask: torch.Tensor | None, replay: torch.Tensor | None = None):
        """Around one micro-batch's forward: its share of the mini-batch's tokens (the loss's weight; 0 for FSDP2's
        padding micro-batches), for padded rows the flat [B·T] token mask, and with R3 the experts to replay
        (replay_tokens). Yields the micro-batch's metrics (filled by the forward, each a mean over the routers).
        Weight, mask and replay stay until the next micro-batch: its backward's recomputation of checkpointed layers
        reads them."""
        self.weight, self.mask = weight, None if mask is None else mask.reshape(-1)
        self.replay = replay
        self.recording = {"router_aux_loss": 0.0, "router_load_imbalance": 0.0}
        try:
            yield self.recording
        finally:
            self.recording = None


class RoutingRecorder:
    """The hf engine's record of every router's choices during one generate call (R3)."""

    def __init__(self, routers: list[torch.nn.Module]):
        self.routers, self.calls = routers, None
        for router in routers:
            router.register_forward_hook(self._hook)

    @classmethod
    def of(cls, model) -> "RoutingRecorder":
        classes = router_classes(model)
        routers = [m for m in model.modules() if classes and isinstance(m, classes)]
        if not routers:
            raise ValueError(f"actor.router_replay.mode=R3: {type(model).__name__} has no router to record (a "
                             "dense model: set actor.router_replay.mode=disabled)")
        return cls(routers)

    def _hook(self, module, args, output):
        if self.calls is not None:
            self.calls[id(module)].append(output[2].to(torch.int16).cpu())

    @contextmanager
    def recording(self):
        self.calls = {id(router): [] for router in self.routers}
        try:
            yield self
        finally:
            self.calls = None

    def fields(self, rows: int, prompt_width: int, generated: int) -> dict[str, torch.Tensor]:
        """ROUTING's two fields of the generate call just recorded: the prefill's [rows, P] tokens, then one decode
        step per generated token but the last (which no forward reads: -1)."""
        per_router = []
        for router in self.routers:
            calls = self.calls[id(router)]
            prefill = calls[0].reshape(rows, prompt_width, -1)
            steps = [call.reshape(rows, 1, -1) for call in calls[1:generated]]
            response = torch.cat(steps, 1) if steps else prefill.new_empty(rows, 0, prefill.shape[-1])
            response = torch.nn.functional.pad(response, (0, 0, 0, generated - response.shape[1]), value=-1)
            per_router.append((prefill, response))
        return {ROUTING[0]: torch.stack([p for p, _ in per_router], 2),
                ROUTING[1]: torch.stack([r for _, r in per_router], 2)}
