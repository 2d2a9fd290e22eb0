"""`fused_rmsnorm`: replaces a model's RMSNorm modules (Llama-style: y = weight * x / rms(x)).

cuda: the Triton kernel (rltrain_kernels.ops.rmsnorm); npu: torch_npu.npu_rms_norm; cpu: the plain-torch
reference. Qwen3's per-head q_norm / k_norm are the same class and are swapped too.
"""

from rltrain_kernels.integrations.families import family_classes, register_per_device, swap_modules
from rltrain_kernels.registry import BaseKernel


class _FusedRMSNorm(BaseKernel):
    kernel_id = "fused_rmsnorm"

    @classmethod
    def apply(cls, model, **kwargs) -> int:
        classes = family_classes(model, "rmsnorm", cls.kernel_id)
        op = cls.load_op()

        def forward(self, hidden_states):
            return op(hidden_states, self.weight, self.variance_epsilon)

        return swap_modules(model, classes, cls.kernel_id, cls.device, forward)


register_per_device(_FusedRMSNorm, {
    "cuda": "rltrain_kernels.ops.rmsnorm:rms_norm",
    "npu": "rltrain_kernels.ops.rmsnorm.npu:npu_rms_norm",
    "cpu": "rltrain_kernels.ops.rmsnorm.naive:naive_rms_norm",
})
