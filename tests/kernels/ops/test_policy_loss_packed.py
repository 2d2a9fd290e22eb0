"""fused_policy_loss on a packed row (cu_seqlens): the same loss, gradients, log-probs and metrics as the same
sequences given as padded rows, for every loss aggregation and the chunked paths, and its argument checks; and a
packed row cut into slices (sequence parallelism) whose per-slice losses, given the whole row's `loss_weights`, sum to
the row's.

Run: `pytest tests/kernels/ops/test_policy_loss_packed.py` (CPU, seconds; the triton path through the interpreter).
"""

from __future__ import annotations

import pytest
import torch

from rltrain_kernels.ops.policy_loss import (
    LOSS_AGGS, PolicyLossChunkConfig, PolicyLossOptions, aggregation_weights, fused_policy_loss, reference_policy_loss,
)
from tests.helpers import assert_rel_close
from tests.kernels.ops.test_policy_loss import make_inputs

CHUNKS = PolicyLossChunkConfig(token_chunk=8, align=1, block_v=128)


def packed_from_rows(inputs: dict, lengths: list[int]) -> tuple[dict, torch.Tensor]:
    """The first lengths[i] tokens of each row, back to back in one row [1, Σ lengths], and the cu_seqlens."""
    def pack(x):
        return torch.cat([x[i, :n] for i, n in enumerate(lengths)])[None]

    packed = {k: pack(v) for k, v in inputs.items() if k != "weight"}
    packed["weight"] = inputs["weight"]
    cu_seqlens = torch.tensor([0] + lengths, device=inputs["hidden"].device).cumsum(0)
    return packed, cu_seqlens


def padded_rows(inputs: dict, lengths: list[int]) -> dict:
    """The rows with everything past lengths[i] masked out (what the packed row holds, in rows)."""
    rows = dict(inputs)
    device = inputs["mask"].device
    keep = torch.arange(inputs["mask"].shape[1], device=device)[None] < torch.tensor(lengths, device=device)[:, None]
    rows["mask"] = inputs["mask"] & keep
    return rows


def forward_backward(inputs: dict, impl: str, chunks=CHUNKS, **opts):
    hidden = inputs["hidden"].clone().requires_grad_(True)
    weight = inputs["weight"].clone().requires_grad_(True)
    rest = {k: v for k, v in inputs.items() if k not in ("hidden", "weight")}
    out = fused_policy_loss(hidden, weight, impl=impl, chunk_config=chunks, **rest, **opts)
    out.loss.backward()
    return out, hidden.grad, weight.grad


@pytest.mark.parametrize("impl", ["torch", "triton", "reference"])
@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
def test_packed_equals_rows(impl, loss_agg, device):
    """A row of 3 sequences (lengths 5, 2, 4; the second fully masked in make_inputs' masked_rows) equals the padded
    rows. Dr.GRPO's norm_len is explicit (the padded width): a packed row's default is its longest sequence."""
    lengths = [5, 2, 4]
    inputs = make_inputs(B=3, T=5, device=device, masked_rows=(1,))
    kl = dict(kl_coef=0.05, kl_type="k2", entropy_coef=0.01, dual_clip=3.0)
    norm = dict(norm_len=5) if loss_agg == "seq-mean-token-sum-norm" else {}
    rows = padded_rows(inputs, lengths)
    expected, grad_h_rows, grad_w_rows = forward_backward(rows, "reference", loss_agg=loss_agg, **kl, **norm)
    packed, cu_seqlens = packed_from_rows(inputs, lengths)
    out, grad_h, grad_w = forward_backward(packed, impl, loss_agg=loss_agg, cu_seqlens=cu_seqlens, **kl, **norm)
    # the loss is one number that cancels towards 0 (advantages of both signs): fp32 rounding relative to 1 + |loss|
    # (a relative bound failed at 1.2e-5 on seq-mean-token-sum with RLTRAIN_TEST_SEED=201196417)
    assert abs(out.loss.item() - expected.loss.item()) <= 1e-5 * (1 + abs(expected.loss.item())), "loss"
    assert_rel_close(grad_w, grad_w_rows, name="grad_weight")
    repacked, _ = packed_from_rows({"hidden": grad_h_rows, "logprobs": expected.logprobs, "weight": None}, lengths)
    assert_rel_close(grad_h, repacked["hidden"], name="grad_hidden")
    assert_rel_close(out.logprobs, repacked["logprobs"], name="logprobs")
    for key in ("clipfrac", "ppo_kl", "ref_kl", "entropy"):
        assert abs(out.metrics[key] - expected.metrics[key]) <= 1e-5 * (1 + abs(expected.metrics[key])), key


def test_packed_seq_mean_counts_sequences_not_rows():
    """seq-mean-token-mean over a packed row divides by its sequences with tokens (2 here), not by B = 1: the
    failure an aggregation that ignored cu_seqlens would show. Only where the two sequences hold different numbers of
    tokens: with equal counts both aggregations are the same number, so row 2 loses a token where the draw made them
    equal (and a draw leaving one token in each, where that cannot help, is redrawn)."""
    inputs = make_inputs(B=3, T=4, masked_rows=(1,))
    while inputs["mask"][0].sum() == inputs["mask"][2].sum() == 1:
        inputs = make_inputs(B=3, T=4, masked_rows=(1,))
    if inputs["mask"][0].sum() == inputs["mask"][2].sum():
        last = int(inputs["mask"][2].nonzero().max())
        inputs["mask"][2, last], inputs["labels"][2, last] = False, -100
    packed, cu_seqlens = packed_from_rows(inputs, [4, 4, 4])
    packed["mask"][0, 4:8] = False
    with torch.no_grad():
        as_packed = fused_policy_loss(**packed, cu_seqlens=cu_seqlens, loss_agg="seq-mean-token-mean", impl="torch")
        as_one_row = fused_policy_loss(**packed, loss_agg="seq-mean-token-mean", impl="torch")
        rows = fused_policy_loss(**padded_rows(inputs, [4, 4, 4]), loss_agg="seq-mean-token-mean", impl="torch")
    assert_rel_close(as_packed.loss, rows.loss, name="loss")
    assert abs(as_one_row.loss.item() - rows.loss.item()) > 1e-3


@pytest.mark.parametrize("impl", ["torch", "reference"])
@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
def test_slices_with_loss_weights_sum_to_the_row(impl, loss_agg):
    """A packed row of 3 sequences cut into 3 slices of 4 tokens (the first and second sequences cross a cut): each
    slice's loss with its part of the row's aggregation weights; the losses sum to the row's, the slices' gradients
    and log-probs are the row's, the gradient of the weight the sum of the slices'."""
    lengths = [5, 2, 4]
    inputs = make_inputs(B=3, T=5, masked_rows=(1,))
    packed, cu_seqlens = packed_from_rows(inputs, lengths)
    opts = dict(kl_coef=0.05, kl_type="k2", entropy_coef=0.01, loss_agg=loss_agg)
    norm = dict(norm_len=5) if loss_agg == "seq-mean-token-sum-norm" else {}
    row, grad_h, grad_w = forward_backward(packed, "reference", cu_seqlens=cu_seqlens, **opts, **norm)
    # the row's weights, then 12 tokens: the last one padding (mask 0, weight 0)
    weights = aggregation_weights(packed["mask"].float(), PolicyLossOptions(**opts, **norm), cu_seqlens)
    weights = torch.nn.functional.pad(weights, (0, 1))
    packed = {k: v if k == "weight" else torch.nn.functional.pad(v, (0, 1) if v.dim() == 2 else (0, 0, 0, 1))
              for k, v in packed.items()}
    parts = [forward_backward({k: v if k == "weight" else v[:, s:s + 4] for k, v in packed.items()}, impl,
                              loss_weights=weights[:, s:s + 4], **opts) for s in (0, 4, 8)]
    assert abs(sum(p[0].loss.item() for p in parts) - row.loss.item()) <= 1e-5 * (1 + abs(row.loss.item()))
    assert_rel_close(torch.cat([p[1] for p in parts], 1)[:, :11], grad_h, name="grad_hidden")
    assert_rel_close(sum(p[2] for p in parts), grad_w, name="grad_weight")
    assert_rel_close(torch.cat([p[0].logprobs for p in parts], 1)[:, :11], row.logprobs, name="logprobs")


def test_loss_weights_checks():
    packed, cu_seqlens = packed_from_rows(make_inputs(B=3, T=4), [4, 4, 4])
    with pytest.raises(ValueError, match=r"loss_weights must have shape \[B, T\] = \[1, 12\]"):
        fused_policy_loss(**packed, loss_weights=torch.ones(1, 11))
    with pytest.raises(ValueError, match="not with cu_seqlens"):
        fused_policy_loss(**packed, loss_weights=torch.ones(1, 12), cu_seqlens=cu_seqlens)


@pytest.mark.parametrize("bad, message", [
    (dict(cu_seqlens=torch.tensor([0, 3])), "rise from 0 to T"),
    (dict(cu_seqlens=torch.tensor([0.0, 12.0])), "1-D integer"),
    (dict(cu_seqlens=torch.tensor([0, 12]), importance_level="sequence", loss_agg="seq-mean-token-mean"),
     "importance_level='sequence'"),
], ids=["short", "float", "gspo"])
def test_packed_checks(bad, message):
    packed, _ = packed_from_rows(make_inputs(B=3, T=4), [4, 4, 4])
    with pytest.raises(ValueError, match=message):
        fused_policy_loss(**packed, **bad)


def test_packed_needs_one_row():
    inputs = make_inputs(B=3, T=4)
    with pytest.raises(ValueError, match="B = 1"):
        fused_policy_loss(**inputs, cu_seqlens=torch.tensor([0, 4]))


def test_reference_packed_matches_its_rows():
    """The reference's own packed form (cut into rows) against itself on the rows, float64."""
    inputs = {k: (v.double() if v.is_floating_point() else v) for k, v in make_inputs(B=2, T=6).items()}
    packed, cu_seqlens = packed_from_rows(inputs, [6, 3])
    out = reference_policy_loss(**packed, cu_seqlens=cu_seqlens, loss_agg="seq-mean-token-sum")
    rows = reference_policy_loss(**padded_rows(inputs, [6, 3]), loss_agg="seq-mean-token-sum")
    assert_rel_close(out.loss, rows.loss, name="loss")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["fused", "triton"])
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_packed_equals_rows_on_gpu(impl, loss_agg):
    """Real sizes, bf16: 8 sequences of 1..512 tokens packed into one row against the same padded rows (both
    fused_policy_loss, same impl), and both against the float64 reference."""
    lengths = torch.randint(1, 513, (8,)).tolist()
    inputs = make_inputs(B=8, T=512, H=512, V=8192, dtype=torch.bfloat16, device="cuda", masked_rows=(3,))
    rows = padded_rows({k: v.cpu() for k, v in inputs.items()}, lengths)
    rows = {k: v.cuda() for k, v in rows.items()}
    expected, grad_h_rows, grad_w_rows = forward_backward(rows, impl, None, loss_agg=loss_agg)
    packed, cu_seqlens = packed_from_rows(inputs, lengths)
    out, grad_h, grad_w = forward_backward(packed, impl, None, loss_agg=loss_agg, cu_seqlens=cu_seqlens.cuda())
    exact = reference_policy_loss(**{k: v.double() if v.is_floating_point() else v for k, v in packed.items()},
                                  cu_seqlens=cu_seqlens.cuda(), loss_agg=loss_agg)
    assert_rel_close(out.loss, exact.loss.float(), threshold=1e-2, name="loss vs float64")
    assert_rel_close(out.loss, expected.loss, threshold=1e-3, name="loss vs rows")
    assert_rel_close(grad_w.float(), grad_w_rows.float(), threshold=1e-2, name="grad_weight vs rows")
    repacked, _ = packed_from_rows({"hidden": grad_h_rows, "weight": None}, lengths)
    assert_rel_close(grad_h.float(), repacked["hidden"].float(), threshold=1e-2, name="grad_hidden vs rows")
