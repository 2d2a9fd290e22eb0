"""Benchmark fla's keywords on the gated delta rule (Qwen3-Next's call: the gate and β from raw projections, the state
in inference engines' [N, HV, V, K] layout) against the same maths as a separate torch pass and against fla 0.6.

    PYTHONPATH=$PWD/kernels:$PWD python3 kernels/benchmarks/bench_fla_keywords.py [--quick | --decode-only]

Correctness first, on fresh random inputs: ours with use_gate_in_kernel + use_beta_sigmoid_in_kernel +
use_qk_l2norm_in_kernel against the float32 naive recurrence (B1 T300 H2 K=V=128, bf16 inputs: outputs and every
gradient, A_log's and dt_bias's included), then ours against fla's forward with the same keywords at every timed
shape, and the decode step against the torch-pass variant. Then times (triton.testing.do_bench, median), bf16:

  chunked, forward and forward+backward (gradients to a, A_log, dt_bias and the beta logits too):
    ours, keywords     the gate in gate.py's kernels (in place of the gate cumsum and its reverse), one torch sigmoid
    ours, torch pass   transformers' lines `g = -A_log.exp() * softplus(a + dt_bias)`, `beta = b.sigmoid()`, then
                       the plain call: the separate torch pass the keywords replace
    ours, precomputed  g and β given, no gate gradients: the floor of both
    fla 0.6, keywords  (its gated chunk backward is refused on Hopper with Triton 3.6, fla #640: the guard is bypassed
                       for timing only, its gradients are not trusted)
  decode step, B=256, T=1, H=HV=16, K=V=128, fp32 state, GPU time of CUDA-graph replays, ours beside fla 0.6: the
    state [N, HV, K, V] with g and β given; the same with every keyword; [N, HV, V, K] (state_v_first) with every
    keyword, and there also ours with a torch pass and the two state transposes. % of copy: the state read and
    written over a 1 GiB device copy's rate in the same run.

A markdown table is printed last.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from delta_rule_bench_common import rel
from triton.testing import do_bench, do_bench_cudagraph

from rltrain_kernels.ops.gated_delta_rule import (
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
    naive_recurrent_gated_delta_rule,
)
from rltrain_kernels.ops.gated_delta_rule.naive import naive_gdn_gate

KEYWORDS = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True)


def load_fla():
    try:
        import fla.ops.common.chunk_o as fla_chunk_o
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_fused
    except ImportError as err:
        print(f"fla not importable ({err}); skipping its rows")
        return None, None
    fla_chunk_o.IS_NVIDIA_HOPPER = False  # timing only, see the module docstring
    return fla_chunk, fla_fused


def make_inputs(B, T, H, D, *, requires_grad=True, state_v_first=False):
    """Qwen3-Next's raw inputs: q, k, v, the gate input a and beta logits b (bf16), A_log = log U(1, 16) and dt_bias
    (fp32, [H]), an fp32 state."""
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x = dict(q=torch.randn(B, T, H, D, **bf16), k=torch.randn(B, T, H, D, **bf16), v=torch.randn(B, T, H, D, **bf16),
             g=torch.randn(B, T, H, **bf16), beta=torch.randn(B, T, H, **bf16),
             A_log=torch.empty(H, device="cuda").uniform_(1, 16).log(), dt_bias=torch.ones(H, device="cuda"))
    for t in x.values():
        t.requires_grad_(requires_grad)
    x["initial_state"] = torch.randn(B, H, D, D, device="cuda")
    if state_v_first:
        x["initial_state"] = x["initial_state"].transpose(-1, -2).contiguous()
    return x


def keywords_call(fn, x, **extra):
    """The op with fla's keywords (fla's chunk and fused-recurrent functions take the same names)."""
    return fn(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
              initial_state=x["initial_state"], output_final_state=True, **KEYWORDS, **extra)


def torch_pass_call(fn, x, state_v_first=False):
    """The same maths as a torch pass before the plain call (transformers' Qwen3-Next lines), the state transposed
    around it for the [N, HV, V, K] layout."""
    g = -x["A_log"].float().exp() * F.softplus(x["g"].float() + x["dt_bias"])
    h0 = x["initial_state"].transpose(-1, -2).contiguous() if state_v_first else x["initial_state"]
    o, ht = fn(x["q"], x["k"], x["v"], g, x["beta"].sigmoid(), initial_state=h0, output_final_state=True,
               use_qk_l2norm_in_kernel=True)
    return o, (ht.transpose(-1, -2).contiguous() if state_v_first else ht)


def precomputed_call(fn, x, g, beta):
    return fn(x["q"], x["k"], x["v"], g, beta, initial_state=x["initial_state"], output_final_state=True,
              use_qk_l2norm_in_kernel=True)


def check_against_naive():
    """Ours with the keywords against the fp32 naive recurrence with them: outputs and every gradient."""
    x = make_inputs(1, 300, 2, 128)
    x["initial_state"].requires_grad_(True)
    names = ["q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state"]
    do = torch.randn(1, 300, 2, 128, device="cuda")
    results = []
    for fn, cast in ((chunk_gated_delta_rule, lambda t: t), (naive_recurrent_gated_delta_rule, lambda t: t.float())):
        leaves = {n: cast(x[n].detach()).requires_grad_() for n in names}
        o, ht = keywords_call(fn, leaves)
        (o.float() * do).sum().add(ht.sum()).backward()
        results.append([o, ht] + [leaves[n].grad for n in names])
    errs = {n: rel(a, b) for n, a, b in zip(["o", "final_state", *[f"d{n}" for n in names]], *results)}
    print("ours vs naive fp32 (bf16 inputs, every keyword):", ", ".join(f"{n} {e:.1e}" for n, e in errs.items()))
    # Qwen3-Next's A = U(1, 16) decays by up to e^-20 a token: dg cancels O(1) per-chunk terms to a small value, so it
    # and the sums over it (dA_log, ddt_bias) get the strong-gate floor of tests/kernels/ops/test_gated_delta_rule.py
    bars = {"o": 5e-3, "final_state": 5e-3, "dg": 5e-2, "dA_log": 5e-2, "ddt_bias": 5e-2}
    failed = [n for n, e in errs.items() if not e <= bars.get(n, 1e-2)]
    if failed:
        raise SystemExit(f"correctness check failed: {failed}")


def time_chunk(label, fn, x, g=None, beta=None, keywords=False):
    """(forward ms, forward+backward ms): keywords (ours or fla's), the torch pass, or precomputed g and β."""
    if keywords:
        step = lambda: keywords_call(fn, x)  # noqa: E731
    elif g is None:
        step = lambda: torch_pass_call(fn, x)  # noqa: E731
    else:
        step = lambda: precomputed_call(fn, x, g, beta)  # noqa: E731
    do = torch.randn_like(x["v"])

    def fwd_bwd():
        o, _ = step()
        o.backward(do)

    leaves = [t for t in (*x.values(), g, beta) if t is not None and t.requires_grad]
    with torch.no_grad():
        t_fwd = do_bench(step, return_mode="median")
    return label, t_fwd, do_bench(fwd_bwd, grad_to_none=leaves, return_mode="median")


def copy_tbps() -> float:
    """The device's copy rate (bytes read + written, TB/s) on a 1 GiB bf16 tensor."""
    x = torch.empty(2**29, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    return 2 * x.numel() * 2 / do_bench(lambda: y.copy_(x), return_mode="median") / 1e9


def time_decode(fla_fused, B=256, H=16, D=128):
    """Decode rows: (state layout and inputs, implementation, µs, % of copy); each ours checked against fla's (and the
    torch-pass variant) first."""
    kv, vk = make_inputs(B, 1, H, D, requires_grad=False), make_inputs(B, 1, H, D, requires_grad=False,
                                                                        state_v_first=True)
    with torch.no_grad():
        g, beta = naive_gdn_gate(kv["g"], kv["A_log"], kv["dt_bias"]), kv["beta"].sigmoid()
    fused = fused_recurrent_gated_delta_rule

    def given(fn):  # by name: fla's fifth positional argument is gk
        return fn(q=kv["q"], k=kv["k"], v=kv["v"], g=g, beta=beta, initial_state=kv["initial_state"],
                  output_final_state=True, use_qk_l2norm_in_kernel=True)

    cases = [("[K, V], g and β given", "ours", lambda: given(fused), lambda: given(fla_fused)),
             ("[K, V], every keyword", "ours, in the kernel", lambda: keywords_call(fused, kv),
              lambda: keywords_call(fla_fused, kv)),
             ("[V, K], every keyword", "ours, in the kernel", lambda: keywords_call(fused, vk, state_v_first=True),
              lambda: keywords_call(fla_fused, vk, state_v_first=True))]
    o, ht = cases[2][2]()
    o_ref, ht_ref = torch_pass_call(fused, vk, state_v_first=True)
    print(f"decode [V, K]: in-kernel vs torch pass: o {rel(o, o_ref):.1e}, state {rel(ht, ht_ref):.1e}")
    state_bytes, ceiling = 2 * B * H * D * D * 4, copy_tbps()
    rows = []
    for layout, label, ours, fla in cases:
        timed = [(label, ours)]
        if layout.startswith("[V, K]"):
            torch_pass = lambda: torch_pass_call(fused, vk, state_v_first=True)  # noqa: E731
            timed.append(("ours, torch pass + state transposes", torch_pass))
        if fla_fused is not None:
            (o, ht), (o_fla, ht_fla) = ours(), fla()
            print(f"decode {layout}: ours vs fla 0.6: o {rel(o, o_fla):.1e}, state {rel(ht, ht_fla):.1e}")
            timed.append(("fla 0.6", fla))
        for name, fn in timed:
            us = do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3
            rows.append((layout, name, us, 100 * state_bytes / us / 1e6 / ceiling))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the issue's shape only")
    parser.add_argument("--decode-only", action="store_true", help="the decode rows only")
    args = parser.parse_args()
    torch.manual_seed(0)
    fla_chunk, fla_fused = load_fla()
    print(f"device: {torch.cuda.get_device_name()}")
    check_against_naive()
    shapes = [] if args.decode_only else [(2, 1024, 8, 128)] + ([] if args.quick else [(8, 2048, 16, 128)])
    rows = []
    for B, T, H, D in shapes:
        shape = f"B{B} T{T} H{H} K=V={D}"
        x = make_inputs(B, T, H, D)
        if fla_chunk is not None:
            with torch.no_grad():
                o, ht = keywords_call(chunk_gated_delta_rule, x)
                o_fla, ht_fla = keywords_call(fla_chunk, x)
            print(f"{shape}: ours vs fla 0.6 forward with the keywords: o {rel(o, o_fla):.1e}, state "
                  f"{rel(ht, ht_fla):.1e}")
        with torch.no_grad():
            g = naive_gdn_gate(x["g"], x["A_log"], x["dt_bias"]).requires_grad_()
            beta = x["beta"].sigmoid().requires_grad_()
        timed = [time_chunk("ours, keywords", chunk_gated_delta_rule, x, keywords=True),
                 time_chunk("ours, torch pass", chunk_gated_delta_rule, x),
                 time_chunk("ours, precomputed g and β (floor)", chunk_gated_delta_rule, x, g, beta)]
        if fla_chunk is not None:
            timed.append(time_chunk("fla 0.6, keywords (bwd guard bypassed)", fla_chunk, x, keywords=True))
        for label, t_fwd, t_all in timed:
            print(f"  {shape} | {label} | {t_fwd:.3f} | {t_all:.3f}", flush=True)
            rows.append((shape, label, t_fwd, t_all))
    decode = time_decode(fla_fused)

    print(f"\n## fla keywords on the gated delta rule, bf16, Qwen3-Next's gate and β ({torch.cuda.get_device_name()})\n")
    print("| shape | implementation | forward ms | forward+backward ms |")
    print("| --- | --- | ---: | ---: |")
    for shape, label, t_fwd, t_all in rows:
        print(f"| {shape} | {label} | {t_fwd:.3f} | {t_all:.3f} |")
    print("\n## Decode step, B=256, H=HV=16, K=V=128, fp32 state (CUDA-graph replays)\n")
    print("| state, inputs | implementation | µs | % of copy |")
    print("| --- | --- | ---: | ---: |")
    for layout, label, us, pct in decode:
        print(f"| {layout} | {label} | {us:.1f} | {pct:.0f}% |")


if __name__ == "__main__":
    main()
