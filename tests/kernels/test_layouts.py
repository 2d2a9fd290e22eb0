"""Every public op gives the contiguous call's results whatever the memory layout of its tensor arguments and of the
gradients that reach its backward. (Issue 32: the chunked delta-rule ops read an initial state stored transposed as
if it were dense and returned wrong outputs and gradients without a word.)

Every public function of the ops (each `rltrain_kernels.ops.<op>` package's `__all__`, and the top-level exports)
has at least one case in CASES: small fresh inputs, passed by the op's own parameter names. Each tensor argument in
turn is then passed as
  - strided:    every other element of its innermost dim of size > 1, the gaps poisoned (NaN, 0 or False),
  - transposed: its two innermost dims of size > 1 stored swapped (the issue's
                `h.transpose(-1, -2).contiguous().transpose(-1, -2)`: a [N, H, K, V] view of a [N, H, V, K] buffer),
  - offset:     sliced out of a larger poisoned buffer (storage offset 1, rows padded by 2: a cache's slot),
and every output and every input gradient must match (and an input the op writes in place, `updated`, must end up
the same) the contiguous call's (fp32: relative error ≤ 1e-5). Then the
gradients reaching every differentiable output are passed strided, transposed, offset and expanded (stride 0, as
`.sum().backward()` hands them). A public function added without a case, or a tensor parameter no case passes,
fails `test_every_public_op_has_a_layout_case`.

Run: `pytest tests/kernels/test_layouts.py` (CPU, Triton interpreted: ~3 min on 2 cores); the `gpu`-marked tests
repeat every case at real sizes on CUDA.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

import rltrain_kernels
import rltrain_kernels.ops
from tests.helpers import rel_error

# Public functions that take no tensor: nothing to lay out.
NO_TENSOR_ARGUMENTS = {"linear_logprobs.workspace_bytes", "policy_loss.workspace_bytes", "kl_div.workspace_bytes"}
# Relative error allowed against the contiguous call. The same values in another layout give the same numbers up to
# the order of a sum (a GEMM on a transposed weight may pick another kernel): fp32 rounding; a 16-bit result may
# differ by an ulp (2^-8 for bf16) in some elements. A misread layout gives errors of 0.1-1 or NaN.
THRESHOLD = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 4e-3, torch.float16: 1e-3}


# ---------------------------------------------------------------------------------------------------------------
# Layouts: the same values in other memory
# ---------------------------------------------------------------------------------------------------------------

def _poison(dtype: torch.dtype):
    if dtype.is_floating_point:
        return float("nan")
    return False if dtype == torch.bool else 0


def _inner_dims(t: torch.Tensor) -> list[int]:
    """The dims of size > 1, innermost last: the ones a layout can change."""
    return [d for d in range(t.dim()) if t.shape[d] > 1]


def strided(t: torch.Tensor) -> torch.Tensor | None:
    """t's values at every other element of its innermost dim of size > 1, the elements between them poisoned."""
    dims = _inner_dims(t)
    if not dims:
        return None
    d = dims[-1]
    shape = list(t.shape)
    shape[d] *= 2
    index = [slice(None)] * t.dim()
    index[d] = slice(None, None, 2)
    view = torch.full(shape, _poison(t.dtype), dtype=t.dtype, device=t.device)[tuple(index)]
    return view.copy_(t)


def transposed(t: torch.Tensor) -> torch.Tensor | None:
    """t's values with its two innermost dims of size > 1 stored swapped."""
    dims = _inner_dims(t)
    if len(dims) < 2:
        return None
    i, j = dims[-2:]
    return t.transpose(i, j).contiguous().transpose(i, j)


def offset(t: torch.Tensor) -> torch.Tensor:
    """t's values sliced out of a larger poisoned buffer: storage offset 1, the innermost dim of size > 1 padded."""
    if t.dim() == 0:
        return torch.full((2,), _poison(t.dtype), dtype=t.dtype, device=t.device)[1].copy_(t)
    dims = _inner_dims(t)
    d = dims[-1] if dims else t.dim() - 1
    shape = list(t.shape)
    shape[d] += 2
    buffer = torch.full(shape, _poison(t.dtype), dtype=t.dtype, device=t.device)
    return buffer.narrow(d, 1, t.shape[d]).copy_(t)


def expanded(t: torch.Tensor) -> torch.Tensor | None:
    """t's first slice along its innermost dim of size > 1, expanded over that dim (stride 0): other values than t."""
    dims = _inner_dims(t)
    if not dims:
        return None
    return t.narrow(dims[-1], 0, 1).expand(t.shape)


INPUT_LAYOUTS = {"strided": strided, "transposed": transposed, "offset": offset}
GRADIENT_LAYOUTS = {"strided": strided, "transposed": transposed, "offset": offset}  # and `expanded`, on its own


# ---------------------------------------------------------------------------------------------------------------
# Cases: one per public op (and per path of it that reads its arguments differently)
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """op: "<package>.<function>" of rltrain_kernels.ops. inputs(device, real): fresh contiguous tensors keyed by
    the op's parameter names (small sizes, or real ones for the GPU). options: its other keyword arguments. grads:
    the inputs that get gradients. outputs: the op's result → a tuple of tensors (or None). rejects: {(argument,
    layout): message regex} where the op refuses a layout with a ValueError instead (the only alternative to the
    contiguous call's results)."""

    op: str
    inputs: Callable[[str, bool], dict[str, torch.Tensor]]
    grads: tuple[str, ...]
    options: dict = field(default_factory=dict)
    outputs: Callable = tuple
    variant: str = ""
    rejects: dict = field(default_factory=dict)
    updated: tuple[str, ...] = ()   # inputs the op writes in place: fresh each call, compared as outputs

    @property
    def id(self) -> str:
        return self.op.split(".")[-1] + (f"-{self.variant}" if self.variant else "")

    def function(self) -> Callable:
        package, name = self.op.split(".")
        return getattr(importlib.import_module(f"rltrain_kernels.ops.{package}"), name)


def _cu_seqlens(T: int, N: int, device) -> torch.Tensor:
    """N sequences over T tokens, int32 as callers pass them (an int64 one is copied by .to(int32) anyway)."""
    cuts = [T * i // N for i in range(N)] + [T]
    return torch.tensor(cuts, dtype=torch.int32, device=device)


def _delta_sizes(real: bool) -> dict:
    # CPU: the tl.dot minimum (16) and one sequence; H = 1 < HV = 2 (GVA) keeps g and beta [1, T, 2], so each has
    # two dims to transpose. GPU: several chunks per sequence, two sequences, the models' head dim and dtype.
    if real:
        return dict(T=300, N=2, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16)
    return dict(T=6, N=1, H=1, HV=2, K=16, V=16, dtype=torch.float32)


def _in_dtype(inputs: dict, dtype: torch.dtype) -> dict:
    """The token tensors in `dtype`; the initial state stays fp32 and cu_seqlens integer."""
    keep = ("initial_state", "cu_seqlens")
    return {name: t if name in keep else t.to(dtype) for name, t in inputs.items()}


def gated_delta_rule_inputs(device, real):
    s = _delta_sizes(real)
    T, N, H, HV, K, V = s["T"], s["N"], s["H"], s["HV"], s["K"], s["V"]
    inputs = dict(q=torch.randn(1, T, H, K, device=device),
                  k=F.normalize(torch.randn(1, T, H, K, device=device), dim=-1),
                  v=torch.randn(1, T, HV, V, device=device),
                  g=F.logsigmoid(torch.randn(1, T, HV, device=device)),
                  beta=torch.rand(1, T, HV, device=device),
                  initial_state=torch.randn(N, HV, K, V, device=device),
                  cu_seqlens=_cu_seqlens(T, N, device))
    return _in_dtype(inputs, s["dtype"])


def gated_delta_rule_gate_inputs(device, real):
    """fla's use_gate_in_kernel and use_beta_sigmoid_in_kernel: g holds the raw gate input and beta logits, with the
    gate's parameters A_log and dt_bias [HV]."""
    inputs = gated_delta_rule_inputs(device, real)
    HV = inputs["g"].shape[-1]
    return dict(inputs, g=torch.randn_like(inputs["g"]), beta=torch.randn_like(inputs["beta"]),
                A_log=torch.rand(HV, device=device).add(0.5).log(), dt_bias=torch.randn(HV, device=device))


def kda_inputs(device, real):
    """The gated delta rule's inputs with a per-channel log decay g [1, T, HV, K] (moderate: −softplus of N(0, 1))."""
    inputs = gated_delta_rule_inputs(device, real)
    T, HV, K = inputs["g"].shape[1], inputs["g"].shape[2], inputs["q"].shape[-1]
    inputs["g"] = -F.softplus(torch.randn(1, T, HV, K, device=device)).to(inputs["g"].dtype)
    return inputs


def kda_gate_inputs(device, real):
    """fla's keywords for KDA: g the raw gate input [1, T, HV, K], beta logits, A_log [HV], dt_bias [HV·K]."""
    inputs = kda_inputs(device, real)
    HV, K = inputs["g"].shape[2:]
    return dict(inputs, g=torch.randn_like(inputs["g"]), beta=torch.randn_like(inputs["beta"]),
                A_log=torch.rand(HV, device=device).add(0.5).log(), dt_bias=torch.randn(HV * K, device=device))


def kda_gate_only_inputs(device, real):
    inputs = kda_gate_inputs(device, real)
    return {"a": inputs["g"], "A_log": inputs["A_log"], "dt_bias": inputs["dt_bias"]}


def iplr_delta_rule_inputs(device, real):
    """b = k̂, a = −β k̂ with β ∈ (0, 1): the stable regime. One head is enough on the CPU (no [B, T, H] argument)."""
    s = _delta_sizes(real)
    T, N, H, K, V = s["T"], s["N"], s["H"], s["K"], s["V"]
    k_hat = F.normalize(torch.randn(1, T, H, K, device=device), dim=-1)
    inputs = dict(q=torch.randn(1, T, H, K, device=device),
                  k=F.normalize(torch.randn(1, T, H, K, device=device), dim=-1),
                  v=torch.randn(1, T, H, V, device=device),
                  a=-torch.rand(1, T, H, 1, device=device) * k_hat, b=k_hat,
                  initial_state=torch.randn(N, H, K, V, device=device),
                  cu_seqlens=_cu_seqlens(T, N, device))
    return _in_dtype(inputs, s["dtype"])


NUM_HOUSEHOLDER = 2


def gated_delta_product_inputs(device, real):
    s = _delta_sizes(real)
    T, N, H, HV, K, V = s["T"], s["N"], s["H"], s["HV"], s["K"], s["V"]
    TN = T * NUM_HOUSEHOLDER
    inputs = dict(q=torch.randn(1, T, H, K, device=device),
                  k=F.normalize(torch.randn(1, TN, H, K, device=device), dim=-1),
                  v=torch.randn(1, TN, HV, V, device=device),
                  g=F.logsigmoid(torch.randn(1, T, HV, device=device)),
                  beta=torch.rand(1, TN, HV, device=device),
                  initial_state=torch.randn(N, HV, K, V, device=device),
                  cu_seqlens=_cu_seqlens(T, N, device))
    return _in_dtype(inputs, s["dtype"])


def _vocab_sizes(real: bool, packed: bool = False) -> tuple[int, int, int, int]:
    """(B, T, hidden size, vocab); a packed batch is one row (B = 1) holding 3 sequences."""
    if real:
        return (1, 1024, 512, 8192 + 3) if packed else (2, 512, 512, 8192 + 3)
    return (1, 6, 16, 40) if packed else (2, 3, 16, 40)


def _needs_fused(device):
    if device == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("impl='fused' needs sm_90+")


def linear_logprobs_inputs(device, real, dtype=torch.float32, packed=False):
    B, T, D, vocab = _vocab_sizes(real, packed)
    return dict(hidden=torch.randn(B, T, D, device=device).to(dtype),
                weight=(torch.randn(vocab, D, device=device) * (3.0 / D ** 0.5)).to(dtype),
                labels=torch.randint(0, vocab, (B, T), device=device))


def _fused_linear_logprobs_inputs(device, real):
    _needs_fused(device)
    return linear_logprobs_inputs(device, real, torch.bfloat16)


def policy_loss_inputs(device, real, dtype=torch.float32, packed=False):
    """Logits of std ≈ 3, ~80% of tokens unmasked, old/ref logprobs = the true ones + N(0, 0.3²): ratios near 1, so
    both clip branches and the unclipped one carry gradient."""
    from rltrain_kernels.ops.policy_loss import reference_policy_loss

    inputs = linear_logprobs_inputs(device, real, dtype, packed)
    B, T = inputs["labels"].shape
    inputs["mask"] = torch.rand(B, T, device=device) > 0.2
    with torch.no_grad():
        logp = reference_policy_loss(inputs["hidden"].double(), inputs["weight"].double(), inputs["labels"],
                                     inputs["mask"], torch.zeros(B, device=device),
                                     torch.zeros(B, T, device=device)).logprobs.float()
    inputs.update(advantages=torch.randn(B, T, device=device),
                  old_logprobs=logp + 0.3 * torch.randn(B, T, device=device),
                  ref_logprobs=logp + 0.3 * torch.randn(B, T, device=device))
    if packed:
        inputs["cu_seqlens"] = _cu_seqlens(T, 3, device)
    return inputs


def _fused_policy_loss_inputs(device, real):
    _needs_fused(device)
    return policy_loss_inputs(device, real, torch.bfloat16)


def _weighted_policy_loss_inputs(device, real):
    """A slice of a packed row: per-token aggregation weights in place of loss_agg's (sequence parallelism)."""
    inputs = policy_loss_inputs(device, real, packed=True)
    del inputs["cu_seqlens"]   # the weights carry the row's aggregation
    inputs["loss_weights"] = torch.rand(inputs["labels"].shape, device=device) / inputs["labels"].numel()
    # advantages of one sign: a weighted sum of terms of both signs cancels, and the loss's relative error then
    # measures the cancellation (7e-5 on an H200 for a transposed head, whose GEMM rounds differently), not the layout
    inputs["advantages"] = inputs["advantages"].abs()
    return inputs


def _aggregation_weight_inputs(device, real):
    T, N = (300, 3) if real else (12, 3)
    generator = torch.Generator().manual_seed(3)
    return {"m": (torch.rand(1, T, generator=generator) > 0.3).float().to(device),
            "cu_seqlens": _cu_seqlens(T, N, device)}


def _aggregation_options():
    from rltrain_kernels.ops.policy_loss import PolicyLossOptions

    return PolicyLossOptions(loss_agg="seq-mean-token-mean")


def _policy_loss_outputs(out):
    return out.loss, out.logprobs, out.entropy, out.metrics.tensor


def _rows(real: bool) -> tuple[int, int, int]:
    return (2, 512, 2048) if real else (2, 3, 16)


def rms_norm_inputs(device, real, residual=False):
    shape = _rows(real)
    inputs = dict(x=torch.randn(shape, device=device), weight=1 + 0.1 * torch.randn(shape[-1], device=device))
    if residual:
        inputs["residual"] = torch.randn(shape, device=device)
    return inputs


def gated_rms_norm_inputs(device, real):
    return dict(rms_norm_inputs(device, real), gate=torch.randn(_rows(real), device=device))


def swiglu_inputs(device, real):
    return dict(gate=torch.randn(_rows(real), device=device), up=torch.randn(_rows(real), device=device))


def rope_inputs(device, real, unsqueeze_dim=1):
    """q with 4 heads, k with 2 (GQA); cos/sin [B, T, D] with halves that differ, as HF allows."""
    B, T, D = (2, 512, 128) if real else (2, 3, 8)

    def heads(n):
        return torch.randn(B, n, T, D, device=device) if unsqueeze_dim == 1 else torch.randn(B, T, n, D, device=device)

    angles = torch.rand(B, T, D, device=device) * 6.0
    return dict(q=heads(4), k=heads(2), cos=angles.cos(), sin=angles.sin())


def rotate_half_inputs(device, real):
    return dict(x=torch.randn(2, 4, 512, 128, device=device) if real else torch.randn(2, 3, 8, device=device))


def fused_moe_inputs(device, real):
    """A softmax top-2 routing over E experts; the weights scaled for unit-size outputs."""
    T, H, I, E, k = (512, 256, 128, 8, 2) if real else (5, 16, 16, 3, 2)
    dtype = torch.bfloat16 if real else torch.float32
    weights, index = torch.topk(torch.randn(T, E, device=device).softmax(-1), k)
    return dict(hidden_states=torch.randn(T, H, device=device).to(dtype),
                gate_up_proj=(torch.randn(E, 2 * I, H, device=device) / H ** 0.5).to(dtype),
                down_proj=(torch.randn(E, H, I, device=device) / I ** 0.5).to(dtype),
                top_k_index=index, top_k_weights=weights.to(dtype))


def short_conv_inputs(device, real, packed=False):
    """x [B, T, C] with bias, residual and an initial state [N, C, W - 1]; packed: one row of 3 sequences."""
    B, T, C, W = (2, 300, 256, 4) if real else (2, 5, 3, 4)
    B, N = (1, 3) if packed else (B, B)
    dtype = torch.bfloat16 if real else torch.float32
    inputs = dict(x=torch.randn(B, T, C, device=device), weight=torch.randn(C, W, device=device) / 2,
                  bias=torch.randn(C, device=device), initial_state=torch.randn(N, C, W - 1, device=device))
    if packed:
        inputs["cu_seqlens"] = _cu_seqlens(T, N, device)
    else:
        inputs["residual"] = torch.randn(B, T, C, device=device)
    return {name: t if name == "cu_seqlens" else t.to(dtype) for name, t in inputs.items()}


def short_conv_update_inputs(device, real):
    B, C, W = (64, 256, 4) if real else (2, 3, 4)
    dtype = torch.bfloat16 if real else torch.float32
    return {name: t.to(dtype) for name, t in dict(
        x=torch.randn(B, C, device=device), conv_state=torch.randn(B, C, W - 1, device=device),
        weight=torch.randn(C, W, device=device) / 2, bias=torch.randn(C, device=device)).items()}


def l2norm_inputs(device, real):
    return dict(x=torch.randn(2, 512, 8, 128, device=device) if real else torch.randn(2, 3, 16, device=device))


def token_shift_inputs(device, real, packed=False):
    """x [B, T, D] and a cache [N, D] (the last token before each sequence); packed: one row of 3 sequences."""
    B, T, D = (2, 300, 256) if real else (2, 5, 3)
    B, N = (1, 3) if packed else (B, B)
    inputs = dict(x=torch.randn(B, T, D, device=device), cache=torch.randn(N, D, device=device))
    if packed:
        inputs["cu_seqlens"] = _cu_seqlens(T, N, device)
    return inputs


def kl_div_inputs(device, real):
    """A student (H) and a teacher (H_t != H) over one vocabulary, logits of std ≈ 3; a few ignored labels."""
    B, T, H, H_t, vocab = (2, 256, 512, 768, 8192 + 3) if real else (2, 3, 16, 24, 40)
    dtype = torch.bfloat16 if real else torch.float32
    labels = torch.randint(0, vocab, (B, T), device=device)
    labels[0, 0] = -100
    return dict(hidden=torch.randn(B, T, H, device=device).to(dtype),
                weight=(torch.randn(vocab, H, device=device) * (3.0 / H ** 0.5)).to(dtype),
                teacher_hidden=torch.randn(B, T, H_t, device=device).to(dtype),
                teacher_weight=(torch.randn(vocab, H_t, device=device) * (3.0 / H_t ** 0.5)).to(dtype),
                labels=labels)


_DELTA_GRADS = ("q", "k", "v", "g", "beta", "initial_state")
_STATE_OUT = dict(output_final_state=True)
# fla's keywords: the gate and β computed inside (A_log and dt_bias get gradients too), and the [N, HV, V, K] states
# (K = V here: a transposed buffer is the other layout's values, which only the op's own reading can tell apart)
_GATE_KEYWORDS = dict(_STATE_OUT, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
_V_FIRST = dict(_STATE_OUT, state_v_first=True)
_GDP = dict(num_householder=NUM_HOUSEHOLDER, output_final_state=True)
_PG = dict(clip_low=0.2, clip_high=0.28, kl_coef=0.1, entropy_coef=0.01)
# impl="fused" asked for explicitly refuses a weight that TMA cannot address (unit inner stride, 16-byte aligned base
# and rows) rather than copy the LM head; linear_logprobs takes hidden's rows as they are, so also a misaligned hidden
_TMA = "16-byte aligned with unit inner stride"
_FUSED_REJECTS = {("weight", layout): _TMA for layout in INPUT_LAYOUTS}
CASES = [
    *(Case(f"gated_delta_rule.{fn}", gated_delta_rule_inputs, _DELTA_GRADS, _STATE_OUT)
      for fn in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "naive_recurrent_gated_delta_rule")),
    *(Case(f"gated_delta_rule.{fn}", gated_delta_rule_gate_inputs, (*_DELTA_GRADS, "A_log", "dt_bias"),
           _GATE_KEYWORDS, variant="gate-in-kernel")
      for fn in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "naive_recurrent_gated_delta_rule")),
    *(Case(f"gated_delta_rule.{fn}", gated_delta_rule_inputs, _DELTA_GRADS, _V_FIRST, variant="state-v-first")
      for fn in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "naive_recurrent_gated_delta_rule")),
    *(Case(f"kda.{fn}", kda_inputs, _DELTA_GRADS, _STATE_OUT)
      for fn in ("chunk_kda", "fused_recurrent_kda", "naive_recurrent_kda")),
    *(Case(f"kda.{fn}", kda_gate_inputs, (*_DELTA_GRADS, "A_log", "dt_bias"), _GATE_KEYWORDS, variant="gate-in-kernel")
      for fn in ("chunk_kda", "fused_recurrent_kda", "naive_recurrent_kda")),
    Case("kda.naive_kda_gate", kda_gate_only_inputs, ("a", "A_log", "dt_bias"), outputs=lambda g: (g,)),
    *(Case(f"iplr_delta_rule.{fn}", iplr_delta_rule_inputs, ("q", "k", "v", "a", "b", "initial_state"), _STATE_OUT)
      for fn in ("chunk_iplr_delta_rule", "fused_recurrent_iplr_delta_rule", "naive_recurrent_iplr_delta_rule")),
    *(Case(f"gated_delta_product.{fn}", gated_delta_product_inputs, _DELTA_GRADS, _GDP)
      for fn in ("chunk_gated_delta_product", "fused_recurrent_gated_delta_product",
                 "naive_recurrent_gated_delta_product")),
    *(Case("linear_logprobs.linear_logprobs", linear_logprobs_inputs, ("hidden", "weight"), dict(impl=impl),
           variant=impl) for impl in ("torch", "triton")),
    Case("linear_logprobs.linear_logprobs", _fused_linear_logprobs_inputs, ("hidden", "weight"), dict(impl="fused"),
         variant="fused", rejects={**_FUSED_REJECTS, ("hidden", "offset"): _TMA}),
    Case("linear_logprobs.naive_linear_logprobs", linear_logprobs_inputs, ("hidden", "weight")),
    *(Case("policy_loss.fused_policy_loss", policy_loss_inputs, ("hidden", "weight"), dict(_PG, impl=impl),
           _policy_loss_outputs, variant=impl) for impl in ("torch", "triton")),
    # bf16 without an entropy bonus: the fused path's default form (scaled.py)
    Case("policy_loss.fused_policy_loss", _fused_policy_loss_inputs, ("hidden", "weight"),
         dict(_PG, entropy_coef=0.0, impl="fused"), _policy_loss_outputs, variant="fused", rejects=_FUSED_REJECTS),
    # packed rows: cu_seqlens sets the per-sequence aggregation (read on the host, the same for every impl)
    Case("policy_loss.fused_policy_loss", lambda device, real: policy_loss_inputs(device, real, packed=True),
         ("hidden", "weight"), dict(_PG, loss_agg="seq-mean-token-sum", impl="torch"), _policy_loss_outputs,
         variant="packed"),
    Case("policy_loss.fused_policy_loss", _weighted_policy_loss_inputs, ("hidden", "weight"), dict(_PG, impl="torch"),
         _policy_loss_outputs, variant="weighted"),
    Case("policy_loss.reference_policy_loss", policy_loss_inputs, ("hidden", "weight"), _PG, _policy_loss_outputs),
    # the per-token weights a slice of a packed row takes its share of the row's loss with (sequence parallelism)
    Case("policy_loss.aggregation_weights", _aggregation_weight_inputs, (),
         dict(opts=_aggregation_options()), lambda w: (w,)),
    Case("rmsnorm.rms_norm", rms_norm_inputs, ("x", "weight"), outputs=lambda y: (y,)),
    *(Case(f"rmsnorm.{fn}", lambda device, real: rms_norm_inputs(device, real, residual=True),
           ("x", "weight", "residual"), variant="residual") for fn in ("rms_norm", "naive_rms_norm")),
    *(Case(f"rmsnorm.{fn}", gated_rms_norm_inputs, ("x", "gate", "weight"), outputs=lambda y: (y,))
      for fn in ("gated_rms_norm", "naive_gated_rms_norm")),
    *(Case(f"swiglu.{fn}", swiglu_inputs, ("gate", "up"), outputs=lambda y: (y,)) for fn in ("swiglu", "naive_swiglu")),
    # cos/sin stay constants: with a gradient on them apply_rotary_pos_emb takes the naive path
    *(Case(f"rope.{fn}", lambda device, real, dim=dim: rope_inputs(device, real, dim), ("q", "k"),
           dict(unsqueeze_dim=dim), variant="BHTD" if dim == 1 else "BTHD")
      for fn in ("apply_rotary_pos_emb", "naive_apply_rotary_pos_emb") for dim in (1, 2)),
    Case("rope.rotate_half", rotate_half_inputs, ("x",), outputs=lambda y: (y,)),
    *(Case(f"fused_moe.{fn}", fused_moe_inputs, ("hidden_states", "gate_up_proj", "down_proj", "top_k_weights"),
           outputs=lambda y: (y,)) for fn in ("fused_moe", "naive_fused_moe")),
    *(Case(f"short_conv.{fn}", short_conv_inputs, ("x", "weight", "bias", "residual", "initial_state"),
           dict(output_final_state=True, activation="silu")) for fn in ("short_conv", "naive_short_conv")),
    *(Case(f"short_conv.{fn}", lambda device, real: short_conv_inputs(device, real, packed=True),
           ("x", "weight", "bias", "initial_state"), dict(output_final_state=True), variant="packed")
      for fn in ("short_conv", "naive_short_conv")),
    # the update writes conv_state in place: the kernel runs when no gradient is asked for (the reference otherwise)
    *(Case(f"short_conv.{fn}", short_conv_update_inputs, (), dict(activation="silu"), lambda y: (y,),
           updated=("conv_state",)) for fn in ("short_conv_update", "naive_short_conv_update")),
    *(Case(f"l2norm.{fn}", l2norm_inputs, ("x",), outputs=lambda y: (y,))
      for fn in ("l2norm", "l2_norm", "naive_l2norm")),
    *(Case(f"token_shift.{fn}", token_shift_inputs, ("x", "cache"), dict(output_cache=True))
      for fn in ("token_shift", "naive_token_shift")),
    *(Case(f"token_shift.{fn}", lambda device, real: token_shift_inputs(device, real, packed=True), ("x", "cache"),
           dict(output_cache=True), variant="packed") for fn in ("token_shift", "naive_token_shift")),
    *(Case(f"kl_div.{fn}", kl_div_inputs, ("hidden", "weight"), dict(reduction="none"), lambda y: (y,))
      for fn in ("linear_kl_div", "naive_linear_kl_div")),
]


# ---------------------------------------------------------------------------------------------------------------
# The public API, and every op of it covered
# ---------------------------------------------------------------------------------------------------------------

def public_ops() -> set[str]:
    """"<package>.<name>" of every public function of the op packages: their `__all__` (else their public names),
    and the top-level exports of rltrain_kernels that come from them."""
    ops = set()
    for info in pkgutil.iter_modules(rltrain_kernels.ops.__path__):
        package = f"rltrain_kernels.ops.{info.name}"
        module = importlib.import_module(package)
        names = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
        for name in names:
            obj = getattr(module, name)
            if inspect.isfunction(obj) and obj.__module__.startswith(package):
                ops.add(f"{info.name}.{name}")
    for name, obj in vars(rltrain_kernels).items():
        if inspect.isfunction(obj) and obj.__module__.startswith("rltrain_kernels.ops."):
            ops.add(f"{obj.__module__.split('.')[2]}.{name}")
    return ops


def _tensor_parameters(fn) -> set[str]:
    """The parameters annotated as tensors (optional ones included)."""
    return {name for name, p in inspect.signature(fn).parameters.items() if "Tensor" in str(p.annotation)}


def test_every_public_op_has_a_layout_case():
    """A public function without a case, a case for a function that is no longer public, or a tensor parameter that
    no case of its op passes fails here: add the case to CASES."""
    public = public_ops()
    covered = {case.op for case in CASES}
    assert {"gated_delta_rule.chunk_gated_delta_rule", "linear_logprobs.linear_logprobs",
            "policy_loss.fused_policy_loss", "rmsnorm.rms_norm"} <= public  # the discovery itself works
    assert not public - covered - NO_TENSOR_ARGUMENTS, f"public ops without a layout case: {public - covered}"
    assert not covered - public, f"layout cases for functions that are not public ops: {covered - public}"
    for op in covered:
        cases = [case for case in CASES if case.op == op]
        passed = set().union(*(case.inputs("cpu", False).keys() for case in cases))
        missing = _tensor_parameters(cases[0].function()) - passed
        assert not missing, f"{op}: no layout case passes its tensor parameters {sorted(missing)}"


# ---------------------------------------------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------------------------------------------

def _fresh_copy(t: torch.Tensor) -> torch.Tensor:
    """t in a copy of its storage, in the same layout (strides, offset): an in-place update leaves t alone."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage().clone(), t.storage_offset(),
                                                               t.size(), t.stride())


def _run(case: Case, inputs: dict, upstream: list | None = None):
    """(outputs, input gradients, upstream gradients) of one call on `inputs` (any layout): the gradients of
    case.grads after a backward of the differentiable outputs with `upstream` (fresh contiguous normals if None)."""
    inputs = {name: _fresh_copy(t) if name in case.updated else t for name, t in inputs.items()}
    leaves = {name: t.detach().requires_grad_() if name in case.grads else t for name, t in inputs.items()}
    outputs = (*case.outputs(case.function()(**leaves, **case.options)), *(inputs[name] for name in case.updated))
    differentiable = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
    if upstream is None:
        upstream = [torch.randn_like(o) for o in differentiable]
    if differentiable:
        torch.autograd.backward(differentiable, upstream)
    detached = [o.detach() if isinstance(o, torch.Tensor) else o for o in outputs]
    return detached, [leaves[name].grad for name in case.grads], upstream


def _differences(case: Case, actual, expected, what: str) -> list[str]:
    """Every output and input gradient of `actual` that differs from `expected`, as messages naming `what`."""
    names = [f"output {i}" for i in range(len(expected[0]))] + [f"grad {name}" for name in case.grads]
    found = []
    for name, a, e in zip(names, actual[0] + actual[1], expected[0] + expected[1], strict=True):
        if a is None or e is None:
            if (a is None) != (e is None):
                found.append(f"{what}: {name} is {'None' if a is None else 'a tensor'}, contiguous call's is not")
            continue
        if e.is_floating_point():
            assert torch.isfinite(e).all(), f"{case.id}: the contiguous call's {name} is not finite"
        if a.shape != e.shape or a.dtype != e.dtype:
            found.append(f"{what}: {name} {tuple(a.shape)} {a.dtype} != {tuple(e.shape)} {e.dtype}")
        elif not e.is_floating_point():
            if not torch.equal(a, e):
                found.append(f"{what}: {name} differs")
        else:
            err = rel_error(a, e)
            if not err <= THRESHOLD[e.dtype]:  # NaN-safe
                found.append(f"{what}: {name} relative error {err:.3g} > {THRESHOLD[e.dtype]:.0e}")
    return found


def check_argument_layouts(case: Case, device: str, real: bool) -> None:
    inputs = case.inputs(device, real)
    expected = _run(case, inputs)
    failures = []
    for name, tensor in inputs.items():
        assert _inner_dims(tensor), f"{case.id}: {name} {tuple(tensor.shape)} has no dim a layout can change"
        for layout, relayout in INPUT_LAYOUTS.items():
            view = relayout(tensor)
            if view is None:  # too few dims of size > 1 for this layout
                continue
            assert torch.equal(view, tensor) and (not view.is_contiguous() or view.storage_offset() > 0)
            if (name, layout) in case.rejects:
                with pytest.raises(ValueError, match=case.rejects[name, layout]):
                    _run(case, {**inputs, name: view}, expected[2])
                continue
            failures += _differences(case, _run(case, {**inputs, name: view}, expected[2]), expected,
                                     f"{name} {layout} (strides {view.stride()}, offset {view.storage_offset()})")
    assert not failures, f"{case.id}: results depend on the arguments' layout:\n  " + "\n  ".join(failures)


def check_gradient_layouts(case: Case, device: str, real: bool) -> None:
    inputs = case.inputs(device, real)
    outputs, grads, upstream = _run(case, inputs)
    if not upstream:
        pytest.skip(f"{case.id}: no differentiable output")
    failures = []
    for layout, relayout in GRADIENT_LAYOUTS.items():
        views = [relayout(g) for g in upstream]
        if all(v is None for v in views):
            continue
        views = [g if v is None else v for g, v in zip(upstream, views)]
        failures += _differences(case, _run(case, inputs, views), (outputs, grads), f"upstream gradients {layout}")
    broadcast = [expanded(g) for g in upstream]
    if any(b is not None for b in broadcast):
        broadcast = [g if b is None else b for g, b in zip(upstream, broadcast)]
        expected = _run(case, inputs, [b.contiguous() for b in broadcast])
        failures += _differences(case, _run(case, inputs, broadcast), expected, "upstream gradients expanded")
    assert not failures, f"{case.id}: results depend on the upstream gradients' layout:\n  " + "\n  ".join(failures)


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_argument_layouts(case, device, poison_allocations):
    check_argument_layouts(case, device, real=False)


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_upstream_gradient_layouts(case, device, poison_allocations):
    check_gradient_layouts(case, device, real=False)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_argument_layouts_real_sizes(case, poison_allocations):
    check_argument_layouts(case, "cuda", real=True)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_upstream_gradient_layouts_real_sizes(case, poison_allocations):
    check_gradient_layouts(case, "cuda", real=True)
