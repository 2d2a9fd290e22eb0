"""Benchmark linear_logprobs against torch naive, verl 0.9.1, CCE and Liger at bf16, H=4096, V=151936.

Run on a CUDA machine from the repo root (peers optional: install/carry liger-kernel==0.8.5,
cut-cross-entropy==25.1.1 and verl==0.9.1 --no-deps to get their rows):
    PYTHONPATH=kernels python kernels/benchmarks/bench_linear_logprobs.py            # N = 8192, 32768
    PYTHONPATH=kernels python kernels/benchmarks/bench_linear_logprobs.py --quick    # small smoke size
    PYTHONPATH=kernels python kernels/benchmarks/bench_linear_logprobs.py --tune     # ours over ChunkConfigs, N=8192
    PYTHONPATH=kernels python kernels/benchmarks/bench_linear_logprobs.py --tune-fused   # impl="fused" GemmConfigs
First checks ours against an fp32 reference (outputs on 256 rows at the real shape, every gradient at N=512), then
measures the bf16 GEMM rate of an 8192³ torch.matmul (at boost clock and sustained at the power limit,
gemm_floor.gemm_rates), then times each implementation (median of CUDA-event timings queued behind GPU work as in
a training step, timing.py; fwd+bwd also from an idle GPU; fresh random inputs, never zeros): forward (no_grad,
like the reference / old-logprob passes) and forward+backward, as ratios to the floors — 1 GEMM (2·N·H·V flops)
for forward, 4 GEMMs for forward+backward, at the burst rate and fwd+bwd also at the sustained one — and the
extra peak memory: max_memory_allocated − (memory before the call + the outputs and gradients it returns).
Peers compute different things (CCE: logprob only; Liger: mean loss only; verl and ours: logprob + entropy), each
called the way its docs show; a peer that fails to import or run is skipped with a note. verl's kernels import
only verl.utils.device, so verl is loaded from its installed files with a stand-in for that module, without
running verl/__init__.py. A markdown table is printed last.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import sys
import types
from pathlib import Path

import torch

from rltrain_kernels.ops.linear_logprobs import ChunkConfig, linear_logprobs, naive_linear_logprobs
from timing import median_ms

GiB = 2**30


# ---------------------------------------------------------------------------------------------------- peers
def torch_naive(hidden, weight, labels, temperature=1.0):
    """What a plain PyTorch actor does: bf16 GEMM, fp32 logits materialised, log_softmax, gather, entropy."""
    logits = (hidden @ weight.T).float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    logprobs = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logprobs, entropy


def load_verl():
    spec = importlib.util.find_spec("verl")   # finds the package without executing verl/__init__.py
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("verl is not installed")
    root = Path(list(spec.submodule_search_locations)[0])
    packages = (("verl", root), ("verl.utils", root / "utils"), ("verl.utils.kernel", root / "utils" / "kernel"))
    for name, path in packages:
        module = types.ModuleType(name)
        module.__path__ = [str(path)]
        sys.modules.setdefault(name, module)
    device = types.ModuleType("verl.utils.device")   # the one verl module its kernels import
    device.is_cuda_available = torch.cuda.is_available()
    device.is_npu_available = False
    device.get_device_name = lambda: "cuda"
    device.get_torch_device = lambda: torch.cuda
    device.get_device_id = lambda: torch.cuda.current_device()
    device.get_device_capability = lambda *a: torch.cuda.get_device_capability(*a)
    sys.modules["verl.utils.device"] = device
    from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy

    def verl_fn(hidden, weight, labels):
        return linear_cross_entropy(hidden, weight, labels, 1.0, "none")

    return verl_fn


def load_cce():
    from cut_cross_entropy import linear_cross_entropy

    def cce_fn(hidden, weight, labels):   # per-token loss = −logprob
        return (linear_cross_entropy(hidden, weight, labels, reduction="none"),)

    return cce_fn


def load_liger():
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss_module = LigerFusedLinearCrossEntropyLoss()

    def liger_fn(hidden, weight, labels):   # mean loss only
        out = loss_module(weight, hidden, labels)
        out = out[0] if isinstance(out, tuple) else getattr(out, "loss", out)
        return (out,)

    return liger_fn


def ours(return_entropy=True, config=None, impl="auto"):
    def fn(hidden, weight, labels):
        logprobs, entropy = linear_logprobs(hidden, weight, labels, return_entropy=return_entropy,
                                            chunk_config=config, impl=impl)
        return (logprobs,) if entropy is None else (logprobs, entropy)

    return fn


# ---------------------------------------------------------------------------------------------------- timing
def make_inputs(n, vocab, hidden_size, logit_std=3.0):
    hidden = torch.randn(n, hidden_size, device="cuda").to(torch.bfloat16)
    weight = (torch.randn(vocab, hidden_size, device="cuda") * (logit_std / math.sqrt(hidden_size))).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (n,), device="cuda")
    return hidden, weight, labels


def measure(fn, hidden, weight, labels, iters, idle=True):
    """(forward ms, forward+backward ms, extra peak bytes of forward+backward, forward+backward ms from idle);
    the times queued behind GPU work (timing.py), the last from an idle GPU (None with idle=False)."""
    with torch.no_grad():
        fwd_ms = median_ms(lambda: fn(hidden, weight, labels), iters=iters)
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    upstream = {}

    def fwd_bwd():
        h.grad = w.grad = None
        outs = fn(h, w, labels)
        grads = [upstream.setdefault(i, torch.randn_like(o)) for i, o in enumerate(outs)]
        torch.autograd.backward(outs, grads)
        return outs

    both_ms = median_ms(fwd_bwd, iters=iters)
    idle_ms = median_ms(fwd_bwd, warmup=0, iters=max(3, iters // 2), queued=False) if idle else None
    h.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    outs = fwd_bwd()
    torch.cuda.synchronize()
    returned = sum(o.numel() * o.element_size() for o in outs) + sum(
        g.numel() * g.element_size() for g in (h.grad, w.grad) if g is not None)
    extra = torch.cuda.max_memory_allocated() - before - returned
    del outs
    h.grad = w.grad = None
    return fwd_ms, both_ms, extra, idle_ms


# ---------------------------------------------------------------------------------------------------- checks
def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_correctness(vocab, hidden_size):
    """Ours vs fp32 dense: outputs on 256 rows of the real shape, every gradient at N=512."""
    hidden, weight, labels = make_inputs(512, vocab, hidden_size)
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    lp, ent = linear_logprobs(h, w, labels)
    g_lp, g_ent = torch.randn_like(lp), torch.randn_like(ent)
    torch.autograd.backward([lp, ent], [g_lp, g_ent])
    h32 = hidden.float().requires_grad_()
    w32 = weight.float().requires_grad_()
    ref_lp, ref_ent = naive_linear_logprobs(h32, w32, labels, compute_dtype=torch.float32)
    torch.autograd.backward([ref_lp, ref_ent], [g_lp, g_ent])
    errs = {"logprobs": rel(lp, ref_lp), "entropy": rel(ent, ref_ent), "grad_hidden": rel(h.grad, h32.grad),
            "grad_weight": rel(w.grad, w32.grad)}
    print("ours vs fp32 dense (bf16 inputs, N=512):", ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    if max(errs.values()) > 1e-2:
        raise SystemExit(f"correctness check failed: {errs}")
    return errs


def check_against_ours(name, fn, hidden, weight, labels, our_lp, our_ent) -> str:
    """A peer's forward against ours on the same inputs (ours is checked against fp32 separately)."""
    with torch.no_grad():
        outs = fn(hidden, weight, labels)
    if name.startswith("4 bare"):
        return "—"
    if name.startswith("CCE"):
        return f"logprob vs ours {rel(-outs[0], our_lp):.1e}"
    if name.startswith("Liger"):
        return f"mean loss vs ours {rel(outs[0], -our_lp.mean()):.1e}"
    notes = [f"logprob vs ours {rel(outs[0], our_lp):.1e}"]
    if len(outs) > 1:
        notes.append(f"entropy vs ours {rel(outs[1], our_ent):.1e}")
    return ", ".join(notes)


# ChunkConfig overrides timed by --tune, the default first
TUNE_CONFIGS = [dict(), dict(vocab_chunk=8192), dict(vocab_chunk=32768), dict(token_chunk=4096, vocab_chunk=8192),
                dict(token_chunk=1024), dict(block_v=1024), dict(block_v=4096)]


def bare(gemms):
    """The bare cuBLAS GEMMs (gemm_floor.bare_gemms) called like the implementations: a measured floor row."""
    return lambda hidden, weight, labels: (gemms(hidden, weight),)


def tune(n, vocab, hidden_size, rate, iters):
    """Ours at several ChunkConfigs (the default first) beside the 4 bare cuBLAS GEMMs, timed before and after them
    in the same process: fwd and fwd+bwd vs the computed floors and vs the bare GEMMs, extra peak memory."""
    from gemm_floor import bare_gemms

    hidden, weight, labels = make_inputs(n, vocab, hidden_size)
    floor1 = 2 * n * hidden_size * vocab / rate * 1e3
    floor_fn = bare(bare_gemms(recompute=True))

    def bare_ms():
        fwd, both, _, _ = measure(floor_fn, hidden, weight, labels, iters, idle=False)
        return fwd, both

    bare_runs = [bare_ms()]
    rows = []
    for overrides in TUNE_CONFIGS:
        config = ChunkConfig(**overrides)
        fwd_ms, both_ms, extra, _ = measure(ours(True, config), hidden, weight, labels, iters, idle=False)
        rows.append((config, fwd_ms, both_ms, extra))
        print(f"{config}: fwd {fwd_ms:.2f} ms, fwd+bwd {both_ms:.2f} ms, extra {extra / GiB:.3f} GiB", flush=True)
        torch.cuda.empty_cache()
    bare_runs.append(bare_ms())
    bare_fwd, bare_both = (statistics.mean(b[i] for b in bare_runs) for i in (0, 1))
    print(f"\nN={n}; bare cuBLAS: fwd {bare_fwd:.2f} ms ({bare_runs[0][0]:.2f} before, {bare_runs[1][0]:.2f} after), "
          f"fwd+bwd {bare_both:.2f} ms ({bare_runs[0][1]:.2f}, {bare_runs[1][1]:.2f}); "
          f"computed 1-GEMM floor {floor1:.2f} ms")
    print("\n| token_chunk | vocab_chunk | block_v | fwd ms | fwd / floor | fwd / bare | fwd+bwd ms "
          "| fwd+bwd / floor | fwd+bwd / bare | extra peak GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for config, fwd_ms, both_ms, extra in rows:
        print(f"| {config.token_chunk} | {config.vocab_chunk} | {config.block_v} | {fwd_ms:.2f} "
              f"| {fwd_ms / floor1:.3f} | {fwd_ms / bare_fwd:.3f} | {both_ms:.2f} | {both_ms / (4 * floor1):.3f} "
              f"| {both_ms / bare_both:.3f} | {extra / GiB:.3f} |")


# GemmConfig overrides timed by --tune-fused (ChunkConfig.gemm), the default first
FUSED_CONFIGS = [dict(), dict(flatten=False), dict(warp_specialize=True, flatten=False), dict(subtile=False),
                 dict(group_m=8), dict(num_stages=4)]


def tune_fused(n, vocab, hidden_size, rate, iters):
    """impl="fused" at several GemmConfigs (the default first), beside the 4 bare cuBLAS GEMMs timed before and after
    them: fwd (logprob+entropy and logprob only) and fwd+bwd vs the computed floors and the bare GEMMs."""
    from dataclasses import replace

    from gemm_floor import bare_gemms
    from rltrain_kernels.ops.common.vocab_tiles import GemmConfig

    hidden, weight, labels = make_inputs(n, vocab, hidden_size)
    floor1 = 2 * n * hidden_size * vocab / rate * 1e3
    floor_fn = bare(bare_gemms(recompute=True))
    bare_runs = [measure(floor_fn, hidden, weight, labels, iters, idle=False)[:2]]
    rows = []
    for overrides in FUSED_CONFIGS:
        config = ChunkConfig(gemm=replace(GemmConfig.default(), **overrides))
        fwd_ms, both_ms, extra, _ = measure(ours(True, config, impl="fused"), hidden, weight, labels, iters,
                                            idle=False)
        lp_only_ms = measure(ours(False, config, impl="fused"), hidden, weight, labels, iters, idle=False)[0]
        rows.append((overrides, fwd_ms, lp_only_ms, both_ms, extra))
        print(f"{overrides or 'default'}: fwd {fwd_ms:.2f} ms (logprob only {lp_only_ms:.2f}), "
              f"fwd+bwd {both_ms:.2f} ms", flush=True)
    bare_runs.append(measure(floor_fn, hidden, weight, labels, iters, idle=False)[:2])
    bare_fwd, bare_both = (statistics.mean(b[i] for b in bare_runs) for i in (0, 1))
    print(f"\nN={n}; bare cuBLAS: fwd {bare_fwd:.2f} ms, fwd+bwd {bare_both:.2f} ms "
          f"(before/after: {bare_runs}); computed 1-GEMM floor {floor1:.2f} ms")
    print("\n| GemmConfig | fwd ms | fwd / floor | fwd / bare | logprob-only fwd ms | fwd+bwd ms | fwd+bwd / floor "
          "| fwd+bwd / bare | extra peak GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for overrides, fwd_ms, lp_only_ms, both_ms, extra in rows:
        print(f"| {overrides or 'default'} | {fwd_ms:.2f} | {fwd_ms / floor1:.3f} | {fwd_ms / bare_fwd:.3f} "
              f"| {lp_only_ms:.2f} | {both_ms:.2f} | {both_ms / (4 * floor1):.3f} | {both_ms / bare_both:.3f} "
              f"| {extra / GiB:.3f} |")


def profile_ours(n, vocab, hidden_size):
    """Per-kernel time of ours (forward alone, then forward+backward) at N=n: where the time over the floor goes."""
    from kernel_profile import print_kernel_times

    hidden, weight, labels = make_inputs(n, vocab, hidden_size)
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    g = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")

    def fwd_bwd():
        h.grad = w.grad = None
        torch.autograd.backward(list(linear_logprobs(h, w, labels)), list(g))

    with torch.no_grad():
        print_kernel_times(f"forward N={n}", lambda: linear_logprobs(hidden, weight, labels))
    print_kernel_times(f"forward+backward N={n}", fwd_bwd)


# ---------------------------------------------------------------------------------------------------- main
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke size: N=2048, V=32000, H=1024")
    parser.add_argument("--tokens", type=int, nargs="*", default=None, help="override the N values")
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--tune", action="store_true",
                        help="instead: time ours over a few ChunkConfigs beside the bare GEMMs")
    parser.add_argument("--tune-fused", action="store_true",
                        help="instead: time impl='fused' over a few GemmConfigs beside the bare GEMMs")
    parser.add_argument("--profile", action="store_true", help="instead: ours' per-kernel times at the first N")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    vocab, hidden_size, tokens = (32000, 1024, [2048]) if args.quick else (151936, 4096, [8192, 32768])
    tokens = args.tokens or tokens
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    check_correctness(vocab, hidden_size)
    from gemm_floor import gemm_rates

    rate, sustained = gemm_rates()
    print(f"bf16 GEMM rate: {rate / 1e12:.0f} TFLOP/s burst, {sustained / 1e12:.0f} sustained")

    if args.tune:
        return tune(tokens[0], vocab, hidden_size, rate, args.iters)
    if args.tune_fused:
        return tune_fused(tokens[0], vocab, hidden_size, rate, args.iters)
    if args.profile:
        return profile_ours(tokens[0], vocab, hidden_size)
    from gemm_floor import bare_gemms

    impls = [("ours (logprob+entropy)", ours(True)), ("ours (logprob only)", ours(False)),
             ("ours, cuBLAS + row passes (impl=triton)", ours(True, impl="triton")),
             ("4 bare cuBLAS GEMMs (measured floor)", bare(bare_gemms(recompute=True))),
             ("torch naive (fp32 logits)", torch_naive)]
    if not args.no_peers:
        for name, loader in (("verl 0.9.1 (logprob+entropy)", load_verl), ("CCE (logprob only)", load_cce),
                             ("Liger FLCE (mean loss only)", load_liger)):
            try:
                impls.append((name, loader()))
            except Exception as err:  # noqa: BLE001 - any import failure just drops the row
                print(f"skipping {name}: {type(err).__name__}: {err}")

    rows = []
    for n in tokens:
        hidden, weight, labels = make_inputs(n, vocab, hidden_size)
        floor1 = 2 * n * hidden_size * vocab / rate * 1e3
        sustained4 = 4 * 2 * n * hidden_size * vocab / sustained * 1e3
        with torch.no_grad():
            our_lp, our_ent = linear_logprobs(hidden, weight, labels)
            ref_lp, ref_ent = naive_linear_logprobs(hidden[:256], weight, labels[:256], compute_dtype=torch.float32)
        print(f"N={n}: ours vs fp32 dense on 256 rows: logprobs {rel(our_lp[:256], ref_lp):.1e}, "
              f"entropy {rel(our_ent[:256], ref_ent):.1e}")
        for name, fn in impls:
            naive_bytes = 5 * n * vocab * 4   # logits, log_softmax, exp, product, grad: ~5 fp32 N×V tensors
            if fn is torch_naive and naive_bytes > torch.cuda.mem_get_info()[0] * 0.9:
                print(f"skipping {name} at N={n}: needs ~{naive_bytes / GiB:.0f} GiB")
                continue
            try:
                note = check_against_ours(name, fn, hidden, weight, labels, our_lp, our_ent)
                fwd_ms, both_ms, extra, idle_ms = measure(fn, hidden, weight, labels, args.iters)
            except Exception as err:  # noqa: BLE001
                print(f"{name} failed at N={n}: {type(err).__name__}: {err}")
                torch.cuda.empty_cache()
                continue
            rows.append((n, name, fwd_ms, fwd_ms / floor1, both_ms, both_ms / (4 * floor1), both_ms / sustained4,
                         idle_ms, extra / GiB, note))
            print(f"N={n} {name}: fwd {fwd_ms:.1f} ms ({fwd_ms / floor1:.2f}x), fwd+bwd {both_ms:.1f} ms "
                  f"({both_ms / (4 * floor1):.2f}x; from idle {idle_ms:.1f}), extra peak {extra / GiB:.3f} GiB  "
                  f"{note}", flush=True)
            torch.cuda.empty_cache()
        del hidden, weight, labels

    print(f"\nbf16, H={hidden_size}, V={vocab}; GEMM rate {rate / 1e12:.0f} TFLOP/s burst, {sustained / 1e12:.0f} "
          f"sustained; floors: fwd = 1 GEMM, fwd+bwd = 4 GEMMs (2·N·H·V flops each)\n")
    print("| N | implementation | fwd ms | fwd / 1-GEMM floor | fwd+bwd ms | fwd+bwd / 4-GEMM floor | "
          "fwd+bwd / floor at sustained rate | fwd+bwd from idle ms | extra peak GiB | forward check |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n, name, fwd_ms, r1, both_ms, r4, r4s, idle_ms, extra, note in rows:
        print(f"| {n} | {name} | {fwd_ms:.1f} | {r1:.2f} | {both_ms:.1f} | {r4:.2f} | {r4s:.2f} | {idle_ms:.1f} "
              f"| {extra:.3f} | {note} |")


if __name__ == "__main__":
    main()
