"""Benchmark: fused_policy_loss vs the torch naive loss (materialised logits) vs Liger's LigerFusedLinearGRPOLoss.

    PYTHONPATH=kernels python kernels/benchmarks/bench_policy_loss.py          # B=8 T=1024 H=4096 V=151936 bf16,
                                                                                # then B=16 T=4096
    PYTHONPATH=kernels python kernels/benchmarks/bench_policy_loss.py --quick  # small shapes, a smoke run
    PYTHONPATH=kernels python kernels/benchmarks/bench_policy_loss.py --tune-fused   # impl="fused" GemmConfigs

Run from the repo root on a CUDA machine (~3 min, most of it Liger and its torch.compile warm-up).
Liger (carry/install liger-kernel==0.8.5 --no-deps) is optional: its rows are skipped when it does not import.
Same options for all three: PPO clip 0.2/0.2, k3 KL vs ref with coefficient 0.04, token-mean (Liger: "bnpo"),
advantages [B], temperature 1. Inputs are fresh random tensors (never zeros): logits with std ≈ 2, ~25% of each
row masked as prompt/padding, old/ref logprobs = the true logp + N(0, 0.1²).

Per method: forward+backward median time (CUDA events, after warm-up; the grads are reset each step), queued
behind GPU work as inside a training step and from an idle GPU (timing.py); extra peak memory beyond the inputs
(it includes grad_hidden and grad_weight, which every method produces) and the part of it beyond those two
gradients; the ratio of the queued time to the 3-GEMM floor, 3·2·N·H·V flops at the bf16 GEMM rate measured in the
same run on an 8192³ matmul — at boost clock (burst) and, second, after seconds of GEMMs (sustained: the card at its
power limit, gemm_floor.gemm_rates). Correctness vs naive is checked first (loss, grad_hidden, grad_weight). A markdown
table is printed last.
"""

from __future__ import annotations

import argparse
import gc
import math

import torch

from rltrain_kernels.ops.policy_loss import PolicyLossChunkConfig, fused_policy_loss
from timing import median_ms

OPTIONS = dict(clip_low=0.2, clip_high=0.2, kl_coef=0.04, kl_type="k3", loss_agg="token-mean")


def make_inputs(B, T, H, V, device="cuda", dtype=torch.bfloat16):
    hidden = torch.randn(B, T, H, device=device, dtype=dtype)
    weight = (torch.randn(V, H, device=device) * (2.0 / math.sqrt(H))).to(dtype)
    labels = torch.randint(0, V, (B, T), device=device)
    starts = torch.randint(0, T // 4 + 1, (B, 1), device=device)          # prompt tokens: masked out
    ends = torch.randint(3 * T // 4, T + 1, (B, 1), device=device)         # padding after the response
    pos = torch.arange(T, device=device)
    mask = (pos >= starts) & (pos < ends)
    advantages = torch.randn(B, device=device)
    with torch.no_grad():
        logp = fused_policy_loss(hidden, weight, labels, mask, advantages, torch.zeros(B, T, device=device)).logprobs
    old = logp + 0.1 * torch.randn_like(logp)
    ref = logp + 0.1 * torch.randn_like(logp)
    return dict(hidden=hidden, weight=weight, labels=labels, mask=mask, advantages=advantages, old=old, ref=ref)


def naive_loss(hidden, weight, labels, mask, advantages, old, ref):
    """What a trainer does without fusion (verl-style): bf16 logits, fp32 log-softmax, entropy for the metric."""
    logits = (hidden @ weight.T).float()
    log_probs = torch.log_softmax(logits, dim=-1)
    logp = log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)
    m = mask.float()
    ratio = torch.exp(logp - old)
    adv = advantages.unsqueeze(1)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - OPTIONS["clip_low"], 1 + OPTIONS["clip_high"]))
    kl = torch.exp(ref - logp) - (ref - logp) - 1
    loss = ((pg + OPTIONS["kl_coef"] * kl) * m).sum() / m.sum()
    with torch.no_grad():
        _ = ((entropy * m).sum() / m.sum()).item()
    return loss


def ours(config, impl="auto"):
    def run(hidden, weight, labels, mask, advantages, old, ref):
        return fused_policy_loss(hidden, weight, labels, mask, advantages, old, ref, chunk_config=config,
                                 impl=impl, **OPTIONS).loss
    return run


def ours_gspo(config):
    def run(hidden, weight, labels, mask, advantages, old, ref):
        opts = dict(OPTIONS, importance_level="sequence", loss_agg="seq-mean-token-mean")
        return fused_policy_loss(hidden, weight, labels, mask, advantages, old, ref, chunk_config=config,
                                 **opts).loss
    return run


def chunk_config(rows: str):
    """"auto": the default PolicyLossChunkConfig (rows from its workspace budget); else that many rows."""
    return None if rows == "auto" else PolicyLossChunkConfig(token_chunk=int(rows))


def liger():
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except Exception as err:   # noqa: BLE001  (any import failure: skip the peer)
        print(f"liger-kernel unavailable ({type(err).__name__}: {err}); skipping its rows")
        return None
    module = LigerFusedLinearGRPOLoss(beta=OPTIONS["kl_coef"], compiled=True, use_ref_model=True, chunk_size=1,
                                      epsilon_low=OPTIONS["clip_low"], epsilon_high=OPTIONS["clip_high"],
                                      loss_type="bnpo", temperature=1.0)

    def run(hidden, weight, labels, mask, advantages, old, ref):
        loss, _metrics = module(hidden, weight, labels, mask.to(torch.int64), advantages,
                                ref_per_token_logps=ref, old_per_token_logps=old)
        return loss
    return run


def fwd_bwd(fn, inputs):
    inputs["hidden"].grad = inputs["weight"].grad = None
    fn(**inputs).backward()


def measure(fn, inputs, warmup, repeats):
    """(median ms queued behind GPU work, median ms from an idle GPU, extra peak bytes) of one forward+backward
    (timing.py: queued is how the loss runs inside a training step, idle shows the call's host overhead too)."""
    def step():
        inputs["hidden"].grad = inputs["weight"].grad = None
        fn(**inputs).backward()

    queued = median_ms(step, warmup=warmup, iters=repeats, queued=True)
    idle = median_ms(step, warmup=0, iters=repeats, queued=False)
    inputs["hidden"].grad = inputs["weight"].grad = None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd(fn, inputs)
    torch.cuda.synchronize()
    return queued, idle, torch.cuda.max_memory_allocated() - base


def grads_of(fn, inputs):
    fwd_bwd(fn, inputs)
    out = (inputs["hidden"].grad.float(), inputs["weight"].grad.float())
    inputs["hidden"].grad = inputs["weight"].grad = None
    return out


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check(name, fn, expected, inputs):
    """Max relative error vs the fp32 naive loss over (loss, grad_hidden, grad_weight); prints each."""
    loss = fn(**inputs)
    gh, gw = grads_of(fn, inputs)
    errs = (abs(loss.item() - expected[0]) / max(abs(expected[0]), 0.1), rel(gh, expected[1]), rel(gw, expected[2]))
    status = "ok" if max(errs) < 2e-2 else "MISMATCH"
    print(f"  check {name}: rel err vs fp32 naive: loss {errs[0]:.2e}, grad_hidden {errs[1]:.2e}, "
          f"grad_weight {errs[2]:.2e} ({status})")
    return max(errs)


def bare():
    """The 3 GEMMs alone (gemm_floor.py): the measured floor under the same loop as ours."""
    from gemm_floor import bare_gemms

    gemms = bare_gemms(recompute=False)

    def run(hidden, weight, labels, mask, advantages, old, ref):
        return gemms(hidden.reshape(-1, hidden.shape[-1]), weight).sum()

    return run


def profile_ours(B, T, H, V, config):
    """Per-kernel time of one forward+backward of ours and of the 3 bare GEMMs, queued behind GPU work (timing.py)
    and ours also from idle: where the time over the 3-GEMM floor goes, kernels vs the GPU's idle gaps."""
    from kernel_profile import print_kernel_times

    inputs = make_inputs(B, T, H, V)
    inputs["hidden"].requires_grad_()
    inputs["weight"].requires_grad_()
    rows = "auto" if config is None else config.token_chunk
    print_kernel_times(f"ours B={B} T={T} rows={rows}", lambda: fwd_bwd(ours(config), inputs), top=12, queued=True,
                       timeline=48)
    print_kernel_times(f"ours B={B} T={T} rows={rows}", lambda: fwd_bwd(ours(config), inputs), top=6)
    print_kernel_times(f"3 bare cuBLAS GEMMs B={B} T={T}", lambda: fwd_bwd(bare(), inputs), queued=True)


# GemmConfig overrides timed by --tune-fused (the shipped config first): GEMM 1's loop (Hopper warp specialization,
# which needs it unflattened), block shape and order. (How it stores the kept logits and the dlogits pass' program
# shape timed within 1% of each other, 4 stages, a 128-wide K block and group 8 slower: RESULTS.md, 2026-11-24
# fourth and fifth sessions.) Warp specialization spills 64 B and 256 × 128 blocks 64 B (sm_90 compile report), the
# shipped config none.
FUSED_CONFIGS = [dict(), dict(warp_specialize=True, flatten=False), dict(flatten=False),
                 dict(block_m=256, block_n=128), dict(group_m=4)]


def tune_fused(B, T, H, V, warmup, repeats):
    """impl="fused" at the main size with each of FUSED_CONFIGS (PolicyLossChunkConfig.gemm), beside the 3 bare
    cuBLAS GEMMs timed before and after them (queued timing)."""
    from dataclasses import replace

    from rltrain_kernels.ops.common.vocab_tiles import GemmConfig

    inputs = make_inputs(B, T, H, V)
    inputs["hidden"].requires_grad_()
    inputs["weight"].requires_grad_()
    bare_runs = [measure(bare(), inputs, warmup, repeats)[0]]
    rows, first = [], None
    for overrides in FUSED_CONFIGS:
        config = PolicyLossChunkConfig(gemm=replace(GemmConfig.default(), **overrides))
        grads = grads_of(ours(config, impl="fused"), inputs)
        first = first or grads
        err = max(rel(g, f) for g, f in zip(grads, first))   # vs the shipped config's gradients
        del grads
        ms, idle_ms, _ = measure(ours(config, impl="fused"), inputs, warmup, repeats)
        rows.append((overrides, ms, idle_ms, err))
        print(f"  {overrides or 'default'}: {ms:.2f} ms (from idle {idle_ms:.2f}), grads vs default {err:.1e}",
              flush=True)
    bare_runs.append(measure(bare(), inputs, warmup, repeats)[0])
    bare_ms = sum(bare_runs) / 2
    print(f"\nB={B} T={T}: 3 bare cuBLAS GEMMs {bare_ms:.2f} ms (before/after {bare_runs[0]:.2f} / {bare_runs[1]:.2f})")
    print("\n| GemmConfig | fwd+bwd ms | / bare | from idle ms | grads vs default |\n|---|---|---|---|---|")
    for overrides, ms, idle_ms, err in rows:
        print(f"| {overrides or 'default'} | {ms:.2f} | {ms / bare_ms:.3f} | {idle_ms:.2f} | {err:.1e} |")


def run_case(label, B, T, H, V, methods, rates, warmup, repeats, with_naive):
    print(f"\n== {label}: B={B} T={T} H={H} V={V} bf16 ==")
    inputs = make_inputs(B, T, H, V)
    inputs["hidden"].requires_grad_()
    inputs["weight"].requires_grad_()
    floor_ms, sustained_ms = (3 * 2 * B * T * H * V / rate * 1e3 for rate in rates)
    grad_bytes = inputs["hidden"].numel() * 2 + inputs["weight"].numel() * 2
    rows, expected = [], None
    if with_naive:
        try:
            # The yardstick is the naive loss on fp32 copies of the inputs: the bf16 naive path is itself ~4.6e-2 off
            # in the gradients at this size (H200, 2026-11-22), so checking against it flags accurate kernels.
            fp32 = {k: (v.detach().float().requires_grad_() if k in ("hidden", "weight") else v)
                    for k, v in inputs.items()}
            expected = (naive_loss(**fp32).item(), *grads_of(naive_loss, fp32))
            del fp32
            methods = [("torch naive", naive_loss)] + methods
        except torch.cuda.OutOfMemoryError:
            print("  torch naive: OOM")
            rows.append((label, "torch naive", None, None, None, None, None, None))
            inputs["hidden"].grad = inputs["weight"].grad = None
            gc.collect()
            torch.cuda.empty_cache()
    for name, fn in methods:
        comparable = expected is not None and "GSPO" not in name and "bare" not in name   # naive is token-level
        err = check(name, fn, expected, inputs) if comparable else None
        try:
            ms, idle_ms, peak = measure(fn, inputs, warmup, repeats)
        except torch.cuda.OutOfMemoryError:
            print(f"  {name}: OOM")
            rows.append((label, name, None, None, None, None, None, err))
            inputs["hidden"].grad = inputs["weight"].grad = None
            gc.collect()
            torch.cuda.empty_cache()
            continue
        print(f"  {name}: {ms:.1f} ms ({ms / floor_ms:.2f}x floor {floor_ms:.1f} ms, {ms / sustained_ms:.2f}x at the "
              f"sustained rate; from idle {idle_ms:.1f} ms), extra peak {peak / 2**30:.2f} GiB "
              f"({(peak - grad_bytes) / 2**30:.2f} GiB beyond the grads)")
        rows.append((label, name, ms, ms / floor_ms, ms / sustained_ms, idle_ms, peak, err))
        gc.collect()
        torch.cuda.empty_cache()
    del inputs
    gc.collect()
    torch.cuda.empty_cache()
    return rows, (floor_ms, sustained_ms), grad_bytes


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, fewer repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--token-chunks", default="auto,1024",
                        help="rows per chunk to time ours (impl=auto) at the main size: 'auto' = the default "
                             "config, first = the one for GSPO, the large shape and --profile")
    parser.add_argument("--no-liger", action="store_true")
    parser.add_argument("--profile", action="store_true", help="instead: ours' per-kernel times at the main size")
    parser.add_argument("--tune-fused", action="store_true",
                        help="instead: impl='fused' at the main size over GemmConfig variants, beside the bare GEMMs")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    torch.manual_seed(0)
    repeats = args.repeats or (3 if args.quick else 7)
    warmup = 1 if args.quick else 2
    from gemm_floor import gemm_rates

    rates = gemm_rates(4096 if args.quick else 8192)
    print(f"{torch.cuda.get_device_name()}: bf16 GEMM {rates[0] / 1e12:.0f} TFLOP/s burst, {rates[1] / 1e12:.0f} "
          f"sustained; torch {torch.__version__}")
    main_shape = (2, 512, 1024, 32000) if args.quick else (8, 1024, 4096, 151936)
    big_shape = (4, 2048, 1024, 32000) if args.quick else (16, 4096, 4096, 151936)

    chunks = [c.strip() for c in args.token_chunks.split(",") if c.strip()]
    first = chunk_config(chunks[0])
    if args.profile:
        return profile_ours(*main_shape, first)
    if args.tune_fused:
        return tune_fused(*main_shape, warmup, repeats)
    methods = [(f"ours (rows={c})", ours(chunk_config(c))) for c in chunks]
    methods.append(("ours, cuBLAS + row passes (impl=triton, rows=1024)",
                    ours(PolicyLossChunkConfig(token_chunk=1024), impl="triton")))
    methods.append((f"ours GSPO (rows={chunks[0]})", ours_gspo(first)))
    methods.append(("3 bare cuBLAS GEMMs (measured floor)", bare()))
    liger_fn = None if args.no_liger else liger()
    if liger_fn is not None:
        methods.append(("Liger GRPO (chunk_size=1)", liger_fn))
    table = []
    rows, floors, grad_bytes = run_case("main", *main_shape, methods, rates, warmup, repeats, with_naive=True)
    table += [(r, floors, grad_bytes) for r in rows]
    big_methods = [(f"ours (rows={chunks[0]})", ours(first)),
                   (f"ours GSPO (rows={chunks[0]}, two-pass)", ours_gspo(first)),
                   ("3 bare cuBLAS GEMMs (measured floor)", bare())]
    rows, floors, grad_bytes = run_case("large", *big_shape, big_methods, rates, warmup, max(2, repeats // 2),
                                        with_naive=True)
    table += [(r, floors, grad_bytes) for r in rows]

    print("\n| shape | method | fwd+bwd ms | × 3-GEMM floor | × floor, sustained rate | from idle ms | extra peak GiB "
          "| beyond grads GiB | rel err vs fp32 naive |")
    print("|---|---|---|---|---|---|---|---|---|")
    shapes = {"main": main_shape, "large": big_shape}
    for (label, name, ms, ratio, sustained_ratio, idle_ms, peak, err), floors, grad_bytes in table:
        B, T, H, V = shapes[label]
        shape = f"B={B} T={T} H={H} V={V} (floor {floors[0]:.1f} / {floors[1]:.1f} ms)"
        if ms is None:
            print(f"| {shape} | {name} | OOM | | | | | | |")
            continue
        err_s = "—" if err is None else f"{err:.1e}"
        print(f"| {shape} | {name} | {ms:.1f} | {ratio:.2f} | {sustained_ratio:.2f} | {idle_ms:.1f} | "
              f"{peak / 2**30:.2f} | {(peak - grad_bytes) / 2**30:.2f} | {err_s} |")


if __name__ == "__main__":
    main()
