"""Mixed precision for the actor (`actor.mixed_precision`, on by default): the trained weights and the optimizer
state in fp32, the forward and backward in model.dtype. This module holds the single-process half (`MasterWeights`)
and the one rule both strategies follow (`trained_dtype`); FSDP2 gets the same split from torch's
MixedPrecisionPolicy (rltrain/workers/fsdp.py `shard_policy`).

Why: bf16 keeps 8 significant bits, so a weight w moves only when its update exceeds half a unit in its last place,
|w|/512 to |w|/256; AdamW's update is about lr per element, so at lr 1e-6 every weight above ~5e-4 in magnitude stays
put. Trained in place, one update of a bf16 Qwen3-0.6B changes ~2% of its elements: the run silently does not learn.
Training fp32 weights with fp32 compute instead costs 5.5x the step time on an H100.

MasterWeights (actor.strategy=single) keeps an fp32 master copy of every trained parameter (all of them, or with
actor.lora only the adapters) beside the model, which is loaded in model.dtype as without mixed precision
(transformers' own casting: RoPE's inv_freq and any module it keeps in fp32 stay fp32; loading fp32 and casting the
whole model would round those too), so the forward and backward are exactly the pure bf16 ones. The masters start
from the loaded values, or, where the directory stores fp32 weights (config.json; rltrain's own checkpoints, the
embedded default), from an fp32 load of it (`stored_fp32_weights`), so its low bits are not lost. Per optimizer
step:
- backward: a post-accumulate-grad hook adds each parameter's model.dtype gradient (one micro-batch's) into its
  master's fp32 .grad and frees it, so micro-batches accumulate in fp32 and the model keeps no gradient of its own;
- the gradient clipping and AdamW run on the masters (fp32 state);
- `copy_to_model()` rounds the masters into the model's parameters (round to nearest), what the next forward and
  the weight push use.
Memory per trained parameter: 2 (model, bf16) + 4 (master) + 4 (its gradient) + 8 (AdamW) bytes, plus 2 for one
micro-batch's bf16 gradient while it is added in, against 8 for bf16 trained in place and 16 for fp32.

Checkpoints hold the masters: `in_model()` puts them into the model's parameters for the length of a state_dict(),
load_state_dict() or save_pretrained() call, so those read and write fp32 under the model's own names and a resumed
run continues bit for bit (the model's weights are the masters rounded, as after every step).

model.dtype=float16 has no loss scaling here: its gradients can underflow; bfloat16 has fp32's range.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from pathlib import Path

import rltrain_kernels.models  # noqa: F401  (registers the delta-rule families with the Auto classes)
import torch
import transformers as tf

from rltrain.workers.hf_config import from_pretrained

logger = logging.getLogger(__name__)


def trained_dtype(dtype: str, mixed_precision: bool) -> str:
    """The dtype the actor holds its trained weights and optimizer state in, model.dtype (`dtype`) being the compute
    dtype: float32 under actor.mixed_precision, else model.dtype itself (a warning where that loses updates)."""
    if mixed_precision:
        return "float32"
    if dtype != "float32":
        logger.warning("actor.mixed_precision=false trains the weights in model.dtype=%s in place: AdamW updates "
                       "below %s's resolution are lost (bfloat16: below |w|/512 to |w|/256 for a weight w, so at lr "
                       "1e-6 most weights never move); actor.mixed_precision=true keeps fp32 weights and computes "
                       "as fast", dtype, dtype)
    return dtype


def stored_fp32_weights(path: str) -> dict[str, torch.Tensor] | None:
    """A model directory's parameters loaded in fp32 (on the CPU, by name), where its config.json says the weights
    are stored in float32; else None (a bf16 release loses nothing when loaded in bf16)."""
    fields = json.loads((Path(path) / "config.json").read_text())
    if (fields.get("dtype") or fields.get("torch_dtype")) != "float32":
        return None
    model = from_pretrained(tf.AutoModelForCausalLM, path, dtype=torch.float32)
    return {name: param.detach() for name, param in model.named_parameters()}


class MasterWeights:
    """fp32 masters of `model`'s trainable parameters (the model already in its compute dtype), from `initial`'s
    tensors of the same names where given, else from the model's values. The optimizer trains `parameters()`."""

    def __init__(self, model: torch.nn.Module, initial: dict[str, torch.Tensor] | None = None):
        # named_parameters() yields a tied parameter once: one master for both of its names
        trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        missing = [name for name, _ in trained if initial is not None and name not in initial]
        if missing:
            raise ValueError(f"the fp32 weights lack trained parameters of the model: {missing[:3]}")
        self.masters = {name: (p if initial is None else initial[name]).detach().to(p.device, torch.float32,
                                                                                     copy=True)
                        for name, p in trained}
        self._params = [p for _, p in trained]
        self.copy_to_model()
        for param, master in zip(self._params, self.masters.values()):
            param.register_post_accumulate_grad_hook(self._accumulate_into(master))
        logger.info("actor.mixed_precision: fp32 masters of %d trained tensors (%.1fM elements%s)", len(self.masters),
                    sum(m.numel() for m in self.masters.values()) / 1e6, ", from fp32 weights" if initial else "")

    @staticmethod
    def _accumulate_into(master: torch.Tensor):
        def hook(param: torch.Tensor) -> None:
            if master.grad is None:
                master.grad = param.grad.float()
            else:
                master.grad.add_(param.grad)
            param.grad = None
        return hook

    def parameters(self) -> list[torch.Tensor]:
        return list(self.masters.values())

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """The masters rounded into the model's parameters (after each optimizer step, and after a load)."""
        for param, master in zip(self._params, self.masters.values()):
            param.copy_(master)

    @contextmanager
    def in_model(self):
        """The masters as the model's parameters' data for the duration (state_dict, load_state_dict and
        save_pretrained read and write fp32); the model.dtype tensors are put back after."""
        held = [param.data for param in self._params]
        try:
            for param, master in zip(self._params, self.masters.values()):
                param.data = master
            yield
        finally:
            for param, data in zip(self._params, held):
                param.data = data
