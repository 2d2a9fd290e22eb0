"""The registry kernel `kda`: runs the Kimi Delta Attention of `rltrain_kernels.layers.KimiDeltaAttention` layers on
rltrain's Triton kernels — chunked for whole sequences (training, prefill), fused-recurrent when decoding from a
cache. The swapped class runs a copy of the layer's forward whose two op names (`torch_chunk_kda`,
`torch_recurrent_kda`) resolve to the kernels; unswapped, the layer runs the plain-PyTorch recurrence. Applies to
any model holding such layers. CUDA only: elsewhere the PyTorch recurrence stays.
"""

from rltrain_kernels.integrations.families import layer_kernel_swap, register_per_device
from rltrain_kernels.registry import BaseKernel


def _ops():
    from rltrain_kernels.ops.kda import chunk_kda, fused_recurrent_kda

    return chunk_kda, fused_recurrent_kda


class _KDA(BaseKernel):
    kernel_id = "kda"

    @classmethod
    def apply(cls, model, **kwargs) -> int:
        from rltrain_kernels.layers import KimiDeltaAttention

        chunk, recurrent = cls.load_op()()
        return layer_kernel_swap(model, KimiDeltaAttention, cls.kernel_id, cls.device, torch_chunk_kda=chunk,
                                 torch_recurrent_kda=recurrent)


register_per_device(_KDA, {"cuda": "rltrain_kernels.integrations.kda:_ops"})
