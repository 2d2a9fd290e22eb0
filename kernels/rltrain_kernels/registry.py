"""Kernel registry: device-neutral kernel ids, one implementation per device, applied to transformers models.

A kernel id (`fused_rmsnorm`, `fused_swiglu`, `fused_rope`, ...) names *what* is swapped into a model; each device
(cuda, npu, cpu) registers its own implementation under that id, so one config works everywhere:

    from rltrain_kernels.registry import apply_default_kernels, get_applied_kernels
    model = apply_default_kernels(model)                         # every default kernel of this device
    model = apply_default_kernels(model, "fused_rmsnorm,fused_rope")
    model = apply_kernel_config(model, KernelConfig(include_kernels="fused_rmsnorm"))   # the config form
    model = apply_kernel_config(model, {"name": "auto", "include_kernels": "auto"})     # ... or its mapping
    get_applied_kernels(model)                                   # {"fused_rmsnorm": 5, ...}: what runs now

Every apply call changes `model` in place and returns it (LLaMA-Factory's kernel API), with one log line of what it
swapped.

Implementations live in `rltrain_kernels.integrations` (one module per kernel id); importing that package's
modules registers them. `discover_kernels()` imports them once; one module failing to import is a logged warning,
never a crash, so a broken optional dependency costs only that kernel.
"""

from __future__ import annotations

import abc
import importlib
import inspect
import logging
import pkgutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import ClassVar

import torch.nn as nn

from rltrain_kernels.utils import DEVICES, check_device, detect_device

logger = logging.getLogger(__name__)

# kernel id -> device -> implementation class
_REGISTRY: dict[str, dict[str, type[BaseKernel]]] = {}
_DISCOVERED: set[str] = set()
DEFAULT_PACKAGE = "rltrain_kernels.integrations"


class UnsupportedModelError(ValueError):
    """A kernel was asked for explicitly on a model it has no adapter for."""


class BaseKernel(abc.ABC):
    """One kernel id's implementation on one device.

    Subclasses set `kernel_id` and `device`, may override `check_deps()` (are the libraries this implementation
    needs importable?) and implement `apply(model, **kwargs) -> int`, which swaps the implementation into `model`
    in place and returns how many modules it changed. Applying must never change weights, parameter names or
    state_dict keys, and applying twice must be the same as applying once.
    """

    kernel_id: ClassVar[str] = ""
    device: ClassVar[str] = ""
    # Part of the device's "auto" set.
    default: ClassVar[bool] = True

    @classmethod
    def check_deps(cls) -> bool:
        return True

    @classmethod
    @abc.abstractmethod
    def apply(cls, model: nn.Module, **kwargs) -> int:
        """Swap this implementation into `model` in place; return the number of modules changed."""


def register_kernel(cls: type[BaseKernel]) -> type[BaseKernel]:
    """Class decorator: register `cls` under (cls.kernel_id, cls.device). A second registration of the same pair
    is an error (two modules claiming one slot is always a bug)."""
    if not (isinstance(cls, type) and issubclass(cls, BaseKernel)):
        raise TypeError(f"register_kernel expects a BaseKernel subclass, got {cls!r}")
    if inspect.isabstract(cls):
        raise TypeError(f"{cls.__name__} does not implement {', '.join(sorted(cls.__abstractmethods__))}")
    if not cls.kernel_id:
        raise ValueError(f"{cls.__name__}: kernel_id is empty")
    check_device(cls.device)
    slot = _REGISTRY.setdefault(cls.kernel_id, {})
    if cls.device in slot:
        other = slot[cls.device]
        raise ValueError(f"kernel {cls.kernel_id!r} on {cls.device!r} is already registered by "
                         f"{other.__module__}.{other.__qualname__}; cannot register {cls.__module__}.{cls.__qualname__}")
    slot[cls.device] = cls
    return cls


def discover_kernels(package: str = DEFAULT_PACKAGE) -> list[str]:
    """Import every module of `package` once so its kernels register. Returns the modules that failed."""
    if package in _DISCOVERED:
        return []
    _DISCOVERED.add(package)
    pkg = importlib.import_module(package)
    failed = []
    for info in pkgutil.iter_modules(pkg.__path__, prefix=f"{package}."):
        try:
            importlib.import_module(info.name)
        except Exception as exc:  # one broken kernel module must not take the others down
            failed.append(info.name)
            logger.warning("kernel module %s failed to import and is skipped: %s: %s",
                           info.name, type(exc).__name__, exc)
    return failed


def known_kernel_ids() -> list[str]:
    discover_kernels()
    return sorted(_REGISTRY)


def _resolve_device(device: str | None) -> str:
    return detect_device() if device in (None, "auto") else check_device(device)


def get_kernel(kernel_id: str, device: str | None = None) -> type[BaseKernel] | None:
    """The implementation of `kernel_id` on `device` (default: detected), or None when that device has none or its
    dependencies are missing. An unknown id raises ValueError listing the known ones."""
    discover_kernels()
    if kernel_id not in _REGISTRY:
        raise ValueError(f"unknown kernel id {kernel_id!r}; known kernel ids: {', '.join(known_kernel_ids())}")
    impl = _REGISTRY[kernel_id].get(_resolve_device(device))
    return impl if impl is not None and impl.check_deps() else None


def get_default_kernels(device: str | None = None) -> list[str]:
    """Kernel ids in the "auto" set that have a usable implementation on `device` (default: detected)."""
    device = _resolve_device(device)
    return [kid for kid in known_kernel_ids()
            if (impl := get_kernel(kid, device)) is not None and impl.default]


def apply_kernel(kernel_id: str, model: nn.Module, device: str | None = None, **kwargs) -> nn.Module:
    """Swap `kernel_id`'s implementation for `device` into `model` (in place); returns the model.
    Raises ValueError for an unknown id, or when `device` has no usable implementation of it."""
    device = _resolve_device(device)
    impl = get_kernel(kernel_id, device)
    if impl is None:
        have = sorted(_REGISTRY[kernel_id])
        raise ValueError(f"kernel {kernel_id!r} has no usable implementation on {device!r} "
                         f"(implemented on: {', '.join(have)}; dependencies may be missing)")
    _log_swaps(device, {kernel_id: impl.apply(model, **kwargs)})
    return model


def get_applied_kernels(model: nn.Module) -> dict[str, int]:
    """{kernel id: modules of `model` running it now}, read off the modules themselves (a swap tags the module's
    class; restore_original_modules removes the tags)."""
    counts: dict[str, int] = {}
    for module in model.modules():
        tag = getattr(type(module), "_rltrain_kernel", None)
        if tag is not None:
            kernel_id = tag.rsplit("/", 1)[0]
            counts[kernel_id] = counts.get(kernel_id, 0) + 1
    return counts


def _log_swaps(device: str, swapped: dict[str, int]) -> None:
    shown = ", ".join(f"{kid} ×{count}" for kid, count in swapped.items()) or "nothing"
    logger.info("kernels applied on %s: %s (modules changed)", device, shown)


def parse_include_kernels(include_kernels) -> list[str] | str | None:
    """Normalise the `include_kernels` option: None/False/""/"none" -> None (no change); True/"auto" -> "auto";
    "a,b" or ["a", "b"] -> ["a", "b"]."""
    if include_kernels is None or include_kernels is False:
        return None
    if include_kernels is True:
        return "auto"
    if isinstance(include_kernels, str):
        text = include_kernels.strip()
        if text.lower() in ("", "none", "false"):
            return None
        if text.lower() in ("auto", "true"):
            return "auto"
        include_kernels = text.split(",")
    if isinstance(include_kernels, Iterable):
        ids = [str(k).strip() for k in include_kernels if str(k).strip()]
        return ids or None
    raise TypeError(f"include_kernels must be None, a bool, 'auto', a comma-separated string or a list of kernel "
                    f"ids; got {include_kernels!r}")


def apply_default_kernels(model: nn.Module, include_kernels="auto", device: str | None = None,
                          kernel_options: Mapping[str, Mapping] | None = None) -> nn.Module:
    """Apply kernels to `model` in place; returns the model (get_applied_kernels says what runs).

    include_kernels: None/False/"" -> no change; True/"auto" -> every default kernel of the device; "id1,id2" or a
    list -> exactly those. An unknown id raises ValueError listing the known ids (before anything is changed). An
    id with no implementation on this device is skipped with one log line. In "auto" mode a kernel without an
    adapter for this model's family is skipped with one log line; asked for by name, it raises.
    kernel_options: {kernel id: keyword arguments of its apply}, for the kernels that take some (the delta-rule
    kernels' recurrence_dot; KernelConfig.kernel_options builds them from the config); a kernel not applied ignores
    its entry.
    """
    wanted = parse_include_kernels(include_kernels)
    if wanted is None:
        return model
    device = _resolve_device(device)
    explicit = wanted != "auto"
    ids = wanted if explicit else get_default_kernels(device)
    unknown = [kid for kid in ids if kid not in known_kernel_ids()]
    if unknown:
        raise ValueError(f"unknown kernel id(s) {', '.join(map(repr, unknown))}; "
                         f"known kernel ids: {', '.join(known_kernel_ids())}")
    applied = {}
    for kid in dict.fromkeys(ids):
        impl = get_kernel(kid, device)
        if impl is None:
            logger.info("kernel %s: no usable implementation on %s, skipped", kid, device)
            continue
        try:
            applied[kid] = impl.apply(model, **(kernel_options or {}).get(kid, {}))
        except UnsupportedModelError as exc:
            if explicit:
                raise
            logger.info("kernel %s skipped: %s", kid, exc)
    _log_swaps(device, applied)
    return model


@dataclass(frozen=True)
class KernelConfig:
    """The config form (rltrain's `kernel_config` section, config/kernel_config/default.yaml), validated on
    construction: errors name the key (`kernel_config.name: must be ...`) and unknown kernel ids fail here, before
    any model is patched."""

    name: str = "auto"                                        # whose implementations: auto | cuda | npu | cpu
    include_kernels: str | list[str] | bool | None = "auto"   # auto | none | "id1,id2" | a list of kernel ids
    delta_rule_recurrence_dot: str = "auto"                   # auto | bf16 | tf32 (gated delta rule / product, KDA)

    # The kernels that take delta_rule_recurrence_dot, as their apply's recurrence_dot (on every device they have).
    RECURRENCE_DOT_KERNELS: ClassVar[tuple[str, ...]] = ("gated_delta_rule", "gated_delta_product", "kda")

    def __post_init__(self):
        # precision imports triton, which this module must not need at import time
        from .ops.common.precision import DOT_CHOICES

        _require(self.name == "auto" or self.name in DEVICES, "name",
                 f"must be auto, {', '.join(DEVICES[:-1])} or {DEVICES[-1]}", self.name)
        _require(self.delta_rule_recurrence_dot in DOT_CHOICES, "delta_rule_recurrence_dot",
                 f"must be {', '.join(DOT_CHOICES)}", self.delta_rule_recurrence_dot)
        try:
            wanted = parse_include_kernels(self.include_kernels)
        except TypeError:
            raise ValueError(f"kernel_config.include_kernels: must be auto, none, a comma-separated string or a list "
                             f"of kernel ids (got {self.include_kernels!r})") from None
        if isinstance(wanted, list):
            known = known_kernel_ids()
            unknown = [kernel_id for kernel_id in wanted if kernel_id not in known]
            _require(not unknown, "include_kernels", f"unknown kernel id(s) {', '.join(map(repr, unknown))}; "
                     f"known kernel ids: {', '.join(known)}")

    def kernel_options(self) -> dict[str, dict]:
        """{kernel id: keyword arguments of its apply} this config sets (apply_default_kernels' kernel_options)."""
        return {kernel_id: {"recurrence_dot": self.delta_rule_recurrence_dot}
                for kernel_id in self.RECURRENCE_DOT_KERNELS}

    @classmethod
    def from_mapping(cls, mapping: Mapping) -> KernelConfig:
        """The config form as a mapping (a parsed YAML file); keys left out take their defaults."""
        allowed = [f.name for f in fields(cls)]
        extra = set(mapping) - set(allowed)
        if extra:
            raise ValueError(f"kernel_config: unknown key(s) {', '.join(sorted(map(str, extra)))}; "
                             f"expected {', '.join(sorted(allowed))}")
        return cls(**mapping)


def _require(condition: bool, key: str, message: str, *value) -> None:
    if not condition:
        got = f" (got {value[0]!r})" if value else ""
        raise ValueError(f"kernel_config.{key}: {message}{got}")


def apply_kernel_config(model: nn.Module, kernel_config: KernelConfig | Mapping | None) -> nn.Module:
    """The config form: a KernelConfig, or its mapping `{name: auto | cuda | npu | cpu, include_kernels: auto | none |
    "a,b" | [a, b], delta_rule_recurrence_dot: auto | bf16 | tf32}`. `name` picks the device whose implementations
    are used (auto = detected); `delta_rule_recurrence_dot` the dots of the gated delta rule / product's and KDA's
    recurrence kernels for bf16 inputs, passed to those kernels, which bind it into this model's swapped layers as
    their ops' recurrence_dot argument (KernelConfig.kernel_options; ops/common/precision.py): it holds for this model
    only, and another model in the process may run another."""
    if kernel_config is None:
        return model
    config = kernel_config if isinstance(kernel_config, KernelConfig) else KernelConfig.from_mapping(kernel_config)
    return apply_default_kernels(model, config.include_kernels, device=config.name,
                                 kernel_options=config.kernel_options())
