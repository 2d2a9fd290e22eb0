"""Dense reference for `linear_kl_div`: materialises both tokens × vocab logits and computes in float32 by default
(float64 in the tests).

The ground truth the chunked paths are tested against and what the benchmark checks them with, not something to
run at real sizes (at 32k tokens × 152k vocab each fp32 logits tensor is 20 GiB). Differentiable through plain
autograd, teacher included (the fused op refuses a teacher that requires grad; this one does not care).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_linear_kl_div(hidden: torch.Tensor, weight: torch.Tensor, teacher_hidden: torch.Tensor,
                        teacher_weight: torch.Tensor, *, temperature: float = 1.0, reduction: str = "batchmean",
                        direction: str = "forward", labels: torch.Tensor | None = None, ignore_index: int = -100,
                        compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """KL between softmax(teacher_hidden @ teacher_weight.T / T) and softmax(hidden @ weight.T / T) per token,
    in `compute_dtype`, then reduced (the definitions are linear_kl_div's).

    direction "forward": KL(teacher ‖ student) = Σ p_t (log p_t − log p_s) (F.kl_div's, with the student's log-probs
    as input); "reverse": KL(student ‖ teacher). Tokens whose label equals `ignore_index` give 0.
    """
    log_ps = torch.log_softmax(hidden.to(compute_dtype) @ weight.to(compute_dtype).T / temperature, dim=-1)
    log_pt = torch.log_softmax(teacher_hidden.to(compute_dtype) @ teacher_weight.to(compute_dtype).T / temperature,
                               dim=-1)
    if direction == "forward":
        kl = F.kl_div(log_ps, log_pt, reduction="none", log_target=True).sum(-1)
    else:
        kl = F.kl_div(log_pt, log_ps, reduction="none", log_target=True).sum(-1)
    if labels is not None:
        valid = labels != ignore_index
        kl = kl.masked_fill(~valid, 0.0)
        n_valid = int(valid.sum())
    else:
        n_valid = kl.numel()
    if reduction == "none":
        return kl
    total = kl.sum()
    if reduction == "sum":
        return total
    count = n_valid if reduction == "mean" else kl.numel()
    return total / count if count else total * 0.0
