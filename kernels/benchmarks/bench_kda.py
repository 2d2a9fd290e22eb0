"""Benchmark the KDA (Kimi Delta Attention) kernels against fla's chunk_kda / fused_recurrent_kda and our gated delta
rule (a scalar decay per head: what the per-channel decay costs on top).

Run on a CUDA machine (fla-core / flash-linear-attention installed for the comparison columns):
    python kernels/benchmarks/bench_kda.py [--quick] [--profile] [--launch kda_dqk=8,2]
    python kernels/benchmarks/bench_kda.py --sweep-launch kda_intra_fwd kda_dqk [--isolate]
    # the script's code paths without a GPU (tiny sizes, Triton interpreter; timings meaningless):
    TRITON_INTERPRET=1 PYTHONPATH=kernels:. python kernels/benchmarks/bench_kda.py --cpu-smoke
Checks correctness first (ours vs the fp32 naive recurrence at a small size, forward and every gradient, with the
gate computed in the op and without; ours vs fla's forward at every timed shape), then times forward and
forward+backward (bf16, H=16, K=V=128; precomputed g, and the layer's call: the gate from A_log / dt_bias and l2norm
inside the op) and the fused-recurrent decode step (B=256, one token, fp32 state in/out). The issue's goal: ours
forward+backward ≤ 0.9× fla's. A markdown table is printed last.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
import torch.nn.functional as F
from delta_rule_bench_common import (add_tuning_arguments, check_against_reference, outputs_and_grads, rel,
                                     sweep_launch, tuning_from_args)

from rltrain_kernels.ops.gated_delta_rule import chunk_gated_delta_rule
from rltrain_kernels.ops.kda import chunk_kda, fused_recurrent_kda, naive_recurrent_kda

DEVICE = "cuda"
GOAL = 0.9  # ours / fla forward+backward (issue 50)


def load_fla():
    try:
        from fla.ops.kda import chunk_kda as fla_chunk
        from fla.ops.kda import fused_recurrent_kda as fla_fused
    except ImportError as err:
        print(f"fla's KDA not importable ({err}); skipping its columns")
        return None, None
    return fla_chunk, fla_fused


def make_inputs(B, T, H, K, V, dtype=torch.bfloat16, requires_grad=False, N=None, gate_in_op=False):
    """q, k, v, g [B, T, H, K] (precomputed logsigmoid, or the raw a with gate_in_op), beta; h0 [N, H, K, V] fp32;
    gate keywords {} or {A_log, dt_bias, use_gate_in_kernel, use_qk_l2norm_in_kernel} (the layer's call)."""
    q = torch.randn(B, T, H, K, device=DEVICE, dtype=dtype)
    k = F.normalize(torch.randn(B, T, H, K, device=DEVICE), dim=-1).to(dtype)
    v = torch.randn(B, T, H, V, device=DEVICE, dtype=dtype)
    g = (torch.randn(B, T, H, K, device=DEVICE) if gate_in_op
         else F.logsigmoid(torch.randn(B, T, H, K, device=DEVICE))).to(dtype)
    beta = torch.rand(B, T, H, device=DEVICE).sigmoid().to(dtype)
    h0 = torch.randn(N or B, H, K, V, device=DEVICE)
    keywords = {}
    if gate_in_op:
        keywords = dict(A_log=torch.empty(H, device=DEVICE).uniform_(1, 16).log(),
                        dt_bias=torch.randn(H * K, device=DEVICE) - 4, use_gate_in_kernel=True,
                        use_qk_l2norm_in_kernel=True)
    tensors = [q, k, v, g, beta]
    for t in tensors:
        t.requires_grad_(requires_grad)
    return tensors, h0, keywords


def bench(fn) -> float:
    """Milliseconds per call: triton's do_bench on a GPU; one call's wall clock under the interpreter."""
    if DEVICE == "cuda":
        from triton.testing import do_bench

        return do_bench(fn)
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def check_against_naive(ours, B=1, T=300, H=2, D=128):
    """Ours vs the fp32 naive recurrence on bf16 inputs, forward and every gradient, with g precomputed and with the
    gate (A_log, dt_bias) and l2norm in the op; SystemExit past the issue's bf16 bars."""
    for gate_in_op in (False, True):
        (q, k, v, g, beta), h0, keywords = make_inputs(B, T, H, D, D, gate_in_op=gate_in_op)
        do = torch.randn(B, T, H, D, device=DEVICE, dtype=torch.bfloat16)
        call = lambda fn: functools.partial(fn, **keywords)  # noqa: E731
        check_against_reference(f"ours vs naive fp32 (bf16 inputs{', gate in op' if gate_in_op else ''})",
                                ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"],
                                outputs_and_grads(call(ours), (q, k, v, g, beta, h0), do),
                                outputs_and_grads(call(naive_recurrent_kda), (q, k, v, g, beta, h0), do))


def time_chunk(fn, B, T, H, D, cu_seqlens=None, N=None, gate_in_op=False, per_channel=True):
    """(forward ms, forward+backward ms) of fn; per_channel False gives g [B, T, H] (our gated delta rule)."""
    (q, k, v, g, beta), h0, keywords = make_inputs(B, T, H, D, D, requires_grad=True, N=N, gate_in_op=gate_in_op)
    if not per_channel:
        g = g[..., 0].detach().requires_grad_()
        keywords = {}
    do = torch.randn_like(v)
    kwargs = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens, **keywords)
    fwd = lambda: fn(q, k, v, g, beta, **kwargs)  # noqa: E731

    def fwd_bwd():
        o, _ = fn(q, k, v, g, beta, **kwargs)
        o.backward(do)

    with torch.no_grad():
        t_fwd = bench(fwd)
    if DEVICE == "cuda":
        from triton.testing import do_bench

        return t_fwd, do_bench(fwd_bwd, grad_to_none=[q, k, v, g, beta])
    return t_fwd, bench(fwd_bwd)


def forward_agreement(ours, fla_chunk, B, T, H, D, cu_seqlens=None, N=None, gate_in_op=False) -> float:
    (q, k, v, g, beta), h0, keywords = make_inputs(B, T, H, D, D, N=N, gate_in_op=gate_in_op)
    kwargs = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens, **keywords)
    o, ht = ours(q, k, v, g, beta, **kwargs)
    o_fla, ht_fla = fla_chunk(q, k, v, g, beta, **kwargs)
    return max(rel(o, o_fla), rel(ht, ht_fla))


def time_decode(fn, B, H, D):
    """(ms, TB/s on the fp32 state read and written once) of one decode step."""
    (q, k, v, g, beta), h0, _ = make_inputs(B, 1, H, D, D)
    t = bench(lambda: fn(q, k, v, g, beta, initial_state=h0, output_final_state=True))
    return t, 2 * h0.numel() * 4 / (t * 1e-3) / 1e12


def profile_kernels(ours, fla_chunk, B=8, T=2048, H=16, D=128):
    """Per-kernel CUDA time of one forward+backward, ours and fla's on the same inputs, with g precomputed and with
    the gate and l2norm in the op: which kernel carries a gap."""
    from kernel_profile import print_autotune_picks, print_fwd_bwd_kernel_times

    for gate_in_op in (False, True):
        (q, k, v, g, beta), h0, keywords = make_inputs(B, T, H, D, D, requires_grad=True, gate_in_op=gate_in_op)
        print_fwd_bwd_kernel_times(
            f"fwd+bwd B{B} T{T} H{H} K=V={D}{', gate + l2norm in op' if gate_in_op else ''}",
            (("ours", ours), ("fla", fla_chunk)), [q, k, v, g, beta],
            lambda fn: fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, **keywords),
            torch.randn_like(v))
    if fla_chunk is not None:
        print_autotune_picks("fla.")


def sweep_kda_launch(names, base, warps_options, isolate, B=8, T=2048, H=16, D=128):
    """delta_rule_bench_common.sweep_launch over KDA's launches: each setting's gradients checked against the fp32
    naive recurrence (bf16 inputs, B1 T300 H2 K=V=128), then timed at B, T. Paste the winners into
    ops/common/launch.py."""
    (q, k, v, g, beta), h0, _ = make_inputs(1, 300, 2, D, D, requires_grad=True)
    do = torch.randn(1, 300, 2, D, device=DEVICE, dtype=torch.bfloat16)
    inputs = (q, k, v, g, beta, h0)
    ours = lambda tuning: functools.partial(chunk_kda, tuning=tuning)  # noqa: E731
    sweep_launch(names, lambda tuning: outputs_and_grads(ours(tuning), inputs, do),
                 outputs_and_grads(naive_recurrent_kda, inputs, do),
                 lambda tuning: time_chunk(ours(tuning), B, T, H, D), f"B{B} T{T}", warps_options, isolate, base)


def main():
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one small shape (smoke run on a GPU)")
    parser.add_argument("--profile", action="store_true",
                        help="also print ours and fla's per-kernel CUDA time for one forward+backward at B8 T2048 "
                             "(g precomputed, then the gate and l2norm in the op)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny sizes on CPU through the Triton interpreter (TRITON_INTERPRET=1): checks the script")
    add_tuning_arguments(parser, "kda_dqk=8,2",
                         "sweep warps x stages of these kernels (ops/common/launch.py kda_* names; none listed = all "
                         "of KDA's) and exit", "unused by KDA's kernels (taken for the shared option parser)")
    args = parser.parse_args()
    torch.manual_seed(0)
    tuning = tuning_from_args(args)
    ours = functools.partial(chunk_kda, tuning=tuning)
    H, D = 16, 128
    shapes = [("B8 T2048", 8, 2048), ("B2 T8192", 2, 8192)]
    varlen = [4096, 1000, 2048, 512, 3000, 5728]
    decode_B = 256
    if args.cpu_smoke:
        DEVICE = "cpu"
        H, D, shapes, varlen, decode_B = 2, 32, [("B1 T80", 1, 80)], [50, 30], 4
    elif args.quick:
        shapes, varlen, decode_B = [("B2 T1024", 2, 1024)], [700, 300, 1024], 32
    if DEVICE == "cuda":
        assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU (or --cpu-smoke)"
    if args.sweep_launch is not None:
        from rltrain_kernels.ops.common.launch import LAUNCH

        sweep_kda_launch(args.sweep_launch or [n for n in LAUNCH if n.startswith("kda_")], tuning, args.sweep_warps,
                         args.isolate)
        return
    fla_chunk, fla_fused = load_fla() if DEVICE == "cuda" else (None, None)
    print(f"device: {torch.cuda.get_device_name() if DEVICE == 'cuda' else 'cpu (interpreter smoke run)'}")
    check_against_naive(ours, T=300 if DEVICE == "cuda" else 70, D=D)
    if args.profile:
        profile_kernels(ours, fla_chunk)

    rows = []

    def add(case, impl, times):
        rows.append((case, impl, *times))
        print(f"  {case} | {impl} | {times[0]:.3f} | {times[1]:.3f}", flush=True)

    cu = torch.tensor([0, *torch.tensor(varlen).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    cases = [(label, dict(B=B, T=T)) for label, B, T in shapes]
    cases.append((f"varlen {len(varlen)} seqs, {sum(varlen)} tokens",
                  dict(B=1, T=sum(varlen), cu_seqlens=cu, N=len(varlen))))
    for label, shape in cases:
        for gate_in_op in (False, True):
            case = label + (" (gate + l2norm in op)" if gate_in_op else "")
            add(case, "ours", time_chunk(ours, H=H, D=D, gate_in_op=gate_in_op, **shape))
            if fla_chunk is None:
                continue
            try:  # a peer's failure (an fla version without a keyword, a guard) costs its row, not the run
                err = forward_agreement(ours, fla_chunk, H=H, D=D, gate_in_op=gate_in_op, **shape)
                print(f"{case}: ours vs fla forward rel err {err:.1e}")
                add(case, "fla", time_chunk(fla_chunk, H=H, D=D, gate_in_op=gate_in_op, **shape))
            except Exception as exc:  # noqa: BLE001 - reported, the run goes on
                print(f"{case}: fla failed: {type(exc).__name__}: {exc}")
        add(label, "ours gated delta rule (scalar decay)",
            time_chunk(chunk_gated_delta_rule, H=H, D=D, per_channel=False, **shape))
    decode = [("ours fused_recurrent", *time_decode(fused_recurrent_kda, decode_B, H, D))]
    if fla_fused is not None:
        decode.append(("fla fused_recurrent", *time_decode(fla_fused, decode_B, H, D)))

    print(f"\n## KDA, bf16, H={H}, K=V={D} ({DEVICE})\n")
    print("| case | implementation | forward ms | forward+backward ms | fwd+bwd / fla |")
    print("| --- | --- | ---: | ---: | ---: |")
    fla_times = {case: t_all for case, impl, _, t_all in rows if impl == "fla"}
    for case, impl, t_fwd, t_all in rows:
        ratio = f"{t_all / fla_times[case]:.2f}" if case in fla_times else ""
        print(f"| {case} | {impl} | {t_fwd:.3f} | {t_all:.3f} | {ratio} |")
    if fla_times:
        worst = max(t / fla_times[c] for c, impl, _, t in rows if impl == "ours" and c in fla_times)
        print(f"\nworst ours / fla forward+backward: {worst:.2f} (goal ≤ {GOAL})")
    print(f"\n## Decode step, B={decode_B}, H={H}, K=V={D}, fp32 state in/out\n")
    print("| implementation | ms | state TB/s |")
    print("| --- | ---: | ---: |")
    for impl, t, tbps in decode:
        print(f"| {impl} | {t:.4f} | {tbps:.2f} |")


if __name__ == "__main__":
    main()
