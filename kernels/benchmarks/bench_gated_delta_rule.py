"""Benchmark the gated delta rule kernels against fla 0.6, torch SDPA (causal) and the naive torch recurrence.

Run on a CUDA machine (fla-core / flash-linear-attention 0.6.0 installed for the comparison columns):
    python kernels/benchmarks/bench_gated_delta_rule.py [--quick] [--launch wy_bwd=8,2] [--value-block narrow]
    python kernels/benchmarks/bench_gated_delta_rule.py --sweep-launch wy_bwd dqkwg [--isolate]
Checks correctness first (ours vs the naive recurrence at a small size, forward and gradients; ours vs fla's
forward at every timed shape), then times forward and forward+backward (bf16, H=16, K=V=128) and the
fused-recurrent decode step (B=256, one token, fp32 state in/out) as bandwidth on the state bytes.
fla's gated chunk backward refuses to run on Hopper with Triton 3.4-3.7.0 (fla issue #640: wrong gradients); its
guard is bypassed here (fla.ops.common.chunk_o.IS_NVIDIA_HOPPER = False) for timing only: its gradients are not
trusted. A markdown table is printed last.
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F
from delta_rule_bench_common import (add_tuning_arguments, check_against_reference, outputs_and_grads, rel,
                                     sweep_launch, tuning_from_args, worst_errors)
from triton.testing import do_bench

from rltrain_kernels.ops.common.precision import LOW_PRECISION_DOT
from rltrain_kernels.ops.common.tuning import Tuning
from rltrain_kernels.ops.gated_delta_rule import (
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
    naive_recurrent_gated_delta_rule,
)


def load_fla():
    try:
        import fla.ops.common.chunk_o as fla_chunk_o
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_fused
    except ImportError as err:
        print(f"fla not importable ({err}); skipping its columns")
        return None, None
    fla_chunk_o.IS_NVIDIA_HOPPER = False  # timing only, see the module docstring
    return fla_chunk, fla_fused


def make_inputs(B, T, H, K, V, dtype=torch.bfloat16, requires_grad=False, N=None):
    q = torch.randn(B, T, H, K, device="cuda", dtype=dtype)
    k = F.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).to(dtype)
    v = torch.randn(B, T, H, V, device="cuda", dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, H, device="cuda")).to(dtype)
    beta = torch.rand(B, T, H, device="cuda").sigmoid().to(dtype)
    h0 = torch.randn(N or B, H, K, V, device="cuda")
    tensors = [q, k, v, g, beta]
    for t in tensors:
        t.requires_grad_(requires_grad)
    return tensors, h0


def check_against_naive(ours):
    """Ours (chunk_gated_delta_rule at the run's tuning) vs the fp32 naive recurrence (B=1, T=300, H=2, K=V=128),
    forward and every gradient."""
    (q, k, v, g, beta), h0 = make_inputs(1, 300, 2, 128, 128, dtype=torch.bfloat16, requires_grad=True)
    h0.requires_grad_(True)
    do = torch.randn(1, 300, 2, 128, device="cuda", dtype=torch.bfloat16)
    inputs = (q, k, v, g, beta, h0)
    check_against_reference("ours vs naive fp32 (bf16 inputs)", ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta",
                            "dh0"], outputs_and_grads(ours, inputs, do),
                            outputs_and_grads(naive_recurrent_gated_delta_rule, inputs, do))


def time_chunk(fn, B, T, H, D, cu_seqlens=None, N=None):
    (q, k, v, g, beta), h0 = make_inputs(B, T, H, D, D, requires_grad=True, N=N)
    do = torch.randn_like(v)
    kwargs = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)
    fwd = lambda: fn(q, k, v, g, beta, **kwargs)  # noqa: E731

    def fwd_bwd():
        o, _ = fn(q, k, v, g, beta, **kwargs)
        o.backward(do)

    with torch.no_grad():
        t_fwd = do_bench(fwd)
    return t_fwd, do_bench(fwd_bwd, grad_to_none=[q, k, v, g, beta])


def time_sdpa(B, T, H, D):
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    with torch.no_grad():
        t_fwd = do_bench(fwd)
    return t_fwd, do_bench(lambda: fwd().backward(do), grad_to_none=[q, k, v])


def forward_agreement(ours, fla_chunk, B, T, H, D, cu_seqlens=None, N=None) -> float:
    (q, k, v, g, beta), h0 = make_inputs(B, T, H, D, D, N=N)
    kwargs = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)
    o, ht = ours(q, k, v, g, beta, **kwargs)
    o_fla, ht_fla = fla_chunk(q, k, v, g, beta, **kwargs)
    return max(rel(o, o_fla), rel(ht, ht_fla))


def time_decode(fn, B, H, D):
    (q, k, v, g, beta), h0 = make_inputs(B, 1, H, D, D)
    t = do_bench(lambda: fn(q, k, v, g, beta, initial_state=h0, output_final_state=True))
    state_bytes = 2 * h0.numel() * 4  # read the fp32 state once, write it once
    return t, state_bytes / (t * 1e-3) / 1e12


def profile_kernels(ours, fla_chunk, B=8, T=2048, H=16, D=128):
    """Per-kernel CUDA time of one forward+backward, ours and fla's on the same inputs (after warm-ups, so fla's
    autotuner has picked), then the config fla's autotuner picked per kernel: which kernel carries the gap."""
    from kernel_profile import print_autotune_picks, print_fwd_bwd_kernel_times

    (q, k, v, g, beta), h0 = make_inputs(B, T, H, D, D, requires_grad=True)
    print_fwd_bwd_kernel_times(
        f"fwd+bwd B{B} T{T} H{H} K=V={D}", (("ours", ours), ("fla 0.6", fla_chunk)),
        [q, k, v, g, beta], lambda fn: fn(q, k, v, g, beta, initial_state=h0, output_final_state=True),
        torch.randn_like(v))
    if fla_chunk is not None:
        print_autotune_picks("fla.")


def sweep_gated_delta_rule_launch(names, base: Tuning, warps_options=(2, 4, 8), isolate=False, B=8, T=2048, H=16,
                                  D=128):
    """delta_rule_bench_common.sweep_launch over the gated delta rule, each setting on `base` (the run's tuning):
    gradients checked against the fp32 naive recurrence (bf16 inputs, B1 T300 H2 K=V=128), forward and fwd+bwd timed
    at B, T; each setting in its own process with `isolate`. Paste the winners into ops/common/launch.py."""
    (q, k, v, g, beta), h0 = make_inputs(1, 300, 2, 128, 128, requires_grad=True)
    do = torch.randn(1, 300, 2, 128, device="cuda", dtype=torch.bfloat16)
    inputs = (q, k, v, g, beta, h0)
    ours = lambda tuning: functools.partial(chunk_gated_delta_rule, tuning=tuning)  # noqa: E731
    sweep_launch(names, lambda tuning: outputs_and_grads(ours(tuning), inputs, do),
                 outputs_and_grads(naive_recurrent_gated_delta_rule, inputs, do),
                 lambda tuning: time_chunk(ours(tuning), B, T, H, D), f"B{B} T{T}", warps_options, isolate, base)


def precision_checks():
    """Inputs (bf16; B1 T300 H2 and B2 T1024 H4, K=V=128) with their upstream gradients, and the fp32 naive
    recurrence's outputs and gradients on them: what the variant sweeps measure errors against."""
    checks = []
    for B, T, Hc in ((1, 300, 2), (2, 1024, 4)):
        (q, k, v, g, beta), h0 = make_inputs(B, T, Hc, 128, 128, requires_grad=True)
        checks.append(((q, k, v, g, beta, h0), torch.randn_like(v)))
    return checks, [outputs_and_grads(naive_recurrent_gated_delta_rule, inputs, do) for inputs, do in checks]


def sweep_precision(ours, fla_chunk, H=16, D=128):
    """Each dot precision of ops/common/precision.py for bf16 inputs (the op's `dot`): gradients against the fp32
    naive recurrence (bf16 inputs; B1 T300 H2 and B2 T1024 H4, K=V=128), then forward and fwd+bwd at both timed
    shapes, fla side by side. The first row is the shipped default (dot="auto")."""
    checks, references = precision_checks()
    rows = []
    for dot in ["auto"] + [d for d in ("bf16", "tf32") if d != LOW_PRECISION_DOT]:
        fn = functools.partial(ours, dot=dot)
        out_err, grad_err = worst_errors(fn, checks, references)
        times = [t for B, T in ((8, 2048), (2, 8192)) for t in time_chunk(fn, B, T, H, D)]
        name = f"dots {LOW_PRECISION_DOT} (default)" if dot == "auto" else f"dots {dot}"
        rows.append((name, out_err, grad_err, *times))
        print("  " + " | ".join(f"{x:.3g}" if isinstance(x, float) else str(x) for x in rows[-1]), flush=True)
    if fla_chunk is not None:  # its errors by the same measure (its gradients on Hopper: see the module docstring)
        times = [t for B, T in ((8, 2048), (2, 8192)) for t in time_chunk(fla_chunk, B, T, H, D)]
        rows.append(("fla 0.6 (bwd guard bypassed)", *worst_errors(fla_chunk, checks, references), *times))
    print("\n| variant | worst output err | worst grad err | B8 T2048 fwd ms | fwd+bwd ms | B2 T8192 fwd ms "
          "| fwd+bwd ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, eo, eg, *t in rows:
        print(f"| {name} | {eo:.1e} | {eg:.1e} | " + " | ".join(f"{x:.3f}" for x in t) + " |")


def add_row(rows: list, row: tuple) -> None:
    """Keep a timing row for the final table and print it now (fla's autotuning can outlast a time limit)."""
    rows.append(row)
    print("  " + " | ".join(f"{x:.3f}" if isinstance(x, float) else str(x) for x in row), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one small shape, fewer columns (smoke run)")
    parser.add_argument("--profile", action="store_true",
                        help="also print ours and fla's per-kernel CUDA time for one forward+backward at B8 T2048, "
                             "and the configs fla's autotuner picked (tuning)")
    parser.add_argument("--precision", action="store_true",
                        help="sweep the dot precisions for bf16 inputs (ops/common/precision.py) and exit")
    add_tuning_arguments(parser, "wy_bwd=8,2",
                         "sweep warps x stages of these kernels (ops/common/launch.py names; none listed = all) and "
                         "exit",
                         "the state passes' value columns per program: 64 (wide), 32 (narrow), or auto (64 when the "
                         "programs still fill every SM)")
    args = parser.parse_args()
    torch.manual_seed(0)
    tuning = tuning_from_args(args)
    ours = functools.partial(chunk_gated_delta_rule, tuning=tuning)
    if args.sweep_launch is not None:
        from rltrain_kernels.ops.common.launch import LAUNCH

        sweep_gated_delta_rule_launch(args.sweep_launch or [n for n in LAUNCH if not n.startswith("iplr_")], tuning,
                                      args.sweep_warps, args.isolate)
        return
    fla_chunk, fla_fused = load_fla()
    print(f"device: {torch.cuda.get_device_name()}")
    if args.precision:
        sweep_precision(ours, fla_chunk)
        return
    check_against_naive(ours)
    if args.profile:
        profile_kernels(ours, fla_chunk)

    H, D = 16, 128
    shapes = [("B8 T2048", 8, 2048), ("B2 T8192", 2, 8192)] if not args.quick else [("B2 T1024", 2, 1024)]
    varlen = [4096, 1000, 2048, 512, 3000, 5728] if not args.quick else [700, 300, 1024]
    rows = []
    for label, B, T in shapes:
        if fla_chunk is not None:
            print(f"{label}: ours vs fla forward rel err {forward_agreement(ours, fla_chunk, B, T, H, D):.1e}")
        add_row(rows, (label, "ours", *time_chunk(ours, B, T, H, D)))
        if fla_chunk is not None:
            add_row(rows, (label, "fla 0.6 (bwd guard bypassed)", *time_chunk(fla_chunk, B, T, H, D)))
        add_row(rows, (label, "torch SDPA causal", *time_sdpa(B, T, H, D)))
    cu = torch.tensor([0, *torch.tensor(varlen).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    label = f"varlen {len(varlen)} seqs, {sum(varlen)} tokens"
    if fla_chunk is not None:
        err = forward_agreement(ours, fla_chunk, 1, sum(varlen), H, D, cu_seqlens=cu, N=len(varlen))
        print(f"{label}: ours vs fla forward rel err {err:.1e}")
    add_row(rows, (label, "ours", *time_chunk(ours, 1, sum(varlen), H, D, cu, len(varlen))))
    if fla_chunk is not None:
        add_row(rows, (label, "fla 0.6 (bwd guard bypassed)",
                     *time_chunk(fla_chunk, 1, sum(varlen), H, D, cu, len(varlen))))
    small = (1, 256, 4, 64)
    add_row(rows, ("B1 T256 H4 K=V=64 (small)", "naive torch", *time_chunk(naive_recurrent_gated_delta_rule, *small)))
    add_row(rows, ("B1 T256 H4 K=V=64 (small)", "ours", *time_chunk(ours, *small)))

    decode_B = 256 if not args.quick else 32
    decode = [("ours fused_recurrent", *time_decode(fused_recurrent_gated_delta_rule, decode_B, H, D))]
    if fla_fused is not None:
        decode.append(("fla 0.6 fused_recurrent", *time_decode(fla_fused, decode_B, H, D)))

    print(f"\n## Gated delta rule, bf16, H={H}, K=V={D} ({torch.cuda.get_device_name()})\n")
    print("| case | implementation | forward ms | forward+backward ms |")
    print("| --- | --- | ---: | ---: |")
    for case, impl, t_fwd, t_all in rows:
        print(f"| {case} | {impl} | {t_fwd:.3f} | {t_all:.3f} |")
    from bench_norm_act_rope import copy_ceiling_gbps

    ceiling = copy_ceiling_gbps() / 1e3  # measured in this run (H200 4.2 TB/s, H100 3.0)
    print(f"\n## Decode step, B={decode_B}, H={H}, K=V={D}, fp32 state in/out\n")
    print(f"| implementation | ms | state TB/s | % of this device's {ceiling:.2f} TB/s copy |")
    print("| --- | ---: | ---: | ---: |")
    for impl, t, tbps in decode:
        print(f"| {impl} | {t:.4f} | {tbps:.2f} | {100 * tbps / ceiling:.0f}% |")


if __name__ == "__main__":
    main()
