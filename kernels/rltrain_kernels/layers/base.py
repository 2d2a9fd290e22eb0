"""DeltaRuleLayer: what the three delta-rule token mixers (GatedDeltaNet, GatedDeltaProduct, IPLRLinearAttention)
share, so each layer's file holds only its own transition.

Shared: the sizes and their checks; the q, k, v projections (k and v with n sub-steps per token: the product's n_h,
else 1) and their short convolutions; the output gate, per-head gated RMSNorm and output projection; and the steps of
forward around the op: the packing and padding rules (layers/common.py), the convolutions continuing the cache's conv
states (`convolved_inputs`), the gated output and the cache handed back (`gated_output_and_cache`).

A layer's own: the projections of its transition (β, the decay rate, the erase direction), made between
`super().__init__` (q, k, v) and `init_convs_and_output` (the order of creation fixes the parameters' order and their
initial weights' draws from the RNG), and its forward, which calls its op through the two
module-level names the registry's kernel rebinds in a copy of that forward (integrations/families.py with_globals):
those names must be read in the layer's own forward, not here.

Ulysses sequence parallelism (rltrain_kernels.sequence_parallel; a packed row, `sequence_parallel` given): the layer
gets this rank's slice of the row and the whole row's cu_seqlens. The projections and gates are token-local; each
convolution reads the previous conv_size − 1 inputs across the cut from the ranks before (`sequence_parallel_conv`);
the op runs on every token of this rank's heads, its [B, T, H, ...] inputs switched by all-to-all and its output
switched back (`sequence_parallel_op`); the output head is token-local again.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from .common import LinearAttentionCache, ShortConvolution, check_packed_call, gated_output, padding_mask


def sequence_parallel_conv(conv: ShortConvolution, x: torch.Tensor, cu_seqlens: torch.Tensor, sp):
    """conv over this rank's slice x [1, L, C] of a packed row (cu_seqlens: the whole row's): its first tokens' taps
    read the inputs before the cut, gathered from the ranks before (differentiably; zeros before the row), and taps
    into another sequence stay masked. Returns (y [1, L, C], None)."""
    W, L = conv.conv_size, x.shape[1]
    tail = min(L, W - 1)   # each rank's last inputs; slices shorter than the window take several ranks' whole
    before = sp.gather(x[:, L - tail:], 1)[:, :sp.rank * tail]
    halo = torch.cat([x.new_zeros(1, W - 1, x.shape[2]), before], 1)[:, -(W - 1):]
    window = torch.cat([halo, x], 1)
    start = sp.rank * L - (W - 1)   # the window's first token in the row
    bounds = torch.cat([cu_seqlens.new_tensor([0, window.shape[1]]), (cu_seqlens - start).clamp(0, window.shape[1])])
    y, _ = conv(window, None, bounds.unique())   # sorted: the window's sequences (its first may be cut)
    return y[:, W - 1:], None


def sequence_parallel_op(op, sp):
    """`op` (a delta-rule op: [B, T, H, ...] tensors in, (o [B, T, H, V], state) out) on every token of this rank's
    heads: each tensor argument of 3 or more dims switched by all-to-all, the output switched back."""
    def switch(arg):
        return sp.gather_sequence(arg, head_dim=2, seq_dim=1) if torch.is_tensor(arg) and arg.dim() >= 3 else arg

    def run(*args, **kwargs):
        o, state = op(*map(switch, args), **{name: switch(arg) for name, arg in kwargs.items()})
        return sp.scatter_sequence(o, head_dim=2, seq_dim=1), state

    return run


def decay_parameters(num_heads: int, dt_values: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(A_log [num_heads], dt_bias [dt_values, default num_heads]) drawn as Gated DeltaNet draws them: A ~ U(1, 16),
    dt ~ logU(1e-3, 0.1) stored as softplus⁻¹(dt). Shared by the gated delta rule and product layers, KDA (a dt per
    head and key channel) and the hybrid model's initialisation."""
    A_log = torch.empty(num_heads).uniform_(1, 16).log()
    dt = torch.rand(dt_values or num_heads) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)
    dt = torch.exp(dt).clamp_min(1e-4)
    return A_log, dt + torch.log(-torch.expm1(-dt))


class DeltaRuleLayer(nn.Module):
    """The shared part of a delta-rule token mixer: see the module docstring. Subclasses create their transition's
    projections after `super().__init__(...)`, then call `init_convs_and_output(...)`."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, head_v_dim: int | None,
                 allow_neg_eigval: bool, norm_eps: float, substeps: int = 1):
        super().__init__()
        if min(hidden_size, num_heads, head_dim) < 1:
            raise ValueError("hidden_size, num_heads and head_dim must be >= 1")
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.head_k_dim, self.head_v_dim = head_dim, head_v_dim or head_dim
        self.allow_neg_eigval, self.norm_eps = allow_neg_eigval, norm_eps
        H, K, V = num_heads, self.head_k_dim, self.head_v_dim
        # Bias-free projections: a zeroed (padded) hidden state then gives zero conv inputs and a zero output gate.
        self.q_proj = nn.Linear(hidden_size, H * K, bias=False)
        self.k_proj = nn.Linear(hidden_size, substeps * H * K, bias=False)
        self.v_proj = nn.Linear(hidden_size, substeps * H * V, bias=False)

    def init_convs_and_output(self, conv_size: int, substeps: int = 1, decay: bool = False) -> None:
        """The output gate, the q, k, v convolutions, the decay parameters A_log and dt_bias (with `decay`), the
        output norm's weight and the output projection."""
        H, K, V = self.num_heads, self.head_k_dim, self.head_v_dim
        self.g_proj = nn.Linear(self.hidden_size, H * V, bias=False)  # output gate
        self.q_conv = ShortConvolution(H * K, conv_size)
        self.k_conv = ShortConvolution(substeps * H * K, conv_size)
        self.v_conv = ShortConvolution(substeps * H * V, conv_size)
        if decay:
            A_log, dt_bias = decay_parameters(H)
            self.A_log, self.dt_bias = nn.Parameter(A_log), nn.Parameter(dt_bias)
        self.norm_weight = nn.Parameter(torch.ones(V))
        self.o_proj = nn.Linear(H * V, self.hidden_size, bias=False)

    def convolved_inputs(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                         cache: LinearAttentionCache | None, use_cache: bool, cu_seqlens: torch.Tensor | None,
                         sequence_parallel=None):
        """The steps before the op: the packing and padding rules, the padded tokens' hidden states zeroed, and q, k,
        v through their projections and convolutions (continuing the cache's conv states). Returns (x, mask [B, T, 1]
        or None, q, k, v [B, T, channels], the convolutions' new states {"q", "k", "v"})."""
        B, T, _ = hidden_states.shape
        check_packed_call(cu_seqlens, B, attention_mask, cache, use_cache)
        if sequence_parallel is not None and cu_seqlens is None:
            raise ValueError("sequence_parallel splits a packed row: it needs cu_seqlens")
        mask = padding_mask(attention_mask, B, T, cache, use_cache)
        x = hidden_states if mask is None else hidden_states * mask.to(hidden_states.dtype)
        conv_states = cache.conv_states if cache is not None else {}

        def conv(module, inputs, state):
            if sequence_parallel is None:
                return module(inputs, state, cu_seqlens)
            return sequence_parallel_conv(module, inputs, cu_seqlens, sequence_parallel)

        q, q_state = conv(self.q_conv, self.q_proj(x), conv_states.get("q"))
        k, k_state = conv(self.k_conv, self.k_proj(x), conv_states.get("k"))
        v, v_state = conv(self.v_conv, self.v_proj(x), conv_states.get("v"))
        return x, mask, q, k, v, {"q": q_state, "k": k_state, "v": v_state}

    def gated_output_and_cache(self, o: torch.Tensor, x: torch.Tensor, mask: torch.Tensor | None,
                               cache: LinearAttentionCache | None, use_cache: bool, conv_states: dict,
                               state: torch.Tensor | None):
        """The steps after the op: o [B, T, H, V] through the gated RMSNorm (output gate from x) and the output
        projection, padded tokens zeroed. Returns (output [B, T, hidden_size], LinearAttentionCache or None)."""
        out = self.o_proj(gated_output(o, self.g_proj(x), self.norm_weight, self.norm_eps))
        if mask is not None:
            out = out * mask.to(out.dtype)
        if not use_cache:
            return out, None
        seen = (cache.seen_tokens if cache is not None else 0) + x.shape[1]
        return out, LinearAttentionCache(conv_states, state, seen)
