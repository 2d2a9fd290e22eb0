"""Benchmark the gated delta product kernels against fla 0.6's chunk_gated_delta_product and against our own
chunk_gated_delta_rule at length T·n_h (the same chunk machinery with a query at every sub-step: the product's forward
reads only the T real queries through its strided output pass, its backward runs that op's backward with zero rows).

Run on a CUDA machine (fla-core / flash-linear-attention 0.6.0 installed for the fla column):
    python kernels/benchmarks/bench_gated_delta_product.py [--quick] [--profile]
    python kernels/benchmarks/bench_gated_delta_product.py --accuracy   # bf16 error by regime and precision setting
Checks correctness first (ours vs the fp32 naive recurrence at a small size, forward and every gradient; ours vs
fla's forward at every timed shape), then times forward and forward+backward, bf16, H=16, K=V=128, n_h=2.
fla's gated chunk backward refuses to run on Hopper with Triton 3.4-3.7.0 (fla issue #640: wrong gradients); its
guard is bypassed here (fla.ops.common.chunk_o.IS_NVIDIA_HOPPER = False) for timing only: its gradients are not
trusted. A markdown table is printed last.
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F
from delta_rule_bench_common import check_against_reference, outputs_and_grads, rel
from triton.testing import do_bench

from rltrain_kernels.ops.gated_delta_product import (
    chunk_gated_delta_product,
    fused_recurrent_gated_delta_product,
    naive_recurrent_gated_delta_product,
)
from rltrain_kernels.ops.gated_delta_rule import chunk_gated_delta_rule


def load_fla():
    try:
        import fla.ops.common.chunk_o as fla_chunk_o
        from fla.ops.gated_delta_product import chunk_gated_delta_product as fla_chunk
    except ImportError as err:
        print(f"fla not importable ({err}); skipping its column")
        return None
    fla_chunk_o.IS_NVIDIA_HOPPER = False  # timing only, see the module docstring
    return fla_chunk


def make_inputs(B, T, H, K, V, n_h, dtype=torch.bfloat16, requires_grad=False, N=None):
    """(q, k, v, g, beta) in the product's layout (k, v, beta with T·n_h rows) and an fp32 initial state."""
    q = torch.randn(B, T, H, K, device="cuda", dtype=dtype)
    k = F.normalize(torch.randn(B, T * n_h, H, K, device="cuda"), dim=-1).to(dtype)
    v = torch.randn(B, T * n_h, H, V, device="cuda", dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, H, device="cuda")).to(dtype)
    beta = torch.rand(B, T * n_h, H, device="cuda").sigmoid().to(dtype)
    h0 = torch.randn(N or B, H, K, V, device="cuda")
    tensors = [q, k, v, g, beta]
    for t in tensors:
        t.requires_grad_(requires_grad)
    return tensors, h0


def with_householder(fn, n_h: int):
    """fn with its num_householder argument bound, in the five-tensors-then-keywords form outputs_and_grads calls."""
    return lambda q, k, v, g, beta, **kwargs: fn(q, k, v, g, beta, n_h, **kwargs)


def check_against_naive(n_h: int):
    """Ours vs the fp32 naive recurrence (B=1, T=200, H=2, K=V=128), forward and every gradient."""
    (q, k, v, g, beta), h0 = make_inputs(1, 200, 2, 128, 128, n_h, requires_grad=True)
    h0.requires_grad_(True)
    do = torch.randn(1, 200, 2, 128, device="cuda", dtype=torch.bfloat16)
    inputs = (q, k, v, g, beta, h0)
    check_against_reference("ours vs naive fp32 (bf16 inputs)", ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta",
                            "dh0"], outputs_and_grads(with_householder(chunk_gated_delta_product, n_h), inputs, do),
                            outputs_and_grads(with_householder(naive_recurrent_gated_delta_product, n_h), inputs, do))


def time_fn(call, tensors):
    """(forward ms, forward+backward ms) of call() -> (o, final_state)."""
    with torch.no_grad():
        t_fwd = do_bench(call)
    o = call()[0]
    do = torch.randn_like(o)
    return t_fwd, do_bench(lambda: call()[0].backward(do), grad_to_none=tensors)


def time_product(fn, B, T, H, D, n_h):
    (q, k, v, g, beta), h0 = make_inputs(B, T, H, D, D, n_h, requires_grad=True)
    call = lambda: fn(q, k, v, g, beta, n_h, initial_state=h0, output_final_state=True)  # noqa: E731
    return time_fn(call, [q, k, v, g, beta])


def time_fla(fla_chunk, B, T, H, D, n_h):
    (q, k, v, g, beta), h0 = make_inputs(B, T, H, D, D, n_h, requires_grad=True)
    call = lambda: fla_chunk(q, k, v, g, beta, n_h, initial_state=h0, output_final_state=True)  # noqa: E731
    return time_fn(call, [q, k, v, g, beta])


def time_rule_expanded(B, T, H, D, n_h):
    """Our chunk_gated_delta_rule on a length T·n_h sequence: the same chunk machinery with a query at every row."""
    (q, k, v, g, beta), h0 = make_inputs(B, T * n_h, H, D, D, 1, requires_grad=True)
    call = lambda: chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)  # noqa: E731
    return time_fn(call, [q, k, v, g, beta])


def profile_kernels(fla_chunk, n_h, B=8, T=2048, H=16, D=128):
    """Per-kernel CUDA time of one forward+backward, ours and fla's on the same inputs (after warm-ups): kernel time
    does not move with the host overhead that wall-clock times carry."""
    from kernel_profile import print_fwd_bwd_kernel_times

    (q, k, v, g, beta), h0 = make_inputs(B, T, H, D, D, n_h, requires_grad=True)
    print_fwd_bwd_kernel_times(
        f"fwd+bwd B{B} T{T} H{H} K=V={D} n_h={n_h}", (("ours", chunk_gated_delta_product), ("fla 0.6", fla_chunk)),
        [q, k, v, g, beta], lambda fn: fn(q, k, v, g, beta, n_h, initial_state=h0, output_final_state=True),
        torch.randn_like(q))


def forward_agreement(fla_chunk, B, T, H, D, n_h) -> float:
    (q, k, v, g, beta), h0 = make_inputs(B, T, H, D, D, n_h)
    o, ht = chunk_gated_delta_product(q, k, v, g, beta, n_h, initial_state=h0, output_final_state=True)
    o_fla, ht_fla = fla_chunk(q, k, v, g, beta, n_h, initial_state=h0, output_final_state=True)
    return max(rel(o, o_fla), rel(ht, ht_fla))


def time_decode(B, H, D, n_h):
    (q, k, v, g, beta), h0 = make_inputs(B, 1, H, D, D, n_h)
    return do_bench(lambda: fused_recurrent_gated_delta_product(q, k, v, g, beta, n_h, initial_state=h0,
                                                                output_final_state=True))


# Regimes of the accuracy sweep: (gate, β) makers from (B, T, H) on a device. β up to 2 is DeltaProduct's
# negative-eigenvalue range; with no gate (or g near 0) nothing forgets, and the bf16 rounding of each chunk stays.
ACCURACY_REGIMES = {
    "g ~ logsigmoid(N(0,1)), β ∈ (0, 2)": (lambda s, d: F.logsigmoid(torch.randn(*s, device=d)), 2.0),
    "g ~ −10⁻³·U(0,1), β ∈ (0, 2)": (lambda s, d: -1e-3 * torch.rand(*s, device=d), 2.0),
    "g = None, β ∈ (0, 1)": (None, 1.0),
    "g = None, β ∈ (0, 2)": (None, 2.0),
}
# Precision settings: the op's precision arguments (ops/common/precision.py).
ACCURACY_SETTINGS = {
    "shipped": {},
    "tf32 WY + state passes (recurrence_dot=tf32)": {"recurrence_dot": "tf32"},
    "all tf32 (dot=tf32)": {"dot": "tf32"},
}


def accuracy_errors(regime: str, n_h: int, device: str = "cuda", B=1, T=512, H=2, D=128,
                    **dots: str) -> tuple[float, float]:
    """(worst of o and the final state, worst gradient) relative errors of ours (bf16, the op's precision arguments
    `dots`: recurrence_dot, dot) vs the fp32 naive recurrence in one of ACCURACY_REGIMES."""
    gate, beta_max = ACCURACY_REGIMES[regime]
    q = torch.randn(B, T, H, D, device=device)
    k = F.normalize(torch.randn(B, T * n_h, H, D, device=device), dim=-1)
    v = torch.randn(B, T * n_h, H, D, device=device)
    g = None if gate is None else gate((B, T, H), device)
    beta = beta_max * torch.rand(B, T * n_h, H, device=device)
    inputs = [None if t is None else t.to(torch.bfloat16) for t in (q, k, v, g, beta)]
    h0 = torch.randn(B, H, D, D, device=device)
    do = torch.randn(B, T, H, D, device=device, dtype=torch.bfloat16)

    ours_fn = functools.partial(chunk_gated_delta_product, **dots)
    ours = outputs_and_grads(with_householder(ours_fn, n_h), inputs + [h0], do)
    ref = outputs_and_grads(with_householder(naive_recurrent_gated_delta_product, n_h),
                            [None if t is None else t.float() for t in inputs] + [h0], do)
    errs = [rel(a, b) for a, b in zip(ours, ref) if a is not None]
    return max(errs[:2]), max(errs[2:])


def accuracy_sweep(n_h: int) -> None:
    """Every ACCURACY_SETTINGS × ACCURACY_REGIMES: errors (B1 T512 H2 K=V=128) and fwd+bwd time at B8 T2048."""
    print("| setting | " + " | ".join(ACCURACY_REGIMES) + " | fwd+bwd ms (B8 T2048) |")
    print("| --- |" + " ---: |" * (len(ACCURACY_REGIMES) + 1))
    for setting, dots in ACCURACY_SETTINGS.items():
        cells = [accuracy_errors(regime, n_h, **dots) for regime in ACCURACY_REGIMES]
        t = time_product(functools.partial(chunk_gated_delta_product, **dots), 8, 2048, 16, 128, n_h)[1]
        print(f"| {setting} | " + " | ".join(f"{o:.1e} / {g:.1e}" for o, g in cells) + f" | {t:.3f} |", flush=True)
    print("(cells: worst output error / worst gradient error vs the fp32 naive recurrence; bars 5e-3 / 1e-2)")


def add_row(rows: list, row: tuple) -> None:
    """Keep a timing row for the final table and print it now (fla's autotuning can outlast a time limit)."""
    rows.append(row)
    print("  " + " | ".join(f"{x:.3f}" if isinstance(x, float) else str(x) for x in row), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one small shape (smoke run)")
    parser.add_argument("--num-householder", type=int, default=2)
    parser.add_argument("--profile", action="store_true",
                        help="also print ours and fla's per-kernel CUDA time for one forward+backward at B8 T2048")
    parser.add_argument("--accuracy", action="store_true",
                        help="bf16 error by gate/β regime and precision setting, with each setting's time, and exit")
    args = parser.parse_args()
    torch.manual_seed(0)
    n_h, H, D = args.num_householder, 16, 128
    fla_chunk = load_fla()
    print(f"device: {torch.cuda.get_device_name()}")
    if args.accuracy:
        accuracy_sweep(n_h)
        return
    check_against_naive(n_h)
    if args.profile:
        profile_kernels(fla_chunk, n_h)
    shapes = [("B8 T2048", 8, 2048), ("B2 T8192", 2, 8192)] if not args.quick else [("B2 T1024", 2, 1024)]
    rows = []
    for label, B, T in shapes:
        if fla_chunk is not None:
            print(f"{label}: ours vs fla forward rel err {forward_agreement(fla_chunk, B, T, H, D, n_h):.1e}")
        add_row(rows, (label, "ours chunk_gated_delta_product", *time_product(chunk_gated_delta_product, B, T, H, D,
                                                                             n_h)))
        if fla_chunk is not None:
            add_row(rows, (label, "fla 0.6 chunk_gated_delta_product (bwd guard bypassed, timing only)",
                         *time_fla(fla_chunk, B, T, H, D, n_h)))
        add_row(rows, (label, f"ours chunk_gated_delta_rule at T·n_h={T * n_h}", *time_rule_expanded(B, T, H, D, n_h)))
    decode_B = 256 if not args.quick else 32
    t_decode = time_decode(decode_B, H, D, n_h)

    print(f"\n## Gated delta product, bf16, H={H}, K=V={D}, n_h={n_h} ({torch.cuda.get_device_name()})\n")
    print("| case | implementation | forward ms | forward+backward ms |")
    print("| --- | --- | ---: | ---: |")
    for case, impl, t_fwd, t_all in rows:
        print(f"| {case} | {impl} | {t_fwd:.3f} | {t_all:.3f} |")
    print(f"\nDecode step (fused recurrent), B={decode_B}, one token, fp32 state in/out: {t_decode:.4f} ms")


if __name__ == "__main__":
    main()
