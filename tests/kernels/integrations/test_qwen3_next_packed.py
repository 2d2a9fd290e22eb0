"""Qwen3-Next's Gated DeltaNet on packed rows (rltrain_kernels/integrations/qwen3_next.py), on a tiny Qwen3NextConfig
model (tests/model_factory.py: Gated DeltaNet and attention layers, dense and MoE MLPs, grouped value heads), fp32:
a packed row of three sequences gives transformers' own per-sequence logits and every gradient, through the plain
PyTorch forward (use_packed_linear_attention) and the registry's CUDA gated_delta_rule kernel (the Triton
interpreter on CPU); padded calls and decoding stay transformers' own.

Run: `pytest tests/kernels/integrations/test_qwen3_next_packed.py` (CPU, ~15 s; on CUDA when a GPU is present).
"""

from __future__ import annotations

import copy

import pytest
import torch
from rltrain_kernels.integrations.families import restore_original_modules
from rltrain_kernels.integrations.qwen3_next import takes_packed_rows, use_packed_linear_attention
from rltrain_kernels.registry import apply_kernel, get_applied_kernels

from tests.helpers import assert_rel_close
from tests.model_factory import tiny_causal_lm, tiny_qwen3_next

pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

LENGTHS = (6, 11, 1)   # one sequence shorter than the conv window (4), one of a single token


def packed_inputs(sequences: list[torch.Tensor]) -> dict:
    """One row of the sequences with per-sequence positions and the varlen keywords rltrain's packed forward passes."""
    from rltrain.workers.attention import varlen_kwargs

    lengths = torch.tensor([len(s) for s in sequences])
    cu_seqlens = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32).to(sequences[0].device)
    positions = torch.cat([torch.arange(n) for n in lengths.tolist()])[None].to(sequences[0].device)
    return dict(input_ids=torch.cat(sequences)[None], position_ids=positions, use_cache=False,
                **varlen_kwargs(cu_seqlens, int(lengths.max())))


def logits_and_grads(model, run, weights):
    """run(model) -> logits [T, V] (every sequence's, concatenated); the gradients of Σ logits · weights."""
    model.zero_grad(set_to_none=True)
    logits = run(model)
    (logits * weights).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("path", ["torch", "kernel"])
def test_packed_row_equals_per_sequence_forward(path, device, monkeypatch):
    """Logits and every parameter's gradient of a packed row equal transformers' forward run on each sequence alone
    (relative error ≤ 1e-5), and every Gated DeltaNet call takes the packed path's op with the row's cu_seqlens."""
    import rltrain_kernels.layers.chunked as chunked
    import rltrain_kernels.ops.gated_delta_rule as gdr
    from rltrain.workers.attention import use_packed_attention

    if device == "cuda":  # transformers' conv1d on cuDNN, which takes tf32 by default: keep the reference fp32
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = tiny_qwen3_next(device=device)
    mlps = {type(layer.mlp).__name__ for layer in model.model.layers}
    assert mlps == {"Qwen3NextMLP", "Qwen3NextSparseMoeBlock"}, mlps
    torch.manual_seed(1)
    sequences = [torch.randint(0, model.config.vocab_size, (n,), device=device) for n in LENGTHS]
    weights = torch.randn(sum(LENGTHS), model.config.vocab_size, device=device)
    ref_logits, ref_grads = logits_and_grads(model, lambda m: torch.cat([m(s[None]).logits[0] for s in sequences]),
                                             weights)

    packed = copy.deepcopy(model)
    if path == "kernel":
        apply_kernel("gated_delta_rule", packed, device="cuda")
        assert use_packed_linear_attention(packed) == 0  # the kernel's forward takes packed rows itself
        module, name = gdr, "chunk_gated_delta_rule"
    else:
        assert use_packed_linear_attention(packed) == 2
        module, name = chunked, "chunked_gated_delta_rule"
    assert takes_packed_rows(packed)
    use_packed_attention(packed)
    inputs = packed_inputs(sequences)
    calls = []
    real = getattr(module, name)  # the kernel's adapter and the plain op import theirs at call time
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(k.get("cu_seqlens")) or real(*a, **k))
    logits, grads = logits_and_grads(packed, lambda m: m(**inputs).logits[0], weights)
    assert len(calls) == 2 and all(torch.equal(c, inputs["cu_seq_lens_q"]) for c in calls), calls
    assert_rel_close(logits, ref_logits, threshold=1e-5, name="logits")
    assert grads.keys() == ref_grads.keys()
    assert any("linear_attn.A_log" in n for n in grads) and any("experts" in n for n in grads)
    for n, grad in grads.items():
        assert_rel_close(grad, ref_grads[n], threshold=1e-5, name=f"grad {n}")


def test_padded_calls_and_decoding_unchanged():
    """Without cu_seqlens the swapped layers run transformers' forward: a left-padded batch's logits are bit for bit
    the same, and greedy generation (prefill, then cached one-token steps) gives the same tokens."""
    model = tiny_qwen3_next().eval()
    swapped = copy.deepcopy(model)
    assert use_packed_linear_attention(swapped) == 2
    ids = torch.randint(1, model.config.vocab_size, (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :4] = mask[2, :1] = 0
    with torch.no_grad():
        assert torch.equal(swapped(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits)
    generate = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    tokens = model.generate(ids, **generate)
    assert torch.equal(swapped.generate(ids, **generate), tokens)
    assert tokens.shape[1] == ids.shape[1] + 5


def test_swap_keeps_weights_is_idempotent_and_reversible():
    model = tiny_qwen3_next()
    before = {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}
    assert not takes_packed_rows(model)
    assert use_packed_linear_attention(model) == 2 and use_packed_linear_attention(model) == 0
    assert takes_packed_rows(model)
    assert repr(model).count("kernel=packed_rows/torch") == 2
    assert get_applied_kernels(model) == {"packed_rows": 2}
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(after[k].data_ptr() == ptr and torch.equal(after[k], v) for k, (ptr, v) in before.items())
    apply_kernel("gated_delta_rule", model, device="cuda")  # replaces the plain forward with its own packed one
    assert get_applied_kernels(model) == {"gated_delta_rule": 2} and takes_packed_rows(model)
    assert restore_original_modules(model) == 2
    assert not takes_packed_rows(model)


def test_other_families_are_left_alone():
    from rltrain_kernels.models import HybridDeltaConfig, HybridDeltaForCausalLM

    qwen3 = tiny_causal_lm("qwen3")
    hybrid = HybridDeltaForCausalLM(HybridDeltaConfig(vocab_size=32, hidden_size=32, intermediate_size=64,
                                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                                      linear_num_heads=2, linear_head_dim=16,
                                                      layer_types=["gated_delta_rule", "full_attention"]))
    for model in (qwen3, hybrid):
        assert use_packed_linear_attention(model) == 0 and not takes_packed_rows(model)
        assert get_applied_kernels(model) == {}


def test_packed_call_takes_one_row_without_padding():
    model = tiny_qwen3_next()
    use_packed_linear_attention(model)
    layer = model.model.layers[0].linear_attn
    x = torch.randn(1, 7, model.config.hidden_size)
    cu_seqlens = torch.tensor([0, 3, 7], dtype=torch.int32)
    with pytest.raises(ValueError, match="no padding"):
        layer(x, attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1, 1]]), cu_seq_lens_q=cu_seqlens)
    with pytest.raises(ValueError, match="one row"):
        layer(x.expand(2, -1, -1), cu_seq_lens_q=cu_seqlens)
    out = layer(x, attention_mask=torch.ones(1, 7, dtype=torch.long), cu_seq_lens_q=cu_seqlens)
    alone = torch.cat([layer(x[:, :3]), layer(x[:, 3:])], 1)  # transformers' forward, each sequence alone
    assert_rel_close(out, alone, threshold=1e-5, name="layer output")
