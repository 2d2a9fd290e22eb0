"""The registry kernel `kda`: runs the Kimi Delta Attention of `rltrain_kernels.layers.KimiDeltaAttention` layers (in
whatever model holds them) on rltrain's Triton kernels, chunked for whole sequences and fused-recurrent for decoding
(families.LayerKernel). `apply(model, recurrence_dot=auto | bf16 | tf32)`: the registry passes
kernel_config.delta_rule_recurrence_dot. CUDA only: elsewhere the PyTorch recurrence stays.
"""

from rltrain_kernels.integrations.families import register_layer_kernel

OPS = "rltrain_kernels.ops.kda"
register_layer_kernel("kda", "KimiDeltaAttention", {"torch_chunk_kda": f"{OPS}:chunk_kda",
                                                    "torch_recurrent_kda": f"{OPS}:fused_recurrent_kda"})
