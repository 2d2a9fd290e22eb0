"""`fused_swiglu`: replaces the activation-and-product of a gated MLP, down(silu(gate(x)) * up(x)).

Only models whose config.hidden_act is silu/swish are swapped (a GELU-gated MLP keeps its forward).
cuda: the Triton kernel (rltrain_kernels.ops.swiglu); npu: torch_npu.npu_swiglu; cpu: the plain-torch reference.
"""

import logging

from rltrain_kernels.integrations.families import family_classes, register_per_device, swap_modules
from rltrain_kernels.registry import BaseKernel

logger = logging.getLogger(__name__)
SILU_NAMES = ("silu", "swish")


class _FusedSwiGLU(BaseKernel):
    kernel_id = "fused_swiglu"

    @classmethod
    def apply(cls, model, **kwargs) -> int:
        classes = family_classes(model, "mlp", cls.kernel_id)
        act = getattr(model.config, "hidden_act", None)
        if act not in SILU_NAMES:
            logger.info("%s: hidden_act is %r, not one of %s; MLPs left unchanged", cls.kernel_id, act, SILU_NAMES)
            return 0
        op = cls.load_op()

        def forward(self, x):
            return self.down_proj(op(self.gate_proj(x), self.up_proj(x)))

        return swap_modules(model, classes, cls.kernel_id, cls.device, forward)


register_per_device(_FusedSwiGLU, {
    "cuda": "rltrain_kernels.ops.swiglu:swiglu",
    "npu": "rltrain_kernels.ops.swiglu.npu:npu_swiglu",
    "cpu": "rltrain_kernels.ops.swiglu.naive:naive_swiglu",
})
