"""Compile the delta-rule chunk kernels for a GPU without one: registers, spills and shared memory per launch.

Runs one forward+backward of an op on CPU tensors at a benchmark shape with every Triton launch replaced by an
ahead-of-time compile for the target (default sm_90a, the H100/H200), then prints, per kernel, the launch grid and
settings, the registers per thread, the bytes spilled to local memory, the dynamic shared memory and the blocks one
SM can hold (by registers and by shared memory). No kernel runs: this answers "does it compile with the device's
Triton, and does it spill or starve occupancy" when no GPU is at hand. Use the device's Triton version:
    pip download --no-deps --only-binary=:all: --python-version 3.11 -d /tmp/tw triton==3.6.0
    pip install --no-deps --target /tmp/t36 /tmp/tw/triton-3.6.0-*.whl
    PYTHONPATH=/tmp/t36:kernels python kernels/benchmarks/compile_report.py [--op gated_delta_rule] [--B 8 --T 2048]
--op: gated_delta_rule | gated_delta_product | iplr_delta_rule | kda (Kimi Delta Attention, a decay per key channel).

--launch NAME=WARPS,STAGES and --value-block wide|narrow compile another setting, as the benches take them (the op's
`tuning` argument, ops/common/tuning.py). --asm DIR also writes each launch's Triton GPU IR, PTX and SASS there (NN_kernel[_config].ttgir / .ptx / .sass), to
read what a kernel does per loop iteration: which tiles go through registers, which layout conversions and waits.

--peer fla does the same for fla 0.6 (flash-linear-attention) on the same inputs, to set its kernels' resources
beside ours: chunk_gated_delta_rule, chunk_gated_delta_product and chunk_kda forward+backward, chunk_iplr_delta_rule
forward only (fla has no IPLR backward). fla believes it is on the target GPU (see fake_gpu_for_fla), and every launch of
an autotuned fla kernel compiles each of its configs, one row per config, the rows of one launch sharing its number:
    pip install --no-deps --target /tmp/flasite .whl/fla_core-0.6.0-*.whl .whl/flash_linear_attention-0.6.0-*.whl einops
    PYTHONPATH=/tmp/t36:/tmp/flasite:kernels python kernels/benchmarks/compile_report.py --peer fla [--op ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import re
import subprocess
import tempfile
import types

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.errors import CompileTimeAssertionFailure
from triton.runtime.autotuner import Autotuner
from triton.runtime.errors import OutOfResources, PTXASError
from triton.runtime.jit import JITFunction

REGISTERS_PER_SM = 65536
SHARED_PER_SM = 228 * 1024  # H100/H200: 228 KiB per SM, up to 227 KiB per block
SHARED_PER_BLOCK = 227 * 1024
# CUDA reserves 1 KiB of shared memory per resident block (cudaDevAttrReservedSharedMemoryPerBlock, sm_80 on):
# two blocks of 113.3 KiB do not fit one SM's 228 KiB.
SHARED_RESERVED_PER_BLOCK = 1024


@dataclasses.dataclass
class Launch:
    """One compiled launch; the configs an autotuned launch compiles share its `number` and count in `config`."""

    number: int
    name: str
    grid: tuple
    tiles: dict  # the launch's block-size constexprs (BT, BK, BV, ...)
    kernel: object  # the CompiledKernel, or the compile error's text
    config: str = ""


class AheadOfTimeDriver:
    """Just enough of a Triton driver for JITFunction to bind arguments and compile for `target`, and for fla to read
    the device properties it plans with."""

    def __init__(self, target: GPUTarget, sms: int):
        self.target = target
        self.utils = types.SimpleNamespace(
            get_device_properties=lambda device=0: {"multiprocessor_count": sms, "max_shared_mem": SHARED_PER_BLOCK})

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def cuobjdump(cubin: bytes, flag: str) -> str:
    """The output of the cuobjdump Triton ships, run with `flag` on `cubin`."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG, STACK, LOCAL, SHARED (static) of the one function in `cubin`."""
    text = cuobjdump(cubin, "--dump-resource-usage")
    return {key: int(val) for key, val in re.findall(r"(REG|STACK|LOCAL|SHARED):(\d+)", text.split("Function")[-1])}


def record_launches(target: GPUTarget, sms: int) -> list[Launch]:
    """Make every JITFunction launch compile for `target` instead of running; returns the (growing) record list."""
    triton.runtime.driver.set_active(AheadOfTimeDriver(target, sms))
    launches = []

    def run(self, *args, grid, warmup, **kwargs):
        kernel = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        meta = {**dict(zip(self.arg_names, args)), **kwargs}
        tiles = {key: val for key, val in meta.items() if re.fullmatch(r"B[A-Z]", key) and isinstance(val, int)}
        number = launches[-1].number + 1 if launches else 1
        launches.append(Launch(number, self.fn.__name__, tuple(grid(meta) if callable(grid) else grid), tiles,
                               kernel))
        return kernel

    real_run = JITFunction.run
    JITFunction.run = run
    return launches


def compile_every_config(launches: list[Launch]) -> None:
    """Make an autotuned launch compile each config it would benchmark (after its pruning) instead of timing them:
    one Launch per config, all with the number of the first; a config that fails to compile (as the autotuner would
    skip it) is recorded with its error."""

    def run(self, *args, **kwargs):
        self.nargs = dict(zip(self.arg_names, args))
        configs = self.prune_configs(kwargs) if len(self.configs) > 1 else self.configs
        first, kernel = len(launches), None
        for config in configs:
            try:
                kernel = self.fn.run(*args, **kwargs, **config.all_kwargs())
            except (OutOfResources, CompileTimeAssertionFailure, PTXASError) as error:
                name = getattr(self.base_fn, "__name__", "?")
                launches.append(Launch(0, name, (), dict(config.kwargs), f"{type(error).__name__}: {error}"))
        for i, launch in enumerate(launches[first:]):
            launch.number = launches[first - 1].number + 1 if first else 1
            launch.config = f"{i + 1}/{len(configs)}"
        self.nargs = None
        return kernel

    Autotuner.run = run


def fake_gpu_for_fla(arch: int) -> None:
    """Stubs so fla plans as on the target GPU; call it after record_launches has set the driver. fla.utils.hardware
    reads the device at import time, from the driver and torch.cuda, and fla fixes its autotune config lists from it
    (e.g. NUM_WARPS = [2, 4] if IS_NVIDIA_HOPPER else [2, 4, 8])."""
    # IS_NVIDIA_HOPPER tests the device name and the capability; IS_NVIDIA_SM100/BLACKWELL, IS_TF32_SUPPORTED and
    # IS_TMA_SUPPORTED the capability; fla.utils.get_device_capability calls it at call time.
    torch.cuda.get_device_name = lambda device=None: "NVIDIA H100 80GB HBM3" if arch == 90 else f"sm_{arch}"
    torch.cuda.get_device_capability = lambda device=None: divmod(arch, 10)
    # get_all_max_shared_mem -> check_shared_mem('hopper') (the BK/BV lists, chunk_bwd_dqkwg's 128 tiling) asks the
    # driver, AheadOfTimeDriver.utils, for max_shared_mem of each of device_count() devices.
    torch.cuda.device_count = lambda: 1
    import fla.utils.hardware as hardware

    # The launchers ask check_shared_mem(arch, k.device.index), None for CPU tensors: without an entry for None it
    # answers False and chunk_bwd_dqkwg / chunk_bwd_dv_local / chunk_fwd_o would fall back from 128- to 32-wide tiles.
    hardware.get_all_max_shared_mem = lambda: {0: SHARED_PER_BLOCK, None: SHARED_PER_BLOCK}
    # The TileLang and FlashQLA backends fla would dispatch to on Hopper, pinned off: the report is of fla's Triton
    # kernels.
    os.environ["FLA_TILELANG"] = os.environ["FLA_FLASH_QLA"] = "0"


def fla_notes() -> list[str]:
    """Bypass fla's refusal of its gated backward on Hopper with Triton 3.4-3.7.0 (fla issue #640: wrong gradients;
    the kernels it compiles are the same), as bench_gated_delta_rule.py does; returns what the output should say."""
    import fla
    import fla.ops.common.chunk_o as chunk_o
    import fla.utils

    chunk_o.IS_NVIDIA_HOPPER = False  # read only by chunk_bwd_dqkwg's #640 guard; the config lists were fixed at import
    return [f"fla {fla.__version__}, seen as Hopper: {fla.utils.IS_NVIDIA_HOPPER}, TMA: {fla.utils.IS_TMA_SUPPORTED} "
            f"(FLA_USE_TMA), backends: Triton only (FLA_TILELANG=0, FLA_FLASH_QLA=0)",
            "fla.ops.common.chunk_o.IS_NVIDIA_HOPPER = False: its #640 guard on the gated backward bypassed",
            "each autotuned launch compiles every config it would benchmark: rows with one # are one launch"]


def make_inputs(op: str, B: int, T: int, H: int, D: int, dtype: torch.dtype, num_householder: int) -> dict:
    """CPU inputs in fla's conventions: k L2-normalised, g = logsigmoid (per key channel for kda), beta = sigmoid, an
    fp32 initial state."""
    n = num_householder if op == "gated_delta_product" else 1
    beta = torch.rand(B, T * n, H).sigmoid().to(dtype)
    gate_shape = (B, T, H, D) if op == "kda" else (B, T, H)
    inputs = dict(
        q=torch.randn(B, T, H, D, dtype=dtype),
        k=torch.nn.functional.normalize(torch.randn(B, T * n, H, D), dim=-1).to(dtype),
        v=torch.randn(B, T * n, H, D, dtype=dtype),
        g=torch.nn.functional.logsigmoid(torch.randn(gate_shape)).to(dtype), beta=beta,
        initial_state=torch.randn(B, H, D, D))
    if op == "iplr_delta_rule":
        a = torch.nn.functional.normalize(torch.randn(B, T, H, D), dim=-1).to(dtype)
        inputs.update(a=a, b=(-a.float() * beta.float()[..., None]).to(dtype))
        del inputs["g"], inputs["beta"]
    return {name: x.requires_grad_() for name, x in inputs.items()}


def op_function(op: str, peer: str | None):
    """The chunked `op` of rltrain_kernels, or of fla when `peer` is "fla"."""
    if peer == "fla":
        from fla.ops.gated_delta_product import chunk_gated_delta_product
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.generalized_delta_rule import chunk_iplr_delta_rule
        from fla.ops.kda import chunk_kda
    else:
        from rltrain_kernels.ops.gated_delta_product import chunk_gated_delta_product
        from rltrain_kernels.ops.gated_delta_rule import chunk_gated_delta_rule
        from rltrain_kernels.ops.iplr_delta_rule import chunk_iplr_delta_rule
        from rltrain_kernels.ops.kda import chunk_kda
    return {"gated_delta_rule": chunk_gated_delta_rule, "gated_delta_product": chunk_gated_delta_product,
            "iplr_delta_rule": chunk_iplr_delta_rule, "kda": chunk_kda}[op]


def run_op(op: str, peer: str | None, inputs: dict, num_householder: int, tuning) -> None:
    """One forward+backward of `op` (forward only for fla's IPLR, which has no backward); ours at `tuning`."""
    extra = {"num_householder": num_householder} if op == "gated_delta_product" else {}
    if peer is None:
        extra["tuning"] = tuning
    o, ht = op_function(op, peer)(**inputs, **extra, output_final_state=True)
    if not (peer == "fla" and op == "iplr_delta_rule"):
        (o.float().sum() + ht.sum()).backward()


def usage(kernel) -> dict:
    """warps, stages, regs (per thread), spilled (bytes per thread), shared (bytes) and blocks/SM by regs and by
    shared memory (each block's 1 KiB reservation counted; 0 when over the per-block limit, which the device would
    refuse) of a compiled kernel."""
    use = resource_usage(kernel.asm["cubin"])
    warps = kernel.metadata.num_warps
    shared = kernel.metadata.shared + use.get("SHARED", 0)
    return dict(warps=warps, stages=kernel.metadata.num_stages, regs=use["REG"],
                spilled=use.get("LOCAL", 0) + use.get("STACK", 0), shared=shared,
                by_regs=REGISTERS_PER_SM // max(1, use["REG"] * 32 * warps),
                by_shared=(SHARED_PER_SM // (shared + SHARED_RESERVED_PER_BLOCK) if shared <= SHARED_PER_BLOCK else 0)
                if shared else "-")


def usage_cells(use: dict) -> list:
    """The table cells from warps to blocks/SM."""
    over = " (over 227 KiB)" if use["by_shared"] == 0 else ""
    return [use["warps"], use["stages"], use["regs"], use["spilled"], f"{use['shared'] / 1024:.1f}",
            f"{use['by_regs']}, {use['by_shared']}{over}"]


def print_table(launches: list[Launch], uses: list, peer: str | None) -> None:
    """Our table as it always was; a peer's with the launch number, its config and block sizes in front."""
    head = ["kernel", "grid", "warps", "stages", "regs/thread", "spilled bytes", "shared KiB",
            "blocks/SM (regs, shared)"]
    align = ["---"] * 2 + ["---:"] * 5 + ["---"]
    if peer:
        head = ["#", "config"] + head[:2] + ["BT, BK, BV..."] + head[2:]
        align = ["---:", "---"] + align[:2] + ["---"] + align[2:]
    print("| " + " | ".join(head) + " |\n| " + " | ".join(align) + " |")
    for launch, use in zip(launches, uses):
        cells = [launch.name, tuple(launch.grid)]
        if peer:
            tiles = ", ".join(f"{key}={val}" for key, val in launch.tiles.items())
            cells = [launch.number, launch.config or "-"] + cells + [tiles]
        cells += usage_cells(use) if use else [launch.kernel] + [""] * 5
        print("| " + " | ".join(str(cell) for cell in cells) + " |")


def print_ranges(launches: list[Launch], uses: list) -> None:
    """Per launch, the range over the configs its autotuner chooses from."""
    print("\n| # | kernel | configs | regs/thread | spilled bytes | blocks/SM by regs | spill-free configs |")
    print("| ---: | --- | ---: | --- | --- | --- | --- |")
    for number, group in itertools.groupby(zip(launches, uses), key=lambda pair: pair[0].number):
        group = list(group)
        compiled = [(launch, use) for launch, use in group if use]
        spread = {key: sorted({use[key] for _, use in compiled}) for key in ("regs", "spilled", "by_regs")}
        span = {key: f"{vals[0]}–{vals[-1]}" if len(vals) > 1 else str(vals[0]) if vals else "-"
                for key, vals in spread.items()}
        clean = [launch.config.split("/")[0] or "1" for launch, use in compiled if not use["spilled"]]
        clean = "all" if len(clean) == len(group) else ", ".join(clean) or "none"
        print(f"| {number} | {group[0][0].name} | {len(group)} | {span['regs']} | {span['spilled']} | "
              f"{span['by_regs']} | {clean} |")


def write_asm(launches: list[Launch], folder: str) -> None:
    """Each compiled launch's TTGIR, PTX and SASS into `folder` as NN_kernel[_cK].{ttgir,ptx,sass}."""
    os.makedirs(folder, exist_ok=True)
    for launch in launches:
        if isinstance(launch.kernel, str):
            continue
        config = f"_c{launch.config.split('/')[0]}" if launch.config else ""
        base = os.path.join(folder, f"{launch.number:02d}_{launch.name}{config}")
        for key in ("ttgir", "ptx"):
            with open(f"{base}.{key}", "w") as f:
                f.write(launch.kernel.asm[key])
        with open(f"{base}.sass", "w") as f:
            f.write(cuobjdump(launch.kernel.asm["cubin"], "--dump-sass"))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", default="gated_delta_rule",
                        choices=["gated_delta_rule", "gated_delta_product", "iplr_delta_rule", "kda"])
    parser.add_argument("--peer", choices=["fla"], help="compile fla 0.6's kernels for the op instead of ours")
    parser.add_argument("--B", type=int, default=8)
    parser.add_argument("--T", type=int, default=2048)
    parser.add_argument("--H", type=int, default=16)
    parser.add_argument("--D", type=int, default=128, help="K = V")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--num-householder", type=int, default=2)
    parser.add_argument("--arch", type=int, default=90, help="compute capability × 10 (90: H100/H200)")
    parser.add_argument("--sms", type=int, default=132, help="SM count the host code plans for (H100/H200: 132)")
    parser.add_argument("--launch", nargs="*", default=[], metavar="NAME=WARPS,STAGES",
                        help="another setting of ops/common/launch.py entries, e.g. wy_bwd=8,2")
    parser.add_argument("--value-block", default="auto",
                        help="the state passes' value columns per program: wide (64), narrow (32), or auto (64 when "
                             "the programs fill --sms)")
    parser.add_argument("--asm", metavar="DIR", help="also write each launch's TTGIR, PTX and SASS into DIR")
    args = parser.parse_args()
    if args.peer and (args.launch or args.value_block != "auto"):
        parser.error("--launch and --value-block tune our kernels: not with --peer")
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("compile_report compiles for a GPU: unset TRITON_INTERPRET")
    return args


def our_tuning(args: argparse.Namespace):
    """--launch and --value-block as the op's Tuning, its occupancy rule planning for --sms SMs as on the GPU."""
    from delta_rule_bench_common import tuning_from_args

    return dataclasses.replace(tuning_from_args(args), sm_count=args.sms)


def main():
    args = parse_args()
    launches = record_launches(GPUTarget("cuda", args.arch, 128), args.sms)  # first: fla reads the driver
    notes, tuning = [], None
    if args.peer == "fla":
        fake_gpu_for_fla(args.arch)
        compile_every_config(launches)
        notes = fla_notes()
    else:
        tuning = our_tuning(args)
    inputs = make_inputs(args.op, args.B, args.T, args.H, args.D, getattr(torch, args.dtype), args.num_householder)
    run_op(args.op, args.peer, inputs, args.num_householder, tuning)

    passes = "forward only" if (args.peer, args.op) == ("fla", "iplr_delta_rule") else "one forward+backward"
    print(f"triton {triton.__version__}, sm_{args.arch}, {(args.peer + ' ') if args.peer else ''}{args.op} "
          f"{args.dtype} B{args.B} T{args.T} H{args.H} K=V={args.D}: {passes}, launches in order\n")
    for note in notes:
        print(f"- {note}")
    if notes:
        print()
    uses = [None if isinstance(launch.kernel, str) else usage(launch.kernel) for launch in launches]
    print_table(launches, uses, args.peer)
    if args.peer:
        print_ranges(launches, uses)
    if args.asm:
        write_asm(launches, args.asm)
        print(f"\nTTGIR, PTX and SASS per launch in {args.asm}")


if __name__ == "__main__":
    main()
