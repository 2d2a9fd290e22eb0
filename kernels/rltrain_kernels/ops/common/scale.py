"""In-place scaling of a gradient the forward already computed, skipped on the device when the scale is 1.

The fused LM-head losses (`policy_loss`, `kl_div`) compute grad_hidden and grad_weight inside their forward; their
backward only multiplies them by the upstream scalar gradient, which is 1 in the usual `loss.backward()`. Reading it
on the host would be a sync, so the kernel decides on the GPU: every program stops after one 4-byte load when the
scale is 1, else it walks its share of the tensor (the 2·V·H·2 B pass over a bf16 grad_weight runs only when
needed).

    from rltrain_kernels.ops.common.scale import scale_unless_one
    scale_unless_one(grad_weight, grad_loss)      # grad (contiguous) *= grad_loss, a one-element tensor

Imported only on the Triton paths; runs on CPU tensors under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _scale_unless_one_kernel(x_ptr, scale_ptr, n, BLOCK: tl.constexpr):
    """x *= scale in place (fp32 product, rounded once to x's dtype), unless scale == 1: then each program stops
    after one 4-byte load. A grid-stride loop over BLOCK-element blocks."""
    scale = tl.load(scale_ptr).to(tl.float32)
    if scale != 1.0:
        for block in range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0)):
            offs = block * tl.full([], BLOCK, tl.int64) + tl.arange(0, BLOCK)   # int64: V·H may pass 2³¹
            inb = offs < n
            x = tl.load(x_ptr + offs, mask=inb, other=0.0)
            tl.store(x_ptr + offs, (x.to(tl.float32) * scale).to(x_ptr.dtype.element_ty), mask=inb)


SCALE_BLOCK = 4096       # elements per block of _scale_unless_one_kernel: 16 per thread at 8 warps
SCALE_PROGRAMS = 1024    # its grid at most (~8 per H100/H200 multiprocessor): a few µs when the scale is 1


def scale_unless_one(grad: torch.Tensor, scale: torch.Tensor, block: int | None = None,
                     programs: int | None = None) -> None:
    """grad (contiguous) *= scale (a one-element tensor on grad's device) in place, skipped on the GPU when
    scale == 1: no host sync. At most `programs` (default SCALE_PROGRAMS) programs of `block` (SCALE_BLOCK)
    elements, striding over the rest."""
    n = grad.numel()
    block, programs = block or SCALE_BLOCK, programs or SCALE_PROGRAMS
    if n:
        grid = (min(triton.cdiv(n, block), programs),)
        _scale_unless_one_kernel[grid](grad, scale, n, BLOCK=block, num_warps=8)
