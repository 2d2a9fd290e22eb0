"""nn.Module token mixers for policy models built on rltrain's linear-attention ops.

    from rltrain_kernels.layers import GatedDeltaNet, GatedDeltaProduct, IPLRLinearAttention
    layer = GatedDeltaProduct(hidden_size=1024, num_heads=8, head_dim=128, num_householder=2)
    # or GatedDeltaNet(hidden_size=1024, num_heads=8, head_dim=128), IPLRLinearAttention(...), KimiDeltaAttention(...)
    out, cache = layer(hidden_states, use_cache=True)                     # whole sequence
    out, cache = layer(next_hidden_states, cache=cache, use_cache=True)   # decoding from the cache
    out, _ = layer(packed_hidden_states, cu_seqlens=cu_seqlens)           # packed sequences, one row

A layer computes its delta rule in plain PyTorch (any device: layers/chunked.py's chunked forms for whole sequences,
layers/recurrence.py's per-step recurrence for decoding and for KDA) until the registry swaps in the Triton kernels —
chunked for whole sequences, fused-recurrent for decoding: `apply_default_kernels(model)` on a GPU, or by id
(`gated_delta_rule`, `gated_delta_product`, `iplr_delta_rule`, `kda`). The four share one base layer (layers/base.py:
DeltaRuleLayer, their projections, convolutions, output head and the steps of forward around the op); each layer's file
holds its own transition. `LinearAttentionCache` holds a layer's conv and recurrent states between calls;
layers/common.py states the padding (attention_mask) and packing (cu_seqlens) rules. Models built from these layers:
rltrain_kernels.models.
"""

from .common import LinearAttentionCache, ShortConvolution
from .gated_delta_product import GatedDeltaProduct
from .gated_delta_rule import GatedDeltaNet
from .iplr import IPLRLinearAttention
from .kda import KimiDeltaAttention

__all__ = ["GatedDeltaNet", "GatedDeltaProduct", "IPLRLinearAttention", "KimiDeltaAttention", "LinearAttentionCache",
           "ShortConvolution"]
