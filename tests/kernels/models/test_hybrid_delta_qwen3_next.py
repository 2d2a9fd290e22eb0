"""The hybrid family as Qwen3-Next (rltrain_kernels/models/hybrid_delta/qwen3_next.py): a family model of Gated DeltaNet
and attention layers, every weight perturbed from its initial value (norms ≠ 1, gates, decays), written with
qwen3_next_config / qwen3_next_state_dict and loaded by transformers' Qwen3NextForCausalLM gives the family model's
logits (fp32, relative error ≤ 1e-5) on sequences shorter and longer than a chunk; Gated DeltaProduct, IPLR and
allow_neg_eigval are refused naming the key.

Run: `pytest tests/kernels/models/test_hybrid_delta_qwen3_next.py` (CPU, a few seconds).
"""

from __future__ import annotations

import pytest
import torch
from huggingface_hub import save_torch_state_dict
from transformers import Qwen3NextForCausalLM

from rltrain_kernels.models import HybridDeltaConfig, HybridDeltaForCausalLM
from rltrain_kernels.models.hybrid_delta.qwen3_next import qwen3_next_config, qwen3_next_state_dict
from tests.helpers import assert_rel_close

VOCAB = 37
GDN, ATTENTION = "gated_delta_rule", "full_attention"
# GQA attention, value heads wider than keys, linear heads unlike attention heads; a tied head; all of one kind
CASES = {
    "gdn3-attn-gqa": dict(layer_types=[GDN, ATTENTION, GDN, GDN], linear_head_v_dim=24),
    "tied": dict(layer_types=[GDN, ATTENTION], tie_word_embeddings=True),
    "gdn-only": dict(layer_types=[GDN, GDN], linear_num_heads=4, linear_head_dim=8),
    "attention-only": dict(layer_types=[ATTENTION], num_key_value_heads=4),
}


def family_model(**overrides) -> HybridDeltaForCausalLM:
    dims = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, linear_num_heads=2, linear_head_dim=16, rms_norm_eps=1e-5, rope_theta=10_000.0)
    torch.manual_seed(0)
    model = HybridDeltaForCausalLM(HybridDeltaConfig(**{**dims, **overrides})).eval()
    with torch.no_grad():   # away from the initial values: a norm's 1, a zero weight
        for parameter in model.parameters():
            parameter.add_(0.2 * torch.randn_like(parameter))
    return model


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_qwen3_next_gives_the_family_logits(overrides, tmp_path):
    model = family_model(**overrides)
    qwen3_next_config(model.config).save_pretrained(tmp_path)
    weights = model.state_dict()
    if model.config.tie_word_embeddings:   # as save_pretrained writes a tied model: no lm_head.weight
        del weights["lm_head.weight"]
    state = qwen3_next_state_dict(model.config, weights)
    assert "lm_head.weight" in state   # vLLM's Qwen3-Next never ties its head: the file must hold one
    save_torch_state_dict(state, tmp_path)
    qwen3_next, info = Qwen3NextForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info   # no missing, unexpected or mismatched keys
    generator = torch.Generator().manual_seed(1)
    for length in (1, 17, 70):   # 70: past one 64-token chunk of the delta rule
        ids = torch.randint(0, VOCAB, (2, length), generator=generator)
        with torch.no_grad():
            expected = model(ids).logits
            actual = qwen3_next.eval()(ids, use_cache=False).logits   # 5.24 needs an attention layer for a cache
        assert_rel_close(actual, expected, threshold=1e-5, name=f"logits T={length}")


@pytest.mark.parametrize("overrides, message", [
    (dict(layer_types=[GDN, "gated_delta_product"]), "layer_types holds gated_delta_product: Qwen3-Next"),
    (dict(layer_types=["iplr", ATTENTION]), "layer_types holds iplr: Qwen3-Next"),
    (dict(layer_types=[GDN, ATTENTION], allow_neg_eigval=True), "allow_neg_eigval=true"),
], ids=["gdp", "iplr", "neg-eigval"])
def test_layers_without_a_qwen3_next_form_are_refused(overrides, message):
    model = family_model(**overrides)
    with pytest.raises(ValueError, match=f"no Qwen3-Next form: {message}"):
        qwen3_next_config(model.config)
    with pytest.raises(ValueError, match=message):
        qwen3_next_state_dict(model.config, model.state_dict())
