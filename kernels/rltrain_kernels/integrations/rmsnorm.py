"""`fused_rmsnorm`: replaces a model's RMSNorm modules (Llama-style: y = weight * x / rms(x)).

cuda: the Triton kernel (rltrain_kernels.ops.rmsnorm); npu: torch_npu.npu_rms_norm; cpu: the plain-torch
reference. Qwen3's per-head q_norm / k_norm are the same class and are swapped too.
"""

from rltrain_kernels.integrations.families import family_classes, swap_modules
from rltrain_kernels.registry import BaseKernel, register_kernel
from rltrain_kernels.utils import module_available


class _FusedRMSNorm(BaseKernel):
    kernel_id = "fused_rmsnorm"

    @classmethod
    def apply(cls, model, **kwargs) -> int:
        classes = family_classes(model, "rmsnorm", cls.kernel_id)
        op = cls.load_op()

        def forward(self, hidden_states):
            return op(hidden_states, self.weight, self.variance_epsilon)

        return swap_modules(model, classes, cls.kernel_id, cls.device, forward)


@register_kernel
class FusedRMSNormCUDA(_FusedRMSNorm):
    device = "cuda"

    @classmethod
    def check_deps(cls) -> bool:
        return module_available("triton")

    @classmethod
    def load_op(cls):
        from rltrain_kernels.ops.rmsnorm import rms_norm
        return rms_norm


@register_kernel
class FusedRMSNormNPU(_FusedRMSNorm):
    device = "npu"

    @classmethod
    def check_deps(cls) -> bool:
        return module_available("torch_npu")

    @classmethod
    def load_op(cls):
        from rltrain_kernels.ops.rmsnorm.npu import npu_rms_norm
        return npu_rms_norm


@register_kernel
class FusedRMSNormCPU(_FusedRMSNorm):
    device = "cpu"

    @classmethod
    def load_op(cls):
        from rltrain_kernels.ops.rmsnorm.naive import naive_rms_norm
        return naive_rms_norm
