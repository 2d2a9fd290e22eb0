"""Dense reference for `linear_logprobs`: materialises every logit, computes in float64 by default.

This is the ground truth the chunked torch path and the Triton path are tested against, not something to run at
real sizes (at 32k tokens × 152k vocab the float64 logits alone are 37 GiB). Differentiable through plain autograd.
"""

from __future__ import annotations

import torch


def naive_linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          temperature: float = 1.0, ignore_index: int = -100, return_entropy: bool = True,
                          compute_dtype: torch.dtype = torch.float64):
    """log_softmax(hidden @ weight.T / temperature)[label] and −Σ p log p, both in `compute_dtype`.

    Rows whose label equals `ignore_index` give 0 for both outputs (and so no gradient).
    """
    logits = hidden.to(compute_dtype) @ weight.to(compute_dtype).T / temperature
    logp = torch.log_softmax(logits, dim=-1)
    ignored = labels == ignore_index
    safe_labels = labels.masked_fill(ignored, 0)
    logprobs = logp.gather(-1, safe_labels.unsqueeze(-1)).squeeze(-1)
    logprobs = logprobs.masked_fill(ignored, 0.0)
    if not return_entropy:
        return logprobs, None
    entropy = -(logp.exp() * logp).sum(-1)
    entropy = entropy.masked_fill(ignored, 0.0)
    return logprobs, entropy
