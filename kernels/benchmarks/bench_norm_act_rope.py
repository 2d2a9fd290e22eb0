"""Benchmark: fused RMSNorm, gated RMSNorm, SwiGLU and RoPE against torch eager, torch.compile, Liger and fla, as %
of copy bandwidth.

Run on a CUDA machine (from the repo root; Liger and fla are optional, carry their wheels to compare):
    pip install liger-kernel==0.8.5          # optional peer; skipped with a note when its import fails
    pip install fla-core==0.6.0              # optional peer for the gated RMSNorm (fla.modules FusedRMSNormGated)
    PYTHONPATH=kernels python kernels/benchmarks/bench_norm_act_rope.py [--tokens 16384 --hidden 4096]
        [--no-compile] [--sweep]             # --sweep: also time RMSNorm backward over programs-per-SM
    # check the script itself without a GPU (tiny sizes, Triton interpreter, wall-clock timings are meaningless):
    TRITON_INTERPRET=1 PYTHONPATH=kernels python kernels/benchmarks/bench_norm_act_rope.py --cpu-smoke

What it does: measures the device copy ceiling in the same run (a 1 GiB device-to-device copy, bytes read +
written, median of triton.testing.do_bench), then for each op and variant checks outputs and every gradient
against the fp32 naive reference on the same (bf16-rounded) values, and only then times forward and
forward+backward (torch.autograd.grad, so no .grad accumulation is timed). GB/s are on the MINIMAL bytes each op
must move (stated per op below), so every variant is judged against the same byte count. do_bench flushes L2
between repetitions, so these are DRAM numbers. A markdown table is printed last.
"""

from __future__ import annotations

import argparse
import functools
import random
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import triton

from rltrain_kernels.ops.rmsnorm import gated_rms_norm, naive_gated_rms_norm, naive_rms_norm, rms_norm
from rltrain_kernels.ops.rmsnorm.kernel import rms_norm_backward, rms_norm_forward
from rltrain_kernels.ops.rope import apply_rotary_pos_emb, naive_apply_rotary_pos_emb
from rltrain_kernels.ops.rope import kernel as rope_kernel
from rltrain_kernels.ops.swiglu import naive_swiglu, swiglu

DTYPE = torch.bfloat16
DEVICE = "cuda"  # "cpu" under --cpu-smoke
BF16_REL_TOLERANCE = 1e-2  # same per-dtype threshold as tests/helpers.py


def bench_ms(fn: Callable[[], object], graph: bool = False) -> float:
    """Median ms per call. graph=True times CUDA-graph replays: GPU time only, no Python/launch gaps (these ops are
    ~0.1 ms of GPU work behind ~0.3-0.5 ms of host code per eager fwd+bwd, so eager timing on an idle GPU mostly
    measures the host; measured on H200 2026-11-22). Replays reuse one input set, so L2 keeps ≤60 MB of it."""
    if DEVICE == "cuda":
        if graph:
            return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    start = time.perf_counter()  # --cpu-smoke: one call, only to exercise the code path
    fn()
    return (time.perf_counter() - start) * 1e3


def kernel_ms(fn: Callable[[], object], iters: int = 50) -> float:
    """GPU time per call as the sum of its kernels' durations from the torch profiler: the graph replays' measure
    (no host gaps) for calls that cannot be captured in a CUDA graph. Memcpy/memset count as kernels here."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    device_us = sum(e.device_time for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA)
    return device_us / iters / 1e3


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.detach().double(), expected.detach().double()
    return ((a - e).norm() / e.norm().clamp_min(1e-30)).item()


def copy_ceiling_gbps() -> float:
    """Device copy bandwidth (bytes read + bytes written per second) of a 1 GiB tensor copy."""
    src = torch.randn(2**29 if DEVICE == "cuda" else 2**16, dtype=DTYPE, device=DEVICE)  # 1 GiB on the GPU
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / ms / 1e6


@dataclass
class Case:
    """One op: `make(seed, dtype)` -> (args, leaves, grad_outs) from a seed (values bf16-rounded whatever the
    dtype, so the fp32 reference sees the same numbers); variants map a name to f(*args) -> tuple of outputs."""
    name: str
    make: Callable
    reference: Callable
    variants: dict[str, Callable] = field(default_factory=dict)
    fwd_bytes: int = 0
    fwdbwd_bytes: int = 0
    notes: list[str] = field(default_factory=list)


def seeded_randn(gen: torch.Generator, *shape, dtype, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    """shift + scale·N(0, 1), rounded to bf16 then cast to `dtype` (so bf16 and fp32 copies hold equal values)."""
    return (shift + scale * torch.randn(*shape, device=DEVICE, generator=gen)).to(DTYPE).to(dtype)


def as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def rmsnorm_case(n_rows: int, hidden: int) -> Case:
    def make(seed, dtype):
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        x = seeded_randn(gen, n_rows, hidden, dtype=dtype).requires_grad_()
        w = seeded_randn(gen, hidden, dtype=dtype, scale=0.1, shift=1.0).requires_grad_()
        dy = seeded_randn(gen, n_rows, hidden, dtype=dtype)
        return (x, w), (x, w), (dy,)

    b = DTYPE.itemsize
    case = Case("RMSNorm", make, lambda x, w: naive_rms_norm(x, w, 1e-6),
                # fwd: read x, write y (N·H each) + read w (H); fwd+bwd adds read x, dy, write dx + write dw.
                fwd_bytes=2 * n_rows * hidden * b + hidden * b,
                fwdbwd_bytes=5 * n_rows * hidden * b + 3 * hidden * b)
    case.variants["rltrain"] = lambda x, w: rms_norm(x, w, 1e-6)
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        # forward(X, W, eps, offset=0.0, casting_mode="llama", in_place=True, row_mode=None) in 0.8.5; in_place
        # writes dX into dY's storage (harmless here: the check uses its own inputs, timings ignore the values).
        case.variants["liger"] = lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6)
    except Exception as exc:  # noqa: BLE001 - any import failure just drops the peer
        case.notes.append(f"liger RMSNorm skipped: {exc!r}")
    return case


def rmsnorm_residual_case(n_rows: int, hidden: int) -> Case:
    def make(seed, dtype):
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        x = seeded_randn(gen, n_rows, hidden, dtype=dtype).requires_grad_()
        r = seeded_randn(gen, n_rows, hidden, dtype=dtype).requires_grad_()
        w = seeded_randn(gen, hidden, dtype=dtype, scale=0.1, shift=1.0).requires_grad_()
        dy, ds = (seeded_randn(gen, n_rows, hidden, dtype=dtype) for _ in range(2))
        return (x, r, w), (x, r, w), (dy, ds)

    b = DTYPE.itemsize
    case = Case("RMSNorm+residual", make, lambda x, r, w: naive_rms_norm(x, w, 1e-6, residual=r),
                # fwd: read x, r; write y, s. bwd: read dy, ds, s; write dx (= d residual, one tensor).
                fwd_bytes=4 * n_rows * hidden * b + hidden * b,
                fwdbwd_bytes=8 * n_rows * hidden * b + 3 * hidden * b)
    case.variants["rltrain"] = lambda x, r, w: rms_norm(x, w, 1e-6, residual=r)
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
        # forward(X, R, W, eps, offset=0.0, casting_mode="llama", in_place=False) -> (Y, S) in 0.8.5
        case.variants["liger"] = lambda x, r, w: LigerFusedAddRMSNormFunction.apply(x, r, w, 1e-6)
    except Exception as exc:  # noqa: BLE001
        case.notes.append(f"liger fused add + RMSNorm skipped: {exc!r}")
    return case


def gated_rmsnorm_case(n_tokens: int, hidden: int, head_dim: int = 128) -> Case:
    """Qwen3-Next's GatedDeltaNet output norm: per head over head_v_dim (128), gated by silu(z); the [tokens,
    hidden] activation is viewed as [tokens·hidden/head_dim, head_dim] rows, as the model reshapes it."""
    head_dim = min(head_dim, hidden)
    n_rows = n_tokens * (hidden // head_dim)

    def make(seed, dtype):
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        x, g, dy = (seeded_randn(gen, n_rows, head_dim, dtype=dtype) for _ in range(3))
        w = seeded_randn(gen, head_dim, dtype=dtype, scale=0.1, shift=1.0).requires_grad_()
        x.requires_grad_(), g.requires_grad_()
        return (x, g, w), (x, g, w), (dy,)

    b = DTYPE.itemsize
    case = Case("GatedRMSNorm", make, lambda x, g, w: naive_gated_rms_norm(x, g, w, 1e-6),
                # fwd: read x, g; write y (+ read w). bwd: read dy, x, g; write dx, dg (+ read w, write dw).
                fwd_bytes=3 * n_rows * head_dim * b + head_dim * b,
                fwdbwd_bytes=8 * n_rows * head_dim * b + 3 * head_dim * b)
    case.variants["rltrain"] = lambda x, g, w: gated_rms_norm(x, g, w, 1e-6)
    try:
        from fla.modules.fused_norm_gate import rms_norm_gated
        # rms_norm_gated(x, g, weight, bias, activation="swish", residual=None, prenorm=False, residual_in_fp32=False,
        # eps=1e-6) in fla 0.6.0 (FusedRMSNormGated's functional form; "swish" = silu); norm before gate.
        case.variants["fla"] = lambda x, g, w: rms_norm_gated(x, g, w, None, activation="swish", eps=1e-6)
    except Exception as exc:  # noqa: BLE001
        case.notes.append(f"fla gated RMSNorm skipped: {exc!r}")
    return case


def swiglu_case(n_rows: int, inter: int) -> Case:
    def make(seed, dtype):
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        gate, up, dy = (seeded_randn(gen, n_rows, inter, dtype=dtype) for _ in range(3))
        gate.requires_grad_(), up.requires_grad_()
        return (gate, up), (gate, up), (dy,)

    b = DTYPE.itemsize
    case = Case("SwiGLU", make, naive_swiglu,
                # fwd: read gate, up; write y. bwd: read dy, gate, up; write dgate, dup.
                fwd_bytes=3 * n_rows * inter * b, fwdbwd_bytes=8 * n_rows * inter * b)
    case.variants["rltrain"] = swiglu
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        # forward(a, b, gate_multiplier=1.0, down_multiplier=1.0) in 0.8.5; its backward overwrites a and b with the
        # gradients (the inputs hold garbage after a timed fwd+bwd, which does not change the timing).
        case.variants["liger"] = lambda g, u: LigerSiLUMulFunction.apply(g, u)
    except Exception as exc:  # noqa: BLE001
        case.notes.append(f"liger SwiGLU skipped: {exc!r}")
    return case


def _rope_with(warps: int, *args):
    default = rope_kernel.NUM_WARPS
    rope_kernel.NUM_WARPS = warps
    try:
        return apply_rotary_pos_emb(*args)
    finally:
        rope_kernel.NUM_WARPS = default


def rope_case(n_tokens: int, n_q_heads: int = 32, n_k_heads: int = 8, head_dim: int = 128,
              sweep: bool = False) -> Case:
    def make(seed, dtype):
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        # HF's layout: projections viewed [B, T, H, D], transposed to [B, H, T, D] (non-contiguous views).
        q_leaf = seeded_randn(gen, 1, n_tokens, n_q_heads, head_dim, dtype=dtype).requires_grad_()
        k_leaf = seeded_randn(gen, 1, n_tokens, n_k_heads, head_dim, dtype=dtype).requires_grad_()
        q, k = q_leaf.transpose(1, 2), k_leaf.transpose(1, 2)
        # HF's rotary table: cat(freqs, freqs), random positions (Liger reads only the first half of cos/sin).
        inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim))
        pos = torch.randint(0, 131072, (n_tokens,), device=DEVICE, generator=gen).float()
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)[None]
        cos, sin = emb.cos().to(DTYPE).to(dtype), emb.sin().to(DTYPE).to(dtype)
        dq = seeded_randn(gen, 1, n_tokens, n_q_heads, head_dim, dtype=dtype).transpose(1, 2)
        dk = seeded_randn(gen, 1, n_tokens, n_k_heads, head_dim, dtype=dtype).transpose(1, 2)
        # gradients w.r.t. the [B, T, H, D] leaves (grads w.r.t. the transposed views failed CUDA-graph capture)
        return (q, k, cos, sin), (q_leaf, k_leaf), (dq, dk)

    b = DTYPE.itemsize
    qk = (n_q_heads + n_k_heads) * n_tokens * head_dim * b
    table = 2 * n_tokens * head_dim * b
    case = Case("RoPE", make, naive_apply_rotary_pos_emb,
                # fwd: read q, k, cos, sin; write q_embed, k_embed.
                # bwd: read dq_embed, dk_embed, cos, sin; write dq, dk.
                fwd_bytes=2 * qk + table, fwdbwd_bytes=4 * qk + 2 * table)
    case.variants["rltrain"] = apply_rotary_pos_emb
    if sweep:  # warps per program (one token each); default: rope_kernel.NUM_WARPS
        for warps in (1, 2, 4):
            if warps != rope_kernel.NUM_WARPS:
                case.variants[f"rltrain {warps}w"] = functools.partial(_rope_with, warps)
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
        # forward(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, rotary_dim=None) in 0.8.5; rotates q/k in place
        # when their [B, T, H, D] buffer is contiguous (HF's layout, used here), and reads only half of cos/sin.
        case.variants["liger"] = lambda q, k, c, s: LigerRopeFunction.apply(q, k, c, s)
    except Exception as exc:  # noqa: BLE001
        case.notes.append(f"liger RoPE skipped: {exc!r}")
    return case


def check_variant(case: Case, fn: Callable, seed: int) -> float:
    """Max relative error of fn's outputs and gradients against the fp32 reference on the same values."""
    args, leaves, grad_outs = case.make(seed, DTYPE)
    outs = as_tuple(fn(*args))
    grads = torch.autograd.grad(outs, leaves, grad_outs)
    ref_args, ref_leaves, ref_grad_outs = case.make(seed, torch.float32)
    ref_outs = as_tuple(case.reference(*ref_args))
    ref_grads = torch.autograd.grad(ref_outs, ref_leaves, ref_grad_outs)
    return max(rel_error(a, e) for a, e in zip([*outs, *grads], [*ref_outs, *ref_grads]))


def time_variant(case: Case, fn: Callable, seed: int, notes: list[str]):
    """(fwd ms, fwd+bwd ms) of GPU time: CUDA-graph replays, or the profiler's kernel sum (kernel_ms) where
    capture fails; and eager fwd+bwd ms (host time included)."""
    args, leaves, grad_outs = case.make(seed, DTYPE)
    forward = lambda: fn(*args)  # noqa: E731
    fwd_bwd = lambda: torch.autograd.grad(as_tuple(fn(*args)), leaves, grad_outs)  # noqa: E731
    graphed = []
    for label, run in (("fwd", forward), ("fwd+bwd", fwd_bwd)):
        try:
            graphed.append(bench_ms(run, graph=DEVICE == "cuda"))
        except Exception as exc:  # noqa: BLE001 - e.g. a peer that syncs inside; reported, profiled instead
            torch.cuda.synchronize()
            notes.append(f"{case.name}: CUDA-graph capture of {label} failed ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:120] if str(exc) else ''}); profiler kernel time instead")
            graphed.append(kernel_ms(run))
    return graphed[0], graphed[1], bench_ms(fwd_bwd)


def sweep_rmsnorm_backward(n_rows: int, hidden: int, ceiling: float) -> None:
    """RMSNorm backward alone (read x, dy; write dx; 3·N·H bytes + dw) over its tuning knobs: num_warps and programs per SM of the persistent grid (auto = as many as are resident at once)."""
    x = torch.randn(n_rows, hidden, device=DEVICE, dtype=DTYPE)
    w = torch.randn(hidden, device=DEVICE, dtype=DTYPE)
    dy = torch.randn_like(x)
    _, normed, rstd, _ = rms_norm_forward(x, w, 1e-6)
    want_dx, want_dw = rms_norm_backward(dy, normed, w, rstd, programs_per_sm=1)
    nbytes = 3 * n_rows * hidden * DTYPE.itemsize
    print("\nRMSNorm backward only (rms_norm_backward), tuning sweep:")
    for num_warps in (8, 16):
        for per_sm in (None, 1, 2, 3, 4):
            def run():
                return rms_norm_backward(dy, normed, w, rstd, programs_per_sm=per_sm, num_warps=num_warps)
            dx, dw = run()
            err = max(rel_error(dx, want_dx), rel_error(dw, want_dw))
            ms = bench_ms(run)
            print(f"  num_warps={num_warps:2d} programs/SM={per_sm or 'auto':>4}: "
                  f"{ms * 1e3:8.1f} us  {nbytes / ms / 1e6:7.0f} GB/s  {100 * nbytes / ms / 1e6 / ceiling:5.1f}% "
                  f"of copy  (vs first config: rel err {err:.1e})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile of the naive references")
    parser.add_argument("--sweep", action="store_true", help="also sweep RMSNorm backward programs per SM and RoPE warps")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny sizes on CPU through the Triton interpreter (TRITON_INTERPRET=1): checks the script")
    args = parser.parse_args()
    global DEVICE
    if args.cpu_smoke:
        DEVICE, args.tokens, args.hidden = "cpu", 8, 96
    else:
        assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU (or --cpu-smoke)"
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter smoke run)"
    print(f"device: {name}, torch {torch.__version__}, triton {triton.__version__}")

    ceiling = copy_ceiling_gbps()
    print(f"copy ceiling: {ceiling:.0f} GB/s (read + write, 1 GiB copy)")
    cases = [rmsnorm_case(args.tokens, args.hidden), rmsnorm_residual_case(args.tokens, args.hidden),
             gated_rmsnorm_case(args.tokens, args.hidden), swiglu_case(args.tokens, args.hidden),
             rope_case(args.tokens, sweep=args.sweep)]
    rows, notes = [], []
    for case in cases:
        variants = {"torch eager": case.reference, **case.variants}
        if not args.no_compile:
            variants["torch.compile"] = torch.compile(case.reference, dynamic=False)
        notes.extend(case.notes)
        for name, fn in variants.items():
            seed = random.randrange(2**31)  # fresh inputs every run
            try:
                err = check_variant(case, fn, seed)
            except Exception as exc:  # noqa: BLE001 - a failing peer is reported, not fatal
                notes.append(f"{case.name} / {name}: check failed: {exc!r}"[:300])
                continue
            if not err <= BF16_REL_TOLERANCE:
                notes.append(f"{case.name} / {name}: WRONG (max rel err {err:.2e}); not timed")
                rows.append((case.name, name, None, None, None, err))
                continue
            fwd_ms, fwdbwd_ms, eager_ms = time_variant(case, fn, seed + 1, notes)
            rows.append((case.name, name, fwd_ms, fwdbwd_ms, eager_ms, err))
            print(f"{case.name:17s} {name:14s} fwd {fmt_us(fwd_ms)} us  fwd+bwd {fmt_us(fwdbwd_ms)} us  "
                  f"eager fwd+bwd {fmt_us(eager_ms)} us  err {err:.1e}", flush=True)
        if args.sweep and case.name == "RMSNorm":
            sweep_rmsnorm_backward(args.tokens, args.hidden, ceiling)

    if notes:
        print("\nNotes:")
        for note in notes:
            print(f"- {note}")
    bytes_of = {c.name: (c.fwd_bytes, c.fwdbwd_bytes) for c in cases}
    print(f"\n### [{args.tokens}, {args.hidden}] bf16 (GatedRMSNorm: per head of {min(128, args.hidden)}; RoPE: q "
          f"[1,32,{args.tokens},128], k [1,8,{args.tokens},128]); copy ceiling {ceiling:.0f} GB/s\n")
    print("GPU time from CUDA-graph replays (profiler kernel sums where a note says capture failed); 'eager' = plain "
          "calls, host (Python + launch) time included.\n")
    print("| op | variant | fwd us | fwd GB/s | fwd % copy | fwd+bwd us | fwd+bwd GB/s | fwd+bwd % copy "
          "| eager fwd+bwd us | max rel err |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for op, name, fwd_ms, fwdbwd_ms, eager_ms, err in rows:
        if eager_ms is None:
            print(f"| {op} | {name} | - | - | - | - | - | - | - | {err:.1e} (WRONG) |")
            continue
        fb, fbb = bytes_of[op]
        print(f"| {op} | {name} | {fmt_us(fwd_ms)} | {gbps(fb, fwd_ms)} | {pct(fb, fwd_ms, ceiling)} | "
              f"{fmt_us(fwdbwd_ms)} | {gbps(fbb, fwdbwd_ms)} | {pct(fbb, fwdbwd_ms, ceiling)} | "
              f"{fmt_us(eager_ms)} | {err:.1e} |")


def fmt_us(ms: float | None) -> str:
    return "-" if ms is None else f"{ms * 1e3:.1f}"


def gbps(nbytes: int, ms: float | None) -> str:
    return "-" if ms is None else f"{nbytes / ms / 1e6:.0f}"


def pct(nbytes: int, ms: float | None, ceiling: float) -> str:
    return "-" if ms is None else f"{100 * nbytes / ms / 1e6 / ceiling:.1f}%"


if __name__ == "__main__":
    main()
