"""The registry kernel `iplr_delta_rule`: runs the IPLR delta rule of `rltrain_kernels.layers.IPLRLinearAttention`
layers on rltrain's Triton kernels — chunked for whole sequences (training, prefill), fused-recurrent when decoding
from a cache. The swapped class runs a copy of the layer's forward whose two op names (`torch_chunk_iplr_delta_rule`,
`torch_recurrent_iplr_delta_rule`) resolve to the kernels; unswapped, the layer runs the plain-PyTorch recurrence.
Applies to any model holding such layers. CUDA only: elsewhere the PyTorch recurrence stays.
"""

from rltrain_kernels.integrations.families import layer_kernel_swap, register_per_device
from rltrain_kernels.registry import BaseKernel


def _ops():
    from rltrain_kernels.ops.iplr_delta_rule import chunk_iplr_delta_rule, fused_recurrent_iplr_delta_rule

    return chunk_iplr_delta_rule, fused_recurrent_iplr_delta_rule


class _IPLRDeltaRule(BaseKernel):
    kernel_id = "iplr_delta_rule"

    @classmethod
    def apply(cls, model, **kwargs) -> int:
        from rltrain_kernels.layers import IPLRLinearAttention

        chunk, recurrent = cls.load_op()()
        return layer_kernel_swap(model, IPLRLinearAttention, cls.kernel_id, cls.device,
                                 torch_chunk_iplr_delta_rule=chunk, torch_recurrent_iplr_delta_rule=recurrent)


register_per_device(_IPLRDeltaRule, {"cuda": "rltrain_kernels.integrations.iplr_delta_rule:_ops"})
