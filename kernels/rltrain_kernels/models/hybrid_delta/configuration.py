"""HybridDeltaConfig: the hybrid delta-rule family's config — Qwen3's dimensions for the attention layers and the
MLPs, one token mixer per layer in `layer_types`, and the linear-attention layers' own heads.

    HybridDeltaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=64, layer_types=["gated_delta_rule"] * 3 + ["full_attention"],
                      linear_num_heads=8, linear_head_dim=128)   # .mixer_types: those 4; .layer_types: transformers'

Mixers: `full_attention` (alias `attention`), `gated_delta_rule`, `gated_delta_product`, `iplr`, `kda`, given per layer
as `layer_types` (as above) and kept as `mixer_types`. `layer_types` itself then holds transformers' vocabulary,
`full_attention` or `linear_attention` per layer: transformers ≥ 5.24 validates it against that list, and code that
reads it (rltrain's MFU, transformers' utilities) sees this config like any hybrid. A config.json carries both; a bad
value raises ValueError naming the argument.
"""

from __future__ import annotations

from transformers import PreTrainedConfig

LAYER_TYPES = ("full_attention", "gated_delta_rule", "gated_delta_product", "iplr", "kda")
LINEAR_LAYER_TYPES = LAYER_TYPES[1:]
_ALIASES = {"attention": "full_attention"}


class HybridDeltaConfig(PreTrainedConfig):
    """Attention layers: num_attention_heads × head_dim queries, num_key_value_heads key/value heads (GQA), RoPE
    with rope_theta. Linear-attention layers: linear_num_heads heads with keys of linear_head_dim and values of
    linear_head_v_dim (default: the key width), a short conv of linear_conv_size, allow_neg_eigval (β ∈ (0, 2):
    negative eigenvalues of the transition, for state tracking), num_householder steps per token for
    gated_delta_product. The Triton kernels need 16 ≤ linear_head_dim ≤ 256 and linear_head_v_dim ≥ 16; the
    PyTorch path takes any width."""

    model_type = "hybrid_delta"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    def __init__(self, vocab_size: int = 32000, hidden_size: int = 1024, intermediate_size: int = 3072,
                 layer_types: list[str] | None = None, mixer_types: list[str] | None = None,
                 num_hidden_layers: int | None = None,
                 num_attention_heads: int = 16, num_key_value_heads: int | None = None, head_dim: int | None = None,
                 rope_theta: float = 1_000_000.0, max_position_embeddings: int = 32768,
                 linear_num_heads: int | None = None, linear_head_dim: int | None = None,
                 linear_head_v_dim: int | None = None, linear_conv_size: int = 4, num_householder: int = 2,
                 allow_neg_eigval: bool = False, rms_norm_eps: float = 1e-6, initializer_range: float = 0.02,
                 tie_word_embeddings: bool = False, use_cache: bool = True, hidden_act: str = "silu",
                 pad_token_id: int | None = None, bos_token_id: int | None = None, eos_token_id: int | None = None,
                 **kwargs):
        if mixer_types is None:   # a new config: the mixers come as layer_types
            mixer_types = layer_types if layer_types is not None else \
                (["gated_delta_rule"] * 3 + ["full_attention"]) * max((num_hidden_layers or 4) // 4, 1)
        self.mixer_types = [_ALIASES.get(kind, kind) for kind in mixer_types]
        unknown = sorted(set(self.mixer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer_types: unknown layer type(s) {', '.join(map(repr, unknown))}; expected "
                             f"{', '.join(LAYER_TYPES)} (or 'attention' for full_attention)")
        if not self.mixer_types:
            raise ValueError("layer_types: needs at least one layer")
        if num_hidden_layers is not None and num_hidden_layers != len(self.mixer_types):
            raise ValueError(f"num_hidden_layers={num_hidden_layers} disagrees with layer_types "
                             f"({len(self.mixer_types)} layers); give layer_types alone")
        self.num_hidden_layers = len(self.mixer_types)
        self.layer_types = ["full_attention" if kind == "full_attention" else "linear_attention"
                            for kind in self.mixer_types]
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        self.rope_theta, self.max_position_embeddings = float(rope_theta), max_position_embeddings
        self.linear_num_heads = linear_num_heads or num_attention_heads
        self.linear_head_dim = linear_head_dim or self.head_dim
        self.linear_head_v_dim = linear_head_v_dim or self.linear_head_dim
        self.linear_conv_size, self.num_householder = linear_conv_size, num_householder
        self.allow_neg_eigval = allow_neg_eigval
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "head_dim",
                     "linear_num_heads", "linear_head_dim", "linear_head_v_dim", "num_householder"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if linear_conv_size < 2:
            raise ValueError(f"linear_conv_size must be >= 2, got {linear_conv_size}")
        if hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu' (the MLP is SwiGLU), got {hidden_act!r}")
        self.hidden_act = hidden_act
        self.rms_norm_eps, self.initializer_range = rms_norm_eps, initializer_range
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        # after the base class: transformers 5.24 declares no token ids of its own, earlier 5.x set them to None
        self.pad_token_id, self.bos_token_id, self.eos_token_id = pad_token_id, bos_token_id, eos_token_id
