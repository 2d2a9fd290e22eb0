"""HybridDeltaCache: what a hybrid model carries between decoding steps — per attention layer its keys and values
([B, H_kv, S, D], grown by each call), per linear-attention layer a `LinearAttentionCache` (the short convs' last
inputs and the fp32 recurrent state [B, H, K, V], a fixed size whatever the length).

It is not a transformers `Cache` subclass (that class's layer API changes between the 5.x releases rltrain runs on);
it offers what `generate` reads from a cache — get_seq_length, is_linear, is_compileable, reorder_cache — and the
model makes one when a forward asks for a cache and has none (`_supports_default_dynamic_cache` is False).
"""

from __future__ import annotations

import torch

from rltrain_kernels.layers import LinearAttentionCache


class HybridDeltaCache:
    is_compileable = False   # grows by concatenation: generate must not compile around it

    def __init__(self, layer_types: list[str]):
        self.layer_types = list(layer_types)
        self.layers: list[tuple[torch.Tensor, torch.Tensor] | LinearAttentionCache | None] = [None] * len(layer_types)
        self.seen_tokens = 0

    @property
    def is_linear(self) -> list[bool]:
        """Per layer: a fixed-size state (no growth with the sequence)."""
        return [kind != "full_attention" for kind in self.layer_types]

    def __len__(self) -> int:
        return len(self.layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens consumed so far (every layer has seen the same)."""
        return self.seen_tokens

    def update_attention(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor):
        """Append this call's keys/values [B, H_kv, T, D] to layer `layer_idx`'s; returns all of them."""
        past = self.layers[layer_idx]
        if past is not None:
            keys, values = torch.cat([past[0], keys], dim=2), torch.cat([past[1], values], dim=2)
        self.layers[layer_idx] = (keys, values)
        return keys, values

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search: keep rows `beam_idx` of every layer's state."""
        for i, layer in enumerate(self.layers):
            if isinstance(layer, LinearAttentionCache):
                index = beam_idx.to(layer.recurrent_state.device)
                self.layers[i] = LinearAttentionCache(
                    {name: state.index_select(0, index) for name, state in layer.conv_states.items()},
                    layer.recurrent_state.index_select(0, index), layer.seen_tokens)
            elif layer is not None:
                index = beam_idx.to(layer[0].device)
                self.layers[i] = (layer[0].index_select(0, index), layer[1].index_select(0, index))
