"""Causal depthwise short convolution (the "short conv" of every Gated DeltaNet / Mamba layer; fla's
`causal_conv1d` / `ShortConvolution`): public functions, autograd Function and the plain-PyTorch reference.

    from rltrain_kernels.ops.short_conv import short_conv, short_conv_update
    y, state = short_conv(x, weight, activation="silu", output_final_state=True)     # x [B, T, C], weight [C, W]
    y, _ = short_conv(row, weight, bias, activation="silu", cu_seqlens=cu_seqlens)   # packed: row [1, T, C]
    y_t = short_conv_update(x_t, state, weight, activation="silu")                  # decode: x_t [B, C], in place

    y[t] = act(bias + Σ_w weight[:, w] · xx[t − (W − 1) + w]) (+ residual[t]),   xx = [initial state, x]

per sequence: tap W − 1 is the current token; the W − 1 inputs before a sequence are its initial state's last W − 1
columns (zeros without one), so with cu_seqlens no tap reaches into the previous sequence. The final state [N, C,
W − 1] is the last W − 1 entries of xx: the decode step's conv_state. fp32 maths, output in x's dtype; gradients for
x, weight, bias, residual and the initial state. 2 ≤ W ≤ 8. Kernels: kernel.py (forward, final state, decode step),
kernel_bwd.py (backward, with its maths). Tensors the kernels cannot take (CPU outside the Triton interpreter,
float64) go to `naive_short_conv` / `naive_short_conv_update`, which compute the same functions.

Against fla 0.6 (`fla.modules.causal_conv1d.causal_conv1d`): the same keywords in the same order (x, weight, bias,
residual, initial_state, output_final_state, activation) and the same return (y, final_state), with cu_seqlens
keyword-only (fla has `backend` before it) and weight required. States differ: ours are [N, C, W − 1] like Tri Dao's
causal-conv1d (fla's are [N, C, W] with an unused first column); an initial state or conv_state wider than W − 1 is
accepted (its last W − 1 columns count), so fla's [N, C, W] states work as input. The decode step takes
causal-conv1d's argument order (x, conv_state, weight, bias, activation) and returns y, not (y, cache).
"""

from rltrain_kernels.ops.short_conv.function import ShortConvFunction, short_conv, short_conv_update
from rltrain_kernels.ops.short_conv.naive import naive_short_conv, naive_short_conv_update

__all__ = ["ShortConvFunction", "naive_short_conv", "naive_short_conv_update", "short_conv", "short_conv_update"]
