"""The actor's work of one RL step — old log-probs (no grad) + one update (forward, backward, AdamW) — on one GPU,
for Qwen3 models built from config, side by side in one process:

    (a) trl        plain transformers (SDPA) + log-softmax over materialised logits, padded micro-batches (what
                   TRL's GRPOTrainer does)
    (b) trl+liger  (a) with Liger's model kernels and its fused linear GRPO loss (TRL's use_liger_kernel)
    (c) rltrain padded   ActorWorker, padded micro-batches of `--rows` rows (actor.use_remove_padding=false)
    (d) rltrain packed   ActorWorker, packed micro-batches of at most `--max-tokens` tokens (the default)
    (e) rltrain packed mixed   (d) with actor.mixed_precision (the default): fp32 master weights, gradients and AdamW
                   state beside the bf16 model, the same bf16 compute (rltrain/workers/precision.py); the table's last
                   line gives its tokens/s and peak against (d)'s (goal: within 10%)
    (f) rltrain packed lora   (d) with actor.lora: rank `--lora-rank` adapters on every linear layer but the LM head
                   (PEFT), the base frozen; its MFU counts the full model's 8·N (the adapters' weight gradients are
                   skipped, so it reads low)
    (g) rltrain packed mixed+critic   PPO's actor-side work: (e) plus a CriticWorker (value model) on the same
                   checkpoint, built as the trainer builds it (default critic settings); the old pass adds its values,
                   the update its value-loss step on fixed random returns (the trainer's order: values after the
                   log-probs, the critic's update before the actor's); the table's last line gives its added time and
                   peak against (e)'s; its MFU counts the actor's flops only (the critic's passes not), so it reads low

(a) to (d) and (f) train the bf16 weights in place, as TRL does (actor.mixed_precision=false): at lr 1e-6 such an
update is lost on most elements, which changes nothing in the timing.

Batch: `--responses` responses after `--prompt-len`-token prompts, response lengths log-normal (σ = 1) with mean
`--mean-len`, capped at `--max-len`, fixed seed; random token ids (timing does not depend on their values). Every
variant trains on the same real tokens; tokens/s counts prompt + response tokens once (padding not counted), over
the old-log-prob pass plus the update. MFU: 8·N_params·tokens + causal attention (4·L²·layers·heads·head_dim per
sequence, ×4 for the three passes) over the time, against the bf16 GEMM rate measured in the same run. Then the
longest response each variant trains at batch 8 (old log-probs, then forward + backward + step in one micro-batch,
gradient checkpointing on for all, `--probe-lens`) before it runs out of memory. Needs a CUDA GPU, rltrain and
rltrain-kernels installed, and liger-kernel for (b) (README.md beside this file).

    python benchmarks/bench_actor_step.py --size 0.6b
    python benchmarks/bench_actor_step.py --size 1.7b --probe-lens 4096,8192,16384,32768
    python benchmarks/bench_actor_step.py --size 1.7b --variants "rltrain packed,rltrain packed lora"
    python benchmarks/bench_actor_step.py --variants "rltrain packed,rltrain packed mixed" --no-probe
    python benchmarks/bench_actor_step.py --variants "rltrain packed mixed,rltrain packed mixed+critic" --no-probe
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import statistics
import tempfile
import time

import torch
from checkpoints import QWEN3_SIZES, VOCAB, build_checkpoint

LIGER_COMPILE_FAILED: list[str] = []
KERNELS = {"name": "auto", "include_kernels": "auto"}   # rltrain's: the registry's kernels for the model


def gemm_rates(n: int = 8192, sustain_s: float = 2.0) -> tuple[float, float]:
    """(burst, sustained) bf16 flop/s of an n³ matmul on this GPU, what MFU is measured against: the median of 20
    single GEMMs, each queued behind a spin kernel (the card at its boost clock), and the last 50 of `sustain_s` of
    back-to-back GEMMs (the card at its power limit)."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    flops = 2 * n**3
    events = lambda: (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))  # noqa: E731

    def queued_ms() -> float:
        torch.cuda.synchronize()
        start, end = events()
        torch.cuda._sleep(20_000_000)  # ≥ 10 ms of GPU work first: the host's launch overlaps it
        start.record()
        a @ b
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    for _ in range(3):
        a @ b
    burst = flops / (statistics.median(queued_ms() for _ in range(20)) * 1e-3)
    reps = max(1, int(sustain_s * burst / flops))
    timed = min(50, reps)
    start, end = events()
    for i in range(reps):
        if i == reps - timed:
            start.record()
        a @ b
    end.record()
    end.synchronize()
    return burst, flops * timed / (start.elapsed_time(end) * 1e-3)


def make_batch(responses: int, prompt_len: int, mean_len: float, max_len: int, seed: int = 0):
    """Left-padded prompts (all prompt_len), right-padded responses of log-normal lengths, GRPO-like fields."""
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    sigma = 1.0
    mu = math.log(mean_len) - sigma ** 2 / 2
    lengths = torch.exp(mu + sigma * torch.randn(responses, generator=g)).round().clamp(16, max_len).long()
    width = int(lengths.max())
    response_mask = (torch.arange(width)[None] < lengths[:, None]).long()
    batch = TensorDict({
        "prompt_ids": torch.randint(100, VOCAB - 100, (responses, prompt_len), generator=g),
        "prompt_mask": torch.ones(responses, prompt_len, dtype=torch.long),
        "response_ids": torch.randint(100, VOCAB - 100, (responses, width), generator=g) * response_mask,
        "response_mask": response_mask,
        "advantages": torch.randn(responses, generator=g)[:, None].expand(-1, width) * response_mask,
        "group_ids": torch.arange(responses) // 16,
    }, batch_size=[responses])
    return batch


# ---------------------------------------------------------------- (a), (b): the TRL path
class TRLPath:
    """TRL GRPOTrainer's actor work: logits of the completion positions (logits_to_keep), selective log-softmax
    row by row, the clipped GRPO loss, micro-batches of `rows` padded to their longest sequence."""

    def __init__(self, model_dir: str, rows: int, liger: bool, checkpointing: bool = False):
        import transformers as tf

        self.model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16,
                                                             attn_implementation="sdpa").cuda()
        self.model.train()
        if checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.rows, self.liger = rows, liger
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-6)
        self.note = ""
        if liger:   # once Liger's compiled loss has failed in this process, later instances go eager at once
            self._liger_loss(compiled=not LIGER_COMPILE_FAILED)
            if LIGER_COMPILE_FAILED:
                self.note = "eager loss math (its compile failed)"
            try:
                from liger_kernel.transformers import apply_liger_kernel_to_qwen3

                apply_liger_kernel_to_qwen3(model=self.model, rope=True, rms_norm=True, swiglu=True,
                                            cross_entropy=False, fused_linear_cross_entropy=False)
            except Exception as err:   # a transformers version Liger's patch does not know: loss kernel only
                self.note = f"model patch failed ({type(err).__name__}: {err}); fused loss only"

    def _liger_loss(self, compiled: bool):
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        self.loss_compiled = compiled
        self.grpo_loss = LigerFusedLinearGRPOLoss(beta=0.0, epsilon_low=0.2, epsilon_high=0.2, temperature=1.0,
                                                  use_ref_model=False, loss_type="bnpo", compiled=compiled)

    def _liger_grpo(self, hidden, micro, m, adv, old_logp):
        """Liger's fused linear GRPO loss; its torch.compile'd loss math falls back to eager where dynamo fails
        (torch 2.11: a guard error on the second, dynamic shape), as a user would have to."""
        args = (hidden, self.model.lm_head.weight, micro["response_ids"], m, adv)
        try:
            return self.grpo_loss(*args, old_per_token_logps=old_logp)[0]
        except Exception as err:   # torch 2.11: InternalTorchDynamoError or a guard AssertionError
            if not self.loss_compiled or isinstance(err, torch.OutOfMemoryError):
                raise
            LIGER_COMPILE_FAILED.append(f"{type(err).__name__}")
            self.note = f"loss compile failed ({type(err).__name__}), eager loss math" + (
                f"; {self.note}" if self.note else "")
            torch._dynamo.reset()
            self._liger_loss(compiled=False)
            return self.grpo_loss(*args, old_per_token_logps=old_logp)[0]

    def _inputs(self, micro):
        ids = torch.cat([micro["prompt_ids"], micro["response_ids"]], 1)
        mask = torch.cat([micro["prompt_mask"], micro["response_mask"]], 1)
        return ids, mask, (mask.cumsum(1) - 1).clamp(min=0)

    def _micros(self, batch):
        for start in range(0, batch.batch_size[0], self.rows):
            micro = batch[start:start + self.rows].clone()
            width = int(micro["response_mask"].sum(1).max())   # padded to the micro-batch's longest
            for key in ("response_ids", "response_mask", "advantages"):
                micro[key] = micro[key][:, :width]
            yield micro.cuda()

    def _logps(self, micro):
        ids, mask, pos = self._inputs(micro)
        width = micro["response_ids"].shape[1]
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                            logits_to_keep=width + 1).logits[:, :-1]
        out = []
        for row_logits, row_ids in zip(logits, micro["response_ids"]):   # TRL's selective_log_softmax (bf16)
            out.append(torch.log_softmax(row_logits, -1).gather(-1, row_ids[:, None]).squeeze(-1))
        return torch.stack(out)

    def old_logprobs(self, batch):
        with torch.no_grad():
            return [self._logps(micro).float() * micro["response_mask"] for micro in self._micros(batch)]

    def update(self, batch, old):
        total = batch["response_mask"].sum().item()
        self.optimizer.zero_grad(set_to_none=True)
        for micro, old_logp in zip(self._micros(batch), old):
            m = micro["response_mask"].float()
            adv = micro["advantages"][:, 0]
            if self.liger:
                ids, mask, pos = self._inputs(micro)
                width = micro["response_ids"].shape[1]
                hidden = self.model.model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
                loss = self._liger_grpo(hidden[:, -width - 1:-1], micro, m, adv, old_logp) * m.sum() / total
            else:
                logp = self._logps(micro).float()
                ratio = torch.exp(logp - old_logp)
                per_token = -torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None])
                loss = (per_token * m).sum() / total
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()


# ---------------------------------------------------------------- (c), (d): rltrain's ActorWorker
class RltrainPath:
    """rltrain's ActorWorker on the GPU; bf16 weights trained in place unless `mixed_precision` (fp32 masters)."""

    def __init__(self, model_dir: str, rows: int, packed: bool, max_tokens: int, checkpointing: bool = False,
                 lora_rank: int = 0, mixed_precision: bool = False, device: str = "cuda"):
        from rltrain.algorithms.config import LossConfig
        from rltrain.workers.actor import ActorWorker
        from rltrain.workers.actor_config import ActorConfig
        from rltrain.workers.lora import LoraConfig

        config = ActorConfig(lr=1e-5 if lora_rank else 1e-6, micro_batch_size=rows, use_remove_padding=packed,
                             max_tokens_per_micro_batch=max_tokens if packed else 0,
                             gradient_checkpointing=checkpointing, mixed_precision=mixed_precision,
                             lora=LoraConfig(rank=lora_rank, alpha=2.0 * lora_rank or 16.0))
        self.actor = ActorWorker(config, LossConfig(clip_low=0.2, clip_high=0.2), model_dir, "bfloat16",
                                 KERNELS, temperature=1.0, device=device)
        self.model, self.note = self.actor.model, ""

    def old_logprobs(self, batch):
        return self.actor.compute_logprobs(batch)

    def update(self, batch, old):
        batch = batch.clone()
        batch["old_logprobs"] = old
        self.actor.update(batch)


class CriticPath(RltrainPath):
    """(g): (e)'s actor and a CriticWorker on the same checkpoint, its ActorConfig from the default CriticConfig and
    the actor's (as the trainer builds it); gradient checkpointing follows the actor's (the length probe's: on)."""

    def __init__(self, model_dir: str, rows: int, max_tokens: int, checkpointing: bool = False, device: str = "cuda"):
        from rltrain.algorithms.config import LossConfig
        from rltrain.workers.critic import CriticConfig, CriticWorker

        super().__init__(model_dir, rows, packed=True, max_tokens=max_tokens, checkpointing=checkpointing,
                         mixed_precision=True, device=device)
        critic = CriticConfig(gradient_checkpointing=checkpointing)
        self.critic = CriticWorker(critic.worker_config(self.actor.config), LossConfig(), model_dir, "bfloat16",
                                   KERNELS, temperature=1.0, device=device, cliprange_value=critic.cliprange_value)
        self.values = None
        self.note = "MFU: the actor's flops only"

    def old_logprobs(self, batch):
        logprobs = super().old_logprobs(batch)
        self.values = self.critic.compute_values(batch)   # V_old, kept for the update
        return logprobs

    def update(self, batch, old):
        # fixed random targets (seed 5) on the response tokens: the value loss's cost does not depend on them
        returns = torch.randn(batch["response_mask"].shape, generator=torch.Generator().manual_seed(5))
        critic_batch = batch.clone()
        critic_batch["values"], critic_batch["returns"] = self.values, returns * batch["response_mask"]
        self.critic.update(critic_batch)
        super().update(batch, old)


VARIANTS = {
    "trl": lambda d, a: TRLPath(d, a.rows, liger=False, checkpointing=a.checkpointing),
    "trl+liger": lambda d, a: TRLPath(d, a.rows, liger=True, checkpointing=a.checkpointing),
    "rltrain padded": lambda d, a: RltrainPath(d, a.rows, packed=False, max_tokens=0, checkpointing=a.checkpointing),
    "rltrain packed": lambda d, a: RltrainPath(d, a.rows, packed=True, max_tokens=a.max_tokens,
                                               checkpointing=a.checkpointing),
    "rltrain packed mixed": lambda d, a: RltrainPath(d, a.rows, packed=True, max_tokens=a.max_tokens,
                                                     checkpointing=a.checkpointing, mixed_precision=True),
    "rltrain packed mixed+critic": lambda d, a: CriticPath(d, a.rows, max_tokens=a.max_tokens,
                                                           checkpointing=a.checkpointing),
    "rltrain packed lora": lambda d, a: RltrainPath(d, a.rows, packed=True, max_tokens=a.max_tokens,
                                                    checkpointing=a.checkpointing, lora_rank=a.lora_rank),
}


def model_flops(model, batch) -> float:
    """8·N·tokens (old log-probs 2N + update 6N) plus causal attention, 4 passes' worth."""
    n_params = sum(p.numel() for p in model.parameters())
    lengths = batch["prompt_mask"].sum(1) + batch["response_mask"].sum(1)
    c = model.config
    attention = 4 * (4 * (lengths.double() ** 2) / 2 * c.num_attention_heads * c.head_dim).sum().item()
    return 8 * n_params * float(lengths.sum()) + attention * c.num_hidden_layers


def timed_step(path, batch):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    old = path.old_logprobs(batch)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    path.update(batch, old)
    torch.cuda.synchronize()
    return t1 - t0, time.perf_counter() - t1, old


def release_memory():
    """Return the memory of dropped objects (a variant's model, optimizer, an OOM's partial step) to the GPU."""
    gc.collect()
    torch.cuda.empty_cache()


def rows_logps(old, batch):
    """The old log-probs as one [B, R] tensor (TRL's come per micro-batch, cut to each one's width)."""
    if isinstance(old, torch.Tensor):
        return old.cpu()
    out = torch.zeros(batch["response_mask"].shape)
    start = 0
    for micro in old:
        out[start:start + micro.shape[0], : micro.shape[1]] = micro.cpu()
        start += micro.shape[0]
    return out


def longest_at_batch_8(factory, model_dir, args, prompt_len: int, probe_lens: list[int]) -> str:
    """The longest response length (of probe_lens, ascending) at which one batch of 8 trains without OOM."""
    best = "< " + str(probe_lens[0])
    for length in probe_lens:
        path = None
        try:
            args.rows, args.max_tokens, args.checkpointing = 8, 8 * (prompt_len + length), True
            path = factory(model_dir, args)
            batch = make_batch(8, prompt_len, length, length)
            batch["response_mask"][:] = 1   # every response exactly `length` long
            path.update(batch, path.old_logprobs(batch))
            torch.cuda.synchronize()
            best = str(length)
        except torch.OutOfMemoryError:
            break
        finally:
            path = None
            release_memory()
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=[s for s in QWEN3_SIZES if s != "tiny"], default="0.6b")
    parser.add_argument("--responses", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--mean-len", type=float, default=1024)
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=4, help="padded variants' micro-batch rows")
    parser.add_argument("--max-tokens", type=int, default=16384, help="packed variant's micro-batch token budget")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--lora-rank", type=int, default=32, help="the lora variant's adapter rank")
    parser.add_argument("--probe-lens", default="4096,8192,16384,32768")
    parser.add_argument("--no-probe", action="store_true")
    parser.add_argument("--no-timing", action="store_true", help="the length probe only")
    args = parser.parse_args()
    args.checkpointing = False   # the timed step: no gradient checkpointing; the length probe: on, for every variant
    # the in-place bf16 variants are on purpose (TRL's precision): not the warning actor.mixed_precision=false logs
    logging.getLogger("rltrain.workers.precision").setLevel(logging.ERROR)
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.get_device_name()}")
    burst, sustained = gemm_rates()
    print(f"bf16 GEMM 8192^3: burst {burst / 1e12:.0f}, sustained {sustained / 1e12:.0f} TFLOP/s")
    root = tempfile.mkdtemp()
    model_dir = build_checkpoint(args.size, root)
    batch = make_batch(args.responses, args.prompt_len, args.mean_len, args.max_len)
    tokens = int(batch["prompt_mask"].sum() + batch["response_mask"].sum())
    padded_tokens = batch.batch_size[0] * (batch["prompt_ids"].shape[1] + batch["response_ids"].shape[1])
    print(f"batch: {args.responses} responses, {tokens} tokens (mean response "
          f"{batch['response_mask'].sum(1).float().mean():.0f}, max {batch['response_ids'].shape[1]}; "
          f"padded to the batch's width: {padded_tokens / tokens:.2f}x)")
    rows, logps = [], {}
    # two shapes: torch.compile (Liger's loss) recompiles once for dynamic shapes, outside the timed step
    warm = [make_batch(8, 64, 128, 256, seed=1), make_batch(8, 96, 300, 600, seed=2)]
    for name in args.variants.split(",") if not args.no_timing else []:
        args_copy = argparse.Namespace(**vars(args))
        while True:   # padded variants: the most rows per micro-batch (of --rows, halved) that fit in memory
            path = VARIANTS[name](model_dir, args_copy)
            try:
                for warm_batch in warm:   # compile / autotune / allocator warm-up
                    timed_step(path, warm_batch)
                torch.cuda.reset_peak_memory_stats()
                old_s, update_s, old = timed_step(path, batch)
                break
            except torch.OutOfMemoryError:
                pass
            path = None
            release_memory()
            if name.startswith("rltrain packed") or args_copy.rows == 1:
                raise RuntimeError(f"{name}: out of memory")
            args_copy.rows //= 2
            print(f"  {name}: out of memory, retrying with {args_copy.rows} rows per micro-batch", flush=True)
        if not name.startswith("rltrain packed"):
            path.note = f"{args_copy.rows} rows/micro-batch" + (f"; {path.note}" if path.note else "")
        peak = torch.cuda.max_memory_allocated() / 2**30
        flops = model_flops(path.model, batch)
        logps[name] = rows_logps(old, batch)
        rows.append([name, tokens / (old_s + update_s), old_s, update_s, peak,
                     flops / (old_s + update_s) / sustained, path.note])
        print(f"  {name}: {rows[-1][1]:.0f} tok/s, old {old_s:.2f} s, update {update_s:.2f} s, peak {peak:.1f} GiB",
              flush=True)
        path = None
        release_memory()
    first, mask = next(iter(logps.values()), None), batch["response_mask"].bool()
    for name, value in logps.items():
        err = (value[mask] - first[mask]).norm() / first[mask].norm()
        print(f"  old log-probs {name} vs {next(iter(logps))}: relative error {err:.2e}")
    longest = {}
    if not args.no_probe:
        probe = [int(x) for x in args.probe_lens.split(",")]
        for name in args.variants.split(","):
            longest[name] = longest_at_batch_8(VARIANTS[name], model_dir, argparse.Namespace(**vars(args)),
                                               args.prompt_len, probe)
            print(f"  {name}: longest response at batch 8: {longest[name]}", flush=True)
    base = {r[0]: r[1] for r in rows}
    print(f"\n### Actor step, Qwen3-{args.size} bf16, {args.responses} responses ({tokens} tokens), "
          f"{torch.cuda.get_device_name()}\n")
    print("| variant | tokens/s | vs trl | vs trl+liger | old log-probs s | update s | peak GiB | MFU (sustained) "
          "| longest response at batch 8 | note |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, tps, old_s, update_s, peak, mfu, note in rows:
        ratio = {k: f"{tps / base[k]:.2f}x" if k in base else "-" for k in ("trl", "trl+liger")}
        print(f"| {name} | {tps:.0f} | {ratio['trl']} | {ratio['trl+liger']} | {old_s:.2f} | {update_s:.2f} | "
              f"{peak:.1f} | {mfu:.1%} | {longest.get(name, '-')} | {note} |")
    print(mixed_precision_cost(rows))
    print(critic_cost(rows))


def mixed_precision_cost(rows: list) -> str:
    """A line: 'rltrain packed mixed' (fp32 masters) against 'rltrain packed' (bf16 in place), where both ran."""
    by_name = {row[0]: row for row in rows}
    if not {"rltrain packed", "rltrain packed mixed"} <= set(by_name):
        return ""
    pure, mixed = by_name["rltrain packed"], by_name["rltrain packed mixed"]
    return (f"\nmixed precision (fp32 masters) against bf16 in place: {mixed[1] / pure[1]:.2f}x the tokens/s "
            f"(goal >= 0.90), update {mixed[3]:.2f} s against {pure[3]:.2f} s, peak {mixed[4] - pure[4]:+.1f} GiB")


def critic_cost(rows: list) -> str:
    """A line: 'rltrain packed mixed+critic' (PPO's actor + critic) against 'rltrain packed mixed' (GRPO's actor)."""
    by_name = {row[0]: row for row in rows}
    if not {"rltrain packed mixed", "rltrain packed mixed+critic"} <= set(by_name):
        return ""
    grpo, ppo = by_name["rltrain packed mixed"], by_name["rltrain packed mixed+critic"]
    return (f"\nthe critic (PPO) against GRPO's actor alone: old pass {ppo[2] - grpo[2]:+.2f} s, update "
            f"{ppo[3] - grpo[3]:+.2f} s, step {(ppo[2] + ppo[3]) / (grpo[2] + grpo[3]):.2f}x the time, peak "
            f"{ppo[4] - grpo[4]:+.1f} GiB")


if __name__ == "__main__":
    main()
