"""`fused_moe`: runs the routed experts of a sparse MoE block (Qwen3-MoE, Mixtral, Qwen3-Next) as one fused op
instead of transformers' per-expert loop (or its torch grouped_mm path).

In transformers 5 the sparse block is a router (`gate`: logits → softmax → top-k, whose logits the model records for
the auxiliary loss) followed by one experts module holding stacked weights (`gate_up_proj` [E, 2I, H], gate rows
first; `down_proj` [E, H, I]) with forward(hidden_states, top_k_index, top_k_weights). The experts module is what is
swapped, so the router, its logits, the top-k weights and the auxiliary loss stay transformers' own by construction;
the block's output changes only by the rounding of the experts' sums. Modules the op does not compute are left
alone: a non-SiLU activation, transposed / interleaved / biased weights, a custom gate or a post-expert norm (the
flags transformers' `use_experts_implementation` sets), and at call time a module sharded for expert parallelism.

cuda: the Triton grouped GEMMs (rltrain_kernels.ops.fused_moe); npu: torch_npu.npu_grouped_matmul
(ops/fused_moe/npu.py; the reference where that op or the NPU tensors are missing); cpu: the plain-torch loop.
"""

import logging

from rltrain_kernels.integrations.families import family_classes, original_class, register_per_device, swap_modules
from rltrain_kernels.registry import BaseKernel

logger = logging.getLogger(__name__)
SILU_NAMES = ("silu", "swish")


def computes_experts(module) -> bool:
    """Whether `module` (a transformers fused experts module) computes what fused_moe does."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if getattr(gate_up, "dim", lambda: 0)() != 3 or getattr(down, "dim", lambda: 0)() != 3:
        return False
    experts, hidden, intermediate = down.shape
    gate = getattr(type(module), "_apply_gate", None)
    return (tuple(gate_up.shape) == (experts, 2 * intermediate, hidden)
            and getattr(getattr(module, "config", None), "hidden_act", None) in SILU_NAMES
            and getattr(module, "has_gate", True) and getattr(module, "is_concatenated", True)
            and not getattr(module, "is_transposed", False) and not getattr(module, "has_bias", False)
            and not getattr(module, "has_post_expert_norm", False)
            and (gate is None or gate.__name__ == "_default_apply_gate"))


class _FusedMoE(BaseKernel):
    kernel_id = "fused_moe"

    @classmethod
    def apply(cls, model, **kwargs) -> int:
        classes = family_classes(model, "experts", cls.kernel_id)
        op = cls.load_op()

        def forward(self, hidden_states, top_k_index, top_k_weights):
            if getattr(self, "_is_expert_parallel", False):   # ids past this rank's experts: transformers' path
                return original_class(self).forward(self, hidden_states, top_k_index, top_k_weights)
            return op(hidden_states, self.gate_up_proj, self.down_proj, top_k_index, top_k_weights)

        changed = swap_modules(model, classes, cls.kernel_id, cls.device, forward, accept=computes_experts)
        skipped = sum(issubclass(original_class(m), classes) and not computes_experts(m) for m in model.modules())
        if skipped:
            logger.info("%s: %d experts module(s) left unchanged (activation or weight layout the op does not "
                        "compute)", cls.kernel_id, skipped)
        return changed


register_per_device(_FusedMoE, {
    "cuda": "rltrain_kernels.ops.fused_moe:fused_moe",
    "npu": "rltrain_kernels.ops.fused_moe.npu:npu_fused_moe",
    "cpu": "rltrain_kernels.ops.fused_moe.naive:naive_fused_moe",
})
