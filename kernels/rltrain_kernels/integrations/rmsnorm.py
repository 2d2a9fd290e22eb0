"""`fused_rmsnorm`: replaces a model's RMSNorm modules (Llama-style: y = weight * x / rms(x)).
`fused_gated_rmsnorm`: replaces gated RMSNorm modules (Qwen3-Next's GatedDeltaNet output norm, y = rms_norm(x) *
silu(gate)), a separate id because its modules take two inputs and only some families have them.

cuda: the Triton kernels (rltrain_kernels.ops.rmsnorm); npu: torch_npu.npu_rms_norm (plain RMSNorm only; the gated
norm keeps transformers' own forward there); cpu: the plain-torch references. Qwen3's per-head q_norm / k_norm are
the same class as its other norms and are swapped too.
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


class _FusedGatedRMSNorm(BaseKernel):
    kernel_id = "fused_gated_rmsnorm"

    @classmethod
    def apply(cls, model, **kwargs) -> int:
        classes = family_classes(model, "gated_rmsnorm", cls.kernel_id)
        op = cls.load_op()

        def forward(self, hidden_states, gate):
            return op(hidden_states, gate, self.weight, self.variance_epsilon)

        # the op's gate activation is SiLU; a module configured otherwise keeps its own forward
        return swap_modules(model, classes, cls.kernel_id, cls.device, forward,
                            accept=lambda m: getattr(m, "activation", "silu") == "silu")


register_per_device(_FusedGatedRMSNorm, {
    "cuda": "rltrain_kernels.ops.rmsnorm:gated_rms_norm",
    "cpu": "rltrain_kernels.ops.rmsnorm.naive:naive_gated_rms_norm",
})
