"""The whole RL step on GPUs, phase by phase, beside the rollout engine's own offline ceiling.

A Qwen3-0.6B or 1.7B shape built from config (random bf16 weights; a word-level tokenizer of the real vocabulary
size; checkpoints.py), --prompts prompts × --n responses of long-tailed lengths: each response's length is drawn from
its own seed (log-normal, mean --mean-len, clipped to [16, --max-len]) and the vLLM engine generates exactly that
many tokens (the request's max_tokens; random weights end a response early about once in 150,000 tokens). The trainer
(rltrain.trainer.GRPOTrainer, what main_grpo runs: colocated sync mode, sleep/wake, the CUDA-IPC push, a reference at
kl_coef 0.001, pseudo-random 0/1 rewards) takes --steps steps; the first is a warm-up. Per step, from its metrics:
rollout, reward, old log-probs, reference, update and weight push seconds; GPU memory (nvidia-smi every 0.2 s, all
processes) at its peak in each phase. Then the same engine alone (vllm.LLM per replica, the trainer's engine
settings, one process per replica) generates the same requests: its tokens/s is the rollout's ceiling.

Goals: rollout ≥ 90% of the bare engine's tokens/s; everything but rollout and update ≤ 15% of the step; the push
≤ 1 s at 1.7B on one node.

    python benchmarks/bench_rl_step.py --size 1.7b                  # one GPU
    python benchmarks/bench_rl_step.py --size 1.7b --gpus 2         # two GPUs: two engines, FSDP2 actor
    python benchmarks/bench_rl_step.py --tiny --device cpu          # a CPU dry run (hf engine, natural lengths)

The bare engine can run on its own (`--ceiling-only`, same arguments) on other GPUs while the trainer runs with
`--no-ceiling`: CUDA_VISIBLE_DEVICES picks each one's GPUs and the memory monitor watches only its own.

Needs rltrain (with Ray) and rltrain-kernels installed, and vllm on GPUs (README.md beside this file).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import random
import subprocess
import tempfile
import threading
import time
from contextlib import contextmanager

import torch
from checkpoints import QWEN3_SIZES, build_checkpoint

PHASES = ("rollout", "reward", "old_logprob", "ref", "update", "weight_sync")
REWARD = '''import zlib


def score(data_source, solution_str, ground_truth, extra_info=None):
    return float(zlib.crc32(solution_str.encode()) % 2)
'''


# ---------------------------------------------------------------- the data
def write_task(root: str, prompts: int, prompt_len: int, vocab: int) -> tuple[str, str]:
    """(a jsonl of `prompts` rows of prompt_len random words, the reward module's path)."""
    rng = random.Random(0)
    data = os.path.join(root, "train.jsonl")
    with open(data, "w") as f:
        for _ in range(prompts):
            text = " ".join(f"t{rng.randrange(vocab - 3)}" for _ in range(prompt_len))
            f.write(json.dumps({"prompt": text, "data_source": "bench", "ground_truth": ""}) + "\n")
    reward = os.path.join(root, "reward.py")
    with open(reward, "w") as f:
        f.write(REWARD)
    return data, reward


def response_length(seed: int, mean: float, cap: int) -> int:
    """A response's forced length, from its seed: log-normal with the given mean (σ = 1: a long tail), in [16, cap]."""
    sigma = 1.0
    draw = random.Random(seed).lognormvariate(math.log(mean) - sigma**2 / 2, sigma)
    return int(min(cap, max(16, draw)))


def forced_length_worker(mean: float):
    """The trainer's RolloutWorker whose vLLM requests run to their drawn lengths (their seeds decide them)."""
    from rltrain.workers.rollout import RolloutWorker

    class ForcedLengths(RolloutWorker):
        def generate(self, *args, **kwargs):
            engine = self.engine
            sample = engine.sample

            def forced(contexts, max_tokens, temperature, seeds):
                return sample(contexts, [response_length(int(s), mean, cap) for s, cap in zip(seeds, max_tokens)],
                              temperature, seeds)

            engine.sample = forced
            try:
                return super().generate(*args, **kwargs)
            finally:
                del engine.sample

    return ForcedLengths


# ---------------------------------------------------------------- memory per phase
def visible_gpus() -> list[str]:
    """The GPUs this process may use (CUDA_VISIBLE_DEVICES; all of nvidia-smi's when unset)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    return [g for g in visible.split(",") if g] if visible else [str(i) for i in range(torch.cuda.device_count())]


def visible_gpu_flag() -> list[str]:
    """nvidia-smi's flag restricting it to the visible GPUs (another job on the machine's other GPUs stays out)."""
    return ["-i", ",".join(visible_gpus())] if os.environ.get("CUDA_VISIBLE_DEVICES", "").strip() else []


class MemoryByPhase:
    """nvidia-smi's used memory (MiB, each GPU) every 0.2 s; the peak (over GPUs) in each phase of the trainer's."""

    def __init__(self):
        self.phase, self.peak, self.stop = "setup", {}, threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self):
        while not self.stop.wait(0.2):
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                      *visible_gpu_flag()], capture_output=True, text=True, timeout=5).stdout
            except (OSError, subprocess.TimeoutExpired):
                return
            used = max((float(line) for line in out.split()), default=0.0)
            self.peak[self.phase] = max(self.peak.get(self.phase, 0.0), used)

    @contextmanager
    def tagging(self, trainer_class):
        """Tags the samples with the trainer's phase: StepTimer.phase and push_weights, patched for the run."""
        from rltrain import perf

        original_phase, original_push = perf.StepTimer.phase, trainer_class.push_weights
        monitor = self

        @contextmanager
        def phase(timer, name):
            before, monitor.phase = monitor.phase, name
            try:
                with original_phase(timer, name):
                    yield
            finally:
                monitor.phase = before

        def push_weights(trainer, *args):
            monitor.phase = "weight_sync"
            try:
                return original_push(trainer, *args)
            finally:
                monitor.phase = "between"

        perf.StepTimer.phase, trainer_class.push_weights = phase, push_weights
        self.thread.start()
        try:
            yield self
        finally:
            self.stop.set()
            perf.StepTimer.phase, trainer_class.push_weights = original_phase, original_push


# ---------------------------------------------------------------- the trainer's step
def job_config(args, model_dir: str, data: str, reward: str, output_dir: str):
    from rltrain.job import load_job_config

    rollout = {"engine": args.engine, "n": args.n, "max_new_tokens": args.max_len, "temperature": 1.0}
    if args.device == "cpu":
        rollout.update(torch_threads=1)
    return load_job_config({
        "trainer": {"total_steps": args.steps, "device": args.device, "n_gpus_per_node": args.gpus,
                    "output_dir": output_dir, "logger": ["jsonl"], "val_every": 0},
        "model": {"path": model_dir},
        "data": {"train_files": data, "batch_size": args.prompts, "max_prompt_length": args.prompt_len + 8},
        "rollout": rollout,
        "actor": {"strategy": "fsdp2" if args.gpus > 1 else "single"},
        "algorithm": {"loss": {"kl_coef": 0.001}},
        "reward": {"path": reward, "name": "score", "num_workers": 2 if args.device == "cpu" else 8},
        "ray": {"num_cpus": 4 if args.device == "cpu" else None},
    })


def run_trainer(job, mean_len: float, forced: bool) -> tuple[list[dict], dict]:
    """(each step's record, peak GPU MiB per phase)."""
    from rltrain import trainer as trainer_module
    from rltrain.workers import rollout_group

    original = rollout_group.RolloutWorker
    if forced:
        rollout_group.RolloutWorker = forced_length_worker(mean_len)
    memory = MemoryByPhase()
    records = []
    try:
        with memory.tagging(trainer_module.GRPOTrainer):
            trainer = trainer_module.GRPOTrainer(job)
            try:
                for step in range(1, job.trainer.total_steps + 1):
                    records.append(trainer.train_step(step))
                    print(f"step {step}: {records[-1]['time/step_s']:.1f} s", flush=True)
            finally:
                trainer.close()
    finally:
        rollout_group.RolloutWorker = original
    return records, memory.peak


# ---------------------------------------------------------------- the bare engine
def bare_replica(model_dir: str, contexts, lengths, seeds, settings: dict, gpu: str, start, queue) -> None:
    """One bare vLLM engine on `gpu` generating its share of the requests after `start` (a barrier)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from rltrain.workers.vllm_engine import without_flashinfer_args

    llm = LLM(model=model_dir, dtype="bfloat16", seed=0, generation_config="vllm", disable_log_stats=True,
              logprobs_mode="processed_logprobs", **settings, **without_flashinfer_args())
    params = [SamplingParams(n=1, temperature=1.0, max_tokens=length, seed=seed, logprobs=0, detokenize=False,
                             stop_token_ids=[llm.get_tokenizer().eos_token_id])
              for length, seed in zip(lengths, seeds)]
    prompts = [TokensPrompt(prompt_token_ids=c) for c in contexts]
    llm.generate(prompts[:8], params[:8], use_tqdm=False)   # warm-up
    start.wait()
    began = time.monotonic()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    queue.put((time.monotonic() - began, sum(len(o.outputs[0].token_ids) for o in outputs)))


def bare_engine(job, model_dir: str, mean_len: float, gpus: int) -> tuple[float, int]:
    """(tokens/s, tokens) of the bare engines generating the trainer's first-step requests, one replica per GPU
    (rollout.tensor_parallel_size 1), the prompts split between them as the trainer splits them."""
    from rltrain.data.rows import load_rows
    from rltrain.data.sampler import PromptSampler, encode_prompts
    from rltrain.workers.policy import load_tokenizer
    from rltrain.workers.sampling import response_seeds

    tokenizer = load_tokenizer(model_dir, padding_side="left")
    rows = PromptSampler(load_rows(job.data.train_files), job.trainer.seed).next(job.data.batch_size)
    ids, mask = encode_prompts(rows, tokenizer)
    n = job.rollout.n
    contexts = [row[m.bool()].tolist() for row, m in zip(ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0))]
    seeds = [int(s) for s in response_seeds(job.trainer.seed * 1_000_003 + 101, 0, len(contexts))]
    lengths = [response_length(s, mean_len, job.rollout.max_new_tokens) for s in seeds]
    settings = dict(enforce_eager=job.rollout.enforce_eager, gpu_memory_utilization=job.rollout.gpu_memory_utilization)
    context = multiprocessing.get_context("spawn")
    devices = visible_gpus()
    start, queue = context.Barrier(gpus), context.Queue()
    share = math.ceil(len(contexts) / gpus / n) * n   # whole groups per replica
    processes = [context.Process(target=bare_replica, args=(model_dir, contexts[i * share:(i + 1) * share],
                                                            lengths[i * share:(i + 1) * share],
                                                            seeds[i * share:(i + 1) * share], settings, devices[i],
                                                            start, queue))
                 for i in range(gpus)]
    for process in processes:
        process.start()
    results = [queue.get(timeout=1800) for _ in processes]
    for process in processes:
        process.join(60)
    tokens = sum(r[1] for r in results)
    return tokens / max(r[0] for r in results), tokens


# ---------------------------------------------------------------- report
def report(args, records: list[dict], peak: dict) -> dict:
    """Print the trainer's step (phases, shares, memory, goals) as soon as it has run: a time limit that stops the
    bare engine after it loses nothing. Returns the mean record of the measured steps."""
    measured = records[1:] or records   # the first step is a warm-up
    mean = {key: sum(r.get(key, 0.0) for r in measured) / len(measured)
            for key in [f"time/{p}_s" for p in PHASES] + ["time/step_s", "perf/rollout_tokens_per_s",
                                                          "train/response_len_mean", "perf/actor_mfu"]}
    step = mean["time/step_s"]
    print(f"\nQwen3 {args.size}, {args.gpus} GPU(s), {args.prompts} prompts × n={args.n}, prompt {args.prompt_len}, "
          f"responses mean {mean['train/response_len_mean']:.0f} (forced mean {args.mean_len:g}, max {args.max_len}), "
          f"engine {args.engine}; mean of steps 2..{len(records)}")
    print("| phase | s | share of step | peak GPU memory (GiB) |")
    print("| --- | --- | --- | --- |")
    for name in PHASES:
        seconds = mean[f"time/{name}_s"]
        memory = peak.get(name)
        print(f"| {name} | {seconds:.2f} | {100 * seconds / step:.1f}% | "
              f"{'-' if memory is None else f'{memory / 1024:.1f}'} |")
    print(f"| step | {step:.2f} | 100% | |")
    other = step - mean["time/rollout_s"] - mean["time/update_s"]
    print(f"\nrollout {mean['perf/rollout_tokens_per_s']:,.0f} tokens/s; actor MFU {mean['perf/actor_mfu']:.1%}")
    print(f"everything but rollout and update: {100 * other / step:.1f}% of the step (goal ≤ 15%: "
          f"{'met' if other <= 0.15 * step else 'not met'})")
    push = mean["time/weight_sync_s"]
    print(f"weight push {push:.2f} s (goal ≤ 1 s at 1.7B: {'met' if push <= 1.0 else 'not met'})", flush=True)
    return mean


def report_ceiling(mean: dict, ceiling: tuple[float, int]) -> None:
    ratio = mean["perf/rollout_tokens_per_s"] / ceiling[0]
    print(f"bare engine {ceiling[0]:,.0f} tokens/s ({ceiling[1]:,} tokens): rollout at {ratio:.0%} of it "
          f"(goal ≥ 90%: {'met' if ratio >= 0.9 else 'not met'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=[s for s in QWEN3_SIZES if s != "tiny"], default="1.7b")
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--mean-len", type=float, default=1024)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--no-ceiling", action="store_true", help="skip the bare engine")
    parser.add_argument("--ceiling-only", action="store_true",
                        help="only the bare engine (on other GPUs beside a --no-ceiling run of the same arguments)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and batch (with --device cpu: a dry run)")
    args = parser.parse_args()
    if args.tiny:
        args.size, args.prompts, args.n, args.prompt_len, args.mean_len, args.max_len, args.steps = \
            "tiny", 4, 2, 8, 8, 16, 2
    if args.device == "cpu":
        args.engine, args.gpus, args.no_ceiling = "hf", 1, True
    with tempfile.TemporaryDirectory() as root:
        model_dir = build_checkpoint(args.size, root)
        data, reward = write_task(root, args.prompts, args.prompt_len, QWEN3_SIZES[args.size]["vocab_size"])
        job = job_config(args, model_dir, data, reward, os.path.join(root, "run"))
        forced = args.engine == "vllm"
        if args.ceiling_only:
            tokens_per_s, tokens = bare_engine(job, model_dir, args.mean_len, args.gpus)
            print(f"bare engine {tokens_per_s:,.0f} tokens/s ({tokens:,} tokens)")
            return
        records, peak = run_trainer(job, args.mean_len, forced)
        import ray

        ray.shutdown()
        mean = report(args, records, peak)
        if forced and not args.no_ceiling:
            report_ceiling(mean, bare_engine(job, model_dir, args.mean_len, args.gpus))


if __name__ == "__main__":
    main()
