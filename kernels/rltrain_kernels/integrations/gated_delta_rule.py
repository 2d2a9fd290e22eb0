"""The registry kernel `gated_delta_rule`: runs the gated delta rule of linear-attention layers (Qwen3-Next's Gated
DeltaNet, and rltrain_kernels.layers.GatedDeltaNet in whatever model holds it) on rltrain's kernels — chunked for
prefill and training, fused-recurrent for decoding steps.

transformers' GatedDeltaNet forward calls its modeling module's `torch_chunk_gated_delta_rule` and
`torch_recurrent_gated_delta_rule` with fla's argument names, plus attention keywords meant for other layers (the
packed batch's cu_seq_lens_k, max_length_q, ...) that the adapters drop. fla's own keywords are passed on, never
dropped: transformers 5.17-5.24 compute Qwen3-Next's gate and β in torch and pass neither, but a caller that hands
the raw gate input with use_gate_in_kernel=True (and A_log, dt_bias), beta logits with use_beta_sigmoid_in_kernel,
state_v_first or a chunk_size gets fla's meaning of them, not a silently different recurrence. As for
RoPE, the swapped class runs a copy of the forward whose globals resolve those two names to the adapters below,
leaving the module and every other model alone. rltrain's GatedDeltaNet layer calls the same two names (plain
PyTorch until swapped), so the same adapters serve it. CUDA only: elsewhere transformers' own torch path (or the
layer's PyTorch recurrence) stays. Qwen3-Next's swapped forward also takes packed rows (integrations/qwen3_next.py:
cu_seq_lens_q without a cache goes through the chunked kernel with the conv restarting per sequence; every other call
through transformers' forward as above).

`apply(model, recurrence_dot=...)` (auto | bf16 | tf32; the registry passes kernel_config.delta_rule_recurrence_dot)
binds the ops' recurrence_dot into this model's swapped layers: another model in the process may run another.
"""

from rltrain_kernels.integrations.families import (LayerKernel, family_classes, holds_layers, original_class,
                                                  swap_modules, with_globals, wrapped_model)
from rltrain_kernels.integrations.qwen3_next import PACKED_FAMILIES, packed_forward
from rltrain_kernels.registry import register_kernel


# fla's keywords both ops take (fla.ops.gated_delta_rule, 0.6): passed through whenever the caller gives them.
FLA_KEYWORDS = ("scale", "use_gate_in_kernel", "A_log", "dt_bias", "use_beta_sigmoid_in_kernel", "allow_neg_eigval",
                "state_v_first", "transpose_state_layout")


def _fla_keywords(kwargs: dict) -> dict:
    return {name: kwargs[name] for name in FLA_KEYWORDS if name in kwargs}


def chunk_adapter(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, recurrence_dot, **kwargs):
    from rltrain_kernels.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule(query, key, value, g, beta, initial_state=initial_state,
                                  output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, recurrence_dot=recurrence_dot,
                                  chunk_size=chunk_size, **_fla_keywords(kwargs))


def recurrent_adapter(query, key, value, g, beta, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, recurrence_dot, **kwargs):
    from rltrain_kernels.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    return fused_recurrent_gated_delta_rule(query, key, value, g, beta, initial_state=initial_state,
                                            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                            recurrence_dot=recurrence_dot, **_fla_keywords(kwargs))


class _GatedDeltaRule(LayerKernel):
    """rltrain's GatedDeltaNet layers as any LayerKernel; else a transformers family's linear-attention classes
    (Qwen3-Next), whose forwards call the same two names."""

    kernel_id = "gated_delta_rule"
    layer = "GatedDeltaNet"
    ops = {"torch_chunk_gated_delta_rule": f"{__name__}:chunk_adapter",
           "torch_recurrent_gated_delta_rule": f"{__name__}:recurrent_adapter"}

    @classmethod
    def apply(cls, model, **options) -> int:
        from rltrain_kernels.layers import GatedDeltaNet

        if holds_layers(model, GatedDeltaNet):
            return super().apply(model, **options)
        ops, swap_options = cls.bound_ops(options)
        packs = wrapped_model(model).config.model_type in PACKED_FAMILIES
        changed = 0
        for layer_cls in family_classes(model, "linear_attention", cls.kernel_id):
            forward = with_globals(layer_cls.forward, **ops)
            if packs:  # packed rows (cu_seq_lens_q) through the same chunked kernel, the conv restarting per sequence
                forward = packed_forward(forward, ops["torch_chunk_gated_delta_rule"])
            changed += swap_modules(model, (layer_cls,), cls.kernel_id, cls.device, forward,
                                    accept=lambda m, c=layer_cls: original_class(m) is c, options=swap_options)
        return changed


register_kernel(_GatedDeltaRule)
