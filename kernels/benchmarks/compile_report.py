"""Compile the delta-rule chunk kernels for a GPU without one: registers, spills and shared memory per launch.

Runs one forward+backward of an op on CPU tensors at a benchmark shape with every Triton launch replaced by an
ahead-of-time compile for the target (default sm_90a, the H100/H200), then prints, per kernel, the launch grid and
settings, the registers per thread, the bytes spilled to local memory, the dynamic shared memory and the blocks one
SM can hold (by registers and by shared memory). No kernel runs: this answers "does it compile with the device's
Triton, and does it spill or starve occupancy" when no GPU is at hand. Use the device's Triton version:
    pip download --no-deps --only-binary=:all: --python-version 3.11 -d /tmp/tw triton==3.6.0
    pip install --no-deps --target /tmp/t36 /tmp/tw/triton-3.6.0-*.whl
    PYTHONPATH=/tmp/t36:kernels python kernels/benchmarks/compile_report.py [--op gated_delta_rule] [--B 8 --T 2048]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import JITFunction

REGISTERS_PER_SM = 65536
SHARED_PER_SM = 228 * 1024  # H100/H200: 228 KiB per SM, up to 227 KiB per block


class AheadOfTimeDriver:
    """Just enough of a Triton driver for JITFunction to bind arguments and compile for `target`."""

    def __init__(self, target: GPUTarget):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG, STACK, LOCAL, SHARED (static) of the one function in `cubin`, read with the cuobjdump Triton ships."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    return {key: int(val) for key, val in re.findall(r"(REG|STACK|LOCAL|SHARED):(\d+)", text.split("Function")[-1])}


def record_launches(target: GPUTarget) -> list:
    """Make every JITFunction launch compile for `target` instead of running; returns the (growing) record list."""
    triton.runtime.driver.set_active(AheadOfTimeDriver(target))
    launches = []

    def run(self, *args, grid, warmup, **kwargs):
        kernel = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        launches.append((self.fn.__name__, grid, kwargs.get("num_warps"), kwargs.get("num_stages"), kernel))
        return kernel

    real_run = JITFunction.run
    JITFunction.run = run
    return launches


def run_op(op: str, B: int, T: int, H: int, D: int, dtype: torch.dtype, num_householder: int) -> None:
    """One forward+backward of `op` on CPU tensors (fla's input conventions)."""
    n = num_householder if op == "gated_delta_product" else 1
    q = torch.randn(B, T, H, D, dtype=dtype, requires_grad=True)
    k = torch.nn.functional.normalize(torch.randn(B, T * n, H, D), dim=-1).to(dtype).requires_grad_()
    v = torch.randn(B, T * n, H, D, dtype=dtype, requires_grad=True)
    beta = torch.rand(B, T * n, H).sigmoid().to(dtype).requires_grad_()
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H)).to(dtype).requires_grad_()
    h0 = torch.randn(B, H, D, D, requires_grad=True)
    if op == "gated_delta_rule":
        from rltrain_kernels.ops.gated_delta_rule import chunk_gated_delta_rule

        o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    elif op == "gated_delta_product":
        from rltrain_kernels.ops.gated_delta_product import chunk_gated_delta_product

        o, ht = chunk_gated_delta_product(q, k, v, g, beta, num_householder, initial_state=h0,
                                          output_final_state=True)
    else:
        from rltrain_kernels.ops.iplr_delta_rule import chunk_iplr_delta_rule

        a = torch.nn.functional.normalize(torch.randn(B, T, H, D), dim=-1).to(dtype).requires_grad_()
        b = (-a.detach().float() * beta.detach().float()[..., None]).to(dtype).requires_grad_()
        o, ht = chunk_iplr_delta_rule(q, k, v, a, b, initial_state=h0, output_final_state=True)
    (o.float().sum() + ht.sum()).backward()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", default="gated_delta_rule",
                        choices=["gated_delta_rule", "gated_delta_product", "iplr_delta_rule"])
    parser.add_argument("--B", type=int, default=8)
    parser.add_argument("--T", type=int, default=2048)
    parser.add_argument("--H", type=int, default=16)
    parser.add_argument("--D", type=int, default=128, help="K = V")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--num-householder", type=int, default=2)
    parser.add_argument("--arch", type=int, default=90, help="compute capability × 10 (90: H100/H200)")
    parser.add_argument("--sms", type=int, default=132, help="SM count the host code plans for (H100/H200: 132)")
    parser.add_argument("--launch", nargs="*", default=[], metavar="NAME=WARPS,STAGES",
                        help="override ops/common/launch.py entries, e.g. wy_bwd=8,2")
    parser.add_argument("--transpose-via-scratch", action="store_true",
                        help="compile with ops/common/scratch.py's TRANSPOSE_VIA_SCRATCH on")
    parser.add_argument("--u-from-t", action="store_true", help="compile with ops/common/state_pass.py's U_FROM_T on")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("compile_report compiles for a GPU: unset TRITON_INTERPRET")

    from delta_rule_bench_common import apply_launch_overrides
    from rltrain_kernels.ops.common import scratch, state_pass

    state_pass._sm_count = lambda device: args.sms  # the host code's occupancy rule, as on the GPU
    scratch.TRANSPOSE_VIA_SCRATCH = args.transpose_via_scratch or scratch.TRANSPOSE_VIA_SCRATCH
    state_pass.U_FROM_T = args.u_from_t or state_pass.U_FROM_T
    apply_launch_overrides(args.launch)
    launches = record_launches(GPUTarget("cuda", args.arch, 128))
    run_op(args.op, args.B, args.T, args.H, args.D, getattr(torch, args.dtype), args.num_householder)

    print(f"triton {triton.__version__}, sm_{args.arch}, {args.op} {args.dtype} B{args.B} T{args.T} H{args.H} "
          f"K=V={args.D}: one forward+backward, launches in order\n")
    print("| kernel | grid | warps | stages | regs/thread | spilled bytes | shared KiB | blocks/SM (regs, shared) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for name, grid, warps, stages, kernel in launches:
        use = resource_usage(kernel.asm["cubin"])
        warps = kernel.metadata.num_warps
        shared = kernel.metadata.shared + use.get("SHARED", 0)
        by_regs = REGISTERS_PER_SM // max(1, use["REG"] * 32 * warps)
        by_shared = SHARED_PER_SM // shared if shared else "-"
        spilled = use.get("LOCAL", 0) + use.get("STACK", 0)
        print(f"| {name} | {tuple(grid)} | {warps} | {kernel.metadata.num_stages} | {use['REG']} | {spilled} | "
              f"{shared / 1024:.1f} | {by_regs}, {by_shared} |")


if __name__ == "__main__":
    main()
