"""`fused_rope`: replaces apply_rotary_pos_emb inside a model's attention modules.

transformers' attention forwards call their modeling module's global `apply_rotary_pos_emb`. Rather than patch
that global for the whole process (which would change every model of the family, including a frozen reference
built from the same class), the swapped attention class runs a copy of the original forward whose globals resolve
`apply_rotary_pos_emb` to the kernel. cuda: the Triton kernel (rltrain_kernels.ops.rope); npu:
torch_npu.npu_rotary_mul; cpu: the plain-torch reference.
"""

from rltrain_kernels.integrations.families import (family_classes, original_class, register_per_device,
                                                  swap_modules, with_globals)
from rltrain_kernels.registry import BaseKernel


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


register_per_device(_FusedRoPE, {
    "cuda": "rltrain_kernels.ops.rope:apply_rotary_pos_emb",
    "npu": "rltrain_kernels.ops.rope.npu:npu_apply_rotary_pos_emb",
    "cpu": "rltrain_kernels.ops.rope.naive:naive_apply_rotary_pos_emb",
})
