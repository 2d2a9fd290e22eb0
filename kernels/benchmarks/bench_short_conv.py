"""Benchmark: the short convolution, l2norm and token shift against fla 0.6's modules (and torch's depthwise conv1d,
HF's Qwen3-Next path, for the convolution), bf16, forward and forward+backward, as % of the device's copy bandwidth.
Goal: at least fla's speed on each.

Run on a CUDA machine from the repo root (fla optional: carry its wheels; a peer that fails to import is skipped
with a note):
    PYTHONPATH=$PWD/kernels:$PWD:/tmp/site python3 kernels/benchmarks/bench_short_conv.py [--sweep]
    # check the script without a GPU (tiny sizes, Triton interpreter; timings meaningless):
    TRITON_INTERPRET=1 PYTHONPATH=kernels python kernels/benchmarks/bench_short_conv.py --cpu-smoke

Sizes (Qwen3-Next-like, B4 T4096): the fused qkv short conv over C = 2·2048 + 4096 = 8192 channels, W = 4, SiLU, as
a batch and as one packed row of 16 uneven sequences; l2norm of q and k, [4, 4096, 32 heads, 128]; token shift of a
[4, 4096, 4096] activation; one decode step of the conv for 64 sequences (fla's [B, C, W] cache, which ours takes
too). Measures the copy ceiling first (1 GiB device copy, bytes read + written), then per op and variant checks the
output and every gradient against the fp32 reference on the same bf16 values, fresh random inputs each run, and
only then times forward and forward+backward with CUDA-graph replays (GPU time; the table's "eager" column is plain
calls, host time included). GB/s are on the minimal bytes each op must move (stated per case), so every variant is
judged against the same count. --sweep also times our kernels alone over their tile settings (each passed to
the host function as an argument). A markdown table is printed last. Machinery shared with bench_norm_act_rope.py
(copy ceiling, checks, CUDA-graph timing).
"""

from __future__ import annotations

import argparse
import random

import torch
import torch.nn.functional as F
import triton

import bench_norm_act_rope as common
from bench_norm_act_rope import Case, check_variant, copy_ceiling_gbps, fmt_us, gbps, pct, rel_error, seeded_randn
from bench_norm_act_rope import time_variant
from rltrain_kernels.ops.l2norm import l2norm, naive_l2norm
from rltrain_kernels.ops.l2norm import kernel as l2norm_kernel
from rltrain_kernels.ops.short_conv import kernel as conv_kernel
from rltrain_kernels.ops.short_conv import kernel_bwd as conv_kernel_bwd
from rltrain_kernels.ops.short_conv import naive_short_conv, naive_short_conv_update, short_conv, short_conv_update
from rltrain_kernels.ops.token_shift import kernel as shift_kernel
from rltrain_kernels.ops.token_shift import naive_token_shift, token_shift

DTYPE = common.DTYPE
BF16_REL_TOLERANCE = common.BF16_REL_TOLERANCE


def packed_offsets(total: int, sequences: int, gen: torch.Generator) -> torch.Tensor:
    """cu_seqlens of `sequences` uneven lengths (0.25× to 1.75× the mean) summing to total."""
    weights = 0.25 + 1.5 * torch.rand(sequences, generator=gen)
    lengths = (weights / weights.sum() * total).long().clamp_min(1)
    lengths[-1] += total - lengths.sum()
    return torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32).to(common.DEVICE)


def fla_peers(notes: list[str]) -> dict:
    """fla 0.6's functions, or {} with a note when fla does not import."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d, causal_conv1d_update
        from fla.modules.l2norm import l2norm as fla_l2norm
        from fla.modules.token_shift import token_shift as fla_token_shift
    except Exception as exc:  # noqa: BLE001 - any import failure just drops the peer
        notes.append(f"fla skipped: {exc!r}"[:300])
        return {}
    return dict(conv=causal_conv1d, update=causal_conv1d_update, l2norm=fla_l2norm, token_shift=fla_token_shift)


def short_conv_case(B: int, T: int, C: int, W: int, fla: dict, packed: bool) -> Case:
    """y = silu(conv(x)); leaves x and the bf16 weight (HF keeps the conv weight in the model dtype)."""
    rows, batch = (1, B * T) if packed else (B, T)
    cu = packed_offsets(B * T, 16, torch.Generator().manual_seed(0)) if packed else None

    def make(seed, dtype):
        gen = torch.Generator(device=common.DEVICE).manual_seed(seed)
        x = seeded_randn(gen, rows, batch, C, dtype=dtype).requires_grad_()
        w = seeded_randn(gen, C, W, dtype=dtype, scale=0.5).requires_grad_()
        return (x, w), (x, w), (seeded_randn(gen, rows, batch, C, dtype=dtype),)

    b = DTYPE.itemsize
    name = "short conv packed" if packed else "short conv"
    case = Case(name, make, lambda x, w: naive_short_conv(x, w, activation="silu", cu_seqlens=cu)[0],
                # fwd: read x, write y (N·C each, + the weight). bwd: read x, dy; write dx (+ read w, write dw).
                fwd_bytes=2 * B * T * C * b + C * W * b, fwdbwd_bytes=5 * B * T * C * b + 3 * C * W * b)
    case.variants["rltrain"] = lambda x, w: short_conv(x, w, activation="silu", cu_seqlens=cu)[0]
    if "conv" in fla:
        # causal_conv1d(x, weight, bias, residual, initial_state, output_final_state, activation, backend,
        # cu_seqlens, ...) -> (y, final_state) in fla 0.6.0
        case.variants["fla"] = lambda x, w: fla["conv"](x, w, activation="silu", cu_seqlens=cu)[0]
    if not packed:  # HF Qwen3-Next's torch path: conv1d on the [B, C, T] view, cut to T, SiLU
        case.variants["torch conv1d"] = lambda x, w: F.silu(
            F.conv1d(x.transpose(1, 2), w[:, None], padding=W - 1, groups=C)[..., :T]).transpose(1, 2)
    return case


def l2norm_case(B: int, T: int, H: int, D: int, fla: dict) -> Case:
    def make(seed, dtype):
        gen = torch.Generator(device=common.DEVICE).manual_seed(seed)
        x = seeded_randn(gen, B, T, H, D, dtype=dtype).requires_grad_()
        return (x,), (x,), (seeded_randn(gen, B, T, H, D, dtype=dtype),)

    n = B * T * H * D * DTYPE.itemsize
    # fwd: read x, write y. bwd: read x (fla: y), dy; write dx.
    case = Case("l2norm", make, naive_l2norm, fwd_bytes=2 * n, fwdbwd_bytes=5 * n)
    case.variants["rltrain"] = l2norm
    if "l2norm" in fla:
        case.variants["fla"] = fla["l2norm"]  # l2norm(x, eps=1e-6, output_dtype=None) in fla 0.6.0
    case.variants["torch eager"] = naive_l2norm
    return case


def token_shift_case(B: int, T: int, D: int, fla: dict) -> Case:
    def make(seed, dtype):
        gen = torch.Generator(device=common.DEVICE).manual_seed(seed)
        x = seeded_randn(gen, B, T, D, dtype=dtype).requires_grad_()
        return (x,), (x,), (seeded_randn(gen, B, T, D, dtype=dtype),)

    n = B * T * D * DTYPE.itemsize
    # fwd: read x, write out. bwd: read dout, write dx.
    case = Case("token shift", make, naive_token_shift, fwd_bytes=2 * n, fwdbwd_bytes=4 * n)
    case.variants["rltrain"] = token_shift
    if "token_shift" in fla:
        case.variants["fla"] = fla["token_shift"]  # token_shift(x, cu_seqlens, cache, output_cache) in fla 0.6.0
    case.variants["torch eager"] = naive_token_shift
    return case


def decode_rows(B: int, C: int, W: int, fla: dict, ceiling: float, notes: list[str]) -> list[tuple]:
    """One decode step of the conv for B sequences on a [B, C, W] cache (fla's layout; ours reads its last W − 1
    columns): checked against the fp32 reference, then timed with CUDA-graph replays (the cache keeps shifting)."""
    gen = torch.Generator(device=common.DEVICE).manual_seed(random.randrange(2**31))
    x = seeded_randn(gen, B, C, dtype=DTYPE)
    w = seeded_randn(gen, C, W, dtype=DTYPE, scale=0.5)
    cache = seeded_randn(gen, B, C, W, dtype=DTYPE)
    want_cache = cache.float()
    want = naive_short_conv_update(x.float(), want_cache, w.float(), activation="silu")
    variants = {"rltrain": lambda c: short_conv_update(x, c, w, activation="silu")}
    if "update" in fla:  # causal_conv1d_update(x, cache, residual, weight, bias, activation) -> (y, cache)
        variants["fla"] = lambda c: fla["update"](x, c, weight=w, activation="silu")[0]
    # read x, the W − 1 live state columns; write y, the state (W − 1 columns; fla moves W)
    nbytes = B * C * DTYPE.itemsize * (2 + 2 * (W - 1))
    rows = []
    for name, fn in variants.items():
        c = cache.clone()
        y = fn(c)
        err = max(rel_error(y, want), rel_error(c[..., -(W - 1):], want_cache[..., -(W - 1):]))
        if not err <= BF16_REL_TOLERANCE:
            notes.append(f"decode step / {name}: WRONG (max rel err {err:.2e}); not timed")
            continue
        ms = common.bench_ms(lambda: fn(c), graph=common.DEVICE == "cuda")
        rows.append((f"decode step B{B}", name, ms, None, None, err, nbytes))
        print(f"decode step      {name:14s} {fmt_us(ms)} us  err {err:.1e}", flush=True)
    return rows


def sweep(label: str, settings: list, run, nbytes: int, ceiling: float) -> None:
    """run(setting) → the outputs of one host-function call at that setting (the first: the shipped one), each timed
    with CUDA-graph replays, its bytes as % of copy, and its outputs' error against the shipped setting's."""
    print(f"\n{label}")
    shipped = None
    for setting in settings:
        try:
            outs = run(setting)
            shipped = shipped or outs
            err = max(rel_error(a, b) for a, b in zip(outs, shipped))
            ms = common.bench_ms(lambda: run(setting), graph=common.DEVICE == "cuda")
            print(f"  {str(setting):16s} {fmt_us(ms):>8} us {pct(nbytes, ms, ceiling):>6}   err vs shipped {err:.1e}",
                  flush=True)
        except Exception as exc:  # noqa: BLE001 - a setting that fails to compile or run is reported
            print(f"  {str(setting):16s} failed: {exc!r}"[:200], flush=True)


def run_sweeps(B: int, T: int, C: int, W: int, H: int, D: int, SHIFT_D: int, ceiling: float) -> None:
    """Our kernels alone over their tile settings, each passed to the host function as an argument (the first
    setting of each list is the shipped one): the conv's forward and backward tiles and backward programs per SM,
    l2norm's elements per program (forward and backward), token shift's tile (forward and backward)."""
    gen = torch.Generator(device=common.DEVICE).manual_seed(random.randrange(2**31))
    b = DTYPE.itemsize
    x, dy = (seeded_randn(gen, B, T, C, dtype=DTYPE) for _ in range(2))
    w = seeded_randn(gen, C, W, dtype=DTYPE, scale=0.5)
    conv = dict(bias=None, residual=None, initial_state=None, activation="silu", cu_seqlens=None, seq_ids=None,
                num_sequences=B)
    sweep("short conv forward: tile (BT, BD, warps)",
          [conv_kernel.FORWARD_TILE, (16, 128, 4), (8, 128, 4), (16, 64, 4), (32, 64, 4), (16, 256, 8), (32, 128, 8)],
          lambda tile: conv_kernel.short_conv_forward(x, w, output_final_state=False, tile=tile, **conv)[:1],
          2 * B * T * C * b, ceiling)
    backward = dict(dfinal=None, x=x, weight=w, compute_dw=True, compute_db=False, compute_dstate=False, **conv)
    del backward["residual"]
    sweep("short conv backward: tile (BT, BD, warps)",
          [conv_kernel_bwd.BACKWARD_TILE, (64, 64, 4), (64, 64, 8), (128, 32, 4), (128, 128, 8), (256, 64, 8)],
          lambda tile: conv_kernel_bwd.short_conv_backward(dy, tile=tile, **backward)[:2], 3 * B * T * C * b, ceiling)
    sweep("short conv backward: programs per SM", [conv_kernel_bwd.PROGRAMS_PER_SM, 8, 32],
          lambda per_sm: conv_kernel_bwd.short_conv_backward(dy, programs_per_sm=per_sm, **backward)[:2],
          3 * B * T * C * b, ceiling)
    q, dq = (seeded_randn(gen, B, T, H, D, dtype=DTYPE) for _ in range(2))

    def l2norm_fwd_bwd(elements):
        y, rows = l2norm_kernel.l2norm_forward(q, 1e-6, DTYPE, tile_elements=elements)
        return y, l2norm_kernel.l2norm_backward(dq, rows, 1e-6, tile_elements=elements)
    sweep("l2norm forward + backward: elements per program", [l2norm_kernel.TILE_ELEMENTS, 1024, 2048, 8192, 16384],
          l2norm_fwd_bwd, 5 * B * T * H * D * b, ceiling)
    s, ds = (seeded_randn(gen, B, T, SHIFT_D, dtype=DTYPE) for _ in range(2))

    def shift_fwd_bwd(tile):
        y, _ = shift_kernel.token_shift_forward(s, None, None, None, False, B, tile=tile)
        return y, shift_kernel.token_shift_backward(ds, None, None, None, False, B, None, tile=tile)[0]
    sweep("token shift forward + backward: tile (BT, BD, warps)",
          [shift_kernel.TILE, (16, 128, 4), (64, 128, 8), (32, 256, 8), (16, 256, 4)], shift_fwd_bwd,
          4 * B * T * SHIFT_D * b, ceiling)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", action="store_true",
                        help="also time our kernels alone over their tile settings (host-function arguments)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny sizes on CPU through the Triton interpreter (TRITON_INTERPRET=1): checks the script")
    args = parser.parse_args()
    B, T, C, W, H, D, SHIFT_D, DECODE_B = 4, 4096, 2 * 2048 + 4096, 4, 32, 128, 4096, 64
    if args.cpu_smoke:
        common.DEVICE = "cpu"
        B, T, C, H, D, SHIFT_D, DECODE_B = 2, 24, 40, 2, 16, 24, 3
    else:
        assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU (or --cpu-smoke)"
    name = torch.cuda.get_device_name() if common.DEVICE == "cuda" else "cpu (interpreter smoke run)"
    print(f"device: {name}, torch {torch.__version__}, triton {triton.__version__}")
    notes: list[str] = []
    fla = fla_peers(notes)
    if fla:
        import fla as fla_package
        print(f"fla {fla_package.__version__}")
    ceiling = copy_ceiling_gbps()
    print(f"copy ceiling: {ceiling:.0f} GB/s (read + write, 1 GiB copy)")

    cases = {case.name: case for case in (short_conv_case(B, T, C, W, fla, packed=False),
                                          short_conv_case(B, T, C, W, fla, packed=True),
                                          l2norm_case(B, T, H, D, fla), token_shift_case(B, T, SHIFT_D, fla))}
    rows = []
    for case in cases.values():
        for variant, fn in case.variants.items():
            seed = random.randrange(2**31)  # fresh inputs every run
            try:
                err = check_variant(case, fn, seed)
            except Exception as exc:  # noqa: BLE001 - a failing peer is reported, not fatal
                notes.append(f"{case.name} / {variant}: check failed: {exc!r}"[:300])
                continue
            if not err <= BF16_REL_TOLERANCE:
                notes.append(f"{case.name} / {variant}: WRONG (max rel err {err:.2e}); not timed")
                continue
            fwd_ms, fwdbwd_ms, eager_ms = time_variant(case, fn, seed + 1, notes)
            rows.append((case.name, variant, fwd_ms, fwdbwd_ms, eager_ms, err, None))
            print(f"{case.name:17s} {variant:14s} fwd {fmt_us(fwd_ms)} us  fwd+bwd {fmt_us(fwdbwd_ms)} us  "
                  f"eager fwd+bwd {fmt_us(eager_ms)} us  err {err:.1e}", flush=True)
    rows += decode_rows(DECODE_B, C, W, fla, ceiling, notes)
    if args.sweep:
        run_sweeps(B, T, C, W, H, D, SHIFT_D, ceiling)

    if notes:
        print("\nNotes:")
        for note in notes:
            print(f"- {note}")
    print(f"\n### bf16; short conv x [{B}, {T}, {C}] W{W} + SiLU (packed: one row of 16 sequences); l2norm "
          f"[{B}, {T}, {H}, {D}]; token shift [{B}, {T}, {SHIFT_D}]; decode step [{DECODE_B}, {C}]; copy ceiling "
          f"{ceiling:.0f} GB/s\n")
    print("GPU time from CUDA-graph replays (profiler kernel sums where a note says capture failed); 'eager' = plain "
          "calls, host time included. Bytes: fwd 2·N (token shift, l2norm, conv: read x, write y), fwd+bwd 5·N "
          "(conv, l2norm) or 4·N (token shift); decode: x, y and the state's W − 1 columns read and written.\n")
    print("| op | variant | fwd us | fwd GB/s | fwd % copy | fwd+bwd us | fwd+bwd GB/s | fwd+bwd % copy "
          "| eager fwd+bwd us | max rel err |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for op, variant, fwd_ms, fwdbwd_ms, eager_ms, err, nbytes in rows:
        fb, fbb = (cases[op].fwd_bytes, cases[op].fwdbwd_bytes) if op in cases else (nbytes, None)
        print(f"| {op} | {variant} | {fmt_us(fwd_ms)} | {gbps(fb, fwd_ms)} | {pct(fb, fwd_ms, ceiling)} | "
              f"{fmt_us(fwdbwd_ms)} | {gbps(fbb, fwdbwd_ms) if fbb else '-'} | "
              f"{pct(fbb, fwdbwd_ms, ceiling) if fbb else '-'} | {fmt_us(eager_ms)} | {err:.1e} |")
    times = {(op, variant): (fwd_ms, fwdbwd_ms) for op, variant, fwd_ms, fwdbwd_ms, *_ in rows}
    print("\nGoal: rltrain at least fla's speed (fla time / rltrain time ≥ 1).\n")
    print("| op | fwd: fla / rltrain | fwd+bwd: fla / rltrain | met |")
    print("|---|---:|---:|---|")
    for op in [*cases, f"decode step B{DECODE_B}"]:
        ours, theirs = times.get((op, "rltrain")), times.get((op, "fla"))
        if ours is None or theirs is None:
            print(f"| {op} | - | - | no fla (or no rltrain) row |")
            continue
        ratios = [t / o if o and t else None for o, t in zip(ours, theirs)]
        met = all(r >= 1 for r in ratios if r is not None)
        cells = [f"{r:.2f}×" if r is not None else "-" for r in ratios]
        print(f"| {op} | {cells[0]} | {cells[1]} | {'yes' if met else 'no'} |")


if __name__ == "__main__":
    main()
