"""Step timing and the actor's model-FLOP utilisation (perf/actor_mfu), for the trainer's per-step record.

FLOPs of the actor's work in one step, per sequence of T tokens (prompt + response) with R response tokens:
  forward = 2·N_body·T + 2·N_head·R + 2·L·W·T²
where N_body counts the parameters every token multiplies through (all but the input embedding and the LM head),
N_head = vocab × hidden is the LM head, which the log-prob and loss heads run on response positions only, and the
last term is causal attention: QKᵀ and PV over the T²/2 visible pairs in each of the L attention layers, with W =
heads × head_dim. A backward pass costs twice its forward, so the step's actor work (the old log-probs' forward plus
one update) is 1 + 3 = 4 forwards. This counts the model's FLOPs, not the hardware's: padding, gradient-checkpointing
recomputation and the reference's forward are not in it. Dense models: a mixture of experts would count every
expert's parameters (an overstatement); linear-attention layers take no T² term.

MFU = those FLOPs / (old-log-prob seconds + update seconds) / (the actor's GPUs × the GPU's dense bf16 peak), logged
only for GPUs in PEAK_BF16_FLOPS (no guess for others; none on CPU).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

# (part of torch.cuda.get_device_name(), dense bf16 tensor-core FLOP/s from NVIDIA's datasheets); first match wins
PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100 80GB HBM3", 989e12),   # the SXM part's name
    ("H100 SXM", 989e12),
    ("H200", 989e12),             # GH200 too
    ("A100", 312e12),             # SXM and PCIe
)


def peak_flops(device_name: str | None) -> float | None:
    """The GPU's dense bf16 peak, or None for a device not in the table."""
    if device_name:
        for part, flops in PEAK_BF16_FLOPS:
            if part in device_name:
                return flops
    return None


@dataclass(frozen=True)
class ModelShape:
    body_params: int        # parameters every token goes through: all but the input embedding and the LM head
    head_params: int        # the LM head, vocab × hidden (run on response positions only)
    attention_layers: int   # layers with softmax attention (the T² term)
    attention_width: int    # query heads × head_dim

    @classmethod
    def of(cls, model) -> ModelShape:
        config = model.config
        embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        total = sum(p.numel() for p in model.parameters())  # a tied head is counted once, as the embedding
        body = total - embedding.numel() - (0 if head is embedding else head.numel())
        layer_types = getattr(config, "layer_types", None)
        layers = (sum(kind in ("full_attention", "sliding_attention") for kind in layer_types) if layer_types
                  else config.num_hidden_layers)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(body, head.numel(), layers, config.num_attention_heads * head_dim)


def forward_flops(shape: ModelShape, sequence_lengths: torch.Tensor, response_lengths: torch.Tensor) -> float:
    """FLOPs of one forward over sequences of these lengths (prompt + response; response)."""
    t = sequence_lengths.double()
    return float(2 * shape.body_params * t.sum() + 2 * shape.head_params * response_lengths.double().sum()
                 + 2 * shape.attention_layers * shape.attention_width * (t * t).sum())


def actor_step_flops(shape: ModelShape, sequence_lengths: torch.Tensor, response_lengths: torch.Tensor) -> float:
    """The old log-probs' forward plus one update (forward + a backward of twice its cost): 4 forwards."""
    return 4 * forward_flops(shape, sequence_lengths, response_lengths)


def mfu(flops: float, seconds: float, devices: int, peak: float) -> float:
    return flops / (seconds * devices * peak)


class StepTimer:
    """Wall-clock seconds per phase of a step (`with timer.phase("rollout"): ...` adds to time/rollout_s), and
    counts that go with them (`timer.count("rollout_tokens", n)`)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        start = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - start

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def count(self, name: str, amount: float) -> None:
        self.counts[name] = self.counts.get(name, 0.0) + amount

    def get(self, name: str) -> float:
        return self.seconds.get(name, 0.0)

    def record(self) -> dict[str, float]:
        return {f"time/{name}_s": seconds for name, seconds in self.seconds.items()}
