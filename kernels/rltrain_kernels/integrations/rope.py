"""`fused_rope`: replaces apply_rotary_pos_emb inside a model's attention modules.

transformers' attention forwards call their modeling module's global `apply_rotary_pos_emb`. Rather than patch
that global for the whole process (which would change every model of the family, including a frozen reference
built from the same class), the swapped attention class runs a copy of the original forward whose globals resolve
`apply_rotary_pos_emb` to the kernel. cuda: the Triton kernel (rltrain_kernels.ops.rope); npu:
torch_npu.npu_rotary_mul; cpu: the plain-torch reference.
"""

from rltrain_kernels.integrations.families import family_classes, original_class, swap_modules, with_globals
from rltrain_kernels.registry import BaseKernel, register_kernel
from rltrain_kernels.utils import module_available


class _FusedRoPE(BaseKernel):
    kernel_id = "fused_rope"

    @classmethod
    def apply(cls, model, **kwargs) -> int:
        classes = family_classes(model, "attention", cls.kernel_id)
        op = cls.load_op()
        changed = 0
        for attention_cls in classes:
            forward = with_globals(attention_cls.forward, apply_rotary_pos_emb=op)
            changed += swap_modules(model, (attention_cls,), cls.kernel_id, cls.device, forward,
                                    accept=lambda m, c=attention_cls: original_class(m) is c)
        return changed


@register_kernel
class FusedRoPECUDA(_FusedRoPE):
    device = "cuda"

    @classmethod
    def check_deps(cls) -> bool:
        return module_available("triton")

    @classmethod
    def load_op(cls):
        from rltrain_kernels.ops.rope import apply_rotary_pos_emb
        return apply_rotary_pos_emb


@register_kernel
class FusedRoPENPU(_FusedRoPE):
    device = "npu"

    @classmethod
    def check_deps(cls) -> bool:
        return module_available("torch_npu")

    @classmethod
    def load_op(cls):
        from rltrain_kernels.ops.rope.npu import npu_apply_rotary_pos_emb
        return npu_apply_rotary_pos_emb


@register_kernel
class FusedRoPECPU(_FusedRoPE):
    device = "cpu"

    @classmethod
    def load_op(cls):
        from rltrain_kernels.ops.rope.naive import naive_apply_rotary_pos_emb
        return naive_apply_rotary_pos_emb
