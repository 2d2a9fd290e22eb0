"""The registry kernel `kda`: runs the Kimi Delta Attention of `rltrain_kernels.layers.KimiDeltaAttention` layers on
rltrain's Triton kernels — chunked for whole sequences (training, prefill), fused-recurrent when decoding from a
cache. The swapped class runs a copy of the layer's forward whose two op names (`torch_chunk_kda`,
`torch_recurrent_kda`) resolve to the kernels; unswapped, the layer runs the plain-PyTorch recurrence. Applies to
any model holding such layers. CUDA only: elsewhere the PyTorch recurrence stays.

`apply(model, recurrence_dot=...)` (auto | bf16 | tf32; the registry passes kernel_config.delta_rule_recurrence_dot)
binds the ops' recurrence_dot into this model's swapped layers: another model in the process may run another.
"""

import functools

from rltrain_kernels.integrations.families import layer_kernel_swap, register_per_device
from rltrain_kernels.registry import BaseKernel


def chunk_op(*args, recurrence_dot: str, **kwargs):
    """chunk_kda, looked up at each call (the swapped class, and the forward that calls this, are shared by every
    model swapped with the same recurrence_dot)."""
    from rltrain_kernels.ops.kda import chunk_kda

    return chunk_kda(*args, recurrence_dot=recurrence_dot, **kwargs)


def recurrent_op(*args, recurrence_dot: str, **kwargs):
    """fused_recurrent_kda, looked up at each call (as chunk_op)."""
    from rltrain_kernels.ops.kda import fused_recurrent_kda

    return fused_recurrent_kda(*args, recurrence_dot=recurrence_dot, **kwargs)


OPS = (chunk_op, recurrent_op)


class _KDA(BaseKernel):
    kernel_id = "kda"

    @classmethod
    def apply(cls, model, recurrence_dot: str = "auto") -> int:
        from rltrain_kernels.layers import KimiDeltaAttention
        from rltrain_kernels.ops.common.precision import check_recurrence_dot

        options = (("recurrence_dot", check_recurrence_dot(recurrence_dot)),)  # the swapped class says so
        chunk, recurrent = (functools.partial(op, recurrence_dot=recurrence_dot) for op in cls.load_op())
        return layer_kernel_swap(model, KimiDeltaAttention, cls.kernel_id, cls.device, options=options,
                                 torch_chunk_kda=chunk, torch_recurrent_kda=recurrent)


register_per_device(_KDA, {"cuda": "rltrain_kernels.integrations.kda:OPS"})
