"""The hybrid delta-rule model: a Qwen3 decoder (pre-norm residual blocks, SwiGLU MLP, RMSNorm) whose token mixer is
chosen per layer (config.mixer_types): Qwen3's softmax attention, or one of rltrain_kernels.layers' linear-attention
layers (GatedDeltaNet, GatedDeltaProduct, IPLRLinearAttention, KimiDeltaAttention).

Three ways through a forward:
- padded rows with an attention_mask (left and/or right padding): the attention layers get a [B, 1, T, S] boolean
  mask (causal, padded keys hidden), the linear-attention layers the 2-D mask (padded tokens leave their state as if
  absent: layers/common.py);
- a packed row (B = 1) with transformers' varlen keywords `cu_seq_lens_q`, ... (rltrain's actor passes them):
  the attention function reads them (rltrain's `rltrain_varlen`, flash varlen), the linear-attention layers take
  `cu_seqlens` — every layer keeps its sequences apart, so a packed row equals the padded rows;
- a packed row split over the ranks of a Ulysses group (`sequence_parallel`, rltrain_kernels.sequence_parallel,
  with the whole row's varlen keywords): each layer runs this rank's slice, the attention function and the
  linear-attention layers switching to a slice of the heads (layers/base.py);
- generation: a HybridDeltaCache (KV per attention layer, conv windows + recurrent state per linear layer), made by
  the forward when `use_cache=True` and none is given; `generate` drives it. Without an explicit `use_cache=True` no
  cache is made (training and scoring forwards keep nothing).

The linear-attention layers compute in plain PyTorch until the registry swaps in the Triton kernels
(`apply_default_kernels(model)` on a GPU: chunked for whole sequences, fused-recurrent when decoding); the RMSNorms,
MLPs and RoPE take `fused_rmsnorm`, `fused_swiglu`, `fused_rope` like Qwen3's (integrations/families.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from rltrain_kernels.layers import (GatedDeltaNet, GatedDeltaProduct, IPLRLinearAttention, KimiDeltaAttention,
                                    ShortConvolution)
from rltrain_kernels.layers.base import decay_parameters

from .cache import HybridDeltaCache
from .configuration import HybridDeltaConfig

# The outputs' cache field: `cache` from transformers 5.24, `past_key_values` before (the GPU machine runs 5.17).
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
# transformers' variable-length attention keywords (a packed row's sequence starts), passed to the attention function,
# and the Ulysses group of a row split over ranks (the attention function and the linear-attention layers take it)
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "sequence_parallel")
# attention implementations that take the [B, 1, T, S] boolean mask this model builds for padded rows
MASKED_ATTENTION = ("eager", "sdpa")


class HybridDeltaRMSNorm(nn.Module):
    """y = weight · x / rms(x), statistics in fp32 (Qwen3's)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(hidden_states.dtype)


class HybridDeltaMLP(nn.Module):
    def __init__(self, config: HybridDeltaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class HybridDeltaRotary(nn.Module):
    """RoPE tables (cos, sin) [B, T, head_dim] for position_ids [B, T]; the frequencies are computed per call (head_dim
    / 2 numbers), so there is no buffer to initialise or to move with the weights."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=x.device) / self.head_dim
        freqs = position_ids[..., None].float() / self.theta ** exponents         # [B, T, head_dim / 2]
        angles = torch.cat([freqs, freqs], dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim: int = 1):
    """transformers' function (the `fused_rope` kernel replaces it by this name): q, k [B, H, T, D]."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def eager_attention_forward(module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0,
                            **kwargs):
    """Softmax attention by matmuls: query [B, H, T, D], key/value [B, H_kv, S, D], attention_mask a [B, 1, T, S]
    boolean (True = may attend) or None (causal, the T queries being the last of the S positions)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is None:
        T, S = query.shape[2], key.shape[2]
        attention_mask = torch.ones(T, S, dtype=torch.bool, device=query.device).tril(S - T)
    scores = scores.masked_fill(~attention_mask, float("-inf"))
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def attention_mask_4d(attention_mask: torch.Tensor | None, batch: int, length: int, past: int, device):
    """The [B, 1, T, past + T] boolean mask of padded rows (causal, padded keys hidden), or None where causality
    alone is the rule and the attention function applies it (no padding, and no earlier tokens or a single query).
    A padded query attends to itself only: no empty softmax row, and its output is never read."""
    keys = past + length
    if attention_mask is None or bool(attention_mask[:, -keys:].all()):
        if past == 0 or length == 1:
            return None
        key_valid = torch.ones(batch, keys, dtype=torch.bool, device=device)
    else:
        key_valid = attention_mask[:, -keys:].to(device=device, dtype=torch.bool)
    query_positions = torch.arange(length, device=device)[:, None] + past
    key_positions = torch.arange(keys, device=device)[None]
    allowed = (key_positions <= query_positions)[None] & key_valid[:, None, :]
    allowed = allowed | (key_positions == query_positions)[None]
    return allowed[:, None]


class HybridDeltaAttention(nn.Module):
    """Qwen3's attention: GQA, per-head q/k RMSNorm, RoPE; the attention function from config._attn_implementation
    (transformers' interface, so `rltrain_varlen` and sdpa plug in)."""

    def __init__(self, config: HybridDeltaConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.head_dim = config.head_dim
        self.scaling = self.head_dim ** -0.5
        self.is_causal = True
        self.attention_dropout = 0.0
        H, H_kv, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.num_key_value_groups = H // H_kv
        self.q_proj = nn.Linear(config.hidden_size, H * D, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, H_kv * D, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, H_kv * D, bias=False)
        self.o_proj = nn.Linear(H * D, config.hidden_size, bias=False)
        self.q_norm = HybridDeltaRMSNorm(D, eps=config.rms_norm_eps)
        self.k_norm = HybridDeltaRMSNorm(D, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache: HybridDeltaCache | None = None,
                **kwargs):
        B, T, _ = hidden_states.shape
        shape = (B, T, -1, self.head_dim)
        query = self.q_norm(self.q_proj(hidden_states).view(shape)).transpose(1, 2)
        key = self.k_norm(self.k_proj(hidden_states).view(shape)).transpose(1, 2)
        value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        if cache is not None:
            key, value = cache.update_attention(self.layer_idx, key, value)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, _ = attention(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(B, T, -1).contiguous())


def linear_attention_layer(config: HybridDeltaConfig, kind: str) -> nn.Module:
    common = dict(hidden_size=config.hidden_size, num_heads=config.linear_num_heads, head_dim=config.linear_head_dim,
                  head_v_dim=config.linear_head_v_dim, conv_size=config.linear_conv_size,
                  allow_neg_eigval=config.allow_neg_eigval, norm_eps=config.rms_norm_eps)
    if kind == "gated_delta_rule":
        return GatedDeltaNet(**common)
    if kind == "gated_delta_product":
        return GatedDeltaProduct(num_householder=config.num_householder, **common)
    if kind == "iplr":
        return IPLRLinearAttention(**common)
    if kind == "kda":
        return KimiDeltaAttention(**common)
    raise ValueError(f"no linear-attention layer of type {kind!r}")


class HybridDeltaDecoderLayer(GradientCheckpointingLayer):
    """x + mixer(norm(x)), then + MLP(norm(·)); the mixer is `self_attn` or `linear_attn` by config.mixer_types."""

    def __init__(self, config: HybridDeltaConfig, layer_idx: int):
        super().__init__()
        self.layer_idx, self.layer_type = layer_idx, config.mixer_types[layer_idx]
        self.input_layernorm = HybridDeltaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if self.layer_type == "full_attention":
            self.self_attn = HybridDeltaAttention(config, layer_idx)
        else:
            self.linear_attn = linear_attention_layer(config, self.layer_type)
        self.post_attention_layernorm = HybridDeltaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = HybridDeltaMLP(config)

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask_4d=None,
                attention_mask=None, cache: HybridDeltaCache | None = None, cu_seqlens=None, **attention_kwargs):
        mixed = self.input_layernorm(hidden_states)
        if self.layer_type == "full_attention":
            mixed = self.self_attn(mixed, position_embeddings, attention_mask_4d, cache, **attention_kwargs)
        else:
            past = cache.layers[self.layer_idx] if cache is not None else None
            mixed, state = self.linear_attn(mixed, attention_mask=attention_mask, cache=past,
                                            use_cache=cache is not None, cu_seqlens=cu_seqlens,
                                            sequence_parallel=attention_kwargs.get("sequence_parallel"))
            if cache is not None:
                cache.layers[self.layer_idx] = state
        hidden_states = hidden_states + mixed
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class HybridDeltaPreTrainedModel(PreTrainedModel):
    config_class = HybridDeltaConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["HybridDeltaDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = False   # its padded path passes a 4-D mask; packed rows use rltrain_varlen instead
    _supports_flex_attn = False
    _supports_attention_backend = True
    # rltrain reads these: every layer takes a packed row's sequence boundaries (rltrain/workers/policy.py can_pack),
    # and a slice of one with a Ulysses group (rltrain/workers/ulysses.py)
    supports_cu_seqlens = True
    supports_sequence_parallel = True

    def check_sequence_parallel(self, size: int) -> None:
        """ValueError unless a Ulysses group of `size` ranks can split the linear-attention layers' heads."""
        if "linear_attention" in self.config.layer_types and self.config.linear_num_heads % size:
            raise ValueError(f"{size} must divide the linear-attention layers' {self.config.linear_num_heads} heads "
                             "(linear_num_heads)")

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.padding_idx is not None and not getattr(module.weight, "_is_hf_initialized", False):
                init.zeros_(module.weight[module.padding_idx])
        elif isinstance(module, HybridDeltaRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, ShortConvolution):
            init.kaiming_uniform_(module.weight, a=math.sqrt(5))   # nn.Conv1d's default, as the layer draws it
        elif isinstance(module, (GatedDeltaNet, GatedDeltaProduct, IPLRLinearAttention, KimiDeltaAttention)):
            init.ones_(module.norm_weight)
            if not isinstance(module, IPLRLinearAttention):
                A_log, dt_bias = decay_parameters(module.num_heads, module.dt_bias.numel())
                init.copy_(module.A_log, A_log)
                init.copy_(module.dt_bias, dt_bias)


class HybridDeltaModel(HybridDeltaPreTrainedModel):
    def __init__(self, config: HybridDeltaConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(HybridDeltaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = HybridDeltaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = HybridDeltaRotary(config.head_dim, config.rope_theta)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, past_key_values=None,
                inputs_embeds=None, use_cache: bool | None = None, **kwargs) -> BaseModelOutputWithPast:
        """`cache` (transformers ≥ 5.24's name) or `past_key_values`: a HybridDeltaCache to continue. kwargs: the
        varlen keywords of a packed row and its Ulysses group (VARLEN_KEYS); others are ignored."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, T = hidden_states.shape[:2]
        cache = cache if cache is not None else past_key_values
        if use_cache is None:
            use_cache = cache is not None
        if use_cache and cache is None:
            cache = HybridDeltaCache(self.config.layer_types)
        cache = cache if use_cache else None
        past = cache.get_seq_length() if cache is not None else 0
        attention_kwargs = {key: kwargs[key] for key in VARLEN_KEYS if key in kwargs}
        cu_seqlens = attention_kwargs.get("cu_seq_lens_q")
        if cu_seqlens is not None and (attention_mask is not None or cache is not None):
            raise ValueError("a packed row (cu_seq_lens_q) takes no attention_mask and no cache")
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
            else:
                position_ids = torch.arange(past, past + T, device=hidden_states.device)[None].expand(B, -1)
        implementation = self.config._attn_implementation
        mask_4d = attention_mask_4d(attention_mask, B, T, past, hidden_states.device)
        if mask_4d is not None and implementation not in MASKED_ATTENTION:
            raise ValueError(f"attn_implementation {implementation!r} takes no padding mask in this model; load it "
                             f"with one of {', '.join(MASKED_ATTENTION)} for padded rows")
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings=position_embeddings, attention_mask_4d=mask_4d,
                                  attention_mask=attention_mask, cache=cache, cu_seqlens=cu_seqlens,
                                  **attention_kwargs)
        if cache is not None:
            cache.seen_tokens += T
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), **{CACHE_FIELD: cache})


class HybridDeltaForCausalLM(HybridDeltaPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: HybridDeltaConfig):
        super().__init__(config)
        self.model = HybridDeltaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False   # generate must not make a DynamicCache: the forward makes its HybridDeltaCache

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache: bool | None = None, logits_to_keep: int = 0,
                **kwargs) -> CausalLMOutputWithPast:
        """labels [B, T] (-100 = ignored): the mean next-token cross-entropy as `loss`. logits_to_keep: only the
        last N positions' logits (0 = all)."""
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             cache=cache, past_key_values=past_key_values, inputs_embeds=inputs_embeds,
                             use_cache=use_cache, **kwargs)
        hidden = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, keep])
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten().to(logits.device),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: getattr(outputs, CACHE_FIELD)})
