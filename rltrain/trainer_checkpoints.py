"""The trainer's checkpoints: TrainerCheckpoints, the part of GRPOTrainer that saves a step (every actor rank and the
critic's write their parts, then the controller the trainer state, last: rltrain/checkpoint.py) and resumes one
(trainer.resume: never | auto, the newest complete checkpoint | a directory), refusing a checkpoint of another run
shape (LoRA or not, a critic or not) with the key to change."""

from __future__ import annotations

import logging
from pathlib import Path

import ray

from rltrain import checkpoint as ckpt
from rltrain.async_rollout import dropped_on_resume
from rltrain.config import ConfigError
from rltrain.distributed_checkpoint import CheckpointError
from rltrain.workers.group import call_each_rank

logger = logging.getLogger(__name__)


def on_every_rank(handle, method: str, *args, context: str) -> None:
    """method(*args) on every rank of a role; a CheckpointError raised there (a checkpoint that does not fit the
    model, a directory a rank cannot see) comes back as one line starting with `context`, not a worker's traceback."""
    try:
        ray.get(call_each_rank(handle, method, *args))
    except CheckpointError as err:
        raise CheckpointError(f"{context}: {getattr(err, 'cause', err)}") from None


class TrainerCheckpoints:
    """Mixed into GRPOTrainer: reads its job, workers (actor, critic), sampler, producer, KL controller and output
    directory, and sets step / initial_val on resume."""

    def save(self, step: int) -> Path:
        """A checkpoint of this step (rltrain/checkpoint.py): every actor rank writes its part of the weights and
        optimizer state (with trainer.save_hf also an HF copy), then this process the trainer state, last."""
        actor, job = self.actor, self.job
        # asynchronous modes: the sampler as of the last trained batch, and the steps queued or in flight, which a
        # resumed run drops (and generates again from the same prompts)
        state = {"sampler": self.trained_sampler_state or self.sampler.state_dict(), "initial_val": self.initial_val,
                 "lr_scheduler": ray.get(actor.lr_scheduler_state.remote()), "mode": job.trainer.mode,
                 "pending": self.producer.pending() if self.producer is not None else {},
                 "kl_control": self.kl_control.state_dict()}
        if self.critic is not None:
            state["critic_lr_scheduler"] = ray.get(self.critic.lr_scheduler_state.remote())

        def save_actor(path: Path) -> None:
            on_every_rank(actor, "save_checkpoint", str(path), job.trainer.save_hf, context="saving a checkpoint")
            if self.critic is not None:
                (path / ckpt.CRITIC_DIR).mkdir()
                on_every_rank(self.critic, "save_checkpoint", str(path / ckpt.CRITIC_DIR), False,
                              context="saving the critic's checkpoint")

        path = ckpt.save_checkpoint(str(self.output_dir), step, save_actor, self.model_dir, self.saved_tokenizer,
                                    state, job.actor.lora)
        logger.info("saved checkpoint %s", path)
        return path

    def maybe_resume(self) -> None:
        """Load the checkpoint trainer.resume names (auto: the newest complete one), then rewind the metrics to its
        step; with none (never, or auto finding none) the metrics start over."""
        mode = self.job.trainer.resume
        path = self._checkpoint_to_resume(mode)
        if path is not None:
            self._resume_from(path)
        self.tracker.rewind(self.step if path is not None else None)

    def _checkpoint_to_resume(self, mode: str) -> Path | None:
        if mode == "never":
            return None
        if mode != "auto":
            return Path(mode)
        path, skipped = ckpt.newest_complete_checkpoint(str(self.output_dir))
        for incomplete, reason in skipped:
            logger.warning("trainer.resume=auto: skipped the incomplete checkpoint %s (%s)", incomplete, reason)
        return path

    def _resume_from(self, path: Path) -> None:
        if not path.is_dir():
            raise FileNotFoundError(f"trainer.resume: no checkpoint directory {str(path)!r}")
        state = ckpt.load_trainer_state(path)
        lora = self.job.actor.lora.enabled
        if ckpt.holds_adapters(path) != lora:
            held = "LoRA adapters" if not lora else "a full model, no LoRA adapters"
            raise ConfigError(f"trainer.resume: checkpoint {str(path)!r} holds {held}, but actor.lora.rank is "
                              f"{self.job.actor.lora.rank}; resume with the run's actor.lora, or trainer.resume=never")
        critic_dir = path / ckpt.CRITIC_DIR
        if (self.critic is not None) != critic_dir.is_dir():
            held = "a critic" if critic_dir.is_dir() else "no critic"
            raise ConfigError(f"trainer.resume: checkpoint {str(path)!r} holds {held}, but algorithm.adv_estimator "
                              f"is {self.job.algorithm.adv_estimator}; resume with the run's estimator, or "
                              "trainer.resume=never")
        # every rank reads what its shards cover, whatever the world size that wrote them
        on_every_rank(self.actor, "load_checkpoint", str(path), context="trainer.resume")
        ray.get(self.actor.load_lr_scheduler_state.remote(state["lr_scheduler"]))
        if self.critic is not None:
            on_every_rank(self.critic, "load_checkpoint", str(critic_dir), context="trainer.resume (the critic)")
            ray.get(self.critic.load_lr_scheduler_state.remote(state["critic_lr_scheduler"]))
        self.push_weights()  # the checkpoint's weights (or adapters) from the actor into every rollout process
        self.sampler.load_state_dict(state["sampler"])
        ckpt.set_rng_state(state["rng"])
        self.step, self.initial_val = state["step"], state.get("initial_val")
        self.kl_control.load_state_dict(state["kl_control"])
        logger.info("resumed from %s at step %d", path, self.step)
        if state.get("pending"):
            logger.warning(dropped_on_resume(state, self.job.rollout.n))
