"""The hybrid delta-rule model family (rltrain_kernels.models.hybrid_delta), on CPU in its plain-PyTorch path: the
config's checks and vocabularies; greedy `generate` through the HybridDeltaCache equal to a full forward's argmax at
every step, for each mix of layers; left-padded rows equal to each row alone; beam reordering of the cache;
safetensors save/load through the Auto classes; the loss and gradients against the same model in float64; gradient
checkpointing; on GPU, the registry's kernels in the model against its PyTorch path. Packed rows (cu_seqlens)
against padded ones run through the actor in tests/rltrain/workers/test_packing.py.

Run: `pytest tests/kernels/models/test_hybrid_delta.py` (CPU, about 20 s).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rltrain_kernels.models import HybridDeltaCache, HybridDeltaConfig, HybridDeltaForCausalLM
from rltrain_kernels.models.hybrid_delta.modeling import CACHE_FIELD
from tests.helpers import assert_rel_close

VOCAB = 37
MIXES = {
    "hybrid": ["gated_delta_rule", "gated_delta_rule", "gated_delta_rule", "attention"],
    "gdp": ["gated_delta_product", "gated_delta_product"],
    "iplr": ["iplr", "iplr"],
    "kda": ["kda", "full_attention", "kda"],
    "all": ["iplr", "full_attention", "gated_delta_product", "gated_delta_rule", "kda"],
}


def make_model(mix: list[str], seed: int = 0, **overrides) -> HybridDeltaForCausalLM:
    config = HybridDeltaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, layer_types=mix,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_heads=2,
                               linear_head_dim=16, num_householder=2, pad_token_id=0, eos_token_id=1,
                               bos_token_id=1, **overrides)
    torch.manual_seed(seed)
    model = HybridDeltaForCausalLM(config).eval()
    with torch.no_grad():   # logits spread wide enough that the argmax is never a near-tie
        model.lm_head.weight.mul_(20)
    return model


# ---------------------------------------------------------------- config
def test_config_vocabularies_and_round_trip():
    config = HybridDeltaConfig(layer_types=MIXES["all"], hidden_size=64, num_attention_heads=4)
    assert config.mixer_types == ["iplr", "full_attention", "gated_delta_product", "gated_delta_rule", "kda"]
    assert config.layer_types == ["linear_attention", "full_attention"] + ["linear_attention"] * 3
    assert config.num_hidden_layers == 5 and config.linear_head_dim == config.head_dim == 16
    again = HybridDeltaConfig.from_dict(config.to_dict())
    assert again.mixer_types == config.mixer_types and again.layer_types == config.layer_types
    assert HybridDeltaConfig(num_hidden_layers=8).mixer_types == (["gated_delta_rule"] * 3 + ["full_attention"]) * 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(layer_types=["mamba"]), "layer_types: unknown layer type"),
    (dict(layer_types=[]), "at least one layer"),
    (dict(layer_types=["iplr"], num_hidden_layers=2), "disagrees with layer_types"),
    (dict(num_attention_heads=6, num_key_value_heads=4), "multiple of num_key_value_heads"),
    (dict(linear_conv_size=1), "linear_conv_size"),
    (dict(num_householder=0), "num_householder"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_config_rejects_bad_values_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HybridDeltaConfig(**kwargs)


# ---------------------------------------------------------------- generation
@pytest.mark.parametrize("mix", MIXES)
def test_greedy_generate_with_cache_equals_full_forward_argmax(mix):
    """Every generated token is the argmax of a cache-free forward over everything before it (batch of 3)."""
    model = make_model(MIXES[mix])
    prompt = torch.randint(2, VOCAB, (3, 5), generator=torch.Generator().manual_seed(1))
    out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                         max_new_tokens=8, min_new_tokens=8, pad_token_id=0, eos_token_id=1)
    assert out.shape == (3, 13)
    with torch.no_grad():
        logits = model(input_ids=out).logits
    logits[..., 1] = float("-inf")   # <eos>, which min_new_tokens holds back
    assert torch.equal(out[:, 5:], logits[:, 4:-1].argmax(-1))
    assert len(set(out[:, 5:].flatten().tolist())) > 2   # the model does not just repeat one token


@pytest.mark.parametrize("mix", ["hybrid", "all"])
def test_left_padded_rows_equal_each_row_alone_and_decode_on(mix):
    model = make_model(MIXES[mix])
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(2, VOCAB, (n,), generator=g) for n in (6, 3, 1)]
    ids = torch.zeros(3, 6, dtype=torch.long)
    mask = torch.zeros(3, 6, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, 6 - len(row):], mask[i, 6 - len(row):] = row, 1
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask).logits
    batch = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=4, min_new_tokens=4,
                           pad_token_id=0, eos_token_id=1)
    for i, row in enumerate(rows):
        with torch.no_grad():
            alone = model(input_ids=row[None]).logits[0]
        assert_rel_close(padded[i, 6 - len(row):], alone, threshold=1e-5, name=f"row {i} logits")
        single = model.generate(input_ids=row[None], attention_mask=torch.ones(1, len(row), dtype=torch.long),
                                do_sample=False, max_new_tokens=4, min_new_tokens=4, pad_token_id=0, eos_token_id=1)
        assert torch.equal(batch[i, 6:], single[0, len(row):]), f"row {i}"


def test_cache_reorder_keeps_the_chosen_rows():
    model = make_model(MIXES["all"])
    ids = torch.randint(2, VOCAB, (3, 4), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cache = getattr(model(input_ids=ids, use_cache=True), CACHE_FIELD)
        assert isinstance(cache, HybridDeltaCache) and cache.get_seq_length() == 4
        assert cache.is_linear == [True, False, True, True, True]
        cache.reorder_cache(torch.tensor([2, 2, 0]))
        step = torch.tensor([[5], [5], [5]])
        continued = model(input_ids=step, cache=cache, use_cache=True).logits[:, -1]
        whole = model(input_ids=torch.cat([ids[[2, 2, 0]], step], 1)).logits[:, -1]
    assert_rel_close(continued, whole, threshold=1e-5, name="reordered cache")


# ---------------------------------------------------------------- save / load, training
def test_save_and_load_through_the_auto_classes(tmp_path):
    model = make_model(MIXES["all"])
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    assert AutoConfig.from_pretrained(tmp_path).mixer_types == model.config.mixer_types
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is HybridDeltaForCausalLM
    ids = torch.randint(2, VOCAB, (2, 7))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("mix", ["hybrid", "all"])
def test_loss_and_gradients_match_float64(mix):
    model = make_model(MIXES[mix], allow_neg_eigval=True)
    model.lm_head.weight.data.div_(20)
    wide = copy.deepcopy(model).double()
    ids = torch.randint(2, VOCAB, (3, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    losses = []
    for m in (model, wide):
        loss = m(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        loss.backward()
        losses.append(loss)
    assert_rel_close(losses[0], losses[1], threshold=1e-5, name="loss")
    for (name, p), p64 in zip(model.named_parameters(), wide.parameters()):
        assert p.grad is not None and p64.grad.abs().sum() > 0, name
        assert_rel_close(p.grad, p64.grad, threshold=1e-4, name=name)


def test_gradient_checkpointing_gives_the_same_gradients():
    ids = torch.randint(2, VOCAB, (2, 8), generator=torch.Generator().manual_seed(5))
    grads = []
    for checkpointing in (False, True):
        model = make_model(MIXES["all"]).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert_rel_close(grads[1], grads[0], threshold=1e-6, name="checkpointed gradients")


# ---------------------------------------------------------------- GPU: the registry's kernels in the model
@pytest.mark.gpu
@pytest.mark.parametrize("mix", ["hybrid", "all"])
def test_gpu_kernels_match_the_torch_path_and_generate_consistently(mix):
    """fp32 on CUDA: with every default kernel swapped in (chunked delta rules, fused-recurrent decoding, fused
    norms / SwiGLU / RoPE) the logits match the plain-PyTorch model's (TF32 dots inside the kernels), and greedy
    generation through the cache equals the argmax of the kernels' own full forward at every step."""
    from rltrain_kernels.registry import apply_default_kernels, get_applied_kernels

    torch.manual_seed(0)
    plain = make_model(MIXES[mix]).cuda()
    fused = apply_default_kernels(copy.deepcopy(plain), device="cuda")
    applied = get_applied_kernels(fused)
    expected = {"gated_delta_rule"} | ({"gated_delta_product", "iplr_delta_rule", "kda"} if mix == "all" else set())
    assert expected <= set(applied), applied
    ids = torch.randint(2, VOCAB, (4, 150), device="cuda")
    with torch.no_grad():
        assert_rel_close(fused(input_ids=ids).logits, plain(input_ids=ids).logits, threshold=5e-3, name="logits")
    out = fused.generate(input_ids=ids[:, :20], attention_mask=torch.ones_like(ids[:, :20]), do_sample=False,
                         max_new_tokens=12, min_new_tokens=12, pad_token_id=0, eos_token_id=1)
    with torch.no_grad():
        logits = fused(input_ids=out).logits
    logits[..., 1] = float("-inf")
    agree = (out[:, 20:] == logits[:, 19:-1].argmax(-1)).float().mean().item()
    assert agree >= 0.95, f"{agree:.0%} of the generated tokens are the full forward's argmax"
