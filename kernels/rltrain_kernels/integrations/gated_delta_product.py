"""The registry kernel `gated_delta_product`: runs the delta product of `rltrain_kernels.layers.GatedDeltaProduct`
layers on rltrain's Triton kernels — chunked for whole sequences (training, prefill), fused-recurrent when decoding
from a cache. The swapped class runs a copy of the layer's forward whose two op names
(`torch_chunk_gated_delta_product`, `torch_recurrent_gated_delta_product`) resolve to the kernels; unswapped, the
layer runs the plain-PyTorch recurrence. Applies to any model holding such layers (the hybrid family of
rltrain_kernels.models, or a user's own). CUDA only: elsewhere the PyTorch recurrence stays.

`apply(model, recurrence_dot=...)` (auto | bf16 | tf32; the registry passes kernel_config.delta_rule_recurrence_dot)
binds the ops' recurrence_dot into this model's swapped layers: another model in the process may run another.
"""

import functools

from rltrain_kernels.integrations.families import layer_kernel_swap, register_per_device
from rltrain_kernels.registry import BaseKernel


def chunk_op(*args, recurrence_dot: str, **kwargs):
    """chunk_gated_delta_product, looked up at each call (the swapped class, and the forward that calls this, are
    shared by every model swapped with the same recurrence_dot)."""
    from rltrain_kernels.ops.gated_delta_product import chunk_gated_delta_product

    return chunk_gated_delta_product(*args, recurrence_dot=recurrence_dot, **kwargs)


def recurrent_op(*args, recurrence_dot: str, **kwargs):
    """fused_recurrent_gated_delta_product, looked up at each call (as chunk_op)."""
    from rltrain_kernels.ops.gated_delta_product import fused_recurrent_gated_delta_product

    return fused_recurrent_gated_delta_product(*args, recurrence_dot=recurrence_dot, **kwargs)


OPS = (chunk_op, recurrent_op)


class _GatedDeltaProduct(BaseKernel):
    kernel_id = "gated_delta_product"

    @classmethod
    def apply(cls, model, recurrence_dot: str = "auto") -> int:
        from rltrain_kernels.layers import GatedDeltaProduct
        from rltrain_kernels.ops.common.precision import check_recurrence_dot

        options = (("recurrence_dot", check_recurrence_dot(recurrence_dot)),)  # the swapped class says so
        chunk, recurrent = (functools.partial(op, recurrence_dot=recurrence_dot) for op in cls.load_op())
        return layer_kernel_swap(model, GatedDeltaProduct, cls.kernel_id, cls.device, options=options,
                                 torch_chunk_gated_delta_product=chunk, torch_recurrent_gated_delta_product=recurrent)


register_per_device(_GatedDeltaProduct, {"cuda": "rltrain_kernels.integrations.gated_delta_product:OPS"})
