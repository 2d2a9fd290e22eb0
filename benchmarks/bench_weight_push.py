"""The weight push's host route through Ray: the path of the asynchronous modes (trainer.mode one_step_off / async:
WeightPush.snapshot, then load_snapshot) and of any rollout process that shares no GPU with an actor rank. For a
Qwen3 built from config (bf16), the trainer's own ActorWorker and RolloutWorker (hf engine) as Ray actors, each on
a GPU of its own when two are visible, else sharing one:

- per-tensor: each bucket returned as a dict of CPU tensors, loaded tensor by tensor (the host route up to
  2026-11-26: Ray pickles every tensor on the way in and out);
- flat: each bucket one flat buffer, one device-to-host copy through pinned staging, returned as a numpy array
  (weight_sync.HostBuffer: one copy into Ray's object store, none out), moved to the rollout's device in one copy;
- ipc: the CUDA IPC route of colocated pushes, the device ceiling (only when both share a GPU).

Export (every bucket in the object store, as snapshot() waits for), load (every bucket into the engine, as
load_snapshot does) and their sum, best of --repeats, with GB/s of the sum; after each route the engine's weights
are checked against the actor's (fp64 checksums, exact; the actor's weights are perturbed before each route, so a
push that did not land shows).

    python benchmarks/bench_weight_push.py                        # Qwen3 0.6B and 1.7B shapes
    python benchmarks/bench_weight_push.py --tiny --device cpu    # a CPU dry run

Needs rltrain (with Ray) and rltrain-kernels installed (README.md beside this file).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch
from checkpoints import QWEN3_SIZES, build_checkpoint

ROUTES = ("per-tensor", "flat", "ipc")


def checksums(state: dict[str, torch.Tensor]) -> dict[str, float]:
    return {name: tensor.double().sum().item() for name, tensor in state.items()}


def roles():
    """The trainer's ActorWorker / RolloutWorker with what the benchmark asks of them besides the trainer's calls."""
    from rltrain.workers.actor import ActorWorker
    from rltrain.workers.rollout import RolloutWorker

    class Actor(ActorWorker):
        def perturb(self, seed: int) -> dict[str, float]:
            generator = torch.Generator(device=self.device).manual_seed(seed)
            with torch.no_grad():
                for param in self.model.parameters():
                    param.add_(torch.randn(param.shape, generator=generator, device=self.device, dtype=param.dtype),
                               alpha=1e-2)
            return checksums(self.pushed_weights())

        def pushed_bytes(self) -> int:
            return sum(tensor.numel() * tensor.element_size() for tensor in self.pushed_weights().values())

        def export_per_tensor(self, names: list[str]) -> dict[str, torch.Tensor]:
            return {name: tensor.cpu() for name, tensor in self.full_weights(names).items()}

    class Rollout(RolloutWorker):
        def load_per_tensor(self, tensors: dict[str, torch.Tensor]) -> str:
            self.engine.load_weights(tensors.items())
            return "host"

        def sync(self) -> None:
            if self.device == "cuda":
                torch.cuda.synchronize()

        def checksums(self) -> dict[str, float]:
            return checksums(self.engine.model.state_dict())

    return Actor, Rollout


def push(actor, rollout, buckets: list[list[str]], route: str) -> tuple[float, float]:
    """(export s, load s) of one push by `route`, as the trainer's snapshot() + load_snapshot() (host routes) or
    push() (ipc) run it."""
    import ray

    start = time.perf_counter()
    if route == "ipc":   # export and load alternate: a rank keeps one IPC buffer alive at a time
        ray.get(rollout.begin_weight_update.remote())
        for names in buckets:
            assert ray.get(rollout.load_bucket.remote(actor.export_weights.remote(names, [0], False))) == "ipc"
        ray.get(actor.release_weights.remote())
        ray.get(rollout.finish_weight_update.remote())
        return 0.0, time.perf_counter() - start
    if route == "flat":
        refs = [actor.export_weights.remote(names, [], True) for names in buckets]
    else:
        refs = [actor.export_per_tensor.remote(names) for names in buckets]
    ray.wait(refs, num_returns=len(refs), fetch_local=False)
    exported = time.perf_counter()
    ray.get(rollout.begin_weight_update.remote())
    for ref in refs:
        load = rollout.load_per_tensor if route == "per-tensor" else rollout.load_bucket
        assert ray.get(load.remote(ref)) == "host"
    ray.get(rollout.finish_weight_update.remote())
    ray.get(rollout.sync.remote())
    return exported - start, time.perf_counter() - exported


def run_size(size: str, args, root: str) -> list[dict]:
    import ray

    from rltrain.algorithms.config import LossConfig
    from rltrain.workers.actor_config import ActorConfig
    from rltrain.workers.rollout import RolloutConfig

    path = build_checkpoint(size, root)
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    share = 0.5 if gpus == 1 else (1 if gpus else 0)
    Actor, Rollout = roles()
    actor = ray.remote(num_gpus=share)(Actor).remote(
        ActorConfig(weight_bucket_mb=args.bucket_mb), LossConfig(), path, "bfloat16", None, 1.0, device=args.device)
    rollout = ray.remote(num_gpus=share)(Rollout).remote(RolloutConfig(), path, "bfloat16", None, device=args.device)
    buckets = ray.get(actor.bucket_names.remote(args.bucket_mb))
    gb = ray.get(actor.pushed_bytes.remote()) / 1e9
    same_gpu = args.device == "cuda" and ray.get(actor.device_info.remote()) == ray.get(rollout.device_info.remote())
    rows = []
    for seed, route in enumerate(ROUTES, start=1):
        if route == "ipc" and not same_gpu:
            continue
        expected = ray.get(actor.perturb.remote(seed))
        times = [push(actor, rollout, buckets, route) for _ in range(args.repeats)]
        got = ray.get(rollout.checksums.remote())
        wrong = sorted(name for name, value in expected.items() if got.get(name) != value)
        export_s, load_s = min(times, key=sum)
        rows.append(dict(size=size, route=route, buckets=len(buckets), gb=gb, export=export_s, load=load_s,
                         total=export_s + load_s, wrong=wrong))
    ray.kill(actor)
    ray.kill(rollout)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["0.6b", "1.7b"],
                        choices=sorted(s for s in QWEN3_SIZES if s != "tiny"))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="a 2-layer toy model (CPU dry run)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=256, help="actor.weight_bucket_mb")
    args = parser.parse_args()
    import ray

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for size in (["tiny"] if args.tiny else args.sizes):
            rows += run_size(size, args, root)
    ray.shutdown()
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"\n## weight push, host route through Ray — {device}, torch {torch.__version__}, ray {ray.__version__}")
    print("| model | route | buckets | GB | export s | load s | total s | GB/s | vs per-tensor | weights equal |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = {row["size"]: row["total"] for row in rows if row["route"] == "per-tensor"}
    for row in rows:
        ok = "yes" if not row["wrong"] else f"NO: {len(row['wrong'])} differ, e.g. {row['wrong'][0]}"
        print(f"| {row['size']} | {row['route']} | {row['buckets']} | {row['gb']:.2f} | {row['export']:.3f} | "
              f"{row['load']:.3f} | {row['total']:.3f} | {row['gb'] / row['total']:.1f} | "
              f"{base[row['size']] / row['total']:.1f}x | {ok} |")
    if any(row["wrong"] for row in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
