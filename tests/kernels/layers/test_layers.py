"""The linear-attention layers (GatedDeltaProduct, IPLRLinearAttention): the chunked whole-sequence forward against
prefill-then-decoding through the cache (fused-recurrent ops), token for token; outputs and every parameter's
gradient against the same layer in float64 (where the ops fall back to their naive references); the padding rules;
the IPLR layer's non-expanding transition; the short convolution against nn.functional.conv1d.

Run: `pytest tests/kernels/layers/test_layers.py` (CPU, Triton through the interpreter, well under a minute).
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.nn.functional as F

from rltrain_kernels.layers import GatedDeltaProduct, IPLRLinearAttention, ShortConvolution
from tests.helpers import assert_rel_close

HIDDEN = 32


def make_layer(kind: str) -> torch.nn.Module:
    """Tiny layers (K = V = 16, the chunked kernels' minimum) with a decay strong enough to matter (α ≈ 0.5-0.9)."""
    if kind == "gated_delta_product":
        layer = GatedDeltaProduct(HIDDEN, num_heads=2, head_dim=16, num_householder=2)
        with torch.no_grad():
            layer.A_log.uniform_(-2.5, -0.5)
        return layer
    return IPLRLinearAttention(HIDDEN, num_heads=2, head_dim=16, head_v_dim=32)


LAYERS = ["gated_delta_product", "iplr"]


def decode(layer, x, steps, attention_mask=None):
    """Prefill x[:, :steps[0]] (chunked), then feed the rest in pieces of the given sizes through the cache."""
    mask = None if attention_mask is None else attention_mask[:, :steps[0]]
    out, cache = layer(x[:, :steps[0]], attention_mask=mask, use_cache=True)
    outs, start = [out], steps[0]
    for size in steps[1:]:
        mask = None if attention_mask is None else attention_mask[:, :start + size]  # HF passes the whole mask
        out, cache = layer(x[:, start:start + size], attention_mask=mask, cache=cache, use_cache=True)
        outs.append(out)
        start += size
    assert start == x.shape[1]
    return torch.cat(outs, 1), cache


@pytest.mark.parametrize("kind", LAYERS)
def test_chunked_forward_equals_prefill_then_decoding(kind, monkeypatch):
    """T = 40 (T·n_h = 80 crosses the chunk size): prefill 9 tokens, then 1-token steps and one 3-token step; the
    whole sequence and the prefill must run the chunked op, every step from the cache the fused-recurrent op."""
    layer = make_layer(kind)
    module = sys.modules[type(layer).__module__]
    op_name = "gated_delta_product" if kind == "gated_delta_product" else "iplr_delta_rule"
    calls = []
    for impl in ("chunk", "fused_recurrent"):
        name = f"{impl}_{op_name}"
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _impl=impl, **k: calls.append(_impl) or _real(*a, **k))
    x = torch.randn(2, 40, HIDDEN)
    full, full_cache = layer(x, use_cache=True)
    steps = [9] + [1] * 20 + [3] + [1] * 8
    stepped, cache = decode(layer, x, steps)
    assert calls == ["chunk", "chunk"] + ["fused_recurrent"] * (len(steps) - 1), calls
    for t in range(x.shape[1]):
        assert_rel_close(stepped[:, t], full[:, t], threshold=1e-5, name=f"output token {t}")
    assert cache.seen_tokens == full_cache.seen_tokens == 40
    assert_rel_close(cache.recurrent_state, full_cache.recurrent_state, threshold=1e-5, name="recurrent state")
    for name, state in cache.conv_states.items():
        assert_rel_close(state, full_cache.conv_states[name], threshold=1e-6, name=f"conv state {name}")


@pytest.mark.parametrize("kind", LAYERS)
def test_outputs_and_every_gradient_match_float64(kind):
    """fp32 layer (Triton ops) vs a float64 copy (the ops' naive references): outputs and all parameter gradients,
    through the chunked path and through prefill + decoding (the fused-recurrent ops' backward)."""
    layer = make_layer(kind)
    reference = copy.deepcopy(layer).double()
    x = torch.randn(2, 30, HIDDEN)
    weights = torch.randn(2, 30, HIDDEN)

    def run(module, inputs, stepped):
        module.zero_grad()
        out = decode(module, inputs, [10, 1, 1, 18])[0] if stepped else module(inputs)[0]
        (out * weights.to(out.dtype)).sum().backward()
        return out.detach(), {n: p.grad for n, p in module.named_parameters()}

    ref_out, ref_grads = run(reference, x.double(), stepped=False)
    assert all(g is not None and g.abs().sum() > 0 for g in ref_grads.values()), "a parameter gets no gradient"
    for stepped in (False, True):
        out, grads = run(layer, x, stepped)
        assert_rel_close(out, ref_out, threshold=1e-5, name=f"output (stepped={stepped})")
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            assert grad is not None, f"no gradient for {name} (stepped={stepped})"
            assert_rel_close(grad, ref_grads[name], threshold=1e-4, name=f"grad {name} (stepped={stepped})")


@pytest.mark.parametrize("kind", LAYERS)
def test_left_padding_equals_the_unpadded_sequence_and_decodes_on(kind):
    layer = make_layer(kind)
    x = torch.randn(2, 24, HIDDEN)
    pads = 5
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, :pads] = 0
    x_padded = x.clone()
    x_padded[1, :pads] = torch.randn(pads, HIDDEN)  # garbage under the padding must not matter
    out, _ = layer(x_padded, attention_mask=mask)
    alone, _ = layer(x[1:, pads:])
    assert_rel_close(out[1, pads:], alone[0], threshold=1e-5, name="left-padded row")
    assert_rel_close(out[0], layer(x[:1])[0][0], threshold=1e-5, name="unpadded row")
    assert torch.all(out[1, :pads] == 0), "padded positions must give zero outputs"
    stepped, _ = decode(layer, x_padded, [12, 1, 1, 10], attention_mask=mask)
    assert_rel_close(stepped[1, pads:], alone[0], threshold=1e-5, name="left-padded prefill + decoding")


@pytest.mark.parametrize("kind", LAYERS)
def test_right_padding_without_cache_and_the_rejected_masks(kind):
    layer = make_layer(kind)
    x = torch.randn(2, 20, HIDDEN)
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[0, 14:] = 0
    out, _ = layer(x, attention_mask=mask)
    assert_rel_close(out[0, :14], layer(x[:1, :14])[0][0], threshold=1e-5, name="right-padded row")
    with pytest.raises(ValueError, match="right padding with use_cache"):
        layer(x, attention_mask=mask, use_cache=True)
    gap = torch.ones(2, 20, dtype=torch.long)
    gap[1, 7:9] = 0
    with pytest.raises(ValueError, match="padding between tokens"):
        layer(x, attention_mask=gap)
    _, cache = layer(x[:, :10], use_cache=True)
    late_left = torch.ones(2, 20, dtype=torch.long)
    late_left[0, 10] = 0
    with pytest.raises(ValueError, match="continues a cache"):
        layer(x[:, 10:], attention_mask=late_left, cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="attention_mask must be"):
        layer(x, attention_mask=torch.ones(2, 5))


@pytest.mark.parametrize("allow_neg_eigval", [True, False], ids=["neg-eigval", "pos-eigval"])
def test_iplr_transition_never_expands_the_state(allow_neg_eigval):
    """Whatever the projections produce (here: large random weights and inputs), I + b aᵀ is symmetric with
    eigenvalues in [−1, 1] ([0, 1] without allow_neg_eigval): no token can amplify the state."""
    layer = IPLRLinearAttention(HIDDEN, num_heads=2, head_dim=16, allow_neg_eigval=allow_neg_eigval)
    with torch.no_grad():
        layer.a_proj.weight.normal_(0, 3.0)
        layer.b_proj.weight.normal_(0, 3.0)
    a, b = layer.erase_vectors(10 * torch.randn(3, 50, HIDDEN))
    transition = torch.eye(16) + b.double()[..., :, None] * a.double()[..., None, :]  # [B, T, H, K, K]
    assert torch.allclose(transition, transition.transpose(-1, -2), atol=1e-6)
    eigenvalues = torch.linalg.eigvalsh(transition)
    assert eigenvalues.max() <= 1 + 1e-6
    assert eigenvalues.min() >= (-1 if allow_neg_eigval else 0) - 1e-6
    assert (eigenvalues.min() < -0.5) == allow_neg_eigval  # β reaches past 1 only with allow_neg_eigval


def test_short_convolution_matches_conv1d_and_streams():
    conv = ShortConvolution(6, conv_size=4)
    x = torch.randn(2, 9, 6)
    reference = F.conv1d(x.transpose(1, 2), conv.weight, padding=3, groups=6)[..., :9]
    y, state = conv(x)
    assert_rel_close(y, F.silu(reference).transpose(1, 2), threshold=1e-6, name="conv")
    y_head, state_head = conv(x[:, :2])  # fewer tokens than the window
    y_tail, state_tail = conv(x[:, 2:], state_head)
    assert_rel_close(torch.cat([y_head, y_tail], 1), y, threshold=1e-6, name="streamed conv")
    assert torch.equal(state_tail, state) and torch.equal(state, x[:, -3:].transpose(1, 2))
