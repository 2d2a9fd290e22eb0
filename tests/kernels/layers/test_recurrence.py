"""The layers' plain-PyTorch delta rules (rltrain_kernels/layers/recurrence.py) against the ops' naive references:
outputs, final states and the gradients of every input (initial state included), float64 and fp32, padded batches
and packed rows (cu_seqlens with an empty and a one-token sequence), grouped value heads.

Run: `pytest tests/kernels/layers/test_recurrence.py` (CPU, a few seconds).
"""

from __future__ import annotations

import pytest
import torch

from rltrain_kernels.layers.recurrence import (recurrent_gated_delta_product, recurrent_gated_delta_rule,
                                               recurrent_iplr_delta_rule)
from rltrain_kernels.ops.gated_delta_product import naive_recurrent_gated_delta_product
from rltrain_kernels.ops.gated_delta_rule import naive_recurrent_gated_delta_rule
from rltrain_kernels.ops.iplr_delta_rule import naive_recurrent_iplr_delta_rule
from tests.helpers import assert_rel_close

LENGTHS = [5, 0, 1, 9]   # packed rows: an empty and a one-token sequence among them


def inputs(op: str, packed: bool, dtype: torch.dtype, n_h: int = 2):
    """(args, kwargs) of one call: B=2, T=7 padded or one packed row of LENGTHS; H=2 key heads, HV=4 value heads
    (IPLR: H=HV=2), K=8, V=6; every floating input requires grad."""
    B, T = (1, sum(LENGTHS)) if packed else (2, 7)
    N = len(LENGTHS) if packed else B
    H, HV, K, V = 2, (2 if op == "iplr" else 4), 8, 6
    steps = n_h if op == "gated_delta_product" else 1
    leaf = lambda *shape, fn=torch.randn: fn(*shape, dtype=dtype).requires_grad_()  # noqa: E731
    q, h0 = leaf(B, T, H, K), leaf(N, HV, K, V)
    cu_seqlens = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist()) if packed else None
    kwargs = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)
    if op == "iplr":
        a = torch.nn.functional.normalize(torch.randn(B, T, H, K, dtype=dtype), dim=-1).requires_grad_()
        b = (-torch.rand(B, T, H, 1, dtype=dtype) * 2 * a.detach()).requires_grad_()   # the stable regime
        return (q, leaf(B, T, H, K), leaf(B, T, H, V), a, b), kwargs
    g = (-torch.rand(B, T, HV, dtype=dtype)).requires_grad_()
    args = (q, leaf(B, T * steps, H, K), leaf(B, T * steps, HV, V), g, leaf(B, T * steps, HV, fn=torch.rand))
    kwargs["use_qk_l2norm_in_kernel"] = True
    return (args + (n_h,), kwargs) if op == "gated_delta_product" else (args, kwargs)


FUNCTIONS = {"gated_delta_rule": (recurrent_gated_delta_rule, naive_recurrent_gated_delta_rule),
             "gated_delta_product": (recurrent_gated_delta_product, naive_recurrent_gated_delta_product),
             "iplr": (recurrent_iplr_delta_rule, naive_recurrent_iplr_delta_rule)}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("op", list(FUNCTIONS))
def test_recurrence_matches_the_naive_reference(op, packed, dtype):
    ours, naive = FUNCTIONS[op]
    args, kwargs = inputs(op, packed, dtype)
    leaves = [x for x in list(args) + [kwargs["initial_state"]] if isinstance(x, torch.Tensor) and x.requires_grad]
    results = {}
    for name, fn in (("ours", ours), ("naive", naive)):
        o, state = fn(*args, **kwargs)
        weights = torch.randn(o.shape, dtype=dtype, generator=torch.Generator().manual_seed(1))
        grads = torch.autograd.grad((o * weights).sum() + state.sum(), leaves)
        results[name] = (o, state, grads)
    threshold = 1e-12 if dtype == torch.float64 else 1e-5
    (o, state, grads), (o_ref, state_ref, grads_ref) = results["ours"], results["naive"]
    assert o.dtype == o_ref.dtype == dtype and state.dtype == state_ref.dtype
    assert_rel_close(o, o_ref, threshold=threshold, name="output")
    assert_rel_close(state, state_ref, threshold=threshold, name="final state")
    for i, (grad, grad_ref) in enumerate(zip(grads, grads_ref)):
        assert_rel_close(grad, grad_ref, threshold=threshold * 10, name=f"gradient of input {i}")


def test_no_final_state_unless_asked():
    args, kwargs = inputs("gated_delta_rule", packed=False, dtype=torch.float32)
    kwargs["output_final_state"] = False
    o, state = recurrent_gated_delta_rule(*args, **kwargs)
    assert state is None and o.shape == (2, 7, 4, 6)
