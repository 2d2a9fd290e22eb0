"""The policy-loss options, their validation, the input checks and the output type — shared by the fused op and the
reference so that both accept exactly the same arguments and fail with the same messages. A bad option value raises
PolicyLossOptionError, which names the option in a field of its own, so a config holding these options (rltrain's
algorithm.loss) reports it under its own key without reading the message."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

LOSS_AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_TYPES = ("k1", "k2", "k3")
# k3's bounds (verl's low_var_kl): the log-ratio ref − logp held in ±20, the estimate capped at 10
K3_LOG_RATIO_BOUND, K3_BOUND = 20.0, 10.0
IMPORTANCE_LEVELS = ("token", "sequence")
METRIC_NAMES = ("clipfrac", "ppo_kl", "ref_kl", "entropy")


class PolicyLossOptionError(ValueError):
    """A bad option value: `option` is its name, `reason` what is wrong with it (without the name); the message is
    the two together, or `message` where the option's name sits inside it."""

    def __init__(self, option: str, reason: str, message: str | None = None):
        super().__init__(f"{option} {reason}" if message is None else message)
        self.option, self.reason = option, reason


def _number(name: str, value) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise PolicyLossOptionError(name, f"must be a number or a one-element tensor, got shape "
                                              f"{tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise PolicyLossOptionError(name, f"must be finite, got {value}")
    return value


def _choice(name: str, value, choices) -> str:
    if value not in choices:
        expected = f"expected one of {', '.join(repr(c) for c in choices)}"
        raise PolicyLossOptionError(name, f"unknown value {value!r}; {expected}",
                                    f"unknown {name} {value!r}; {expected}")
    return value


@dataclass(frozen=True)
class PolicyLossOptions:
    """Every scalar option of the loss, validated on construction (a PolicyLossOptionError names the argument)."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_type: str = "k3"
    entropy_coef: float = 0.0
    loss_agg: str = "token-mean"
    importance_level: str = "token"
    temperature: float = 1.0
    norm_tokens: float | None = None
    norm_len: float | None = None

    def __post_init__(self):
        set_ = lambda key, value: object.__setattr__(self, key, value)  # noqa: E731  (frozen dataclass)
        for key in ("clip_low", "clip_high", "kl_coef", "entropy_coef", "temperature"):
            set_(key, _number(key, getattr(self, key)))
        if not 0.0 <= self.clip_low < 1.0:
            raise PolicyLossOptionError("clip_low", f"must be in [0, 1) so that the lower bound 1 - clip_low is > 0, "
                                                    f"got {self.clip_low}")
        if self.clip_high < 0.0:
            raise PolicyLossOptionError("clip_high", f"must be >= 0, got {self.clip_high}")
        if self.dual_clip is not None:
            set_("dual_clip", _number("dual_clip", self.dual_clip))
            if self.dual_clip <= 1.0:
                raise PolicyLossOptionError("dual_clip", f"must be > 1 (it caps -A·ratio at -A·dual_clip for A < 0), "
                                                         f"got {self.dual_clip}")
        if self.temperature <= 0.0:
            raise PolicyLossOptionError("temperature", f"must be > 0, got {self.temperature}")
        _choice("kl_type", self.kl_type, KL_TYPES)
        _choice("loss_agg", self.loss_agg, LOSS_AGGS)
        _choice("importance_level", self.importance_level, IMPORTANCE_LEVELS)
        if self.norm_tokens is not None:
            set_("norm_tokens", _number("norm_tokens", self.norm_tokens))
            if self.norm_tokens <= 0:
                raise PolicyLossOptionError("norm_tokens", f"must be > 0, got {self.norm_tokens}")
            if self.loss_agg != "token-mean":
                raise PolicyLossOptionError("norm_tokens", f"applies to loss_agg='token-mean' only, "
                                                           f"got loss_agg={self.loss_agg!r}")
        if self.norm_len is not None:
            set_("norm_len", _number("norm_len", self.norm_len))
            if self.norm_len <= 0:
                raise PolicyLossOptionError("norm_len", f"must be > 0, got {self.norm_len}")
            if self.loss_agg != "seq-mean-token-sum-norm":
                raise PolicyLossOptionError("norm_len", f"applies to loss_agg='seq-mean-token-sum-norm' only, "
                                                        f"got loss_agg={self.loss_agg!r}")

    @property
    def kl_index(self) -> int:
        """0: no KL term (kl_coef == 0), else 1/2/3 for k1/k2/k3 — the Triton kernels' constexpr."""
        return 0 if self.kl_coef == 0.0 else KL_TYPES.index(self.kl_type) + 1


class Metrics(Mapping):
    """The metrics as a read-only mapping name → float (METRIC_NAMES, in that order), read from the device at the
    first access with one device→host copy, not when the loss returns: a training step that logs them after its
    backward never stalls its forward on a host sync. `tensor` holds the [4] fp32 values without any copy (for an
    all-reduce, say); `dict(metrics)` is a plain dict."""

    def __init__(self, values: torch.Tensor):
        self.tensor = values.detach()
        self._floats: dict[str, float] | None = None

    def _read(self) -> dict[str, float]:
        if self._floats is None:
            self._floats = dict(zip(METRIC_NAMES, self.tensor.double().cpu().tolist()))
        return self._floats

    def __getitem__(self, key: str) -> float:
        return self._read()[key]

    def __iter__(self):
        return iter(METRIC_NAMES)

    def __len__(self) -> int:
        return len(METRIC_NAMES)

    def __repr__(self) -> str:
        return f"Metrics({self._read()!r})"


@dataclass
class PolicyLossOutput:
    """loss: scalar, differentiable w.r.t. hidden and weight. logprobs, entropy: [B, T] fp32 (the reference: its
    compute dtype), detached, 0 where mask == 0. metrics: floats `clipfrac`, `ppo_kl`, `ref_kl`, `entropy`, read
    from the device when first used (Metrics)."""

    loss: torch.Tensor
    logprobs: torch.Tensor
    entropy: torch.Tensor
    metrics: Metrics


def _shape(t) -> tuple:
    return tuple(getattr(t, "shape", ()))


def check_inputs(hidden, weight, labels, mask, advantages, old_logprobs, ref_logprobs, opts: PolicyLossOptions,
                 cu_seqlens=None, loss_weights=None):
    """Shapes, dtypes and devices of the tensor arguments; raises naming the argument."""
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels), ("mask", mask),
                    ("advantages", advantages)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    for name, t in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor or None, got {type(t).__name__}")
    if hidden.dim() != 3:
        raise ValueError(f"hidden must have shape [B, T, H], got {_shape(hidden)}")
    if not hidden.dtype.is_floating_point:
        raise TypeError(f"hidden must be a floating-point tensor, got {hidden.dtype}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[2] or weight.shape[0] < 1:
        raise ValueError(f"weight must have shape [V, H] with H = hidden.shape[-1] = {hidden.shape[2]}, "
                         f"got {_shape(weight)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype}")
    bt = tuple(hidden.shape[:2])
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    for name, t in (("labels", labels), ("mask", mask), ("old_logprobs", old_logprobs),
                    ("ref_logprobs", ref_logprobs)):
        if t is not None and tuple(t.shape) != bt:
            raise ValueError(f"{name} must have shape [B, T] = {list(bt)}, got {list(t.shape)}")
    if tuple(advantages.shape) not in (bt[:1], bt):
        raise ValueError(f"advantages must have shape [B] = {list(bt[:1])} or [B, T] = {list(bt)}, "
                         f"got {list(advantages.shape)}")
    for name, t in (("advantages", advantages), ("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs)):
        if t is not None and not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if mask.dtype.is_complex:
        raise TypeError(f"mask must be bool or real (0/1), got {mask.dtype}")
    if cu_seqlens is not None:
        _check_cu_seqlens(cu_seqlens, hidden, opts)
    if loss_weights is not None:
        _check_loss_weights(loss_weights, hidden, opts, cu_seqlens)
    if opts.kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={opts.kl_coef} needs ref_logprobs (got None)")
    for name, t in (("weight", weight), ("labels", labels), ("mask", mask), ("advantages", advantages),
                    ("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}")


def _check_cu_seqlens(cu_seqlens, hidden, opts: PolicyLossOptions) -> None:
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or \
            cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor of N + 1 sequence starts, got "
                         f"{type(cu_seqlens).__name__} {_shape(cu_seqlens)}")
    if hidden.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs a packed batch (B = 1), got hidden of shape {_shape(hidden)}")
    if cu_seqlens.device != hidden.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but hidden is on {hidden.device}")
    if opts.importance_level == "sequence":
        raise ValueError("importance_level='sequence' takes [B, T] rows; pass the sequences as rows, not packed "
                         "with cu_seqlens")
    if not cu_seqlens.is_cuda:   # on CUDA this would be a host sync; the aggregation's index_add bounds it there
        if cu_seqlens[0] != 0 or cu_seqlens[-1] != hidden.shape[1] or (cu_seqlens[1:] < cu_seqlens[:-1]).any():
            raise ValueError(f"cu_seqlens must rise from 0 to T = {hidden.shape[1]}, got {cu_seqlens.tolist()}")


def _check_loss_weights(loss_weights, hidden, opts: PolicyLossOptions, cu_seqlens) -> None:
    if not isinstance(loss_weights, torch.Tensor) or not loss_weights.dtype.is_floating_point:
        raise TypeError(f"loss_weights must be a floating-point tensor, got {getattr(loss_weights, 'dtype', None)}")
    if tuple(loss_weights.shape) != tuple(hidden.shape[:2]):
        raise ValueError(f"loss_weights must have shape [B, T] = {list(hidden.shape[:2])}, "
                         f"got {list(loss_weights.shape)}")
    if loss_weights.device != hidden.device:
        raise ValueError(f"loss_weights is on {loss_weights.device} but hidden is on {hidden.device}")
    if cu_seqlens is not None or opts.importance_level == "sequence":
        raise ValueError("loss_weights replace the aggregation: not with cu_seqlens or importance_level='sequence' "
                         "(whose sequence ratio needs whole sequences)")


def check_label_range(labels: torch.Tensor, valid: torch.Tensor, vocab: int) -> None:
    """Labels where mask != 0 must be token ids; masked positions may hold anything (padding, -100)."""
    bad = valid & ((labels < 0) | (labels >= vocab))
    if labels.is_cuda:
        torch._assert_async(~bad.any(), f"labels must lie in [0, {vocab}) where mask != 0")  # no host sync
    elif bad.any():
        raise ValueError(f"labels must lie in [0, {vocab}) where mask != 0; got {labels[bad][:5].tolist()}")
