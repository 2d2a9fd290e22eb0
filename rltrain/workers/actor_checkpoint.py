"""The actor's checkpoints (rltrain/checkpoint.py: the directory layout): ActorCheckpoints, the part of ActorWorker
that saves and loads its trained weights, optimizer state and learning-rate position, and writes the policy in HF
(or, with LoRA, PEFT) format. One code path for both strategies: the states are this process's tensors themselves
(DTensors holding this rank's shards under FSDP2), which DCP writes from and reads into in place
(rltrain/distributed_checkpoint.py); FSDPActorWorker overrides only the gathered views (state_dict,
optimizer_state, save_pretrained)."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch

from rltrain.checkpoint import HF_DIR, MODEL_DIR, OPTIMIZER_DIR
from rltrain.distributed_checkpoint import (
    check_fits, check_visible_on_every_rank, load_state, materialize_optimizer_state, save_state,
)
from rltrain.workers.lora import is_adapter_weight
from rltrain.workers.policy import untied_state_dict


class ActorCheckpoints:
    """Mixed into ActorWorker: reads its model, adapters, trained_whole, master (fp32 masters or None), optimizer and
    updates."""

    def _checkpointed_weights(self):
        """A context in which the model's parameters hold the weights a checkpoint saves and loads: the fp32 masters
        where there are any (MasterWeights.in_model), else the model's own."""
        return self.master.in_model() if self.master is not None else nullcontext()

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """The trained weights as CPU tensors by state_dict name (fp32 under actor.mixed_precision; None on ranks
        other than 0 under FSDP2)."""
        with self._checkpointed_weights():
            return {name: tensor.detach().cpu() for name, tensor in self.model.state_dict().items()}

    def optimizer_state(self) -> dict:
        """The optimizer state whole, in torch.optim's layout (parameter indices; None on ranks other than 0 under
        FSDP2): what tests compare the strategies with. Checkpoints hold it by name (_optimizer_checkpoint_state)."""
        return self.optimizer.state_dict()

    def lr_scheduler_state(self) -> dict:
        """The schedule's position (JSON-safe): the updates done."""
        return {"updates": self.updates}

    def load_lr_scheduler_state(self, state: dict) -> None:
        self.updates = int(state["updates"])

    def _model_checkpoint_state(self) -> dict[str, torch.Tensor]:
        """The model's state_dict (a tied weight once, under its first name), or with LoRA its adapters and the
        modules trained whole beside them (the frozen base is model.path's); call inside _checkpointed_weights() for
        the fp32 masters."""
        state = untied_state_dict(self.model)
        if self.adapters is None:
            return state
        return {n: t for n, t in state.items() if is_adapter_weight(n) or n.rsplit(".", 1)[0] in self.trained_whole}

    def _optimizer_checkpoint_state(self) -> dict[str, torch.Tensor]:
        """The optimizer's own state tensors as `<parameter name>.<key>` (a fresh optimizer's made first)."""
        materialize_optimizer_state(self.optimizer)
        named = self.master.masters.items() if self.master is not None else self.model.named_parameters()
        names = {id(param): name for name, param in named}
        state = {}
        for param in (p for group in self.optimizer.param_groups for p in group["params"]):
            for key, value in self.optimizer.state[param].items():
                if not torch.is_tensor(value):
                    raise TypeError(f"optimizer state {key!r} of {names[id(param)]} is not a tensor: {value!r}")
                state[f"{names[id(param)]}.{key}"] = value
        return state

    def save_checkpoint(self, path: str, save_hf: bool = False) -> None:
        """This process's part of the trained weights and the optimizer state into `path`/model and
        `path`/optimizer (under FSDP2 every rank calls it and writes its own shards); with save_hf also the policy
        into `path`/hf (save_pretrained: under FSDP2 gathered onto rank 0)."""
        check_visible_on_every_rank(path)
        with self._checkpointed_weights():
            save_state(self._model_checkpoint_state(), Path(path) / MODEL_DIR)
        save_state(self._optimizer_checkpoint_state(), Path(path) / OPTIMIZER_DIR)
        if save_hf:
            self.save_pretrained(str(Path(path) / HF_DIR))

    def load_checkpoint(self, path: str) -> None:
        """A checkpoint directory's model/ and optimizer/, written by any strategy and world size, into this
        process's weights (the fp32 masters, then rounded into the model) and optimizer state; CheckpointError
        naming the directory when they do not fit this model (every rank raises before any reads)."""
        check_visible_on_every_rank(path)
        with self._checkpointed_weights():
            parts = [(self._model_checkpoint_state(), Path(path) / MODEL_DIR, "the model"),
                     (self._optimizer_checkpoint_state(), Path(path) / OPTIMIZER_DIR, "the optimizer state")]
            for state, directory, what in parts:
                check_fits(state, directory, what)
            for state, directory, what in parts:
                load_state(state, directory, what)
        if self.master is not None:
            self.master.copy_to_model()

    def save_pretrained(self, path: str) -> None:
        """The policy in HF format, or with LoRA its adapters in PEFT's (adapter_config.json naming the base model's
        directory, adapter_model.safetensors); the fp32 masters where there are any."""
        with self._checkpointed_weights():
            (self.model if self.adapters is None else self.adapters).save_pretrained(path)
