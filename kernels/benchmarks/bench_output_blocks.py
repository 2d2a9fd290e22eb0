"""Tile sweep of the chunk output passes (gated delta rule: gated_delta_rule/chunk_fwd.py, IPLR:
iplr_delta_rule/chunk_fwd.py): each (BK, BV) × warps × stages run alone on the same stored intermediates, checked
against a float64 evaluation of the pass's formula, then timed; each setting reaches the launcher as its `tuning`
argument (ops/common/tuning.py: output_blocks and the launch entry's warps and stages). Prints rows as it goes (a
setting Triton miscompiles into a fault ends the process, not the rows before it) and a markdown table last; paste
the winner into the op's OUTPUT_BLOCKS and ops/common/launch.py.

    python kernels/benchmarks/bench_output_blocks.py [--op gated_delta_rule|iplr_delta_rule] [--B 8 --T 2048]
        [--blocks 64,64 128,128 ...] [--warps 2 4 8] [--stages 1 2 3]

The intermediates are synthetic but shaped as a real forward stores them (bf16 H16 K=V=128: q, k, b l2-normalised,
chunk-start states h and the corrected values in bf16, G a chunk-local cumsum of log-sigmoid gates).
"""

from __future__ import annotations

import argparse
import importlib
import itertools

import torch
import torch.nn.functional as F
from delta_rule_bench_common import parse_blocks, rel
from triton.testing import do_bench

from rltrain_kernels.ops.common.chunking import chunk_layout
from rltrain_kernels.ops.common.launch import LAUNCH
from rltrain_kernels.ops.common.precision import iplr_dot_precision, op_dot_precision
from rltrain_kernels.ops.common.tuning import Tuning

OPS = {  # op: (module holding OUTPUT_BLOCKS and the launcher, launcher name, LAUNCH entry)
    "gated_delta_rule": ("rltrain_kernels.ops.gated_delta_rule.chunk_fwd", "chunk_output_fwd", "output_fwd"),
    "iplr_delta_rule": ("rltrain_kernels.ops.iplr_delta_rule.chunk_fwd", "iplr_output_fwd", "iplr_output_fwd"),
}


def make_case(op: str, B: int, T: int, H: int, D: int, BT: int = 64, device="cuda"):
    """(the launcher's arguments, its keyword arguments (the op's default dot precision), float64 reference output
    [B·T, H, D]) for B sequences of T tokens (T a multiple of BT)."""
    layout = chunk_layout(B, T, None, BT, device)
    TT, NT = B * T, T // BT
    bf = dict(device=device, dtype=torch.bfloat16)
    q = torch.randn(TT, H, D, **bf)
    k = F.normalize(torch.randn(TT, H, D, device=device), dim=-1).to(torch.bfloat16)
    h = (0.3 * torch.randn(layout.num_chunks, H, D, D, device=device)).to(torch.bfloat16)
    vals = torch.randn(TT, H, D, **bf)  # δ for the gated delta rule, X for IPLR
    scale = D ** -0.5
    # chunk views in float64: [B, NT, BT, H, D]; states [B, NT, H, D, D]
    c = lambda t: t.double().view(B, NT, BT, H, D)  # noqa: E731
    causal = torch.ones(BT, BT, device=device, dtype=torch.bool).tril()
    qc, kc, hc = c(q), c(k), h.double().view(B, NT, H, D, D)
    inter = torch.einsum("bntha,bnhav->bnthv", qc, hc)
    if op == "gated_delta_rule":
        g = F.logsigmoid(torch.randn(B, NT, BT, H, device=device)).cumsum(2)
        G = g.reshape(TT, H).contiguous()
        gd = g.double()
        decay = torch.exp(gd[:, :, :, None, :] - gd[:, :, None, :, :]).permute(0, 1, 4, 2, 3)  # [B, NT, H, i, j]
        P = torch.einsum("bniha,bnjha->bnhij", qc, kc) * decay * causal
        ref = torch.exp(gd)[..., None] * inter + torch.einsum("bnhij,bnjhv->bnihv", P, c(vals))
        return ((q, k, vals, h, G, scale, layout, torch.bfloat16),
                dict(dot_prec=op_dot_precision(torch.bfloat16, "auto")), (scale * ref).reshape(TT, H, D))
    b = F.normalize(torch.randn(TT, H, D, device=device), dim=-1).to(torch.bfloat16)
    v = torch.randn(TT, H, D, **bf)
    Pb = torch.einsum("bniha,bnjha->bnhij", qc, c(b)) * causal
    Pk = torch.einsum("bniha,bnjha->bnhij", qc, kc) * causal
    ref = inter + torch.einsum("bnhij,bnjhv->bnihv", Pb, c(vals)) + torch.einsum("bnhij,bnjhv->bnihv", Pk, c(v))
    return ((q, k, v, b, vals, h, scale, layout, torch.bfloat16), dict(dot_prec=iplr_dot_precision(torch.bfloat16)),
            (scale * ref).reshape(TT, H, D))


def sweep(op: str, B: int, T: int, blocks: list[tuple[int, int]], warps: list[int], stages: list[int]) -> list:
    module_name, launcher_name, entry = OPS[op]
    module = importlib.import_module(module_name)
    launcher = getattr(module, launcher_name)
    args, kwargs, ref = make_case(op, B, T, 16, 128)
    shipped = (tuple(module.OUTPUT_BLOCKS), LAUNCH[entry]["num_warps"], LAUNCH[entry]["num_stages"])
    rows = []
    for (bk, bv), w, s in itertools.product(blocks, warps, stages):
        tuning = Tuning(launches={entry: (w, s)}, output_blocks=(bk, bv))
        try:
            err = rel(launcher(*args, **kwargs, tuning=tuning), ref)
            ms = (do_bench(lambda: launcher(*args, **kwargs, tuning=tuning), warmup=25, rep=200) if err < 5e-3
                  else float("nan"))
            note = "" if err < 5e-3 else "over the 5e-3 bar"
        except Exception as exc:  # out of shared memory and the like: the row says so, the sweep goes on
            err, ms, note = float("nan"), float("nan"), f"{type(exc).__name__}: {str(exc)[:60]}"
        mark = " (shipped)" if ((bk, bv), w, s) == shipped else ""
        rows.append((f"{bk}×{bv}", w, s, err, ms, note + mark))
        print(f"  {op} {bk}x{bv} {w}w/{s}s err {err:.1e} {ms:.4f} ms {note}{mark}", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", choices=sorted(OPS), nargs="+", default=sorted(OPS))
    parser.add_argument("--B", type=int, default=8)
    parser.add_argument("--T", type=int, default=2048)
    parser.add_argument("--blocks", nargs="+", default=["64,64", "128,64", "64,128", "128,128"], metavar="BK,BV")
    parser.add_argument("--warps", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--stages", nargs="+", type=int, default=[1, 2, 3])
    args = parser.parse_args()
    blocks = [parse_blocks(spec, "--blocks") for spec in args.blocks]
    if args.T % 64:
        raise SystemExit(f"--T {args.T}: must be a multiple of the chunk size 64")
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}, bf16 B{args.B} T{args.T} H16 K=V=128")
    for op in args.op:
        rows = sweep(op, args.B, args.T, blocks, args.warps, args.stages)
        print(f"\n{op} output pass, B{args.B} T{args.T}:\n")
        print("| BK×BV | warps | stages | rel err vs float64 | ms | note |")
        print("| --- | ---: | ---: | ---: | ---: | --- |")
        for blk, w, s, err, ms, note in sorted(rows, key=lambda r: (r[4] != r[4], r[4])):
            print(f"| {blk} | {w} | {s} | {err:.1e} | {ms:.4f} | {note} |")


if __name__ == "__main__":
    main()
