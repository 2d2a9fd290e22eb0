"""The hybrid delta-rule family: a Qwen3-style decoder whose token mixer is chosen per layer from softmax attention
(`full_attention`, Qwen3's: GQA, q/k RMSNorm, RoPE), `gated_delta_rule` (Gated DeltaNet), `gated_delta_product`
(Gated DeltaProduct, `num_householder` steps per token), `iplr` (identity-plus-low-rank delta rule) and `kda` (Kimi
Delta Attention: a decay per key channel).

    from rltrain_kernels.models.hybrid_delta import HybridDeltaConfig, HybridDeltaForCausalLM
    config = HybridDeltaConfig(vocab_size=..., hidden_size=1024, layer_types=["gated_delta_rule"] * 3 +
                               ["full_attention"])                    # Qwen3-Next's 3 : 1
    model = HybridDeltaForCausalLM(config)
    model.generate(...)        # a HybridDeltaCache: KV per attention layer, conv windows + state per linear layer

Importing this package registers model_type `hybrid_delta` with AutoConfig, AutoModel and AutoModelForCausalLM;
weights save and load as safetensors. Files: configuration.py (the config and its checks), modeling.py (layers,
model, LM head, generation), cache.py (the generation cache), qwen3_next.py (a Gated DeltaNet + attention model as
transformers' / vLLM's Qwen3-Next: config and weights, for rltrain.export).
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache import HybridDeltaCache
from .configuration import LAYER_TYPES, HybridDeltaConfig
from .modeling import HybridDeltaForCausalLM, HybridDeltaModel, HybridDeltaPreTrainedModel

AutoConfig.register(HybridDeltaConfig.model_type, HybridDeltaConfig, exist_ok=True)
AutoModel.register(HybridDeltaConfig, HybridDeltaModel, exist_ok=True)
AutoModelForCausalLM.register(HybridDeltaConfig, HybridDeltaForCausalLM, exist_ok=True)

__all__ = ["LAYER_TYPES", "HybridDeltaCache", "HybridDeltaConfig", "HybridDeltaForCausalLM", "HybridDeltaModel",
           "HybridDeltaPreTrainedModel"]
