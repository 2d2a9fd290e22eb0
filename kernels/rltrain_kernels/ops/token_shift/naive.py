"""Plain-PyTorch token shift (RWKV's time shift, fla's `token_shift`): the ground truth the Triton kernels are tested
against, and the fallback where they cannot run.

Per sequence, out[t] = x[t − 1] − x[t], with x[−1] the cache (the previous call's last token) or 0; with
cu_seqlens (B = 1) every packed sequence starts afresh from its own cache row. The returned cache is each
sequence's last token (an empty sequence passes its cache on, or zeros). Exact in x's dtype arithmetic as fla's
(one subtraction, rounded once); differentiable by autograd.
"""

from __future__ import annotations

import torch


def naive_token_shift(x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, cache: torch.Tensor | None = None,
                      output_cache: bool = False):
    """token_shift's reference: same arguments and results (out [B, T, D], and the cache [N, D] if output_cache)."""
    B, T, D = x.shape
    if cu_seqlens is None:
        sequences = [(b, 0, T) for b in range(B)]
    else:
        offsets = cu_seqlens.tolist()
        sequences = [(0, start, end) for start, end in zip(offsets, offsets[1:])]
    outputs, last = [], []
    for n, (b, start, end) in enumerate(sequences):
        before = cache[n : n + 1].to(x.dtype) if cache is not None else x.new_zeros(1, D)
        full = torch.cat([before, x[b, start:end]])                     # [1 + L, D]
        outputs.append(full[:-1] - full[1:])
        last.append(full[-1])
    out = torch.stack(outputs) if cu_seqlens is None else torch.cat(outputs)[None]
    if not output_cache:
        return out
    return out, torch.stack(last) if last else x.new_zeros(0, D)
