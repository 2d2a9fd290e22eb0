"""The actor step of a large policy under each parallel layout of one host's GPUs: FSDP2 alone, Ulysses sequence
parallelism (actor.ulysses_sequence_parallel_size) and expert parallelism (actor.expert_parallel_size), with the
trainer's own FSDPActorWorker in plain processes (torch.multiprocessing, NCCL; each process sees only its GPU, as
under Ray), models built from config:
    qwen3-8b        Qwen3-8B: 36 layers, hidden 4096, MLP 12288, 32 query / 8 key-value heads of 128, untied
    qwen3-30b-a3b   Qwen3-30B-A3B: hidden 2048, 128 experts of 768 (top 8), 32 / 4 heads of 128, 48 layers (reduce
                    them with --layers: every layer has the same shape)
A layout is GPUS[:spN|:epN]: `4` FSDP2 over 4 GPUs, `4:sp4` the same with each packed row split over 4 ranks,
`4:ep2` experts split 2 ways (2 replicas of each half). Every layout trains the same batch per length: --responses
responses after --prompt-len-token prompts, each response exactly L tokens (`--lengths 16384,32768`) or `tail` (log-
normal, mean --mean-len, capped at --max-len: bench_actor_step.py's batch). The step is the actor's work of an RL step:
old log-probs (no grad) then one update (forward, backward, AdamW), bf16 compute with fp32 master weights and optimizer
state (actor.mixed_precision, the default), packed micro-batches of the per-rank token budget (--max-tokens; default
the longest row's share of a rank, at least 16384), the registry's kernels, gradient checkpointing with
--checkpointing. Timed: one step per length, after a warm-up step on the first length's batch (compiles, the
allocator's pools).
Reported per layout and length: tokens/s (prompt + response tokens once, over both passes), tokens/s per GPU, MFU
(model flops: 8·N_active·tokens + causal attention over four passes, recomputation not counted, against the bf16 GEMM
rate of an 8192³ matmul measured in the same run, sustained), scaling efficiency (tokens/s per GPU against the layout
with the fewest GPUs of that length), peak memory allocated and reserved on the fullest GPU, and the old log-probs'
relative error against the fewest-GPU layout's (bf16: ~1e-3 expected; a broken layout shows ~1). A layout that runs
out of memory or hangs (a rank that died leaves its peers in a collective) is reported as such after --timeout-s.
    python benchmarks/bench_parallel_layouts.py --shape qwen3-8b --layouts 2,4,4:sp2,4:sp4 --lengths 16384,32768 \
        --responses 4 --checkpointing                                 # long responses (4 GPUs)
    python benchmarks/bench_parallel_layouts.py --shape qwen3-30b-a3b --layers 8 --layouts 1,4,4:ep2,4:ep4 \
        --lengths tail --responses 64                                 # MoE with and without expert parallelism
    python benchmarks/bench_parallel_layouts.py --tiny --device cpu  # a CPU dry run over gloo
Needs rltrain and rltrain-kernels installed (README.md beside this file).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp
from bench_actor_step import gemm_rates
from bench_actor_step import make_batch as tail_batch
from bench_multi_gpu import free_port
from checkpoints import VOCAB

AUTO = {"name": "auto", "include_kernels": "auto"}
COMMON = dict(max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=False, vocab_size=VOCAB)
SHAPES = {
    "qwen3-8b": ("Qwen3Config", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, **COMMON)),
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                             num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                                             num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                             head_dim=128, **COMMON)),
}
TINY = {   # CPU dry runs: --tiny picks the dense or the MoE one by --shape
    "qwen3-8b": ("Qwen3Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, **COMMON)),
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                             num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             head_dim=16, **COMMON)),
}


def model_config(args):
    import transformers as tf

    kind, shape = (TINY if args.tiny else SHAPES)[args.shape]
    shape = dict(shape, vocab_size=1024 if args.tiny else VOCAB)
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    return getattr(tf, kind)(eos_token_id=shape["vocab_size"] - 1, pad_token_id=shape["vocab_size"] - 1,
                             bos_token_id=None, **shape)


def build_model_dir(config, device: str, root: str) -> str:
    """Random bf16 weights (seed 0), initialised on `device` (an 8B model's init on the CPU takes minutes)."""
    import transformers as tf

    torch.manual_seed(0)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    path = f"{root}/model"
    model.save_pretrained(path)
    return path


def active_params(config) -> tuple[int, int]:
    """(all parameters, those a token uses: an MoE layer's routed experts count top-k of n)."""
    import transformers as tf

    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    n, k = getattr(config, "num_experts", 0), getattr(config, "num_experts_per_tok", 0)
    return total, total - experts + (experts * k // n if n else 0)


def make_batch(args, length: str, vocab: int):
    """bench_actor_step.py's long-tailed batch (`tail`), or every response exactly `length` tokens; ids < vocab."""
    from tensordict import TensorDict

    if length == "tail":
        batch = tail_batch(args.responses, args.prompt_len, args.mean_len, args.max_len)
    else:
        g = torch.Generator().manual_seed(0)
        rows, width = args.responses, int(length)
        batch = TensorDict({
            "prompt_ids": torch.randint(100, VOCAB - 100, (rows, args.prompt_len), generator=g),
            "prompt_mask": torch.ones(rows, args.prompt_len, dtype=torch.long),
            "response_ids": torch.randint(100, VOCAB - 100, (rows, width), generator=g),
            "response_mask": torch.ones(rows, width, dtype=torch.long),
            "advantages": torch.randn(rows, generator=g)[:, None].expand(-1, width).clone(),
            "group_ids": torch.arange(rows) // 16,
        }, batch_size=[rows])
    for key in ("prompt_ids", "response_ids"):
        batch[key] = batch[key] % (vocab - 2)
    return batch


def model_flops(config, batch, n_active: int) -> float:
    """8·N_active per token (old log-probs 2N, update 6N) plus causal attention, over four passes."""
    lengths = (batch["prompt_mask"].sum(1) + batch["response_mask"].sum(1)).double()
    attention = 4 * (4 * lengths ** 2 / 2 * config.num_attention_heads * config.head_dim).sum().item()
    return 8 * n_active * float(lengths.sum()) + attention * config.num_hidden_layers


def parse_layout(text: str) -> tuple[int, int, int]:
    """'4' -> (4, 1, 1); '4:sp2' -> (4, 2, 1); '4:ep4' -> (4, 1, 4)."""
    gpus, _, rest = text.partition(":")
    sp = int(rest[2:]) if rest.startswith("sp") else 1
    ep = int(rest[2:]) if rest.startswith("ep") else 1
    if not gpus.isdigit() or (rest and not rest[2:].isdigit()) or (rest and rest[:2] not in ("sp", "ep")):
        sys.exit(f"--layouts: {text!r} is not GPUS, GPUS:spN or GPUS:epN")
    return int(gpus), sp, ep


def rank_main(rank: int, world: int, port: int, sp: int, ep: int, model_dir: str, args, out: str) -> None:
    import torch.distributed as dist

    from rltrain.algorithms.config import LossConfig
    from rltrain.workers.actor import FSDPActorWorker
    from rltrain.workers.actor_config import ActorConfig

    os.environ["CUDA_VISIBLE_DEVICES"], os.environ["LOCAL_RANK"] = str(rank), "0"   # as Ray shows a rank its GPU
    vocab = 1024 if args.tiny else VOCAB
    batches = {length: make_batch(args, length, vocab) for length in args.lengths.split(",")}
    longest = max(int(b["prompt_mask"].sum(1).max() + b["response_mask"].sum(1).max()) for b in batches.values())
    budget = args.max_tokens or max(16384 if not args.tiny else 256, math.ceil(longest / sp))
    config = ActorConfig(lr=1e-6, strategy="fsdp2", max_tokens_per_micro_batch=budget,
                         gradient_checkpointing=args.checkpointing, ulysses_sequence_parallel_size=sp,
                         expert_parallel_size=ep, torch_threads=1 if args.tiny else 0)
    actor = FSDPActorWorker(rank, world, "127.0.0.1", port, config, LossConfig(), model_dir, "bfloat16", AUTO, 1.0,
                            device=args.device)
    cuda = args.device == "cuda"

    def step(batch) -> tuple[float, torch.Tensor]:
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        holder = [actor.compute_logprobs(batch)]
        dist.broadcast_object_list(holder, src=0)   # the controller sends rank 0's old log-probs to every rank
        batch = batch.clone()
        batch["old_logprobs"] = holder[0]
        actor.update(batch)
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        return time.perf_counter() - start, holder[0]

    step(next(iter(batches.values())))   # warm-up: compiles, autotuning, the allocator's pools
    results = {}
    for length, batch in batches.items():
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        seconds, old = step(batch)
        peaks = [None] * world
        mine = (torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30) if cuda else (0, 0)
        dist.all_gather_object(peaks, mine)
        results[length] = {"seconds": seconds, "peaks": peaks, "old": old}
        if rank == 0:
            print(f"    {length}: {seconds:.2f} s, peak {max(p[0] for p in peaks):.1f} GiB", flush=True)
    if rank == 0:
        torch.save(results, f"{out}/result.pt")
    dist.barrier()
    dist.destroy_process_group()


def run_layout(layout: str, model_dir: str, args, root: str) -> dict | str:
    """The layout's results by length, or why there are none."""
    gpus, sp, ep = parse_layout(layout)
    out = tempfile.mkdtemp(dir=root)
    context = mp.get_context("spawn")
    port = free_port()
    ranks = [context.Process(target=rank_main, args=(r, gpus, port, sp, ep, model_dir, args, out))
             for r in range(gpus)]
    for process in ranks:
        process.start()
    deadline = time.monotonic() + args.timeout_s
    for process in ranks:
        process.join(max(1.0, deadline - time.monotonic()))
    alive = [p for p in ranks if p.is_alive()]
    for process in alive:
        process.kill()
        process.join()
    if not os.path.exists(f"{out}/result.pt"):
        codes = [p.exitcode for p in ranks]
        return f"no result ({'timed out after ' + str(args.timeout_s) + ' s; ' if alive else ''}exit codes {codes})"
    return torch.load(f"{out}/result.pt", weights_only=False)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen3-8b")
    parser.add_argument("--layers", type=int, default=0, help="decoder layers (0: the shape's own)")
    parser.add_argument("--layouts", default="1,2")
    parser.add_argument("--lengths", default="16384", help="comma-separated: a response length, or tail")
    parser.add_argument("--responses", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--mean-len", type=float, default=1024, help="tail: the responses' mean length")
    parser.add_argument("--max-len", type=int, default=8192, help="tail: the longest response")
    parser.add_argument("--max-tokens", type=int, default=0, help="per-rank micro-batch token budget (0: auto)")
    parser.add_argument("--checkpointing", action="store_true", help="actor.gradient_checkpointing")
    parser.add_argument("--timeout-s", type=int, default=600, help="a layout's limit (a hung collective)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny models and batches (with --device cpu: a dry run)")
    args = parser.parse_args()
    if args.tiny:
        args.prompt_len, args.mean_len, args.max_len = 16, 32, 64
        if args.lengths == parser.get_default("lengths"):
            args.lengths = "48,tail"
        if args.layouts == parser.get_default("layouts"):
            args.layouts = "1,2,2:ep2" if args.shape == "qwen3-30b-a3b" else "1,2,2:sp2"
    layouts = args.layouts.split(",")
    most = max(parse_layout(layout)[0] for layout in layouts)
    if args.device == "cuda" and torch.cuda.device_count() < most:
        sys.exit(f"--layouts needs {most} GPUs; {torch.cuda.device_count()} visible")
    import transformers

    cuda = args.device == "cuda"
    device_name = torch.cuda.get_device_name(0) if cuda else "cpu"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {device_name}")
    sustained = gemm_rates()[1] if cuda else 0.0
    if cuda:
        print(f"bf16 GEMM 8192^3 sustained: {sustained / 1e12:.0f} TFLOP/s")
        torch.cuda.empty_cache()
    config = model_config(args)
    total, active = active_params(config)
    root = tempfile.mkdtemp()
    model_dir = build_model_dir(config, args.device, root)
    if cuda:
        torch.cuda.empty_cache()
    vocab = config.vocab_size
    batches = {length: make_batch(args, length, vocab) for length in args.lengths.split(",")}
    print(f"{args.shape}: {config.num_hidden_layers} layers, {total / 1e9:.2f} B parameters "
          f"({active / 1e9:.2f} B active)")
    results = {}
    for layout in layouts:
        print(f"  layout {layout}", flush=True)
        results[layout] = run_layout(layout, model_dir, args, root)
        if isinstance(results[layout], str):
            print(f"    {results[layout]}", flush=True)

    print(f"\n### Actor step by parallel layout, {args.shape} ({config.num_hidden_layers} layers, "
          f"{total / 1e9:.1f} B parameters, {active / 1e9:.1f} B active), bf16 with fp32 masters, "
          f"{'gradient checkpointing, ' if args.checkpointing else ''}{device_name}\n")
    print("| response tokens | layout | GPUs | tokens in step | step s | tokens/s | tokens/s per GPU | MFU | "
          "scaling efficiency | peak GiB allocated / reserved | old log-probs rel. err |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for length, batch in batches.items():
        tokens = int(batch["prompt_mask"].sum() + batch["response_mask"].sum())
        flops = model_flops(config, batch, active)
        done = [(layout, r[length]) for layout, r in results.items() if not isinstance(r, str)]
        base = min(done, key=lambda item: parse_layout(item[0])[0]) if done else None
        mask = batch["response_mask"].bool()
        for layout, result in results.items():
            gpus = parse_layout(layout)[0]
            label = ("tail, mean " + f"{batch['response_mask'].sum(1).float().mean():.0f}") if length == "tail" \
                else length
            if isinstance(result, str):
                print(f"| {label} | {layout} | {gpus} | {tokens} | - | - | - | - | - | {result} | - |")
                continue
            r = result[length]
            tps = tokens / r["seconds"]
            base_gpus = parse_layout(base[0])[0]
            efficiency = tps / gpus / (tokens / base[1]["seconds"] / base_gpus)
            mfu = f"{flops / r['seconds'] / gpus / sustained:.1%}" if cuda else "-"
            first = base[1]["old"][mask].double()
            err = ((r["old"][mask].double() - first).norm() / first.norm()).item()
            allocated, reserved = max(p[0] for p in r["peaks"]), max(p[1] for p in r["peaks"])
            print(f"| {label} | {layout} | {gpus} | {tokens} | {r['seconds']:.2f} | {tps:.0f} | {tps / gpus:.0f} | "
                  f"{mfu} | {efficiency:.0%} (vs {base[0]}) | {allocated:.1f} / {reserved:.1f} | {err:.1e} |")


if __name__ == "__main__":
    main()
