"""Benchmark the IPLR delta rule kernels against fla 0.6's chunk_iplr_delta_rule (forward only: fla has no chunked
IPLR backward) and our chunk_gated_delta_rule (the closest op with a backward, same sizes).

Run on a CUDA machine (flash-linear-attention 0.6.0 installed for the fla column):
    python kernels/benchmarks/bench_iplr_delta_rule.py [--quick] [--dot bf16] [--launch iplr_bwd_key=8,2 ...]
    python kernels/benchmarks/bench_iplr_delta_rule.py --dot bf16 --sweep-launch iplr_bwd_query iplr_bwd_key
    python kernels/benchmarks/bench_iplr_delta_rule.py --check-only --dot-per-kernel iplr_bwd_key_kernel=bf16
(a sweep that hits an illegal memory access loses the process's CUDA context, so suspected settings go one process
each with --launch, or --isolate. --dot-per-kernel gives single kernels another dot precision, the intermediates
keeping their dtype: bf16 in one kernel at a time, the rest tf32, says which kernel a bf16 failure lives in.
Every setting reaches the op as its `tuning` argument, ops/common/tuning.py.)
Checks correctness first (ours vs the fp32 naive recurrence at a small size, forward and every gradient; ours vs
fla's forward at every timed shape), then times forward and forward+backward in bf16, H=16, K=V=128, inputs in the
stable regime a = −β k̂, b = k̂ (k̂ l2-normalised, β ∈ (0, 1)), with an fp32 initial state and the final state out.
A markdown table is printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import torch
import torch.nn.functional as F
import triton
from delta_rule_bench_common import (add_tuning_arguments, check_against_reference, outputs_and_grads, rel,
                                     sweep_launch, tuning_from_args, with_launch, worst_errors)
from triton.testing import do_bench

from rltrain_kernels.ops.common.tuning import DEFAULT_TUNING, Tuning
from rltrain_kernels.ops.gated_delta_rule import chunk_gated_delta_rule
from rltrain_kernels.ops.iplr_delta_rule import chunk_iplr_delta_rule, naive_recurrent_iplr_delta_rule


def load_fla():
    try:
        from fla.ops.generalized_delta_rule import chunk_iplr_delta_rule as fla_chunk
    except ImportError as err:
        print(f"fla not importable ({err}); skipping its column")
        return None
    return fla_chunk


def make_inputs(B, T, H, K, V, dtype=torch.bfloat16, requires_grad=False, N=None):
    """q, k, v, a, b (bf16) in the stable regime and an fp32 initial state."""
    q = torch.randn(B, T, H, K, device="cuda", dtype=dtype)
    k = F.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).to(dtype)
    v = torch.randn(B, T, H, V, device="cuda", dtype=dtype)
    k_hat = F.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1)
    beta = torch.rand(B, T, H, 1, device="cuda")
    a, b = (-beta * k_hat).to(dtype), k_hat.to(dtype)
    h0 = torch.randn(N or B, H, K, V, device="cuda")
    tensors = [q, k, v, a, b]
    for t in tensors:
        t.requires_grad_(requires_grad)
    return tensors, h0


def check_against_naive(ours, B=1, T=300, H=2):
    """Ours (chunk_iplr_delta_rule at the run's --dot) vs the fp32 naive recurrence (K=V=128, bf16 inputs), forward
    and every gradient."""
    (q, k, v, a, b), h0 = make_inputs(B, T, H, 128, 128)
    do = torch.randn(B, T, H, 128, device="cuda", dtype=torch.bfloat16)
    inputs = (q, k, v, a, b, h0)
    check_against_reference(f"ours vs naive fp32 (bf16 inputs, B{B} T{T} H{H})",
                            ["o", "final_state", "dq", "dk", "dv", "da", "db", "dh0"],
                            outputs_and_grads(ours, inputs, do),
                            outputs_and_grads(naive_recurrent_iplr_delta_rule, inputs, do))


def time_iplr(fn, B, T, H, D, backward=True, cu_seqlens=None, N=None):
    (q, k, v, a, b), h0 = make_inputs(B, T, H, D, D, requires_grad=backward, N=N)
    do = torch.randn_like(v)
    kwargs = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)
    fwd = lambda: fn(q, k, v, a, b, **kwargs)  # noqa: E731
    with torch.no_grad():
        t_fwd = do_bench(fwd)
    if not backward:
        return t_fwd, None

    def fwd_bwd():
        o, _ = fn(q, k, v, a, b, **kwargs)
        o.backward(do)

    return t_fwd, do_bench(fwd_bwd, grad_to_none=[q, k, v, a, b])


def gated_delta_rule_inputs(B, T, H, D, N=None):
    """q, k, v as make_inputs draws them, a log-sigmoid gate and β ∈ (0, 1), all bf16 leaves; the fp32 h0."""
    (q, k, v, _, _), h0 = make_inputs(B, T, H, D, D, N=N)
    g = F.logsigmoid(torch.randn(B, T, H, device="cuda")).to(torch.bfloat16)
    beta = torch.rand(B, T, H, device="cuda").to(torch.bfloat16)
    return [t.requires_grad_() for t in (q, k, v, g, beta)], h0


def time_gated_delta_rule(B, T, H, D, cu_seqlens=None, N=None, tuning: Tuning = DEFAULT_TUNING):
    tensors, h0 = gated_delta_rule_inputs(B, T, H, D, N=N)
    do = torch.randn_like(tensors[2])
    kwargs = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens, tuning=tuning)
    with torch.no_grad():
        t_fwd = do_bench(lambda: chunk_gated_delta_rule(*tensors, **kwargs))
    t_all = do_bench(lambda: chunk_gated_delta_rule(*tensors, **kwargs)[0].backward(do), grad_to_none=tensors)
    return t_fwd, t_all


def forward_agreement(ours, fla_chunk, B, T, H, D, cu_seqlens=None, N=None) -> float:
    (q, k, v, a, b), h0 = make_inputs(B, T, H, D, D, N=N)
    kwargs = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)
    o, ht = ours(q, k, v, a, b, **kwargs)
    o_fla, ht_fla = fla_chunk(q, k, v, a, b, **kwargs)
    return max(rel(o, o_fla), rel(ht, ht_fla))


def profile_kernels(ours, fla_chunk, B=8, T=2048, H=16, D=128):
    """Per-kernel CUDA time of one call on the same inputs: our forward and forward+backward, fla's forward (it has
    no chunked IPLR backward), after warm-ups, then the configs fla's autotuner picked."""
    from kernel_profile import print_autotune_picks, print_kernel_times

    (q, k, v, a, b), h0 = make_inputs(B, T, H, D, D, requires_grad=True)
    do = torch.randn_like(v)
    kwargs = dict(initial_state=h0, output_final_state=True)
    shape = f"B{B} T{T} H{H} K=V={D}"

    def fwd_bwd():
        for t in (q, k, v, a, b):
            t.grad = None
        ours(q, k, v, a, b, **kwargs)[0].backward(do)

    with torch.no_grad():
        print_kernel_times(f"ours forward {shape}", lambda: ours(q, k, v, a, b, **kwargs))
        if fla_chunk is not None:
            print_kernel_times(f"fla 0.6 forward {shape}", lambda: fla_chunk(q, k, v, a, b, **kwargs))
    print_kernel_times(f"ours forward+backward {shape}", fwd_bwd, top=14)
    if fla_chunk is not None:
        print_autotune_picks("fla.")


# --compare-variants: (label, the Tuning fields it sets on the run's tuning; `launches` adds to the run's)
VARIANTS = [
    ("fwd state pass narrow: raw in registers", dict(iplr_raw_in_registers={"wide": True, "narrow": True})),
    ("reverse pass: a as stored", dict(iplr_a_in_registers={"wide": False, "narrow": False})),
    ("narrow fwd state pass 4w/2s", dict(launches={"iplr_state_pass_fwd": (4, 2)})),
    ("query side 8w/2s", dict(launches={"iplr_bwd_query": (8, 2)})),
    ("key side 8w/2s", dict(launches={"iplr_bwd_key": (8, 2)})),
]


def variant_tuning(base: Tuning, fields: dict) -> Tuning:
    """`base` with a VARIANTS entry's fields set (its launch settings beside base's)."""
    tuning = dataclasses.replace(base, **{k: v for k, v in fields.items() if k != "launches"})
    for name, (warps, stages) in fields.get("launches", {}).items():
        tuning = with_launch(tuning, name, warps, stages)
    return tuning


def compare_variants(ours, base: Tuning, H=16, D=128):
    """The shipped kernels (ours: chunk_iplr_delta_rule at the run's --dot and tuning `base`), then each of VARIANTS
    on `base`: the worst output and gradient errors against the fp32 naive recurrence (B1 T300 H2 and B2 T1024 H4;
    three runs), and the forward+backward kernel time (torch.profiler sums, kernel_profile.py) at B8 T2048 and B2
    T8192, with the kernels that moved most against the shipped run; then our gated delta rule's at the same shapes
    and the shipped IPLR's ratio to it (issue 6's goal: ≤ 1.2×)."""
    from kernel_profile import kernel_times

    checks = []
    for B, T, Hc in ((1, 300, 2), (2, 1024, 4)):
        (q, k, v, a, b), h0 = make_inputs(B, T, Hc, 128, 128, requires_grad=True)
        checks.append(((q, k, v, a, b, h0), torch.randn_like(v)))
    references = [outputs_and_grads(naive_recurrent_iplr_delta_rule, inputs, do) for inputs, do in checks]
    shapes = ((8, 2048), (2, 8192))
    steps = []
    for B, T in shapes:
        (q, k, v, a, b), h0 = make_inputs(B, T, H, D, D, requires_grad=True)
        do = torch.randn_like(v)

        def step(fn, q=q, k=k, v=v, a=a, b=b, h0=h0, do=do):
            for t in (q, k, v, a, b):
                t.grad = None
            fn(q, k, v, a, b, initial_state=h0, output_final_state=True)[0].backward(do)

        steps.append(step)
    rows, shipped = [], None
    for label, fields in [("shipped", {})] + VARIANTS:
        fn = functools.partial(ours, tuning=variant_tuning(base, fields))
        try:
            errs = [worst_errors(fn, checks, references) for _ in range(3)]
            # the lower of two profiled calls per shape (one call's kernel sums vary by a few µs per kernel)
            totals = [min((kernel_times(functools.partial(step, fn))[0] for _ in range(2)),
                          key=lambda t: sum(t.values())) for step in steps]
        except triton.runtime.errors.OutOfResources as err:   # a setting that does not fit: its row says so
            print(f"  {label}: {err}", flush=True)
            continue
        if shipped is None:
            shipped = totals
            for (B, T), total in zip(shapes, totals):
                print(f"  shipped, B{B} T{T}: " + ", ".join(f"{n[:28]} {t:.3f}" for n, t in
                                                            sorted(total.items(), key=lambda x: -x[1])), flush=True)
        moved = sorted(((totals[0].get(n, 0.0) - shipped[0].get(n, 0.0), n)
                        for n in set(totals[0]) | set(shipped[0])), key=lambda x: -abs(x[0]))[:2]
        rows.append((label, max(e[0] for e in errs), [e[1] for e in errs], *(sum(t.values()) for t in totals),
                     ", ".join(f"{n[:32]} {d:+.3f}" for d, n in moved if abs(d) >= 0.005)))
        print("  " + " | ".join(str(x) for x in rows[-1]), flush=True)
    if not rows or rows[0][0] != "shipped":
        raise SystemExit("the shipped kernels did not run (see above): no baseline to compare the variants with")
    gdr = []   # our gated delta rule's forward+backward kernels at the same shapes: issue 6's yardstick
    for B, T in shapes:
        leaves, h0 = gated_delta_rule_inputs(B, T, H, D)
        do = torch.randn_like(leaves[2])

        def gdr_step(leaves=leaves, h0=h0, do=do):
            for t in leaves:
                t.grad = None
            chunk_gated_delta_rule(*leaves, initial_state=h0, output_final_state=True, tuning=base)[0].backward(do)

        gdr.append(min(sum(kernel_times(gdr_step)[0].values()) for _ in range(2)))
    print(f"\nour chunk_gated_delta_rule, fwd+bwd kernels: B8 T2048 {gdr[0]:.3f} ms, B2 T8192 {gdr[1]:.3f} ms; "
          f"shipped IPLR / it: {rows[0][3] / gdr[0]:.2f}x, {rows[0][4] / gdr[1]:.2f}x")
    print("\n| variant | worst output err | worst grad err (3 runs) | B8 T2048 fwd+bwd kernels ms | B2 T8192 ms "
          "| B8 T2048 kernels that moved (ms) |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for label, eo, eg, t1, t2, moved in rows:
        print(f"| {label} | {eo:.1e} | " + " / ".join(f"{e:.2e}" for e in eg) + f" | {t1:.3f} | {t2:.3f} | {moved} |")


def add_row(rows: list, row: tuple) -> None:
    """Keep a timing row for the final table and print it now (fla's autotuning can outlast a time limit)."""
    rows.append(row)
    print("  " + " | ".join(f"{x:.3f}" if isinstance(x, float) else str(x) for x in row), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one small shape (smoke run)")
    parser.add_argument("--check-only", action="store_true",
                        help="only the checks against the naive recurrence (B1 T300 H2 and B2 T1024 H4), no timing")
    parser.add_argument("--dot", choices=["auto", "tf32", "bf16"], default="auto",
                        help="the IPLR kernels' dot precision for bf16 inputs (the op's dot argument; auto: "
                             "precision.IPLR_LOW_PRECISION_DOT)")
    add_tuning_arguments(parser, "iplr_bwd_key=8,2",
                         "sweep warps x stages of these launch.py entries (none listed = the iplr_* ones), each "
                         "checked against the naive recurrence at B2 T1024 H4, and exit",
                         "the reverse state pass's value columns per program (common/state_pass.py): 64 (wide), 32 "
                         "(narrow), or auto")
    parser.add_argument("--output-blocks", metavar="BK,BV",
                        help="the output pass's key and value blocks (default: iplr_delta_rule/chunk_fwd.py "
                             "OUTPUT_BLOCKS), e.g. 128,128")
    parser.add_argument("--profile", action="store_true",
                        help="also print the per-kernel CUDA time of ours (forward, forward+backward) and fla's "
                             "forward at B8 T2048")
    parser.add_argument("--compare-variants", action="store_true",
                        help="errors and kernel time of the run's kernels and each of VARIANTS (register switches, "
                             "launch settings) at B8 T2048 and B2 T8192, and exit")
    parser.add_argument("--dot-per-kernel", nargs="*", default=[], metavar="KERNEL=PREC",
                        help="this Triton kernel's dot precision (ieee, tf32, bf16) whatever --dot says, e.g. "
                             "iplr_bwd_key_kernel=bf16; the stored intermediates keep their dtype")
    args = parser.parse_args()
    torch.manual_seed(0)
    tuning = tuning_from_args(args)
    ours = functools.partial(chunk_iplr_delta_rule, dot=args.dot, tuning=tuning)
    print(f"device: {torch.cuda.get_device_name()}")
    if args.compare_variants:
        return compare_variants(ours, tuning)
    if args.sweep_launch is not None:
        from rltrain_kernels.ops.common.launch import LAUNCH

        (q, k, v, a, b), h0 = make_inputs(2, 1024, 4, 128, 128)  # the shape the bf16 GPU test failed at
        inputs, do = (q, k, v, a, b, h0), torch.randn_like(v)
        sweep_launch(args.sweep_launch or [n for n in LAUNCH if n.startswith("iplr_")],
                     lambda t: outputs_and_grads(functools.partial(ours, tuning=t), inputs, do),
                     outputs_and_grads(naive_recurrent_iplr_delta_rule, inputs, do),
                     lambda t: time_iplr(functools.partial(ours, tuning=t), 8, 2048, 16, 128), "B8 T2048",
                     args.sweep_warps, args.isolate, tuning)
        return
    check_against_naive(ours)
    check_against_naive(ours, 2, 1024, 4)
    if args.check_only:
        return
    fla_chunk = load_fla()
    if args.profile:
        profile_kernels(ours, fla_chunk)

    H, D = 16, 128
    shapes = [("B8 T2048", 8, 2048, None), ("B2 T8192", 2, 8192, None)] if not args.quick else \
        [("B2 T1024", 2, 1024, None)]
    lengths = [4096, 1000, 2048, 512, 3000, 5728] if not args.quick else [700, 300, 1024]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    shapes.append((f"varlen {len(lengths)} seqs, {sum(lengths)} tokens", 1, sum(lengths), cu))
    rows = []
    for label, B, T, cu_seqlens in shapes:
        N = None if cu_seqlens is None else cu_seqlens.numel() - 1
        if fla_chunk is not None:
            err = forward_agreement(ours, fla_chunk, B, T, H, D, cu_seqlens=cu_seqlens, N=N)
            print(f"{label}: ours vs fla forward rel err {err:.1e}")
        add_row(rows, (label, "ours chunk_iplr_delta_rule", *time_iplr(ours, B, T, H, D,
                                                                      cu_seqlens=cu_seqlens, N=N)))
        if fla_chunk is not None:
            add_row(rows, (label, "fla 0.6 chunk_iplr_delta_rule (no backward)",
                         *time_iplr(fla_chunk, B, T, H, D, backward=False, cu_seqlens=cu_seqlens, N=N)))
        add_row(rows, (label, "ours chunk_gated_delta_rule", *time_gated_delta_rule(B, T, H, D, cu_seqlens, N,
                                                                                     tuning)))

    print(f"\n## IPLR delta rule, bf16, H={H}, K=V={D} ({torch.cuda.get_device_name()})\n")
    print("| case | implementation | forward ms | forward+backward ms |")
    print("| --- | --- | ---: | ---: |")
    for case, impl, t_fwd, t_all in rows:
        print(f"| {case} | {impl} | {t_fwd:.3f} | {'n/a' if t_all is None else f'{t_all:.3f}'} |")


if __name__ == "__main__":
    main()
