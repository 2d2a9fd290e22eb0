"""The registry kernel `iplr_delta_rule`: runs the IPLR delta rule of `rltrain_kernels.layers.IPLRLinearAttention`
layers (in whatever model holds them) on rltrain's Triton kernels, chunked for whole sequences and fused-recurrent for
decoding (families.LayerKernel; its ops take no recurrence_dot). CUDA only: elsewhere the PyTorch recurrence stays.
"""

from rltrain_kernels.integrations.families import register_layer_kernel

OPS = "rltrain_kernels.ops.iplr_delta_rule"
register_layer_kernel("iplr_delta_rule", "IPLRLinearAttention",
                      {"torch_chunk_iplr_delta_rule": f"{OPS}:chunk_iplr_delta_rule",
                       "torch_recurrent_iplr_delta_rule": f"{OPS}:fused_recurrent_iplr_delta_rule"},
                      takes_recurrence_dot=False)
