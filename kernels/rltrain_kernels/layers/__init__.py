"""nn.Module token mixers for policy models built on rltrain's linear-attention ops.

    from rltrain_kernels.layers import GatedDeltaProduct, IPLRLinearAttention
    layer = GatedDeltaProduct(hidden_size=1024, num_heads=8, head_dim=128, num_householder=2)
    # or IPLRLinearAttention(hidden_size=1024, num_heads=8, head_dim=128)
    out, cache = layer(hidden_states, use_cache=True)            # whole sequence: chunked op
    out, cache = layer(next_hidden_states, cache=cache, use_cache=True)  # decoding: fused-recurrent op

`LinearAttentionCache` holds a layer's conv and recurrent states between calls; layers/common.py states the
padding (attention_mask) rules.
"""

from .common import LinearAttentionCache, ShortConvolution
from .gated_delta_product import GatedDeltaProduct
from .iplr import IPLRLinearAttention

__all__ = ["GatedDeltaProduct", "IPLRLinearAttention", "LinearAttentionCache", "ShortConvolution"]
