"""Precision of the delta-rule chunk kernels: what the tensor-core dots take as operands, and the dtype in which
the chunk intermediates (the chunk states h, δ = v_new and the state gradients dh) are stored.

Kernels call `mm(a, b, DOT_PREC)` instead of `tl.dot`, with `DOT_PREC = dot_precision(input dtype)`, and
`mm(a, b, RAW_PREC)` (`raw_precision`) for a product of two raw inputs (q kᵀ, k kᵀ): in bf16 or fp16 there, since
the products of two such numbers are exact in fp32 (that dot loses nothing, at twice tf32's rate); `mma(a, b, acc,
DOT_PREC)` accumulates into acc in the dot itself. The modes:
- "ieee": exact fp32 products (fp32 inputs: the CPU interpreter's and the fp32 GPU path);
- "tf32": fp32 operands rounded to tf32 (10-bit mantissa) on the tensor cores;
- "bf16" / "fp16": operands cast to bf16 (7-bit mantissa) / fp16 in registers, twice tf32's tensor-core rate and
  half the operand registers and shared memory. Computed operands (T, w, u, h, δ) are rounded to bf16 there, as
  fla does throughout.
Accumulation is fp32 in every mode, and the state recurrences keep their running state in fp32 registers. The
chunked ops take the dots' precision for bf16 inputs as arguments (auto | bf16 | tf32), resolved once per call into
DOT_PREC strings handed down to the launches, forward and backward: `dot` for the chunk kernels
(`op_dot_precision`: "auto" is LOW_PRECISION_DOT, IPLR's IPLR_LOW_PRECISION_DOT) and, for the gated delta rule and
product, `recurrence_dot` for the WY and state-pass kernels (`recurrence_dot_precision`: "auto" follows `dot`; the
registry binds kernel_config.delta_rule_recurrence_dot into the swapped layers' calls), which can keep them in tf32
while the rest runs bf16.

Triton 3.4–3.7.0 miscompiles, on Hopper, a tensor-core dot whose operand is tl.trans of another tensor-core dot's
result (fla #640): that gave dk off by 10–15% here with "tf32". No kernel of ours does that (the transposed product
is computed as its own dot from loaded tiles; tests/kernels/test_transposed_dot_operands.py checks every kernel).
The interpreter ignores input_precision, so only a GPU run can validate a choice
(kernels/benchmarks/bench_gated_delta_rule.py --precision sweeps them).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# The chunk products' dots for bf16 inputs under dot="auto" (the ops' `dot` argument: "bf16" or "tf32"; fp16 inputs
# always use "tf32": fp16's range would overflow computed operands such as the chunk states; fp32 inputs "ieee").
# bf16 dots with bf16 h, δ and dh: 3.41 ms forward+backward against 4.34 with all tf32 and fp32 states (H100, bf16 B8
# T2048 H16 K=V=128), errors 3.6e-3 / 4.5e-3 within the 5e-3 / 1e-2 bars (kernels/benchmarks/RESULTS.md, "Precision
# of the delta-rule chunk kernels").
LOW_PRECISION_DOT = "bf16"
# Products of two raw bf16/fp16 inputs run in their own dtype (raw_precision: exact, at twice tf32's rate); h, δ and
# dh are stored bf16 for bf16 inputs (work_dtype: half the bytes of the passes between kernels); T, w, dδ and dw, which
# only ever feed DOT_PREC dots, are stored in the dots' operand dtype (operand_dtype: rounded once on the store
# instead of in every dot that reads them, the same numbers at half the bytes).
# The IPLR kernels' dots for bf16 inputs under dot="auto": 3.94 ms forward+backward against 6.35 with "tf32" (H100,
# bf16 B8 T2048 H16 K=V=128), worst B2 T1024 errors 3.4e-3 outputs, 5.3e-3 gradients. It needs the state passes at
# 2+ stages: at 1 stage Triton 3.6 miscompiles them (common/launch.py).
IPLR_LOW_PRECISION_DOT = "bf16"
# The ops' recurrence_dot argument (kernel_config.delta_rule_recurrence_dot): the dots of the kernels that carry the
# recurrence (the WY forward and backward, both state passes) of the gated delta rule and product, for bf16 inputs.
# "auto" follows the op's `dot`; "tf32" keeps bf16 rounding out of what the state accumulates chunk after chunk
# (T, w, dδ and dw, which feed those dots, are then stored fp32). For the gated delta product with β up to 2 and
# nothing forgetting it takes the outputs' error from 5.6e-3 to 3.5e-3 at +28% forward+backward time (H100;
# RESULTS.md). The choices of both arguments:
DOT_CHOICES = ("auto", "bf16", "tf32")
# The solve's merges in "tf32x3" (three tf32 products: ≈ fp32 accuracy on tensor cores) instead of "ieee": forward
# 3.80 → 2.30 ms (H200, bf16 B8 T2048 H16 K=V=128), gradients unchanged (2.6e-3).
LOW_PRECISION_SOLVE = "tf32x3"


def dot_precision(dtype: torch.dtype, low: str = LOW_PRECISION_DOT) -> str:
    """DOT_PREC for inputs of `dtype`: 'ieee' for fp32, `low` (default LOW_PRECISION_DOT) for bf16, 'tf32' for fp16.
    Under the interpreter bf16's mode gets an '_interpreted' suffix (mm and cast_for_store round to nearest then)."""
    if dtype in (torch.float32, torch.float64):
        return "ieee"
    if dtype != torch.bfloat16:
        return "tf32"
    return low + ("_interpreted" if _interpreted() else "")


def check_dot(value: str, argument: str = "dot") -> str:
    """`value` itself when it is one of DOT_CHOICES, else a ValueError naming the argument."""
    if not isinstance(value, str) or value not in DOT_CHOICES:
        raise ValueError(f"{argument} must be one of {', '.join(DOT_CHOICES)}; got {value!r}")
    return value


def check_recurrence_dot(recurrence_dot: str) -> str:
    """check_dot for the `recurrence_dot` argument."""
    return check_dot(recurrence_dot, "recurrence_dot")


def op_dot_precision(dtype: torch.dtype, dot: str, auto: str = LOW_PRECISION_DOT) -> str:
    """DOT_PREC of an op's chunk kernels for inputs of `dtype` under its `dot` argument (auto | bf16 | tf32, checked;
    for bf16 inputs "auto" is `auto`, default LOW_PRECISION_DOT; fp32 and fp16 inputs as dot_precision)."""
    return dot_precision(dtype, auto if check_dot(dot) == "auto" else dot)


def iplr_dot_precision(dtype: torch.dtype, dot: str = "auto") -> str:
    """op_dot_precision of the IPLR kernels ("auto": IPLR_LOW_PRECISION_DOT)."""
    return op_dot_precision(dtype, dot, IPLR_LOW_PRECISION_DOT)


def recurrence_dot_precision(dtype: torch.dtype, recurrence_dot: str, dot: str = "auto") -> str:
    """DOT_PREC of the WY and state-pass kernels for inputs of `dtype` under `recurrence_dot` (auto | bf16 | tf32: for
    bf16 inputs, "auto" gives the op's `dot` precision, the others their own; fp32 and fp16 inputs as dot_precision)."""
    if check_recurrence_dot(recurrence_dot) == "auto":
        return op_dot_precision(dtype, dot)
    return dot_precision(dtype, recurrence_dot)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def raw_precision(dtype: torch.dtype) -> str:
    """RAW_PREC: the dot precision of a product of two raw inputs of `dtype` (exact in bf16/fp16)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return dot_precision(dtype)
    native = "bf16" if dtype == torch.bfloat16 else "fp16"
    return native + ("_interpreted" if _interpreted() else "")


def solve_precision(dtype: torch.dtype) -> str:
    """The solve's block merges: T feeds every later stage, so its error is kept below tf32's 2⁻¹¹
    (LOW_PRECISION_SOLVE for bf16/fp16 inputs); 'ieee' for fp32 inputs."""
    return "ieee" if dtype in (torch.float32, torch.float64) else LOW_PRECISION_SOLVE


def sixteen_bit_dots(dot_prec: str) -> bool:
    """Whether dots in `dot_prec` take 16-bit operand tiles (bf16 / fp16, interpreted or not): half the shared memory
    of tf32 / ieee ones, which is what lets the backward kernels step 64 value columns at a time (DQKWG_BV, IPLR's
    BWD_BV)."""
    return dot_prec.startswith(("bf16", "fp16"))


def operand_dtype(dtype: torch.dtype, dot_prec: str) -> torch.dtype:
    """Storage dtype of the intermediates that only ever feed DOT_PREC dots (T, w, dδ, dw; in IPLR also h, X, dh)
    for inputs of `dtype` and dots in `dot_prec`: the dots' own operand dtype, bf16 when the dots are bf16 (stored
    through cast_for_store, they round exactly as the dot's own cast would), else fp32."""
    low = dtype == torch.bfloat16 and dot_prec.startswith("bf16")
    return torch.bfloat16 if low else torch.float32


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Storage dtype of the chunk intermediates h, δ and dh for inputs of `dtype`: bf16 for bf16 inputs."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


@triton.jit
def round_to_bf16(x):
    """fp32 x rounded to the nearest bf16 value (ties to even), kept in fp32. Triton 3.6's interpreter truncates in
    its own fp32 → bf16 casts (and returns garbage for bf16 x bf16 dots), so the interpreted modes round here."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def mm(a, b, DOT_PREC: tl.constexpr):
    """a @ b with fp32 accumulation; the operands cast to bf16 / fp16 when DOT_PREC is "bf16" / "fp16", else to fp32
    with tl.dot's input_precision=DOT_PREC. The "_interpreted" modes compute the same numbers on the CPU interpreter
    (bf16 and fp16 products are exact in fp32). Operands may come in their stored dtype: a tile loaded without a
    cast reaches the tensor cores from shared memory as it was copied there (a tl.trans of it too), where an fp32
    copy would make a round trip through registers, and a bf16 → fp32 → bf16 trip is exact."""
    return mma(a, b, tl.zeros([a.shape[0], b.shape[1]], dtype=tl.float32), DOT_PREC)


@triton.jit
def mma(a, b, acc, DOT_PREC: tl.constexpr):
    """acc + a @ b (fp32 acc; operands as in mm), accumulated in the dot itself: a chain of them into one
    accumulator waits once, where a dot then a separate add or subtract waits for each product and holds both
    tiles (Triton folds `acc + dot` but not `acc - dot`: negate an operand instead)."""
    if DOT_PREC == "bf16":
        c = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    elif DOT_PREC == "fp16":
        c = tl.dot(a.to(tl.float16), b.to(tl.float16), acc)
    elif DOT_PREC == "bf16_interpreted":
        c = acc + tl.dot(round_to_bf16(a.to(tl.float32)), round_to_bf16(b.to(tl.float32)), input_precision="ieee")
    elif DOT_PREC == "fp16_interpreted":  # only raw fp16 operands come here: the casts are exact
        c = acc + tl.dot(a.to(tl.float16).to(tl.float32), b.to(tl.float16).to(tl.float32), input_precision="ieee")
    elif DOT_PREC == "tf32_interpreted":
        c = acc + tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=DOT_PREC)
    return c


@triton.jit
def store_rounded(ptr, v, mask, INTERPRETED: tl.constexpr):
    """Store fp32 v in ptr's element type, rounded to nearest: under the interpreter (INTERPRETED, from
    utils.triton_interpreted()) the rounding is done first (round_to_bf16), as the GPU's cast does it."""
    if INTERPRETED:
        if ptr.dtype.element_ty == tl.bfloat16:
            v = round_to_bf16(v)
    tl.store(ptr, v.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def cast_for_store(x, ptr, DOT_PREC: tl.constexpr):
    """x in ptr's element type, rounded to nearest also under the interpreter (see round_to_bf16)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        if DOT_PREC == "bf16_interpreted" or DOT_PREC == "tf32_interpreted":
            x = round_to_bf16(x)
    return x.to(ptr.dtype.element_ty)
