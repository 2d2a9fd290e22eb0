"""Fused PPO/GRPO/GSPO policy loss from the last hidden states: gradients computed in the forward pass, logits
never materialised beyond one token chunk.

    from rltrain_kernels.ops.policy_loss import fused_policy_loss
    out = fused_policy_loss(hidden, lm_head.weight, labels, mask, advantages, old_logprobs, ref_logprobs,
                            clip_low=0.2, clip_high=0.28, kl_coef=0.001, loss_agg="token-mean")
    out.loss.backward(); out.logprobs, out.entropy, out.metrics["clipfrac"]

Layers: the vocabulary tiling shared with linear_logprobs in ops/common/ (vocab_tiles.py, row_pass.py: the
vocab-wide row passes; vocab_gemm.py: the fused GEMM) and kernel.py (Triton token kernels) → chunk.py (chunk driver,
torch twins of the kernels) → function.py (checks, path choice, autograd Function, public function); shifted.py is
the fused path's kept logits and their dlogits pass, scaled.py their bf16 form (no dlogits pass); naive.py is
the dense ground truth with the same signature; options.py holds the shared options, checks and output types;
accumulation.py how a mini-batch's loss splits over micro-batches. README.md has the maths, the GEMM count and the
memory bound.
"""

from rltrain_kernels.ops.policy_loss.accumulation import LossAccumulation
from rltrain_kernels.ops.policy_loss.chunk import PolicyLossChunkConfig, aggregation_weights, workspace_bytes
from rltrain_kernels.ops.policy_loss.function import FusedPolicyLossFunction, fused_policy_loss
from rltrain_kernels.ops.policy_loss.options import (
    IMPORTANCE_LEVELS, KL_TYPES, LOSS_AGGS, Metrics, PolicyLossOptions, PolicyLossOutput,
)
from rltrain_kernels.ops.policy_loss.naive import reference_policy_loss

__all__ = ["FusedPolicyLossFunction", "IMPORTANCE_LEVELS", "KL_TYPES", "LOSS_AGGS", "LossAccumulation", "Metrics",
           "PolicyLossChunkConfig", "PolicyLossOptions", "PolicyLossOutput", "fused_policy_loss",
           "aggregation_weights", "reference_policy_loss", "workspace_bytes"]
