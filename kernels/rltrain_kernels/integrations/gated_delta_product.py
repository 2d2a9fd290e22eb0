"""The registry kernel `gated_delta_product`: runs the delta product of `rltrain_kernels.layers.GatedDeltaProduct`
layers on rltrain's Triton kernels — chunked for whole sequences (training, prefill), fused-recurrent when decoding
from a cache. The swapped class runs a copy of the layer's forward whose two op names
(`torch_chunk_gated_delta_product`, `torch_recurrent_gated_delta_product`) resolve to the kernels; unswapped, the
layer runs the plain-PyTorch recurrence. Applies to any model holding such layers (the hybrid family of
rltrain_kernels.models, or a user's own). CUDA only: elsewhere the PyTorch recurrence stays.
"""

from rltrain_kernels.integrations.families import layer_kernel_swap, register_per_device
from rltrain_kernels.registry import BaseKernel


def _ops():
    from rltrain_kernels.ops.gated_delta_product import (chunk_gated_delta_product,
                                                         fused_recurrent_gated_delta_product)

    return chunk_gated_delta_product, fused_recurrent_gated_delta_product


class _GatedDeltaProduct(BaseKernel):
    kernel_id = "gated_delta_product"

    @classmethod
    def apply(cls, model, **kwargs) -> int:
        from rltrain_kernels.layers import GatedDeltaProduct

        chunk, recurrent = cls.load_op()()
        return layer_kernel_swap(model, GatedDeltaProduct, cls.kernel_id, cls.device,
                                 torch_chunk_gated_delta_product=chunk, torch_recurrent_gated_delta_product=recurrent)


register_per_device(_GatedDeltaProduct, {"cuda": "rltrain_kernels.integrations.gated_delta_product:_ops"})
