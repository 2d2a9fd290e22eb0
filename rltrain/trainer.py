"""The single controller: holds the GRPO loop and nothing heavy; the roles are Ray actors holding the models.

One step: sample prompts → rollout (n responses each, split across the rollout replicas) → reward (and DAPO's
length shaping) → old (and reference, and with algorithm.distill the teacher's) log-probs → with a critic
(adv_estimator=gae, PPO) its values → advantages (REINFORCE++'s KL penalty in the reward needs the reference's,
distillation's per-token term the teacher's) → critic update → actor update (none in the critic's warm-up) → push
the new weights into every rollout replica.
Validation (trainer.val_n responses per prompt, by default one, greedy) runs at step 0, every trainer.val_every
steps and at the end; checkpoints every trainer.save_every steps and at the end. Each step's record says where its
time went (time/*_s: rollout, reward, old_logprob, ref, teacher, values, critic, update, weight_sync, step) and how
fast the rollout and the actor ran (perf/*; rltrain/perf.py).
trainer.mode one_step_off / async hand the sampling, rollout and scoring to a RolloutProducer thread
(rltrain/async_rollout.py) that runs while the actor trains; the step takes its batch from the producer's queue and
publishes each update's weights to it instead of pushing them. Every response carries the weight version that
sampled it (weight_version), logged as rollout/version_lag_mean and _max; with rollout.partial every token carries
its own (token_versions: a push interrupts the generation in flight, which goes on with the new weights) and the
lags are over tokens. Without dynamic sampling a batch is scored on a thread of its own (self.scoring) while the
producer generates the next one.
The trainer holds its output directory's lock (rltrain/output_dir.py) from construction to close(), which stops
every worker whatever fails; a local Ray it starts dies with the driver (rltrain/watchdog.py). Saving and resuming
checkpoints: rltrain/trainer_checkpoints.py; the reward model's and the judge's scores blended into the reward:
rltrain/rewards/combine.py.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import ray
import torch
import transformers
from tensordict import TensorDict

from rltrain.algorithms.advantages import batch_advantages
from rltrain.algorithms.config import LossConfig
from rltrain.algorithms.dapo import collect_groups, mask_truncated, overlong_penalty
from rltrain.algorithms.kl_control import KLController
from rltrain.algorithms.rollout_correction import apply_rollout_correction
from rltrain.async_rollout import (
    ProducedBatch, RolloutProducer, generate_in_segments, lag_metrics, token_lags, warn_uncorrected,
)
from rltrain.config import ConfigError
from rltrain.data.rows import load_rows
from rltrain.data.sampler import PromptSampler, drop_long_prompts, encode_prompts
from rltrain.embedded.model import embedded_policy_dir
from rltrain.embedded.task import make_rows
from rltrain.job import JobConfig, resolve_device, resolve_dtype
from rltrain.output_dir import OutputDirLock, remove_unfinished
from rltrain.perf import StepTimer, actor_step_flops, mfu, peak_flops
from rltrain.ray_session import init_ray
from rltrain.rewards.combine import Scorers, score_batch
from rltrain.rewards.health import ErrorRateGuard, RewardStats
from rltrain.tracking import Tracker
from rltrain.trainer_checkpoints import TrainerCheckpoints
from rltrain.validation import validation_metrics
from rltrain.workers.actor import ActorWorker, FSDPActorWorker
from rltrain.workers.agent_loop import episode_metrics, prompt_tools
from rltrain.workers.critic import CriticWorker, FSDPCriticWorker, value_metrics
from rltrain.workers.group import Placement, call_each_rank, kill, place_model_roles, place_separate, start_role
from rltrain.workers.judge import JudgeWorker
from rltrain.workers.lora import check_target_modules_of
from rltrain.workers.policy import load_tokenizer
from rltrain.workers.reference import FSDPReferenceWorker, ReferenceWorker, check_teacher
from rltrain.workers.reward import RewardWorker, response_texts
from rltrain.workers.reward_model import FSDPRewardModelWorker, RewardModelWorker
from rltrain.workers.rollout_group import RolloutReplicas, place_rollout
from rltrain.workers.vllm_lora import check_lora_dtype
from rltrain.workers.weight_sync import WeightPush

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 60.0  # close() waits this long for the reward worker to stop its pool


def resolve_model_and_data(job: JobConfig):
    """(model dir, train rows, val rows): the given ones, or the embedded default's (warm-started, cached). Data is
    read and validated first, so a malformed row fails before any model work."""
    if job.data.train_files is None:
        train_rows, val_rows = make_rows(job.data.task)
    else:
        train_rows = load_rows(job.data.train_files)
        val_rows = load_rows(job.data.val_files) if job.data.val_files is not None else []
    if job.model.path is None:
        model_dir = str(embedded_policy_dir(job.trainer.output_dir, job.model.embedded, job.data.task,
                                            job.trainer.seed, resolve_device(job.trainer.device)))
    else:
        model_dir = job.model.path
        if not (Path(model_dir) / "config.json").is_file():
            raise FileNotFoundError(f"model.path: {model_dir!r} is not a transformers model directory "
                                    "(no config.json)")
    return model_dir, train_rows, val_rows


class GRPOTrainer(TrainerCheckpoints):
    # what close() stops; None until started (a constructor that failed half-way closes what it started)
    lock = tracker = actor = critic = rollout = reference = teacher = reward = reward_model = judge = None
    placement = rollout_placement = None
    own_placements: tuple[Placement, ...] = ()   # the reward roles' placement=separate devices

    def __init__(self, job: JobConfig):
        self.job = job
        self.output_dir = Path(job.trainer.output_dir)
        # first: a second run in this directory stops here (exit 2), before it touches anything in it
        self.lock = OutputDirLock.acquire(self.output_dir)
        try:
            remove_unfinished(self.output_dir)
            self._setup()
        except BaseException:
            self.close(raise_errors=False)
            raise

    def _setup(self) -> None:
        transformers.utils.logging.disable_progress_bar()
        job = self.job
        device = job.trainer.device
        if device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("trainer.device: 'cuda' was asked for but this machine shows no CUDA device")
        self.device = resolve_device(device)
        self.model_dir, train_rows, val_rows = resolve_model_and_data(job)
        check_target_modules_of(self.model_dir, job.actor.lora)
        if job.algorithm.adv_estimator == "gae":
            check_target_modules_of(job.critic.model.path or self.model_dir, job.critic.lora, "critic.lora")
        if job.actor.lora.enabled and job.rollout.engine == "vllm":
            check_lora_dtype(resolve_dtype(job.model.dtype, self.device), self.device)
        self.saved_tokenizer = load_tokenizer(self.model_dir)   # checkpoints carry the model's own, unchanged
        self.tokenizer = load_tokenizer(self.model_dir, padding_side="left")
        if self.tokenizer.pad_token_id is None:  # prompts are left-padded (masked) with <eos> where no pad exists
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if job.algorithm.distill.enabled:
            check_teacher(job.algorithm.distill.teacher_path, self.tokenizer)
        if job.algorithm.adv_estimator == "gae" and job.critic.model.path is not None:
            check_teacher(job.critic.model.path, self.tokenizer, key="critic.model.path", role="critic")
        limit = job.data.max_prompt_length
        self.tools = prompt_tools(job.rollout.multi_turn)  # chat prompts carry the tools' schemas: measured with them
        self.sampler = PromptSampler(drop_long_prompts(train_rows, self.tokenizer, limit, "data.train_files",
                                                       self.tools), job.trainer.seed)
        self.val_rows = drop_long_prompts(val_rows, self.tokenizer, limit, "data.val_files", self.tools) \
            if val_rows else []
        if job.data.val_max_rows:
            self.val_rows = self.val_rows[:job.data.val_max_rows]
        self._start_workers()
        self.tracker = Tracker(job.trainer.logger, str(self.output_dir), job.trainer.total_steps,
                               project=job.trainer.project, run_name=job.trainer.run_name or self.output_dir.name,
                               config=dataclasses.asdict(job))
        self.step, self.initial_val = 0, None
        self.producer: RolloutProducer | None = None   # trainer.mode one_step_off / async, while fit() runs
        self.scoring: ThreadPoolExecutor | None = None  # the producer's batches' scoring, beside its next rollout
        self.first_version, self.trained_sampler_state = 0, None
        self.reward_guard = ErrorRateGuard.for_config(job.reward)   # reward.max_error_rate: stops a failing run
        self.kl_control = KLController(job.algorithm.kl_ctrl, job.algorithm.loss.kl_coef)   # kl_in_reward's β

    def _start_workers(self) -> None:
        job = self.job
        if not ray.is_initialized():
            init_ray(job.ray)
        # The model roles are colocated: rank r of the actor and the reference and rollout process r share placement
        # bundle r, one GPU (or CPU), each asking a fraction of it, since Ray hides the GPU from an actor that asks
        # for none. trainer.nnodes × n_gpus_per_node bundles; actor.strategy=fsdp2 puts a rank on each, the rollout
        # one engine per rollout.tensor_parallel_size of them (rltrain/workers/rollout_group.py). With actor.lora on
        # the reference is the actor's own base (adapters disabled): no reference role.
        # rollout.placement=separate: the rollout replicas hold devices of their own (place_rollout), so the engines
        # can generate while the actor trains, and the model roles share only their bundles
        needs_reference = job.algorithm.loss.kl_coef > 0 and not job.actor.lora.enabled
        distill, separate = job.algorithm.distill, job.rollout.placement == "separate"
        teacher_worker = distill.enabled and not distill.exact  # exact: the teacher lives in the actor's process
        reward_model, critic = job.reward.model.enabled, job.algorithm.adv_estimator == "gae"
        judge = job.reward.judge.enabled
        # reward.model / reward.judge .placement=separate: GPUs of their own (place_separate), not a share of these
        own_model, own_judge = (reward_model and job.reward.model.placement == "separate",
                                judge and job.reward.judge.placement == "separate")
        model_roles = (2 + needs_reference + teacher_worker + critic - separate + reward_model - own_model + judge
                       - own_judge)
        share, sharded = 1 / model_roles, job.actor.strategy == "fsdp2"
        self.placement = place_model_roles(job.trainer.nnodes, job.trainer.n_gpus_per_node, self.device,
                                           job.ray.placement_timeout_s)
        self.rollout_placement = place_rollout(job.rollout, self.device, job.ray.placement_timeout_s) \
            if separate else None
        common = dict(model_path=self.model_dir, dtype=resolve_dtype(job.model.dtype, self.device),
                      kernel_config=job.kernel_config, device=self.device,
                      attn_implementation=job.model.attn_implementation)
        temperature, actor_config = job.rollout.temperature, job.actor
        if separate and self.device != "cuda" and actor_config.torch_threads == 0:  # the cores the rollout leaves
            threads = max(1, ((os.cpu_count() or 1) - job.rollout.replicas) // self.placement.world_size)
            actor_config = dataclasses.replace(actor_config, torch_threads=threads)
        self.actor = start_role(FSDPActorWorker if sharded else ActorWorker, self.placement, share, sharded,
                                config=actor_config, loss=job.algorithm.actor_loss(job.rollout.max_new_tokens),
                                temperature=temperature, seed=job.trainer.seed,
                                total_steps=job.trainer.total_steps,
                                **(dict(distill=distill) if distill.exact else {}), **common)
        self.rollout = RolloutReplicas(job.rollout, self.rollout_placement or self.placement,
                                       1.0 if separate else share, job.ray.placement_timeout_s, lora=job.actor.lora,
                                       logprobs=job.rollout_reports_logprobs,
                                       routing=job.actor.router_replay.mode == "R3", **common)

        sharding = dict(fsdp=job.actor.fsdp, sequence_parallel_size=job.actor.ulysses_sequence_parallel_size)

        def frozen(model_path: str):  # a ReferenceWorker: the reference, or distillation's teacher
            return start_role(FSDPReferenceWorker if sharded else ReferenceWorker, self.placement, share, sharded,
                              temperature=temperature, batching=job.actor.micro_batching,
                              **(sharding if sharded else {}), **dict(common, model_path=model_path))

        self.reference = frozen(self.model_dir) if needs_reference else None
        self.teacher = frozen(distill.teacher_path) if teacher_worker else None
        if critic:  # sharded and placed like the actor
            self.critic = start_role(FSDPCriticWorker if sharded else CriticWorker, self.placement, share, sharded,
                                     config=job.critic.worker_config(actor_config), loss=LossConfig(),
                                     temperature=1.0, seed=job.trainer.seed, total_steps=job.trainer.total_steps,
                                     cliprange_value=job.critic.cliprange_value,
                                     **dict(common, model_path=job.critic.model.path or self.model_dir))
        self.reward = ray.remote(RewardWorker).options(num_cpus=0).remote(job.reward)
        if reward_model:  # colocated: placed and sharded like the reference; separate: FSDP2 over its own GPUs
            config, timeout = job.reward.model, job.ray.placement_timeout_s
            placement = self._own_placement("reward.model.placement", config.n_gpus, timeout) if own_model \
                else self.placement
            fsdp = dataclasses.replace(job.actor.fsdp, fsdp_size=-1) if own_model else job.actor.fsdp
            shard = config.n_gpus > 1 if own_model else sharded
            self.reward_model = start_role(FSDPRewardModelWorker if shard else RewardModelWorker, placement,
                                           1.0 if own_model else share, shard, config=config,
                                           dtype=common["dtype"], device=self.device,
                                           torch_threads=job.actor.torch_threads, **(dict(fsdp=fsdp) if shard else {}))
        if judge:  # colocated: a share of bundle 0, like the reward model; separate: a GPU of its own
            path = self.model_dir if job.reward.judge.path == "policy" else job.reward.judge.path
            engine = job.rollout.engine if job.reward.judge.engine == "auto" else job.reward.judge.engine
            placement = self._own_placement("reward.judge.placement", 1, job.ray.placement_timeout_s) if own_judge \
                else self.placement
            self.judge = start_role(JudgeWorker, placement, 1.0 if own_judge else share, False,
                                    config=job.reward.judge, model_path=path, dtype=common["dtype"],
                                    device=self.device, torch_threads=job.actor.torch_threads, engine=engine)
        self.weight_push = WeightPush(self.actor, self.rollout, job.actor.weight_bucket_mb)
        self.model_shape = ray.get(self.actor.model_shape.remote())
        actor_device = ray.get(self.actor.device_info.remote())
        self.peak_flops = peak_flops(actor_device[1]) if actor_device else None

    def _own_placement(self, key: str, ranks: int, timeout_s: float) -> Placement:
        """A reward role's devices of its own (`key`=separate), removed with the others at close."""
        placement = place_separate(key, ranks, self.device, timeout_s)
        self.own_placements += (placement,)
        return placement

    # ---------------------------------------------------------------- one step
    def _generate_and_score(self, rows, n: int, temperature: float, seed: int, timer: StepTimer | None = None,
                            refresh=None):
        """(batch with its rewards, reward extras, RewardStats): _generate, then _score."""
        timer = timer or StepTimer()
        batch, scoring = self._generate(rows, n, temperature, seed, timer, refresh)
        extras, errors = self._score(batch, scoring, timer)
        return batch, extras, errors

    def _generate(self, rows, n: int, temperature: float, seed: int, timer: StepTimer, refresh=None):
        """(batch, what _score needs besides it) for n responses per row. refresh: rollout.partial's
        RolloutProducer.refresh (training batches): newer weights loaded during the generation, which the vllm engine
        aborts and resumes (rltrain/workers/interruptible.py) and the hf engine generates in segments for
        (rltrain/async_rollout.py)."""
        ids, mask = encode_prompts(rows, self.tokenizer, self.tools)
        with timer.phase("rollout"):
            if refresh is None:
                env_rows = [dataclasses.asdict(row) for row in rows] if self.job.rollout.multi_turn.needs_rows \
                    else None   # an environment's reset, or an agent, reads each episode's row
                batch = self.rollout.generate(ids, mask, n, temperature, seed, rows=env_rows)
            else:
                def timed_refresh() -> int:  # its loads count as weight_load (the producer's), not as rollout
                    start = time.monotonic()
                    version = refresh()
                    timer.add("rollout", start - time.monotonic())
                    return version

                rollout = self.job.rollout
                if rollout.engine == "vllm":   # the async engine: a push aborts the requests in flight and resumes them
                    batch = self.rollout.generate_partial(ids, mask, n, temperature, seed, timed_refresh)
                else:   # the hf engine has no async engine: segments, newer weights loaded between them
                    batch = generate_in_segments(self.rollout.generate, timed_refresh, ids, mask, n, temperature,
                                                 seed, rollout.max_new_tokens, rollout.partial_segment_tokens,
                                                 self.tokenizer.pad_token_id)
        timer.count("rollout_tokens", batch["response_mask"].sum().item())
        response_rows = [row for row in rows for _ in range(n)]
        messages = batch.pop("messages").tolist() if "messages" in batch.keys() else None  # multi-turn episodes
        env_rewards = batch["env_reward"].tolist() if "env_reward" in batch.keys() else None   # an environment's
        return batch, (response_rows, messages, env_rewards)

    def _score(self, batch: TensorDict, scoring: tuple, timer: StepTimer) -> tuple[list, RewardStats]:
        """batch["rewards"] from the reward function, model and judge; (reward extras, RewardStats)."""
        response_rows, messages, env_rewards = scoring
        with timer.phase("reward"):
            texts = response_texts(self.tokenizer, batch["response_ids"], batch["response_mask"])
            rewards, extras, errors = score_batch(Scorers(self.reward, self.reward_model, self.judge), self.job.reward,
                                                  texts, response_rows, messages, env_rewards)
        batch["rewards"] = rewards
        return extras, errors

    def _collect(self, step: int, timer: StepTimer):
        """A batch of data.batch_size prompt groups (collect_groups), with the reward extras and error count of
        every round generated and the number of prompts sampled."""
        job = self.job
        want, n = job.data.batch_size, job.rollout.n
        extras, errors = [], RewardStats()

        def generate_round(round_: int) -> TensorDict:
            nonlocal errors
            batch, round_extras, round_errors = self._generate_and_score(
                self.sampler.next(want), n, job.rollout.temperature, self._seed(step, round_), timer, self._refresh())
            extras.extend(round_extras)
            errors += round_errors
            return batch

        batch, rounds = collect_groups(generate_round, want, n, job.algorithm.dynamic_sampling,
                                       job.algorithm.dynamic_sampling_max_rounds)
        return batch, extras, errors, rounds * want

    def _seed(self, step: int, round_: int) -> int:
        return self.job.trainer.seed * 1_000_003 + step * 101 + round_

    def _refresh(self):
        return self.producer.refresh if self.job.rollout.partial and self.producer is not None else None

    def _produce(self, step: int) -> ProducedBatch:
        """The producer's work for one step (on its thread), timed apart from the trainer's step: _collect; or, where
        nothing waits on the rewards (no dynamic sampling), the rollout alone, its scoring handed to the scoring
        thread so that the next step's rollout overlaps it (take() waits for it)."""
        timer = StepTimer()
        if self.scoring is None:
            batch, extras, errors, prompts = self._collect(step, timer)
            return ProducedBatch(step, batch, extras, errors, prompts, timer.seconds, timer.counts,
                                 self.sampler.state_dict())
        want = self.job.data.batch_size
        batch, scoring = self._generate(self.sampler.next(want), self.job.rollout.n, self.job.rollout.temperature,
                                        self._seed(step, 0), timer, self._refresh())
        item = ProducedBatch(step, batch, [], RewardStats(), want, timer.seconds, timer.counts,
                             self.sampler.state_dict())

        def score():
            item.extras, item.errors = self._score(batch, scoring, timer)

        item.scored = self.scoring.submit(score)
        return item

    def _take(self, step: int, timer: StepTimer):
        """Step `step`'s batch from the producer's queue, like _collect's; its phases join the step's record and the
        wait for it is time/rollout_wait_s."""
        with timer.phase("rollout_wait"):
            item = self.producer.take(step)
        for name, seconds in item.seconds.items():
            timer.add(name, seconds)
        for name, amount in item.counts.items():
            timer.count(name, amount)
        self.trained_sampler_state = item.sampler_state
        return item.batch, item.extras, item.errors, item.prompts

    def train_step(self, step: int) -> dict:
        job, start, timer = self.job, time.monotonic(), StepTimer()
        if self.producer is None:
            batch, extras, errors, prompts_seen = self._collect(step, timer)
            batch["weight_version"] = torch.full((batch.batch_size[0],), step - 1, dtype=torch.long)
        else:
            batch, extras, errors, prompts_seen = self._take(step, timer)
        self.reward_guard.add(errors)
        lags = token_lags(job.trainer.mode, job.trainer.max_staleness, step, self.first_version, batch)
        if batch.batch_size[0] == 0:
            logger.warning("step %d: dynamic sampling kept no group (all rewards equal in every group); skipped",
                           step)
            if self.producer is not None:  # the same weights as version `step`: the producer may wait for it
                timer.add("weight_sync", self.push_weights(step))
            return {"step": step, "train/groups_kept": 0.0, **errors.metrics(), **timer.record()}
        if self.producer is None:
            self.rollout.sleep()  # colocated: the engines free their memory until the weight push
        response_len, scores = batch["response_mask"].sum(1).float(), batch["rewards"]
        metrics = {**lag_metrics(lags), **self._shape_rewards(batch, response_len)}
        if job.algorithm.overlong_filter:
            batch["response_mask"] = mask_truncated(batch["response_mask"], batch["truncated"])
        on_policy = job.old_logprobs == "update"   # π_old = π_θ: the update's own forward gives its log-probs
        timer.add("old_logprob", 0.0)
        if not on_policy:
            with timer.phase("old_logprob"):  # algorithm.old_logprobs=rollout: the sampling engine's, no recompute
                batch["old_logprobs"] = batch["rollout_logprobs"].clone() if job.old_logprobs == "rollout" \
                    else ray.get(self.actor.compute_logprobs.remote(batch))
            metrics.update(apply_rollout_correction(batch, job.algorithm.rollout_correction,
                                                    job.algorithm.loss.decoupled))
        timer.add("ref", 0.0)
        if job.algorithm.loss.kl_coef > 0:
            with timer.phase("ref"):
                batch["ref_logprobs"] = ray.get(self._reference_logprobs(batch))
        if self.teacher is not None:
            with timer.phase("teacher"):
                batch["teacher_logprobs"] = ray.get(self.teacher.compute_logprobs.remote(batch))
        if self.critic is not None:
            with timer.phase("values"):
                batch["values"] = ray.get(self.critic.compute_values.remote(batch))
        batch["advantages"], advantage_metrics = batch_advantages(batch, job.algorithm, self.kl_control.coef)
        if job.algorithm.kl_in_reward:   # the next step's β (adaptive); this step's penalty used the one before
            self.kl_control.update(advantage_metrics["train/kl"], batch.batch_size[0])
        metrics.update(advantage_metrics)
        if self.critic is not None:
            with timer.phase("critic"):
                metrics.update(ray.get(self.critic.update.remote(batch, step)))
            metrics.update(value_metrics(batch))
        if self.critic is None or step > job.critic.warmup_steps:   # the critic's warm-up: the policy waits
            with timer.phase("update"):
                update = ray.get(self.actor.update.remote(batch, step))
            if on_policy:  # the train-inference mismatch metrics, against the log-probs the update computed
                batch["old_logprobs"] = update.pop("old_logprobs")
                metrics.update(apply_rollout_correction(batch, job.algorithm.rollout_correction,
                                                        job.algorithm.loss.decoupled))
            metrics.update(update)
        timer.add("weight_sync", self.push_weights(step))
        if self.producer is None:
            self._offload_idle_roles()
        elapsed = time.monotonic() - start
        tokens = batch["prompt_mask"].sum().item() + batch["response_mask"].sum().item()
        record = {"step": step, "train/reward_mean": scores.mean().item(),
                  "train/reward_std": scores.std().item() if batch.batch_size[0] > 1 else 0.0,
                  "train/response_len_mean": response_len.mean().item(),
                  "train/truncated_frac": batch["truncated"].float().mean().item(),
                  "train/groups_kept": batch.batch_size[0] / job.rollout.n / job.data.batch_size,
                  "train/prompts_sampled": prompts_seen, **metrics, **episode_metrics(batch), **errors.metrics(),
                  **self._perf(batch, timer), "time/step_s": elapsed, "perf/tokens_per_s": tokens / elapsed}
        for key in sorted({k for e in extras for k in e}):
            values = [e[key] for e in extras if key in e]
            record[f"reward/{key}_mean"] = sum(values) / len(values)
        return record

    def _offload_idle_roles(self) -> None:
        """actor.fsdp.param_offload (sync mode): the actor's and critic's shards to CPU memory while the colocated
        rollout generates; each returns at its next forward (the reference offloads itself after its log-probs)."""
        if self.job.actor.strategy == "fsdp2" and self.job.actor.fsdp.param_offload:
            ray.get([ref for role in (self.actor, self.critic) if role is not None
                     for ref in call_each_rank(role, "offload")])

    def _reference_logprobs(self, batch: TensorDict) -> ray.ObjectRef:
        """The reference policy's log-probs: the ReferenceWorker's, or with actor.lora the actor's base model's
        (its adapters disabled)."""
        if self.reference is None:
            return self.actor.compute_ref_logprobs.remote(batch)
        return self.reference.compute_logprobs.remote(batch)

    def _shape_rewards(self, batch: TensorDict, response_len: torch.Tensor) -> dict:
        """DAPO's soft overlong punishment (algorithm.overlong_buffer) added to batch["rewards"], after dynamic
        sampling kept the groups whose scores differ; train/reward_mean stays the reward function's mean."""
        buffer = self.job.algorithm.overlong_buffer
        if not buffer.len:
            return {}
        penalty = overlong_penalty(response_len, self.job.rollout.max_new_tokens, buffer.len, buffer.penalty_factor)
        batch["rewards"] = batch["rewards"] + penalty.to(batch["rewards"].dtype)
        return {"train/overlong_penalty_mean": penalty.mean().item()}

    def _perf(self, batch: TensorDict, timer: StepTimer) -> dict:
        """time/<phase>_s and the step's rates: rollout tokens (generated, every round) and the actor's tokens
        (prompt + response, through the old log-probs and the update) per second, and on a known GPU the actor's
        MFU (rltrain/perf.py)."""
        generated = timer.counts.get("rollout_tokens", 0.0)
        response_lengths = batch["response_mask"].sum(1)
        sequence_lengths = batch["prompt_mask"].sum(1) + response_lengths
        actor_s = timer.get("old_logprob") + timer.get("update")
        record = {**timer.record(), "perf/rollout_tokens_per_s": generated / max(timer.get("rollout"), 1e-9),
                  "perf/actor_tokens_per_s": sequence_lengths.sum().item() / max(actor_s, 1e-9)}
        if self.peak_flops is not None:
            flops = actor_step_flops(self.model_shape, sequence_lengths, response_lengths)
            record["perf/actor_mfu"] = mfu(flops, actor_s, self.placement.world_size, self.peak_flops)
        return record

    def validate(self, step: int) -> dict | None:
        """trainer.val_n responses per held-out prompt at rollout.val_temperature: the mean reward (val/reward_mean
        = val/mean@n), unbiased pass@k and both per data source (rltrain/validation.py)."""
        if not self.val_rows:
            return None
        job, n = self.job, self.job.trainer.val_n

        def generate():
            return self._generate_and_score(self.val_rows, n, job.rollout.val_temperature, seed=job.trainer.seed + 7)

        # asynchronous modes: between two of the producer's batches, on this step's weights
        batch, _, errors = generate() if self.producer is None else self.producer.with_weights(step, generate)
        record = {"step": step, "val/reward_mean": batch["rewards"].mean().item(), "val/n": n,
                  **validation_metrics(batch["rewards"], n, [row.data_source for row in self.val_rows]),
                  "val/response_len_mean": batch["response_mask"].sum(1).float().mean().item(),
                  "val/reward_errors": errors.errors, **episode_metrics(batch, "val/tool")}
        self.tracker.log(record)
        return record

    def push_weights(self, version: int | None = None) -> float:
        """The actor's new weights into every rollout process, in place, bucket by bucket (by CUDA IPC from the
        colocated actor rank on GPU, through the object store on CPU: rltrain/workers/weight_sync.py); seconds.
        With a producer running: a snapshot of them, published as `version` for it to load between batches."""
        if self.producer is None:
            return self.weight_push.push()
        start = time.monotonic()
        self.producer.publish(version, self.weight_push.snapshot())
        return time.monotonic() - start

    # ---------------------------------------------------------------- the loop
    def fit(self) -> dict:
        job = self.job.trainer
        self.maybe_resume()
        if self.job.trainer.mode == "sync":
            self._offload_idle_roles()   # the first rollout's turn
        if self.step == 0:
            record = self.validate(0)
            self.initial_val = record["val/reward_mean"] if record else None
        final_val, self.first_version = None, self.step
        if job.mode != "sync":
            warn_uncorrected(self.job)
            if not self.job.algorithm.dynamic_sampling:   # dynamic sampling reads a round's rewards before the next
                self.scoring = ThreadPoolExecutor(1, thread_name_prefix="scoring")
            self.producer = RolloutProducer(self._produce, self.weight_push.load_snapshot,
                                            range(self.step + 1, job.total_steps + 1), self.step, job.mode,
                                            job.max_staleness)
            self.producer.start()  # after the assignment: its first batch reads self.producer (rollout.partial)
        try:
            for step in range(self.step + 1, job.total_steps + 1):
                self.tracker.log(self.train_step(step))
                self.reward_guard.check()  # after the step's line, before its checkpoint
                self.step = step
                last = step == job.total_steps
                if last or (job.val_every and step % job.val_every == 0):
                    record = self.validate(step)
                    final_val = record["val/reward_mean"] if record and last else final_val
                if last or (job.save_every and step % job.save_every == 0):
                    self.save(step)
        finally:
            if self.producer is not None:
                self.producer.stop()
            if self.scoring is not None:   # a batch still being scored after a failed step is not waited for
                self.scoring.shutdown(wait=False, cancel_futures=True)
                self.scoring = None
        if self.initial_val is not None and final_val is not None:
            print(f"held-out reward: {self.initial_val:.3f} before RL -> {final_val:.3f} after "
                  f"({100 * (final_val - self.initial_val):+.1f} points)", flush=True)
        return {"initial_val": self.initial_val, "final_val": final_val, "step": self.step}

    def close(self, raise_errors: bool = True) -> None:
        """Stop everything the run started, each step whatever the others do (a dead worker's close raises), the
        output directory's lock last; the failures are reported once, together: raised as one RuntimeError, or with
        raise_errors=False (closing after another error, which stays the one raised) logged. A second call does
        nothing."""
        reward = self.reward

        def stop_reward_pool():
            ray.get(reward.close.remote(), timeout=CLOSE_TIMEOUT_S)

        def method(holder, name: str):
            return None if holder is None else getattr(holder, name)

        steps = [("tracker", method(self.tracker, "close")),
                 ("reward pool", None if reward is None else stop_reward_pool),
                 ("rollout", method(self.rollout, "kill")),
                 *((role, None if handle is None else partial(kill, handle)) for role, handle in (
                     ("actor", self.actor), ("critic", self.critic), ("reference", self.reference),
                     ("teacher", self.teacher),
                     ("reward worker", self.reward), ("reward model", self.reward_model), ("judge", self.judge))),
                 ("placement", method(self.placement, "remove")),
                 ("rollout placement", method(self.rollout_placement, "remove")),
                 *(("reward roles' placement", placement.remove) for placement in self.own_placements),
                 ("output directory lock", method(self.lock, "release"))]
        self.tracker = self.reward = self.reward_model = self.judge = self.rollout = self.actor = self.critic = None
        self.reference = None
        self.teacher = None
        self.placement = self.rollout_placement = self.lock = None
        self.own_placements = ()
        errors = []
        for name, step in steps:
            try:
                if step is not None:
                    step()
            except Exception as err:  # every step runs; the failures are reported together below
                errors.append(f"{name}: {type(err).__name__}: {err}")
        if errors:
            message = f"closing the run: {len(errors)} step(s) failed; " + "; ".join(errors)
            if raise_errors:
                raise RuntimeError(message)
            logger.error(message)
