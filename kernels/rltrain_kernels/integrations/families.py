"""Which modules of a transformers model each kernel replaces, per model family, and how they are replaced.

Table-driven (one row per `config.model_type`), so supporting a family is one entry, not a patch file. Classes are
looked up by name in the model's own modeling module, so the table imports nothing from transformers.

A PEFT-wrapped model (LoRA) is swapped like the model it wraps: its LoRA layers replace the Linear projections,
which the swapped forwards call as modules, so swapping before or after wrapping gives the same model.

Swapping sets `module.__class__` to a cached subclass of the original whose `forward` calls the kernel. Weights,
parameter names, buffers and state_dict keys are untouched, only the given model changes (no process-wide
monkey-patching), applying twice is a no-op, and `restore_original_modules(model)` undoes it. Such a model still
deep-copies; pickling it by reference is not supported (the subclasses are created at run time).
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
from dataclasses import dataclass

import torch.nn as nn

from rltrain_kernels.registry import BaseKernel, UnsupportedModelError, register_kernel
from rltrain_kernels.utils import module_available

# What each device's implementations need importable.
DEVICE_DEPS = {"cuda": "triton", "npu": "torch_npu", "cpu": None}


@dataclass(frozen=True)
class ModelFamily:
    rmsnorm: tuple[str, ...] = ()    # RMSNorm classes: `weight`, `variance_epsilon`, y = w * x / rms(x)
    mlp: tuple[str, ...] = ()        # gated MLPs: gate_proj, up_proj, down_proj, act_fn
    attention: tuple[str, ...] = ()  # attention classes whose forward calls the module's apply_rotary_pos_emb
    linear_attention: tuple[str, ...] = ()  # gated delta rule layers calling fla-named module functions
    gated_rmsnorm: tuple[str, ...] = ()  # gated RMSNorms: `weight`, `variance_epsilon`, forward(x, gate) = norm·silu
    # routed experts of a sparse MoE block, transformers 5's fused modules: gate_up_proj [E, 2I, H], down_proj
    # [E, H, I], forward(hidden_states, top_k_index, top_k_weights) (the router stays the block's own)
    experts: tuple[str, ...] = ()


def _family(prefix: str, **roles) -> ModelFamily:
    return ModelFamily((f"{prefix}RMSNorm",), (f"{prefix}MLP",), (f"{prefix}Attention",), **roles)


FAMILIES: dict[str, ModelFamily] = {
    "llama": _family("Llama"),
    "mistral": _family("Mistral"),
    "qwen2": _family("Qwen2"),
    "qwen3": _family("Qwen3"),
    # Experts are one fused module in transformers 5 (no per-expert MLP): fused_moe swaps it, fused_swiglu the dense
    # layers' MLP class.
    "qwen3_moe": _family("Qwen3Moe", experts=("Qwen3MoeExperts",)),
    # Mixtral: every layer sparse, no dense MLP class.
    "mixtral": ModelFamily(rmsnorm=("MixtralRMSNorm",), attention=("MixtralAttention",), experts=("MixtralExperts",)),
    # rltrain's hybrid delta-rule family (rltrain_kernels.models.hybrid_delta); its linear-attention layers are
    # rltrain_kernels.layers classes, which their kernels find in any model (layer_kernel_swap).
    "hybrid_delta": _family("HybridDelta"),
    # Qwen3-Next: its RMSNorm is (1 + w)-scaled and its attention uses partial rotary, so only the MLPs (the shared
    # expert's too), the routed experts, the Gated DeltaNet layers and their gated output norms take our kernels.
    "qwen3_next": ModelFamily(mlp=("Qwen3NextMLP",), linear_attention=("Qwen3NextGatedDeltaNet",),
                              gated_rmsnorm=("Qwen3NextRMSNormGated",), experts=("Qwen3NextExperts",)),
}


def register_model_family(model_type: str, family: ModelFamily) -> None:
    """Add or replace a row of the table (e.g. for a custom model loaded with trust_remote_code)."""
    FAMILIES[model_type] = family


def wrapped_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a wrapper that hands it out with get_base_model() (PEFT's PeftModel, whose LoRA
    layers sit inside that model's modules), else `model` itself. Its config and class name the family."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def family_classes(model: nn.Module, role: str, kernel_id: str) -> tuple[type, ...]:
    """The classes playing `role` (a ModelFamily field: 'rmsnorm', 'mlp', ...) in `model` (or the model a PEFT
    wrapper holds), resolved in its modeling module."""
    model = wrapped_model(model)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"{kernel_id}: no adapter for model_type {model_type!r} ({type(model).__name__}); supported: "
            f"{', '.join(sorted(FAMILIES))} (add one with rltrain_kernels.integrations.families.register_model_family)")
    module = sys.modules[type(model).__module__]
    names = getattr(FAMILIES[model_type], role)
    if not names:
        raise UnsupportedModelError(f"{kernel_id}: model_type {model_type!r} has no {role} modules it applies to")
    classes = tuple(c for name in names if isinstance(c := getattr(module, name, None), type))
    if not classes:
        raise UnsupportedModelError(f"{kernel_id}: {module.__name__} defines none of {', '.join(names)}")
    return classes


_SWAPPED: dict[tuple[type, str, str, tuple], type] = {}


def original_class(module: nn.Module) -> type:
    return getattr(type(module), "_rltrain_original_class", type(module))


def swap_forward(module: nn.Module, kernel_id: str, device: str, forward, options: tuple = ()) -> bool:
    """Give `module` a forward that runs `kernel_id` on `device`. Returns False when it already had it.
    options: the ((name, value), ...) the forward was built with (the delta-rule kernels' recurrence_dot): part of
    the swapped class and its repr, so models swapped with different options run their own."""
    original = original_class(module)
    key = (original, kernel_id, device, options)
    swapped = _SWAPPED.get(key)
    if swapped is None:
        tag = f"{kernel_id}/{device}"
        shown = "".join(f", {name}={value}" for name, value in options)

        def extra_repr(self) -> str:
            base = original.extra_repr(self)
            return f"{base}, kernel={tag}{shown}" if base else f"kernel={tag}{shown}"

        swapped = type(original.__name__, (original,), {
            "forward": forward, "extra_repr": extra_repr, "_rltrain_original_class": original,
            "_rltrain_kernel": tag, "__module__": original.__module__, "__qualname__": original.__qualname__})
        _SWAPPED[key] = swapped
    if type(module) is swapped:
        return False
    module.__class__ = swapped
    return True


def swap_modules(model: nn.Module, classes: tuple[type, ...], kernel_id: str, device: str, forward,
                 accept=lambda module: True, options: tuple = ()) -> int:
    """swap_forward on every module of `model` that is an instance of `classes` and passes `accept`."""
    targets = [m for m in model.modules() if issubclass(original_class(m), classes) and accept(m)]
    return sum(swap_forward(m, kernel_id, device, forward, options) for m in targets)


def restore_original_modules(model: nn.Module) -> int:
    """Undo every kernel swap in `model`; returns the number of modules restored."""
    restored = 0
    for m in model.modules():
        if original_class(m) is not type(m):
            m.__class__ = original_class(m)
            restored += 1
    return restored


def holds_layers(model: nn.Module, layer_cls: type) -> bool:
    return any(issubclass(original_class(m), layer_cls) for m in model.modules())


def layer_kernel_swap(model: nn.Module, layer_cls: type, kernel_id: str, device: str, options: tuple = (),
                      **ops) -> int:
    """Swap every `layer_cls` module of `model` (rltrain_kernels.layers classes, in whatever model holds them) to a
    forward whose module-level op names in `ops` resolve to the given kernels (built with `options`, swap_forward);
    returns how many changed. A model without such layers is an UnsupportedModelError (skipped with a log line in
    "auto" mode)."""
    if not holds_layers(model, layer_cls):
        raise UnsupportedModelError(f"{kernel_id}: {type(model).__name__} has no {layer_cls.__name__} layers")
    forward = with_globals(layer_cls.forward, **ops)
    return swap_modules(model, (layer_cls,), kernel_id, device, forward, options=options)


def with_globals(func: types.FunctionType, **replacements) -> types.FunctionType:
    """A copy of `func` whose global names in `replacements` resolve to the given objects; the module itself (and
    every other model of that family in the process) is left alone. A decorated function (functools.wraps, holding
    the original in a closure cell, e.g. transformers' force_accelerate_hooks) is rebuilt around the rebound
    original, so the decorator keeps working."""
    if not all(name in func.__code__.co_names for name in replacements):
        inner = getattr(func, "__wrapped__", None)
        cells = func.__closure__ or ()
        if inner is None or not any(c.cell_contents is inner for c in cells):
            missing = [name for name in replacements if name not in func.__code__.co_names]
            raise UnsupportedModelError(f"{func.__qualname__} does not call {', '.join(missing)}")
        new_inner = with_globals(inner, **replacements)
        closure = tuple(types.CellType(new_inner) if c.cell_contents is inner else c for c in cells)
        wrapper = _copy_function(func, func.__globals__, closure)
        wrapper.__wrapped__ = new_inner
        return wrapper
    return _copy_function(func, dict(func.__globals__, **replacements), func.__closure__)


def _copy_function(func: types.FunctionType, namespace: dict, closure) -> types.FunctionType:
    new = types.FunctionType(func.__code__, namespace, func.__name__, func.__defaults__, closure)
    new.__kwdefaults__ = func.__kwdefaults__
    new.__qualname__ = func.__qualname__
    new.__doc__ = func.__doc__
    new.__dict__.update({k: v for k, v in func.__dict__.items() if k != "__wrapped__"})
    return new


def register_per_device(base: type, ops: dict[str, str]) -> None:
    """Register one subclass of `base` (a BaseKernel whose apply() calls `cls.load_op()`) per device, from
    {device: "module.path:attribute"}; each checks its device's dependency (DEVICE_DEPS) and imports its op lazily."""
    for device, target in ops.items():
        module_name, attribute = target.split(":")
        dep = DEVICE_DEPS[device]

        def check_deps(cls, dep=dep) -> bool:
            return dep is None or module_available(dep)

        def load_op(cls, module_name=module_name, attribute=attribute):
            return getattr(importlib.import_module(module_name), attribute)

        name = f"{base.__name__.lstrip('_')}{device.upper()}"
        register_kernel(type(name, (base,), {"device": device, "check_deps": classmethod(check_deps),
                                             "load_op": classmethod(load_op), "__module__": base.__module__}))


@functools.cache
def _resolve(target: str):
    module_name, name = target.split(":")
    return getattr(importlib.import_module(module_name), name)


def lazy_op(target: str):
    """A function that calls the op at "module.path:function", imported at the first call: registering a kernel
    imports no Triton module."""

    def op(*args, **kwargs):
        return _resolve(target)(*args, **kwargs)

    op.__name__ = op.__qualname__ = target.split(":")[1]
    return op


class LayerKernel(BaseKernel):
    """A kernel that swaps the token mixer of one rltrain_kernels.layers class (in whatever model holds it): the
    layer's forward calls two module-level op names, its chunked op (whole sequences: training, prefill) and its
    fused-recurrent one (decoding from a cache); they are plain PyTorch until swapped, and resolve to the device's
    kernels in the swapped class. Subclasses name the layer and the ops; `register_layer_kernel` registers them."""

    device = "cuda"
    layer: str = ""                      # the class name in rltrain_kernels.layers
    ops: dict[str, str] = {}             # {the forward's op name: "module.path:function"}
    takes_recurrence_dot: bool = True    # apply(recurrence_dot=auto | bf16 | tf32), bound into this model's layers

    @classmethod
    def apply(cls, model, **options) -> int:
        ops, swap_options = cls.bound_ops(options)
        layer_cls = getattr(importlib.import_module("rltrain_kernels.layers"), cls.layer)
        return layer_kernel_swap(model, layer_cls, cls.kernel_id, cls.device, options=swap_options, **ops)

    @classmethod
    def bound_ops(cls, options: dict) -> tuple[dict, tuple]:
        """({op name: the kernel with apply's options bound}, the options as the swapped class records them: another
        model in the process may run others)."""
        options, bound = dict(options), {}
        if cls.takes_recurrence_dot:
            from rltrain_kernels.ops.common.precision import check_recurrence_dot

            bound = {"recurrence_dot": check_recurrence_dot(options.pop("recurrence_dot", "auto"))}
        if options:
            raise TypeError(f"{cls.kernel_id}: apply() takes no option(s) {', '.join(map(repr, options))}")
        ops = {name: functools.partial(lazy_op(target), **bound) for name, target in cls.ops.items()}
        return ops, tuple(bound.items())

    @classmethod
    def check_deps(cls) -> bool:
        return module_available(DEVICE_DEPS[cls.device])


def register_layer_kernel(kernel_id: str, layer: str, ops: dict[str, str], takes_recurrence_dot: bool = True) -> None:
    """Register the CUDA kernel `kernel_id` (a LayerKernel swapping rltrain_kernels.layers.`layer`, needing Triton):
    elsewhere the layer's PyTorch recurrence stays."""
    module = sys._getframe(1).f_globals["__name__"]
    register_kernel(type(f"LayerKernel[{kernel_id}]", (LayerKernel,), {
        "kernel_id": kernel_id, "layer": layer, "ops": dict(ops), "takes_recurrence_dot": takes_recurrence_dot,
        "__module__": module}))
