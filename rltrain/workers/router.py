"""The routers of a mixture-of-experts policy in the actor's update: the load-balancing auxiliary loss
(`actor.router_aux_loss_coef`, off by default as in verl) and the routing metrics (actor/router_aux_loss,
actor/router_load_imbalance).

Routers are the modules transformers records `router_logits` from (the model's `_can_record_outputs`: Qwen3-MoE's and
Mixtral's top-k routers, returning (logits, top-k weights, top-k expert ids)). For each router forward of the update,
over its T tokens, E experts and top-k:

    f_e = (assignments to e) / (T·k),   P_e = mean softmax probability of e,   loss = E · Σ_e f_e · P_e

(Switch Transformer's loss; 1 when balanced), averaged over the model's routers and weighted over the micro-batches by
their share of the mini-batch's tokens. The loss's gradient enters the graph through the router's top-k weights
(`AttachAuxLoss`: identity forward; backward adds coef × weight × dloss): it then flows while the backward is inside
that layer — under FSDP2, after the layer's parameters are gathered again — and a checkpointed layer's recomputation
repeats the same operations. The load imbalance is max_e f_e · E (1 = every expert takes its share). Padded
micro-batches mask their padding out of f and P; a packed row has none.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from tensordict import TensorDict

from rltrain.workers.packing import response_lengths, sequence_lengths


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


def router_classes(model) -> tuple[type, ...]:
    """The router module classes of `model` (empty for a dense model)."""
    recorder = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    target = getattr(recorder, "target_class", None)
    return (target,) if isinstance(target, type) else ()


class RouterBalance:
    """Forward hooks on every router of an MoE model (`of` gives None for a dense one)."""

    def __init__(self, routers: list[torch.nn.Module], coef: float):
        self.coef, self.count = coef, len(routers)
        self.weight, self.mask, self.recording = 0.0, None, None
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
        if not training and self.recording is None:
            return None
        logits, weights, experts = output
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
    def micro_batch(self, weight: float, mask: torch.Tensor | None):
        """Around one micro-batch's forward: its share of the mini-batch's tokens (the loss's weight; 0 for FSDP2's
        padding micro-batches) and, for padded rows, the flat [B·T] token mask. Yields the micro-batch's metrics
        (filled by the forward, each a mean over the routers). Weight and mask stay until the next micro-batch:
        its backward's recomputation of checkpointed layers reads them."""
        self.weight, self.mask = weight, None if mask is None else mask.reshape(-1)
        self.recording = {"router_aux_loss": 0.0, "router_load_imbalance": 0.0}
        try:
            yield self.recording
        finally:
            self.recording = None
