"""Benchmark: linear_kl_div vs fla's fused_kl_div_loss vs torch (materialised logits, F.kl_div on log_softmax).

    PYTHONPATH=kernels:/tmp/site python kernels/benchmarks/bench_kl_div.py          # N = 8192 and 32768 tokens,
                                                                                 # H = 2048 student, 4096 teacher,
                                                                                 # V = 151936, bf16
    PYTHONPATH=kernels python kernels/benchmarks/bench_kl_div.py --quick          # small shapes, a smoke run
    PYTHONPATH=kernels python kernels/benchmarks/bench_kl_div.py --token-chunks auto,1024,1280   # ours' chunks
    PYTHONPATH=kernels python kernels/benchmarks/bench_kl_div.py --profile        # ours' per-kernel times

Run from the repo root on a CUDA machine (~1.5 min on an H100). fla (carry fla-core==0.6.0 +
flash-linear-attention==0.6.0 and einops) is optional: its rows are skipped when it does not import. Every method
computes the same loss: forward KL(teacher ‖ student), "batchmean" (sum over tokens / N), temperature 1, no ignored
tokens (fla has no mask); the teacher is frozen. Inputs are fresh random tensors (never zeros): student and teacher
logits of std ≈ 2 from independent heads.

Each method is first checked against an fp32 reference (naive.py on fp32 copies of the inputs, in row chunks so it
fits at N = 32768): relative error of the loss, grad_hidden and grad_weight. Then per method: forward+backward
median time (CUDA events, after warm-up; queued behind GPU work as inside a training step, and from an idle GPU:
timing.py), the extra peak memory beyond the inputs (it includes grad_hidden and grad_weight, which every method
returns) and the part beyond those gradients, and the ratio of the queued time to the floor: the bare cuBLAS GEMMs
the op needs, timed in the same run — 4 for the student's forward+backward (logits, logits again, grad_hidden,
grad_weight) + 1 for the teacher's logits. Ours runs 3 + 1 of them (its gradients come from the forward); that
measured set is printed too, and both computed floors (2·N·V·(4·H + H_t) flops at the 8192³ GEMM's burst and
sustained rates, gemm_floor.gemm_rates). Goal: ≤ 1.3× the 5-GEMM floor, faster than fla, extra peak ≤ 1 GiB beyond
the gradients. A markdown table is printed last.
"""

from __future__ import annotations

import argparse
import gc
import math

import torch
import torch.nn.functional as F

from rltrain_kernels.ops.kl_div import KLDivChunkConfig, linear_kl_div, naive_linear_kl_div
from timing import median_ms

GiB = 2**30


def make_inputs(n, h, h_teacher, v, device="cuda", dtype=torch.bfloat16):
    hidden = torch.randn(n, h, device=device, dtype=dtype).requires_grad_()
    weight = (torch.randn(v, h, device=device) * (2.0 / math.sqrt(h))).to(dtype).requires_grad_()
    teacher_hidden = torch.randn(n, h_teacher, device=device, dtype=dtype)
    teacher_weight = (torch.randn(v, h_teacher, device=device) * (2.0 / math.sqrt(h_teacher))).to(dtype)
    return dict(hidden=hidden, weight=weight, teacher_hidden=teacher_hidden, teacher_weight=teacher_weight)


# ---------------------------------------------------------------------------------------------------- methods
def torch_naive(hidden, weight, teacher_hidden, teacher_weight):
    """What a plain PyTorch distillation step does: bf16 GEMMs, fp32 log_softmax of both, F.kl_div."""
    with torch.no_grad():
        teacher_logp = torch.log_softmax((teacher_hidden @ teacher_weight.T).float(), dim=-1)
    student_logp = torch.log_softmax((hidden @ weight.T).float(), dim=-1)
    return F.kl_div(student_logp, teacher_logp, reduction="batchmean", log_target=True)


def ours(config=None):
    def run(hidden, weight, teacher_hidden, teacher_weight):
        return linear_kl_div(hidden, weight, teacher_hidden, teacher_weight, reduction="batchmean",
                             chunk_config=config)
    return run


def fla():
    try:
        from fla.modules.fused_kl_div import fused_kl_div_loss
    except Exception as err:   # noqa: BLE001  (any import failure: skip the peer)
        print(f"fla unavailable ({type(err).__name__}: {err}); skipping its rows")
        return None

    def run(hidden, weight, teacher_hidden, teacher_weight):
        return fused_kl_div_loss(hidden, teacher_hidden, weight, teacher_weight, reduction="batchmean")
    return run


def bare(recompute: bool):
    """The bare cuBLAS GEMMs (gemm_floor.py): the student's 3 (4 with recompute) + the teacher's logits."""
    from gemm_floor import bare_gemms

    student = bare_gemms(recompute=recompute)

    def run(hidden, weight, teacher_hidden, teacher_weight):
        with torch.no_grad():
            teacher_logits = teacher_hidden @ teacher_weight.t()
        del teacher_logits
        return student(hidden, weight).sum()
    return run


# ---------------------------------------------------------------------------------------------------- measuring
def reset_grads(inputs):
    inputs["hidden"].grad = inputs["weight"].grad = None


def fwd_bwd(fn, inputs):
    reset_grads(inputs)
    fn(**inputs).backward()


def reference(inputs, row_chunk=2048):
    """fp32 loss, grad_hidden, grad_weight of forward KL "batchmean" on fp32 copies, row chunk by row chunk."""
    n = inputs["hidden"].shape[0]
    weight = inputs["weight"].detach().float().requires_grad_()
    teacher_weight = inputs["teacher_weight"].float()
    loss, grad_hidden = 0.0, []
    for r0 in range(0, n, row_chunk):
        hidden = inputs["hidden"][r0:r0 + row_chunk].detach().float().requires_grad_()
        part = naive_linear_kl_div(hidden, weight, inputs["teacher_hidden"][r0:r0 + row_chunk].float(),
                                   teacher_weight, reduction="sum") / n
        part.backward()
        loss += part.item()
        grad_hidden.append(hidden.grad)
    return loss, torch.cat(grad_hidden), weight.grad


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check(name, fn, expected, inputs):
    """Max relative error vs the fp32 reference over (loss, grad_hidden, grad_weight); prints each."""
    reset_grads(inputs)
    loss = fn(**inputs)
    loss.backward()
    errs = (abs(loss.item() - expected[0]) / abs(expected[0]), rel(inputs["hidden"].grad, expected[1]),
            rel(inputs["weight"].grad, expected[2]))
    reset_grads(inputs)
    status = "ok" if max(errs) < 2e-2 else "MISMATCH"
    print(f"  check {name}: rel err vs fp32: loss {errs[0]:.2e}, grad_hidden {errs[1]:.2e}, grad_weight "
          f"{errs[2]:.2e} ({status})", flush=True)
    return max(errs)


def measure(fn, inputs, warmup, repeats):
    """(median ms queued behind GPU work, median ms from an idle GPU, extra peak bytes) of one forward+backward."""
    queued = median_ms(lambda: fwd_bwd(fn, inputs), warmup=warmup, iters=repeats, queued=True)
    idle = median_ms(lambda: fwd_bwd(fn, inputs), warmup=0, iters=repeats, queued=False)
    reset_grads(inputs)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd(fn, inputs)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    reset_grads(inputs)
    return queued, idle, peak


def free_memory():
    gc.collect()
    torch.cuda.empty_cache()


def run_case(n, h, h_teacher, v, methods, rates, warmup, repeats):
    print(f"\n== N={n} H={h} H_teacher={h_teacher} V={v} bf16 ==", flush=True)
    inputs = make_inputs(n, h, h_teacher, v)
    expected = reference(inputs)
    free_memory()
    flops = 2 * n * v * (4 * h + h_teacher)
    floors = tuple(flops / rate * 1e3 for rate in rates)
    grad_bytes = (inputs["hidden"].numel() + inputs["weight"].numel()) * 2
    rows = []
    for name, fn in methods:
        failure = None
        try:
            err = None if name.startswith("bare") else check(name, fn, expected, inputs)
            ms, idle_ms, peak = measure(fn, inputs, warmup, repeats)
        except torch.cuda.OutOfMemoryError:
            failure = "OOM"   # freed below, once the exception (and the frames it holds) is gone
        except Exception as error:   # noqa: BLE001  (a peer that fails to run: its row says so, the rest go on)
            failure = f"failed ({type(error).__name__}: {str(error)[:200]})"
        if failure:
            print(f"  {name}: {failure}", flush=True)
            reset_grads(inputs)
            free_memory()
            rows.append((name, failure, None, None, None))
            continue
        print(f"  {name}: {ms:.1f} ms (from idle {idle_ms:.1f}), extra peak {peak / GiB:.2f} GiB "
              f"({(peak - grad_bytes) / GiB:.2f} beyond the grads)", flush=True)
        rows.append((name, ms, idle_ms, peak, err))
        free_memory()
    floor_ms = next((ms for name, ms, *_ in rows if name.startswith("bare 5") and not isinstance(ms, str)), None)
    del inputs
    free_memory()
    return rows, floors, floor_ms, grad_bytes


def profile_ours(n, h, h_teacher, v, config):
    """Per-kernel time of one forward+backward of ours and of the 5 bare GEMMs, queued behind GPU work."""
    from kernel_profile import print_kernel_times

    inputs = make_inputs(n, h, h_teacher, v)
    print_kernel_times(f"ours N={n}", lambda: fwd_bwd(ours(config), inputs), top=12, queued=True, timeline=24)
    print_kernel_times(f"5 bare cuBLAS GEMMs N={n}", lambda: fwd_bwd(bare(True), inputs), queued=True)


def chunk_config(rows: str):
    """"auto": the default KLDivChunkConfig (rows from its workspace budget); else that many rows."""
    return None if rows == "auto" else KLDivChunkConfig(token_chunk=int(rows))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, fewer repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--token-chunks", default="auto",
                        help="comma-separated rows per chunk to time ours at ('auto' = the default config)")
    parser.add_argument("--profile", action="store_true", help="instead: ours' per-kernel times at N=8192")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    torch.manual_seed(0)
    repeats = args.repeats or (3 if args.quick else 5)
    warmup = 1 if args.quick else 2
    shapes = [(2048, 512, 1024, 32000), (4096, 512, 1024, 32000)] if args.quick else \
        [(8192, 2048, 4096, 151936), (32768, 2048, 4096, 151936)]
    chunks = [c.strip() for c in args.token_chunks.split(",") if c.strip()]
    if args.profile:
        return profile_ours(*shapes[0], chunk_config(chunks[0]))
    from gemm_floor import gemm_rates

    rates = gemm_rates(4096 if args.quick else 8192)
    print(f"{torch.cuda.get_device_name()}: bf16 GEMM {rates[0] / 1e12:.0f} TFLOP/s burst, {rates[1] / 1e12:.0f} "
          f"sustained; torch {torch.__version__}", flush=True)
    methods = [(f"ours (rows={c})", ours(chunk_config(c))) for c in chunks]
    fla_fn = fla()
    if fla_fn is not None:
        methods.append(("fla fused_kl_div_loss", fla_fn))
    methods += [("torch (logits materialised, F.kl_div)", torch_naive),
                ("bare 5 GEMMs: student 4 (with recompute) + teacher 1 (floor)", bare(True)),
                ("bare 4 GEMMs: student 3 + teacher 1 (what ours runs)", bare(False))]
    table = []
    for shape in shapes:
        table.append((shape, *run_case(*shape, methods, rates, warmup, repeats)))

    print("\n| N | method | fwd+bwd ms | × 5-GEMM floor (measured) | × computed floor, burst / sustained "
          "| from idle ms | extra peak GiB | beyond grads GiB | max rel err vs fp32 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (n, h, h_teacher, v), rows, floors, floor_ms, grad_bytes in table:
        for name, ms, idle_ms, peak, err in rows:
            if isinstance(ms, str):
                print(f"| {n} | {name} | {ms.split(' (')[0]} | | | | | | |")
                continue
            measured = f"{ms / floor_ms:.2f}" if floor_ms else "—"
            err_s = "—" if err is None else f"{err:.1e}"
            print(f"| {n} | {name} | {ms:.1f} | {measured} | {ms / floors[0]:.2f} / {ms / floors[1]:.2f} | "
                  f"{idle_ms:.1f} | {peak / GiB:.2f} | {(peak - grad_bytes) / GiB:.2f} | {err_s} |")
    print(f"\nH={shapes[0][1]} (student), {shapes[0][2]} (teacher), V={shapes[0][3]}, bf16, forward KL batchmean, "
          f"T=1; computed floors 2·N·V·(4H + H_t) flops at {rates[0] / 1e12:.0f} / {rates[1] / 1e12:.0f} TFLOP/s.")


if __name__ == "__main__":
    main()
