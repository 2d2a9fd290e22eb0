"""The actor and the weight push on several GPUs of one host (actor.strategy=fsdp2, one HF rollout replica per GPU),
against one GPU, for a Qwen3 and a delta-rule hybrid built from config. Plain processes (torch.multiprocessing, NCCL),
no Ray: each process sees only its own GPU, as under Ray, and the roles are the trainer's own classes
(FSDPActorWorker, ActorWorker, RolloutWorker); the controller's loop is replayed here in a few lines.

For each arch:
1. Gradients. One update on a small batch: FSDP2 over `--world` GPUs against a single process on one GPU in fp32
   (the same kernels), in fp32 (the sharding alone) and in bf16 mixed precision (model.dtype=bfloat16 with
   actor.mixed_precision, the default); FSDP2's bf16 against its own 1-GPU bf16 (the sharding at equal precision);
   and the single process's bf16 (its fp32 masters' gradients) against its fp32 (the error bf16 brings on one GPU).
   Relative errors of the old log-probs, of all gradients as one vector, and of the worst parameter's.
2. Actor step (old log-probs + update, packed micro-batches, the registry's kernels), timed: a single process in bf16
   mixed precision (what a one-GPU user runs), FSDP2 on 1 GPU and on `--world` GPUs (fp32 master weights, bf16
   compute); tokens/s, tokens/s per GPU, scaling efficiency (per-GPU tokens/s at `--world` over FSDP2's at 1), peak
   memory per GPU.
3. Weight push into `--world` rollout replicas (HF engine, one per GPU, beside the actor rank on that GPU): the
   device route (CUDA IPC from the colocated rank) against the host route (rank 0's host copy, a numpy array pickled
   to each replica; Ray's object store takes it in once and hands it out without a copy, so this overstates the
   host route by a copy per extra replica), each the best of `--push-repeats`; the push sends model.dtype (bf16)
   tensors, into fp32 replicas; then every replica's weights checked against the actor's (fp64 checksums, exact)
   and every replica generates, concurrently.

    python benchmarks/bench_multi_gpu.py                           # 2 GPUs, qwen3 0.6B + hybrid 1B
    python benchmarks/bench_multi_gpu.py --archs qwen3 --world 2
    python benchmarks/bench_multi_gpu.py --gradients-only         # section 1 alone
    python benchmarks/bench_multi_gpu.py --tiny --device cpu      # a CPU dry run over gloo (host route)

Needs rltrain and rltrain-kernels installed (README.md beside this file).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp
from bench_actor_step import make_batch
from checkpoints import QWEN3_COMMON, QWEN3_SIZES, VOCAB, word_tokenizer

AUTO = {"name": "auto", "include_kernels": "auto"}
FULL = {  # Qwen3-0.6B; bench_hybrid_policy's 1B-class hybrid (3 Gated DeltaNet : 1 attention)
    "qwen3": QWEN3_SIZES["0.6b"],
    "hybrid": {**QWEN3_SIZES["1.7b"], "num_hidden_layers": 16},
}
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, vocab_size=1024)   # vocab_size > 1000: the replicas generate after random ids below 1000


def build_model_dir(arch: str, tiny: bool, root: str) -> str:
    import transformers as tf

    import rltrain_kernels.models as families

    shape = TINY if tiny else FULL[arch]
    vocab = shape["vocab_size"]
    shape = dict(eos_token_id=vocab - 1, pad_token_id=vocab - 1, bos_token_id=vocab - 1, **QWEN3_COMMON, **shape)
    if arch == "qwen3":
        config = tf.Qwen3Config(**shape)
    else:
        pattern = ["gated_delta_rule"] * 3 + ["full_attention"]
        config = families.HybridDeltaConfig(layer_types=[pattern[i % 4] for i in range(shape["num_hidden_layers"])],
                                            linear_num_heads=shape["num_attention_heads"],
                                            linear_head_dim=shape["head_dim"], **shape)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():   # the <eos> row pushed down: random sampling never draws it, every row decodes in full
        model.get_input_embeddings().weight[vocab - 1].mul_(-50)
    path = f"{root}/{arch}"
    model.save_pretrained(path)
    word_tokenizer(vocab).save_pretrained(path)   # the rollout replicas load it (generation_config.json's ids win)
    return path


def batches(tiny: bool, arch: str, vocab: int):
    """(the gradient check's batch, the timed batch, warm-up batches), token ids inside the vocabulary."""
    def fit(batch):
        for key in ("prompt_ids", "response_ids"):
            batch[key] = batch[key] % (vocab - 2)
        return batch

    if tiny:
        return (fit(make_batch(8, 16, 24, 48, seed=5)), fit(make_batch(16, 16, 32, 64)),
                [fit(make_batch(4, 8, 8, 16, seed=1))])
    timed = make_batch(256 if arch == "qwen3" else 128, 256, 1024, 8192)   # bench_actor_step's batch (hybrid: half)
    return (fit(make_batch(16, 64, 256, 1024, seed=5)), fit(timed),
            [fit(make_batch(8, 64, 128, 256, seed=1)), fit(make_batch(8, 96, 300, 600, seed=2))])


def actor_config(tiny: bool):
    """actor.mixed_precision on (the default): with model.dtype=bfloat16, fp32 weights and bf16 compute."""
    from rltrain.workers.actor_config import ActorConfig

    return ActorConfig(lr=1e-6, max_tokens_per_micro_batch=2048 if tiny else 16384, torch_threads=1 if tiny else 0)


def timed_step(actor, batch, device: str, sharded: bool) -> tuple[float, torch.Tensor | None]:
    """(seconds, old log-probs) of one actor step; rank 0's old log-probs reach every rank, as the controller sends
    them."""
    import torch.distributed as dist

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if sharded:
        dist.barrier()
    sync()
    start = time.perf_counter()
    old = actor.compute_logprobs(batch)
    if sharded:
        holder = [old]
        dist.broadcast_object_list(holder, src=0)
        old = holder[0]
    batch = batch.clone()
    batch["old_logprobs"] = old
    actor.update(batch)
    sync()
    if sharded:
        dist.barrier()
    return time.perf_counter() - start, old


def full_grads(actor, sharded: bool) -> dict[str, torch.Tensor]:
    """The trained weights' gradients by name: the fp32 masters' where the single process keeps them (bf16)."""
    from torch.distributed.tensor import DTensor

    named = actor.master.masters.items() if actor.master is not None else actor.model.named_parameters()
    return {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).float().cpu()
            for name, p in named if p.grad is not None}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def compare(grads: dict, old: torch.Tensor, expected_grads: dict, expected_old: torch.Tensor) -> tuple:
    """(old log-probs rel. error, all gradients' rel. error as one vector, the worst parameter and its error)."""
    if set(grads) != set(expected_grads):
        raise RuntimeError(f"gradients of different parameters: {sorted(set(grads) ^ set(expected_grads))[:4]}")
    mask = expected_old != 0
    names = sorted(expected_grads)
    errors = {name: rel_err(grads[name], expected_grads[name]) for name in names}
    worst = max(errors, key=errors.get)
    every = rel_err(torch.cat([grads[n].flatten() for n in names]),
                    torch.cat([expected_grads[n].flatten() for n in names]))
    return rel_err(old[mask], expected_old[mask]), every, worst, errors[worst]


# ---------------------------------------------------------------- single process (one GPU)
def single_main(model_dir: str, tiny: bool, device: str, out: str, arch: str, vocab: int, timing: bool) -> None:
    """The one-GPU side: fp32 gradients of the check batch; the bf16 actor step timed."""
    from rltrain.algorithms.config import LossConfig
    from rltrain.workers.actor import ActorWorker

    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")
    check, timed, warm = batches(tiny, arch, vocab)
    actor = ActorWorker(actor_config(tiny), LossConfig(), model_dir, "float32", AUTO, 1.0, device=device)
    _, old = timed_step(actor, check, device, sharded=False)
    torch.save({"grads": full_grads(actor, False), "old": old}, f"{out}/single_grads.pt")
    actor = None
    actor = ActorWorker(actor_config(tiny), LossConfig(), model_dir, "bfloat16", AUTO, 1.0, device=device)
    _, old = timed_step(actor, check, device, sharded=False)
    torch.save({"grads": full_grads(actor, False), "old": old}, f"{out}/single_bf16_grads.pt")
    if not timing:
        return
    for batch in warm:
        timed_step(actor, batch, device, sharded=False)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = min(timed_step(actor, timed, device, sharded=False)[0] for _ in range(2))
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
    torch.save({"seconds": seconds, "peak": [peak]}, f"{out}/single_step.pt")


# ---------------------------------------------------------------- FSDP2 ranks (+ rollout replicas)
def rank_main(rank: int, world: int, port: int, model_dir: str, tiny: bool, device: str, out: str, arch: str,
              vocab: int, connections: list, push_repeats: int, timing: bool) -> None:
    import torch.distributed as dist

    from rltrain.algorithms.config import LossConfig
    from rltrain.workers.actor import FSDPActorWorker

    os.environ["CUDA_VISIBLE_DEVICES"], os.environ["LOCAL_RANK"] = str(rank), "0"   # as Ray shows a rank its GPU
    check, timed, warm = batches(tiny, arch, vocab)
    result = {}
    # 1. gradients on the check batch: bf16 mixed precision (every world size), fp32 (world > 1)
    for precision in ("fp32", "bf16") if world > 1 else ("bf16",):
        dtype = "bfloat16" if precision == "bf16" else "float32"
        actor = FSDPActorWorker(rank, world, "127.0.0.1", port, actor_config(tiny), LossConfig(), model_dir, dtype,
                                AUTO, 1.0, device=device)
        _, old = timed_step(actor, check, device, sharded=True)
        grads = full_grads(actor, sharded=True)
        if rank == 0:
            result[f"grads_{precision}"], result[f"old_{precision}"] = grads, old
        actor = None
    if not timing:
        if rank == 0:
            torch.save(result, f"{out}/fsdp{world}.pt")
        return
    # 2. the timed step (bf16 mixed precision, the default)
    actor = FSDPActorWorker(rank, world, "127.0.0.1", port, actor_config(tiny), LossConfig(), model_dir,
                            "bfloat16", AUTO, 1.0, device=device)
    for batch in warm:
        timed_step(actor, batch, device, sharded=True)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = min(timed_step(actor, timed, device, sharded=True)[0] for _ in range(2))
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0])
    peaks = [torch.zeros(1) for _ in range(world)]
    dist.all_gather_object(peaks, peak)
    result.update(seconds=seconds, peak=[float(p) for p in peaks])
    # 3. the weight push into the replicas
    if connections:
        result.update(push(actor, rank, world, connections, push_repeats, device))
    if rank == 0:
        torch.save(result, f"{out}/fsdp{world}.pt")
    dist.barrier()


def push(actor, rank: int, world: int, connections: list, repeats: int, device: str) -> dict:
    """Every bucket into every replica by each route; the replicas' checksums and generation after the last."""
    import torch.distributed as dist

    from rltrain.workers.weight_sync import plan_sources

    def ask(conn, *message):
        conn.send(message)
        return conn.recv()

    mine = connections[rank]   # the replica on this rank's GPU
    infos = [None] * world
    dist.all_gather_object(infos, actor.device_info())
    replica_infos = ask(mine, "info")
    replica_gpus = [None] * world
    dist.all_gather_object(replica_gpus, replica_infos and replica_infos[0])
    sources = plan_sources([info and info[0] for info in infos], replica_gpus)
    buckets = actor.bucket_names(actor.config.weight_bucket_mb)
    routes = ["ipc", "host"] if all(source is not None for source in sources) else ["host"]
    weights = actor.full_weights([name for names in buckets for name in names])
    expected = {name: tensor.double().sum().item() for name, tensor in weights.items()}
    size = sum(tensor.numel() * tensor.element_size() for tensor in weights.values())
    weights = None
    before = ask(mine, "checksums")   # the replica's weights before any push: the check below must tell them apart
    stale = sum(before.get(name) != value for name, value in expected.items())
    times = {}
    for route in routes:
        best = float("inf")
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            ask(mine, "begin")
            dist.barrier()   # host route: rank 0 writes to every replica's pipe, after each one's own "begin"
            for names in buckets:
                bucket = actor.export_weights(names, list(range(world)) if route == "ipc" else [], route == "host")
                if route == "ipc":
                    assert ask(mine, "bucket", bucket) == "ipc"
                elif rank == 0:   # rank 0's host copy to every replica, pickled once per replica
                    for conn in connections:
                        conn.send(("bucket", bucket))
                    assert all(conn.recv() == "host" for conn in connections)
            actor.release_weights()
            dist.barrier()
            ask(mine, "finish")
            dist.barrier()
            best = min(best, time.perf_counter() - start)
        times[route] = best
    got = ask(mine, "checksums")
    mismatched = sorted(name for name, value in expected.items() if got.get(name) != value)
    replicas = [None] * world
    dist.all_gather_object(replicas, (mismatched, ask(mine, "generate"), stale))
    return {"push": times, "buckets": len(buckets), "replicas": replicas,
            "bytes": size}


def replica_main(index: int, model_dir: str, tiny: bool, device: str, conn) -> None:
    """One rollout replica (HF engine, fp32 so the checksums are exact) on GPU `index`, serving the pushes."""
    os.environ["CUDA_VISIBLE_DEVICES"] = str(index)
    from rltrain.workers.rollout import RolloutConfig, RolloutWorker

    config = RolloutConfig(n=4, max_new_tokens=16 if tiny else 128, micro_batch_size=256,
                           torch_threads=1 if tiny else 0)
    rollout = RolloutWorker(config, model_dir, "float32", AUTO, device=device)
    while True:
        command, *args = conn.recv()
        if command == "info":
            conn.send(rollout.device_info())
        elif command == "begin":
            conn.send(rollout.begin_weight_update())
        elif command == "bucket":
            conn.send(rollout.load_bucket(args[0]))
        elif command == "finish":
            conn.send(rollout.finish_weight_update())
        elif command == "checksums":
            conn.send({name: t.double().sum().item() for name, t in rollout.engine.model.state_dict().items()})
        elif command == "generate":
            g = torch.Generator().manual_seed(index)
            ids = torch.randint(4, 1000, (8 if tiny else 32, 16 if tiny else 128), generator=g)
            start = time.perf_counter()
            result = rollout.generate(ids, torch.ones_like(ids), config.n, 1.0, seed=index)
            tokens = int(result["response_mask"].sum())
            conn.send(tokens / (time.perf_counter() - start))
        elif command == "stop":
            conn.send(None)
            return


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_world(world: int, model_dir: str, args, out: str, arch: str, vocab: int, replicas: bool) -> dict:
    context = mp.get_context("spawn")
    pipes = [context.Pipe() for _ in range(world)] if replicas and args.timing else []
    servers = [context.Process(target=replica_main, args=(i, model_dir, args.tiny, args.device, child))
               for i, (_, child) in enumerate(pipes)]
    for server in servers:
        server.start()
    port = free_port()
    ranks = [context.Process(target=rank_main, args=(r, world, port, model_dir, args.tiny, args.device, out, arch,
                                                     vocab, [parent for parent, _ in pipes], args.push_repeats,
                                                     args.timing))
             for r in range(world)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join()
    for parent, _ in pipes:
        if all(p.exitcode == 0 for p in ranks):
            parent.send(("stop",))
            parent.recv()
    for server in servers:
        server.join(timeout=60)
        if server.is_alive():
            server.kill()
    if any(p.exitcode != 0 for p in ranks):
        raise RuntimeError(f"{arch}: an FSDP2 rank of world {world} failed (exit codes "
                           f"{[p.exitcode for p in ranks]})")
    return torch.load(f"{out}/fsdp{world}.pt", weights_only=False)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", default="qwen3,hybrid")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="small models and batches (a dry run)")
    parser.add_argument("--push-repeats", type=int, default=3)
    parser.add_argument("--gradients-only", dest="timing", action="store_false",
                        help="section 1 alone (no timed step, no weight push)")
    args = parser.parse_args()
    if args.world < 2:
        sys.exit("--world must be >= 2 (one GPU is the baseline every run measures)")
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        sys.exit(f"--world {args.world} needs {args.world} GPUs; {torch.cuda.device_count()} visible")
    import transformers

    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {args.world} x {device_name}")
    root = tempfile.mkdtemp()
    rows, pushes, checks = [], [], []
    for arch in args.archs.split(","):
        model_dir, vocab = build_model_dir(arch, args.tiny, root), TINY["vocab_size"] if args.tiny else VOCAB
        out = tempfile.mkdtemp(dir=root)
        _, timed, _ = batches(args.tiny, arch, vocab)
        tokens = int(timed["prompt_mask"].sum() + timed["response_mask"].sum())
        context = mp.get_context("spawn")
        single = context.Process(target=single_main, args=(model_dir, args.tiny, args.device, out, arch, vocab,
                                                           args.timing))
        single.start()
        single.join()
        if single.exitcode != 0:
            raise RuntimeError(f"{arch}: the single-process run failed (exit {single.exitcode})")
        reference = torch.load(f"{out}/single_grads.pt")
        fsdp1 = run_world(1, model_dir, args, out, arch, vocab, replicas=False)
        fsdpn = run_world(args.world, model_dir, args, out, arch, vocab, replicas=True)
        single_bf16 = torch.load(f"{out}/single_bf16_grads.pt")
        fp32 = {"grads": reference["grads"], "old": reference["old"]}
        pairs = [(f"fsdp2 x{args.world} fp32 vs single fp32", fsdpn, "fp32", fp32),
                 (f"fsdp2 x{args.world} bf16 vs fsdp2 x1 bf16", fsdpn, "bf16",
                  {"grads": fsdp1["grads_bf16"], "old": fsdp1["old_bf16"]}),
                 (f"fsdp2 x{args.world} bf16 vs single fp32", fsdpn, "bf16", fp32),
                 ("single bf16 vs single fp32", {"grads_": single_bf16["grads"], "old_": single_bf16["old"]}, "",
                  fp32)]
        for label, result, precision, expected in pairs:
            checks.append((arch, label) + compare(result[f"grads_{precision}"], result[f"old_{precision}"],
                                                  expected["grads"], expected["old"]))
        if args.timing:
            one = torch.load(f"{out}/single_step.pt")
            for name, result, gpus in (("single, bf16", one, 1), ("fsdp2 x1", fsdp1, 1),
                                       (f"fsdp2 x{args.world}", fsdpn, args.world)):
                rows.append((arch, name, gpus, tokens / result["seconds"], result["seconds"], result["peak"]))
            pushes.append((arch, fsdpn))
        print(f"  {arch}: done ({tokens} tokens in the timed batch)", flush=True)

    print(f"\n### Gradients after one update (same kernels), {device_name}\n")
    print("| arch | compared | old log-probs rel. err | all gradients rel. err | worst parameter | its rel. err |")
    print("|---|---|---:|---:|---|---:|")
    for arch, label, old_err, every, worst, worst_err in checks:
        print(f"| {arch} | {label} | {old_err:.1e} | {every:.1e} | {worst} | {worst_err:.1e} |")
    if not args.timing:
        return
    print(f"\n### Actor step (old log-probs + update, packed), {device_name}\n")
    print("| arch | variant | GPUs | tokens/s | tokens/s per GPU | scaling efficiency | step s | peak GiB per GPU |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    base = {(arch, name): tps for arch, name, _, tps, _, _ in rows}
    for arch, name, gpus, tps, seconds, peak in rows:
        efficiency = f"{tps / gpus / base[(arch, 'fsdp2 x1')]:.0%}" if name.startswith("fsdp2") else "-"
        print(f"| {arch} | {name} | {gpus} | {tps:.0f} | {tps / gpus:.0f} | {efficiency} | {seconds:.2f} | "
              f"{', '.join(f'{p:.1f}' for p in peak)} |")
    print(f"\n### Weight push into {args.world} HF rollout replicas (fp32 weights), {device_name}\n")
    print("| arch | GB pushed | buckets | device route s | host route s | host / device "
          "| replicas' weights equal the actor's | replicas generate (tokens/s each) |")
    print("|---|---:|---:|---:|---:|---:|---|---|")
    for arch, result in pushes:
        times = result["push"]
        equal = all(not mismatched for mismatched, _, _ in result["replicas"])
        stale = min(count for _, _, count in result["replicas"])
        speeds = ", ".join(f"{tps:.0f}" for _, tps, _ in result["replicas"])
        device_s = f"{times['ipc']:.3f}" if "ipc" in times else "-"
        ratio = f"{times['host'] / times['ipc']:.1f}x" if "ipc" in times else "-"
        print(f"| {arch} | {result['bytes'] / 1e9:.2f} | {result['buckets']} | {device_s} | {times['host']:.3f} | "
              f"{ratio} | {equal} ({stale} differed before) | {speeds} |")


if __name__ == "__main__":
    main()
