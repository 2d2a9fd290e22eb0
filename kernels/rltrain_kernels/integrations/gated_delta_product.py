"""The registry kernel `gated_delta_product`: runs the delta product of `rltrain_kernels.layers.GatedDeltaProduct`
layers (the hybrid family of rltrain_kernels.models, or a user's own) on rltrain's Triton kernels, chunked for whole
sequences and fused-recurrent for decoding (families.LayerKernel). `apply(model, recurrence_dot=auto | bf16 | tf32)`:
the registry passes kernel_config.delta_rule_recurrence_dot. CUDA only: elsewhere the PyTorch recurrence stays.
"""

from rltrain_kernels.integrations.families import register_layer_kernel

OPS = "rltrain_kernels.ops.gated_delta_product"
register_layer_kernel("gated_delta_product", "GatedDeltaProduct",
                      {"torch_chunk_gated_delta_product": f"{OPS}:chunk_gated_delta_product",
                       "torch_recurrent_gated_delta_product": f"{OPS}:fused_recurrent_gated_delta_product"})
