"""`fused_swiglu`: replaces the activation-and-product of a gated MLP, down(silu(gate(x)) * up(x)).

Only models whose config.hidden_act is silu/swish are swapped (a GELU-gated MLP keeps its forward). cuda: the Triton kernel
(rltrain_kernels.ops.swiglu); npu: torch_npu.npu_swiglu; cpu: the plain-torch reference.
"""

import logging

from rltrain_kernels.integrations.families import family_classes, swap_modules
from rltrain_kernels.registry import BaseKernel, register_kernel
from rltrain_kernels.utils import module_available

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


@register_kernel
class FusedSwiGLUCUDA(_FusedSwiGLU):
    device = "cuda"

    @classmethod
    def check_deps(cls) -> bool:
        return module_available("triton")

    @classmethod
    def load_op(cls):
        from rltrain_kernels.ops.swiglu import swiglu
        return swiglu


@register_kernel
class FusedSwiGLUNPU(_FusedSwiGLU):
    device = "npu"

    @classmethod
    def check_deps(cls) -> bool:
        return module_available("torch_npu")

    @classmethod
    def load_op(cls):
        from rltrain_kernels.ops.swiglu.npu import npu_swiglu
        return npu_swiglu


@register_kernel
class FusedSwiGLUCPU(_FusedSwiGLU):
    device = "cpu"

    @classmethod
    def load_op(cls):
        from rltrain_kernels.ops.swiglu.naive import naive_swiglu
        return naive_swiglu
