"""Benchmark: the fused MoE (rltrain_kernels.ops.fused_moe, kernel id `fused_moe`) at Qwen3-30B-A3B's expert shapes
(hidden 2048, moe_intermediate 768, 128 experts, top-8, bf16) against transformers' Qwen3-MoE sparse block — its
eager per-expert loop and its grouped_mm path (torch's grouped GEMM, transformers 5's default) — and Liger's fused
MoE (liger_kernel.ops.fused_moe, 0.8.5), each as a whole block (router + experts, the router shared).

Run on a CUDA machine from the repo root (Liger optional: carry its wheel; a peer that fails to import is skipped):
    PYTHONPATH=$PWD/kernels:$PWD:/tmp/site python3 kernels/benchmarks/bench_fused_moe.py [--tokens 8192 16384]
        [--liger-autotune]    # Liger's own autotuner (~160 configs to compile: minutes); default: its pinned configs
        [--profile]           # ours: CUDA time per kernel of one forward+backward
        [--sweep]             # ours: fwd+bwd time per launch setting of each kernel (fused_moe's tuning argument,
                              # each setting checked first)
    # the script's code paths without a GPU (tiny sizes, Triton interpreter; timings meaningless):
    TRITON_INTERPRET=1 PYTHONPATH=kernels:. python kernels/benchmarks/bench_fused_moe.py --cpu-smoke

Correctness first, on fresh random inputs: every implementation's experts output and gradients (hidden states,
gate_up_proj, down_proj, routing weights) on the block's own routing, against the per-expert loop in fp32 on the
same bf16 values (relative error; 1e-2 is the bf16 bar of tests/helpers.py; ours must pass or the script stops).
Then forward and forward+backward (torch.autograd.grad of the block's output w.r.t. the hidden states and every
block parameter) are timed with triton.testing.do_bench (median). The floor is the dense GEMM work of the routed
tokens, 6·T·k·H·I flops forward and 3× that forward+backward, at the bf16 GEMM rate of an 8192³ matmul measured in
the same run (gemm_floor.gemm_rates: burst). A markdown table is printed last.
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import torch

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 2048, 768, 128, 8
DTYPE = torch.bfloat16
BF16_BAR = 1e-2


def bench_ms(fn, device: str) -> float:
    if device == "cpu":  # --cpu-smoke: one call, to exercise the code path
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.detach().double(), expected.detach().double()
    return ((a - e).norm() / e.norm().clamp_min(1e-30)).item()


def make_model(hidden, intermediate, experts, top_k, device):
    """A one-layer Qwen3-MoE (tiny vocabulary) whose layer 0 holds the sparse block, initialised as transformers
    does (std 0.02), in bf16."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=16, hidden_size=hidden, moe_intermediate_size=intermediate, intermediate_size=4 * intermediate,
        num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, head_dim=64)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=DTYPE).to(device)
    block = model.model.layers[0].mlp
    with torch.no_grad():   # whatever this transformers version initialises: a spread routing, std-0.02 experts
        for param in (block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj):
            param.normal_(0, 0.02)
    return model


def liger_experts():
    """Liger's fused MoE autograd function, or None with a printed reason."""
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
    except Exception as exc:  # noqa: BLE001 - any import failure drops the peer
        print(f"liger fused MoE skipped: {exc!r}")
        return None
    return lambda experts, x, index, weights: LigerFusedMoEFunction.apply(
        x, experts.gate_up_proj, experts.down_proj, index.to(torch.int32), weights)


def experts_impls(model, liger):
    """{name: f(experts module, x [T, H], top_k_index, top_k_weights) -> [T, H]} of every implementation, and
    {name: (f(x [1, T, H]) -> block output, the block's parameters)} of the whole blocks (router + experts)."""
    from rltrain_kernels.ops.fused_moe import fused_moe
    from rltrain_kernels.registry import apply_kernel

    block = model.model.layers[0].mlp
    config = model.config
    swapped = apply_kernel("fused_moe", copy.deepcopy(model), device="cuda").model.layers[0].mlp

    def transformers_path(implementation):
        def set_path():
            config._experts_implementation = implementation
        return set_path

    experts = {}
    blocks = {}
    for name, implementation in (("transformers eager loop", "eager"), ("transformers grouped_mm", "grouped_mm")):
        use = transformers_path(implementation)
        experts[name] = lambda e, x, i, w, use=use: (use(), e(x, i, w))[1]
        blocks[name] = (lambda x, use=use: (use(), block(x))[1], list(block.parameters()))
    experts["rltrain fused_moe"] = lambda e, x, i, w: fused_moe(x, e.gate_up_proj, e.down_proj, i, w)
    blocks["rltrain fused_moe"] = (swapped, list(swapped.parameters()))
    if liger is not None:
        experts["liger fused MoE"] = liger

        def liger_block(x):
            flat = x.view(-1, x.shape[-1])
            _, weights, index = block.gate(flat)
            return liger(block.experts, flat, index, weights).view(x.shape)
        blocks["liger fused MoE"] = (liger_block, list(block.parameters()))
    return block, swapped, experts, blocks


def check_experts(block, experts_fns, tokens, device) -> dict[str, float]:
    """{name: worst relative error over the output and the four gradients} on the block's routing of fresh inputs."""
    from rltrain_kernels.ops.fused_moe import naive_fused_moe

    experts = block.experts
    x = torch.randn(tokens, experts.gate_up_proj.shape[-1], device=device, dtype=DTYPE)
    with torch.no_grad():
        _, weights, index = block.gate(x)
    d_out = torch.randn_like(x)
    leaves32 = [t.detach().float().requires_grad_() for t in (x, experts.gate_up_proj, experts.down_proj, weights)]
    ref = naive_fused_moe(leaves32[0], leaves32[1], leaves32[2], index, leaves32[3])
    ref_grads = torch.autograd.grad(ref, leaves32, d_out.float())
    errors = {}
    for name, fn in experts_fns.items():
        xi, wi = x.detach().requires_grad_(), weights.detach().requires_grad_()
        try:
            out = fn(experts, xi, index, wi)
            grads = torch.autograd.grad(out, (xi, experts.gate_up_proj, experts.down_proj, wi), d_out)
        except Exception as exc:  # noqa: BLE001 - a peer that fails is reported, not fatal
            print(f"{name}: failed on the check: {exc!r}")
            continue
        errors[name] = max(rel_error(a, b) for a, b in zip((out, *grads), (ref, *ref_grads)))
    return errors


def time_blocks(blocks, hidden, tokens, device) -> dict[str, tuple[float, float]]:
    """{name: (forward ms, forward+backward ms)} of each (block, its parameters) on fresh inputs [1, tokens, hidden]."""
    x = torch.randn(1, tokens, hidden, device=device, dtype=DTYPE, requires_grad=True)
    d_out = torch.randn_like(x)
    times = {}
    for name, (block, params) in blocks.items():
        def forward(block=block):
            with torch.no_grad():
                block(x)

        def forward_backward(block=block, params=params):
            torch.autograd.grad(block(x), [x, *params], d_out)
        times[name] = (bench_ms(forward, device), bench_ms(forward_backward, device))
    return times


# Launch settings --sweep times: each compiled spill-free for sm_90 with Triton 3.6 (compile_report's AOT compile;
# settings that spilled left out: up_swiglu (64, 64, 4, 4) and (128, 64, 8, 3), down_backward (128, 64, 8, 3) and
# (64, 64, 4, 4) at 128-row tiles).
SWEEP = {
    "up_swiglu": [(64, 64, 8, 3), (32, 64, 4, 4), (64, 128, 8, 3), (32, 128, 4, 4)],
    "scatter": [(128, 64, 8, 3), (64, 64, 4, 4), (128, 32, 8, 5), (128, 128, 8, 3), (256, 64, 8, 3)],
    "down_backward": [(64, 64, 8, 3), (32, 64, 4, 4)],
    "weight_grad": [(128, 128, 32, 8, 4), (128, 64, 64, 4, 3), (64, 128, 64, 4, 3), (256, 128, 64, 8, 3)],
}
ROW_TILE_64 = {"up_swiglu": (64, 64, 4, 4), "scatter": (128, 64, 4, 4), "down_backward": (64, 64, 4, 4)}


def sweep_variants() -> list:
    """(label, MoeTuning) per setting, each kernel's alone (the others at their defaults), then 64-row tiles with every
    row kernel at 4 warps."""
    from rltrain_kernels.ops.fused_moe.tuning import MoeTuning

    variants = [("defaults", MoeTuning())]
    for kernel, settings in SWEEP.items():
        for setting in settings:
            variants.append((f"{kernel} {setting}", MoeTuning(**{kernel: setting})))
    variants.append(("64-row tiles, 4 warps " + str(ROW_TILE_64), MoeTuning(row_tile=64, **ROW_TILE_64)))
    return variants


def ours_at(tuning):
    """Our experts, f(experts module, x, top_k_index, top_k_weights), with the kernels at `tuning` (a MoeTuning)."""
    from rltrain_kernels.ops.fused_moe import fused_moe

    return lambda e, x, i, w: fused_moe(x, e.gate_up_proj, e.down_proj, i, w, tuning=tuning)


def sweep(block, tokens, device) -> None:
    """fwd+bwd time of the block with our experts under each of sweep_variants() (passed as fused_moe's tuning), every
    setting checked against the fp32 loop first."""
    hidden = block.experts.gate_up_proj.shape[-1]
    rows = []
    for label, tuning in sweep_variants():
        experts = ours_at(tuning)

        def ours_block(x, experts=experts):
            flat = x.view(-1, x.shape[-1])
            _, weights, index = block.gate(flat)
            return experts(block.experts, flat, index, weights).view(x.shape)

        try:
            err = check_experts(block, {"ours": experts}, tokens, device).get("ours", float("nan"))
            ms = (time_blocks({"ours": (ours_block, list(block.parameters()))}, hidden, tokens, device)["ours"][1]
                  if err <= BF16_BAR else None)
        except Exception as exc:  # noqa: BLE001 - a setting that fails to compile or run is a row
            err, ms = float("nan"), None
            print(f"{label}: {exc!r}")
        rows.append((label, err, ms))
    print(f"\n### Launch sweep, T={tokens}, fwd+bwd of the block with our experts\n")
    print("| setting | max rel err | fwd+bwd ms |\n| --- | ---: | ---: |")
    for label, err, ms in rows:
        print(f"| {label} | {err:.2e} | {'-' if ms is None else f'{ms:.3f}'} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--liger-autotune", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--cpu-smoke", action="store_true")
    args = parser.parse_args()
    if not args.liger_autotune:
        os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")   # read when liger's kernels module is imported
    device = "cpu" if args.cpu_smoke else "cuda"
    dims = (64, 48, 8, 2) if args.cpu_smoke else (HIDDEN, INTERMEDIATE, EXPERTS, TOP_K)
    tokens_list = [40] if args.cpu_smoke else args.tokens
    torch.manual_seed(0)
    model = make_model(*dims, device)
    liger = None if args.cpu_smoke else liger_experts()
    block, swapped, experts, blocks = experts_impls(model, liger)
    if args.cpu_smoke:   # the interpreter runs ours; the loop and torch's grouped_mm are CPU code anyway
        experts.pop("transformers grouped_mm")
        blocks.pop("transformers grouped_mm")
    rate = None
    if device == "cuda":
        from gemm_floor import gemm_rates

        rate = gemm_rates()[0]
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16 GEMM rate {rate / 1e12:.0f} TFLOP/s "
              f"(8192³ burst), LIGER_FUSED_MOE_AUTOTUNE={os.environ.get('LIGER_FUSED_MOE_AUTOTUNE', '1')}")
    hidden, intermediate, n_experts, top_k = dims
    table = []
    for tokens in tokens_list:
        errors = check_experts(block, experts, tokens, device)
        print(f"T={tokens}: max relative error vs the fp32 loop (output, dx, d gate_up, d down, d weights): "
              + ", ".join(f"{name} {err:.2e}" for name, err in errors.items()))
        if errors.get("rltrain fused_moe", 1.0) > BF16_BAR:
            raise SystemExit(f"rltrain fused_moe fails the check ({errors.get('rltrain fused_moe')}): not timed")
        with torch.no_grad():
            counts = torch.bincount(block.gate(torch.randn(tokens, hidden, device=device, dtype=DTYPE))[2].flatten(),
                                    minlength=n_experts)
        print(f"T={tokens}: rows per expert max {counts.max().item()}, mean {counts.float().mean().item():.0f}, "
              f"experts with none {(counts == 0).sum().item()}")
        times = time_blocks(blocks, hidden, tokens, device)
        flops = 6 * tokens * top_k * hidden * intermediate
        floor = (flops / rate * 1e3, 3 * flops / rate * 1e3) if rate else (float("nan"), float("nan"))
        for name, (fwd, fwd_bwd) in times.items():
            table.append((tokens, name, fwd, fwd_bwd, floor, errors.get(name), times))
        if args.profile and device == "cuda":
            from kernel_profile import print_kernel_times

            x = torch.randn(1, tokens, hidden, device=device, dtype=DTYPE, requires_grad=True)
            print_kernel_times(f"ours fwd+bwd T={tokens}",
                               lambda: torch.autograd.grad(swapped(x), [x, *swapped.parameters()], torch.ones_like(x)))
        if args.sweep and device == "cuda":
            sweep(block, tokens, device)

    print(f"\n### Fused MoE, Qwen3-30B-A3B experts (H {hidden}, I {intermediate}, E {n_experts}, top-{top_k}), bf16\n")
    print("| tokens | implementation | max rel err | fwd ms | fwd+bwd ms | fwd+bwd vs eager loop | vs grouped_mm | "
          "fwd+bwd / floor |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for tokens, name, fwd, fwd_bwd, floor, err, times in table:
        loop = times.get("transformers eager loop", (None, None))[1]
        grouped = times.get("transformers grouped_mm", (None, None))[1]
        print(f"| {tokens} | {name} | {'-' if err is None else f'{err:.1e}'} | {fwd:.3f} | {fwd_bwd:.3f} | "
              f"{f'{loop / fwd_bwd:.2f}×' if loop else '-'} | {f'{grouped / fwd_bwd:.2f}×' if grouped else '-'} | "
              f"{fwd_bwd / floor[1]:.2f} |")
    if rate:
        print(f"\nfloor: {floor[0]:.3f} ms forward, {floor[1]:.3f} ms fwd+bwd at the last T "
              f"({rate / 1e12:.0f} TFLOP/s); goal: rltrain fwd+bwd ≥ 3× transformers'")


if __name__ == "__main__":
    main()
