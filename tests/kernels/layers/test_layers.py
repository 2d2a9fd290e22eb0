"""The linear-attention layers (GatedDeltaNet, GatedDeltaProduct, IPLRLinearAttention, KimiDeltaAttention), each on
both of its paths — `torch` (the plain-PyTorch recurrence a layer runs unswapped) and `kernels` (the Triton ops the
registry swaps in, here through the interpreter): the whole-sequence forward against prefill-then-decoding through the
cache, token for token, with the whole-sequence op for whole sequences and the recurrent op for every step from the
cache; outputs and every parameter's gradient against the same layer in float64; packed rows (cu_seqlens) against each
sequence alone; the padding rules; the IPLR layer's non-expanding transition; the short convolution against conv1d.

Run: `pytest tests/kernels/layers/test_layers.py` (CPU, Triton through the interpreter, about a minute).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from rltrain_kernels.layers import (GatedDeltaNet, GatedDeltaProduct, IPLRLinearAttention, KimiDeltaAttention,
                                    ShortConvolution)
from rltrain_kernels.registry import apply_kernel, get_applied_kernels
from tests.helpers import assert_decay_grad_close, assert_rel_close, record_decay_terms

HIDDEN = 32
LAYERS = ["gated_delta_rule", "gated_delta_product", "iplr", "kda"]
IMPLS = ["torch", "kernels"]
# layer kind -> (registry kernel id, op package, op name)
KERNELS = {"gated_delta_rule": ("gated_delta_rule", "rltrain_kernels.ops.gated_delta_rule", "gated_delta_rule"),
           "gated_delta_product": ("gated_delta_product", "rltrain_kernels.ops.gated_delta_product",
                                   "gated_delta_product"),
           "iplr": ("iplr_delta_rule", "rltrain_kernels.ops.iplr_delta_rule", "iplr_delta_rule"),
           "kda": ("kda", "rltrain_kernels.ops.kda", "kda")}


def make_layer(kind: str) -> torch.nn.Module:
    """Tiny layers (K = V = 16, the chunked kernels' minimum; IPLR with V = 32) with a decay strong enough to matter
    (α ≈ 0.5-0.9) and β up to 2 (allow_neg_eigval)."""
    if kind == "iplr":
        return IPLRLinearAttention(HIDDEN, num_heads=2, head_dim=16, head_v_dim=32)
    if kind == "gated_delta_product":
        layer = GatedDeltaProduct(HIDDEN, num_heads=2, head_dim=16, num_householder=2)
    elif kind == "kda":
        layer = KimiDeltaAttention(HIDDEN, num_heads=2, head_dim=16, allow_neg_eigval=True)
    else:
        layer = GatedDeltaNet(HIDDEN, num_heads=2, head_dim=16, allow_neg_eigval=True)
    with torch.no_grad():
        layer.A_log.uniform_(-2.5, -0.5)
    return layer


def on_path(layer: torch.nn.Module, kind: str, impl: str, device: str = "cpu") -> torch.nn.Module:
    """The layer on `impl`: unchanged (torch, on the CPU) or with its registry kernel swapped in, on `device` (the
    GPU's kernels natively, or the interpreter on the CPU)."""
    if impl == "kernels":
        kernel_id = KERNELS[kind][0]
        apply_kernel(kernel_id, layer, device="cuda")
        assert get_applied_kernels(layer) == {kernel_id: 1}
        layer.to(device)
    return layer


def where(impl: str, device: str) -> str:
    return device if impl == "kernels" else "cpu"


def tolerance(impl: str, device: str, kind: str = "out") -> float:
    """fp32 on the CPU (and the interpreter) agrees to rounding; the GPU's kernels run their fp32 dots in tf32
    (a misread state, window or padding rule is off by O(1) either way)."""
    if where(impl, device) == "cuda":
        return {"out": 2e-3, "grad": 5e-3}[kind]
    return {"out": 1e-5, "grad": 1e-4}[kind]


def decode(layer, x, steps, attention_mask=None):
    """Prefill x[:, :steps[0]] (whole sequence), then feed the rest in pieces of the given sizes through the cache."""
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


def record_calls(monkeypatch, layer, kind: str) -> list[str]:
    """Patch the two op names the layer's forward resolves (`torch_chunk_<op>`, `torch_recurrent_<op>`: the PyTorch
    forms unswapped, the kernels swapped in) so each call appends "whole" or "step". Patched in the forward's own
    globals, which a swapped class keeps from its first swap in the process, so the test holds in any order."""
    calls: list[str] = []
    namespace = type(layer).forward.__globals__
    op = KERNELS[kind][2]
    for name, role in ((f"torch_chunk_{op}", "whole"), (f"torch_recurrent_{op}", "step")):
        real = namespace[name]
        monkeypatch.setitem(namespace, name,
                            lambda *a, _real=real, _role=role, **k: calls.append(_role) or _real(*a, **k))
    return calls


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", LAYERS)
def test_whole_forward_equals_prefill_then_decoding(kind, impl, monkeypatch, device):
    """T = 40 (T·n_h = 80 crosses the chunk size): prefill 9 tokens, then 1-token steps and one 3-token step; the
    whole sequence and the prefill run the whole-sequence op, every step from the cache the recurrent op."""
    layer = on_path(make_layer(kind), kind, impl, device)
    calls = record_calls(monkeypatch, layer, kind)
    x, tol = torch.randn(2, 40, HIDDEN, device=where(impl, device)), tolerance(impl, device)
    full, full_cache = layer(x, use_cache=True)
    steps = [9] + [1] * 20 + [3] + [1] * 8
    stepped, cache = decode(layer, x, steps)
    assert calls == ["whole", "whole"] + ["step"] * (len(steps) - 1), calls
    for t in range(x.shape[1]):
        assert_rel_close(stepped[:, t], full[:, t], threshold=tol, name=f"output token {t}")
    assert cache.seen_tokens == full_cache.seen_tokens == 40
    assert_rel_close(cache.recurrent_state, full_cache.recurrent_state, threshold=tol, name="recurrent state")
    for name, state in cache.conv_states.items():
        assert_rel_close(state, full_cache.conv_states[name], threshold=1e-6, name=f"conv state {name}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", LAYERS)
def test_outputs_and_every_gradient_match_float64(kind, impl, device):
    """fp32 layer vs a float64 copy on the PyTorch path (itself checked against the ops' naive references in
    test_recurrence.py): outputs and all parameter gradients, through the whole-sequence path and through prefill +
    decoding (the recurrent ops' backward)."""
    layer = make_layer(kind)
    reference = copy.deepcopy(layer).double()
    layer = on_path(layer, kind, impl, device)
    x = torch.randn(2, 30, HIDDEN)
    weights = torch.randn(2, 30, HIDDEN)

    def run(module, inputs, stepped):
        module.zero_grad()
        inputs = inputs.to(next(module.parameters()).device)
        out = decode(module, inputs, [10, 1, 1, 18])[0] if stepped else module(inputs)[0]
        (out * weights.to(out)).sum().backward()
        return out.detach().cpu(), {n: p.grad.cpu() for n, p in module.named_parameters()}

    decay_terms = record_decay_terms(reference)
    ref_out, ref_grads = run(reference, x.double(), stepped=False)
    assert all(g is not None and g.abs().sum() > 0 for g in ref_grads.values()), "a parameter gets no gradient"
    for stepped in (False, True):
        out, grads = run(layer, x, stepped)
        assert_rel_close(out, ref_out, threshold=tolerance(impl, device), name=f"output (stepped={stepped})")
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            assert grad is not None, f"no gradient for {name} (stepped={stepped})"
            label, bar = f"grad {name} (stepped={stepped})", tolerance(impl, device, "grad")
            if name in decay_terms:
                assert_decay_grad_close(grad, ref_grads[name], decay_terms[name], bar, label)
            else:
                assert_rel_close(grad, ref_grads[name], threshold=bar, name=label)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", LAYERS)
def test_packed_row_equals_each_sequence_alone(kind, impl, device):
    """Sequences of 7, 1, 0, 12 and 5 tokens packed in one row (cu_seqlens): outputs and every parameter's gradient
    equal those of each sequence run alone (fresh state and conv window per sequence)."""
    layer, on = on_path(make_layer(kind), kind, impl, device), where(impl, device)
    lengths = [7, 1, 0, 12, 5]
    cu_seqlens = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=on)
    x = torch.randn(1, sum(lengths), HIDDEN, device=on)
    weights = torch.randn(1, sum(lengths), HIDDEN, device=on)

    def grads_of(loss):
        layer.zero_grad()
        loss.backward()
        return torch.cat([p.grad.flatten() for p in layer.parameters()])

    packed = layer(x, cu_seqlens=cu_seqlens)[0]
    packed_grads = grads_of((packed * weights).sum())
    starts = cu_seqlens.tolist()
    alone = torch.cat([layer(x[:, a:b])[0] for a, b in zip(starts, starts[1:]) if b > a], 1)
    alone_grads = grads_of((alone * weights).sum())
    assert_rel_close(packed, alone, threshold=tolerance(impl, device), name="packed output")
    assert_rel_close(packed_grads, alone_grads, threshold=tolerance(impl, device), name="packed gradients")
    with pytest.raises(ValueError, match="packed call"):
        layer(x, cu_seqlens=cu_seqlens, use_cache=True)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", LAYERS)
def test_left_padding_equals_the_unpadded_sequence_and_decodes_on(kind, impl, device):
    layer, on, tol = on_path(make_layer(kind), kind, impl, device), where(impl, device), tolerance(impl, device)
    x = torch.randn(2, 24, HIDDEN, device=on)
    pads = 5
    mask = torch.ones(2, 24, dtype=torch.long, device=on)
    mask[1, :pads] = 0
    x_padded = x.clone()
    x_padded[1, :pads] = torch.randn(pads, HIDDEN, device=on)  # garbage under the padding must not matter
    out, _ = layer(x_padded, attention_mask=mask)
    alone, _ = layer(x[1:, pads:])
    assert_rel_close(out[1, pads:], alone[0], threshold=tol, name="left-padded row")
    assert_rel_close(out[0], layer(x[:1])[0][0], threshold=tol, name="unpadded row")
    assert torch.all(out[1, :pads] == 0), "padded positions must give zero outputs"
    stepped, _ = decode(layer, x_padded, [12, 1, 1, 10], attention_mask=mask)
    assert_rel_close(stepped[1, pads:], alone[0], threshold=tol, name="left-padded prefill + decoding")


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
    with pytest.raises(ValueError, match="one row"):
        layer(x, cu_seqlens=torch.tensor([0, 20], dtype=torch.int32))


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


def test_short_convolution_matches_conv1d_streams_and_packs():
    conv = ShortConvolution(6, conv_size=4)
    x = torch.randn(2, 9, 6)
    reference = F.conv1d(x.transpose(1, 2), conv.weight, padding=3, groups=6)[..., :9]
    y, state = conv(x)
    assert_rel_close(y, F.silu(reference).transpose(1, 2), threshold=1e-6, name="conv")
    y_head, state_head = conv(x[:, :2])  # fewer tokens than the window
    y_tail, state_tail = conv(x[:, 2:], state_head)
    assert_rel_close(torch.cat([y_head, y_tail], 1), y, threshold=1e-6, name="streamed conv")
    assert torch.equal(state_tail, state) and torch.equal(state, x[:, -3:].transpose(1, 2))
    row = torch.cat([x[0, :2], x[1], x[0, 2:]])[None]     # sequences of 2, 9 (and an empty one) and 7 tokens
    packed, _ = conv(row, cu_seqlens=torch.tensor([0, 2, 11, 11, 18]))
    alone = torch.cat([conv(x[:1, :2])[0], y[1:], conv(x[:1, 2:])[0]], 1)
    assert_rel_close(packed, alone, threshold=1e-6, name="packed conv")


@pytest.mark.parametrize("call", ["whole", "streamed", "packed"])
def test_short_convolution_plain_gradients_match_conv1d(call):
    """plain_forward's own backward (in-place shifted multiply-adds; a packed row's taps into the previous sequence
    skipped) against autograd through F.conv1d in float64, one sequence at a time: y, the new state and the
    gradients of x, the weight and the incoming state."""
    conv = ShortConvolution(5, conv_size=4).double()
    x = torch.randn(2, 9, 5, dtype=torch.float64, requires_grad=True)
    state = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    dy, dstate = torch.randn(2, 9, 5, dtype=torch.float64), torch.randn(2, 5, 3, dtype=torch.float64)
    # (row of x, first token, tokens) per sequence; packed: lengths 2, 9, 0, 7 (one shorter than the window)
    pieces = [(0, 0, 2), (1, 0, 9), (0, 2, 0), (0, 2, 7)] if call == "packed" else [(0, 0, 9), (1, 0, 9)]
    leaves = [x, conv.weight] + ([state] if call == "streamed" else [])

    def reference():
        ys, states = [], []
        for b, start, length in pieces:
            if length == 0:
                continue
            context = state[b] if call == "streamed" else x.new_zeros(5, 3)
            full = torch.cat([context, x[b, start:start + length].T], 1)[None]   # [1, C, 3 + length]
            ys.append(F.silu(F.conv1d(full, conv.weight, groups=5))[0].T)
            states.append(full[0, :, -3:])
        y = torch.cat(ys) if call == "packed" else torch.stack(ys)
        return y, None if call == "packed" else torch.stack(states)

    def plain():
        if call == "packed":
            row = torch.cat([x[b, start:start + length] for b, start, length in pieces])[None]
            return conv(row, cu_seqlens=torch.tensor([0, 2, 11, 11, 18]))[0][0], None
        return conv(x, state if call == "streamed" else None)

    results = []
    for run in (reference, plain):
        y, new_state = run()
        target = dy.reshape(-1, 5)[:y.numel() // 5].reshape(y.shape)
        loss = (y * target).sum() + ((new_state * dstate).sum() if new_state is not None else 0)
        results.append([y, new_state, *torch.autograd.grad(loss, leaves)])
    for name, expected, actual in zip(["y", "state", "dx", "dweight", "dstate"], *results):
        if expected is not None:
            assert_rel_close(actual, expected, threshold=1e-12, name=name)


@pytest.mark.parametrize("call", ["whole", "streamed", "packed"])
def test_short_convolution_fused_forward_matches_the_plain_path(call, device):
    """fused_forward (ops/short_conv: what forward runs on CUDA; on CPU through the interpreter) against
    plain_forward: outputs, new state and the gradients of x, the weight and the incoming state."""
    conv = ShortConvolution(20, conv_size=4).to(device)
    x = torch.randn(2, 9, 20, device=device, requires_grad=True)
    state = torch.randn(2, 20, 3, device=device, requires_grad=True)
    dy = torch.randn(2, 9, 20, device=device)

    def run(forward):
        if call == "whole":
            y, new_state = forward(x)
        elif call == "streamed":
            y, new_state = forward(x, state)
        else:
            row = torch.cat([x[0, :2], x[1], x[0, 2:]])[None]  # sequences of 2, 9 (and an empty one) and 7 tokens
            y, new_state = forward(row, cu_seqlens=torch.tensor([0, 2, 11, 11, 18], device=device))
        loss = (y * dy.reshape(y.shape)).sum() + (new_state.square().sum() if new_state is not None else 0)
        leaves = [x, conv.weight] + ([state] if call == "streamed" else [])
        return [y, new_state, *torch.autograd.grad(loss, leaves)]

    plain, fused = run(conv.plain_forward), run(conv.fused_forward)
    assert (plain[1] is None) == (fused[1] is None) == (call == "packed")
    for name, a, b in zip(["y", "state", "dx", "dweight", "dstate"], fused, plain):
        if b is not None:
            assert_rel_close(a, b, threshold=1e-5, name=name)


@pytest.mark.parametrize("kind", LAYERS)
def test_layer_on_the_fused_conv_and_l2norm_equals_the_plain_path(kind, monkeypatch, device):
    """What an unswapped layer runs on CUDA besides its delta-rule op: the short convolutions through ops/short_conv
    and the q/k (and IPLR's erase direction) l2 normalisation through ops/l2norm (on CPU through the interpreter).
    Outputs, the cache after prefill and decoding, a packed row and every parameter's gradient equal those of the
    plain forms."""
    from rltrain_kernels.layers import iplr, recurrence
    from rltrain_kernels.ops.l2norm import naive_l2norm as plain_l2norm
    from rltrain_kernels.ops.l2norm import l2norm as fused_l2norm

    layer = make_layer(kind).to(device)
    x, weights = torch.randn(2, 12, HIDDEN, device=device), torch.randn(2, 12, HIDDEN, device=device)
    row, cu_seqlens = torch.cat([x[0, :5], x[1]])[None], torch.tensor([0, 5, 17], device=device)

    def run():
        layer.zero_grad()
        out, cache = decode(layer, x, [8, 1, 3])
        packed, _ = layer(row, cu_seqlens=cu_seqlens)
        ((out * weights).sum() + packed.square().sum()).backward()
        tensors = {"output": out, "packed output": packed, "recurrent state": cache.recurrent_state,
                   **{f"conv state {name}": state for name, state in cache.conv_states.items()}}
        return ({name: t.detach() for name, t in tensors.items()},
                {name: p.grad.clone() for name, p in layer.named_parameters()})

    calls = {"conv": 0, "l2norm": 0}

    def counted(name, fn):
        return lambda *args, **kwargs: calls.__setitem__(name, calls[name] + 1) or fn(*args, **kwargs)

    def use(conv, norm):
        monkeypatch.setattr(ShortConvolution, "forward", counted("conv", conv))
        for module in (iplr, recurrence):
            monkeypatch.setattr(module, "l2norm", counted("l2norm", norm))

    decay_terms = record_decay_terms(layer)
    use(ShortConvolution.plain_forward, plain_l2norm)
    plain_outputs, plain_grads = run()
    decay_terms = dict(decay_terms)  # the plain run's sums, before the fused run adds to them
    calls.update(conv=0, l2norm=0)
    use(ShortConvolution.fused_forward, fused_l2norm)
    fused_outputs, fused_grads = run()
    assert calls["conv"] == 3 * 4 and calls["l2norm"] > 0, calls  # q, k, v convs in 3 decode calls and the packed one
    assert fused_outputs.keys() == plain_outputs.keys()
    for name, value in fused_outputs.items():
        assert_rel_close(value, plain_outputs[name], threshold=1e-5, name=name)
    for name, grad in fused_grads.items():
        if name in decay_terms:
            assert_decay_grad_close(grad, plain_grads[name], decay_terms[name], 1e-4, f"grad {name}")
        else:
            assert_rel_close(grad, plain_grads[name], threshold=1e-4, name=f"grad {name}")
