"""The layers' plain-PyTorch delta rules against the ops' naive references: the per-step recurrences
(rltrain_kernels/layers/recurrence.py, decoding) and the chunked forms (layers/chunked.py, whole sequences). Outputs,
final states and the gradients of every input (initial state included); float64 and fp32, padded batches and packed
rows (cu_seqlens with an empty and a one-token sequence), grouped value heads; KDA's recurrence with a decay per key
channel. The chunked forms also over one chunk (T < 64, T = 64), several chunks with a ragged last one, n_h = 1, 2, 3,
and decays strong enough (g down to −40) that an unmasked e^(G_i − G_j) overflows.

Run: `pytest tests/kernels/layers/test_recurrence.py` (CPU, ~10 s).
"""

from __future__ import annotations

import pytest
import torch

from rltrain_kernels.layers import gated_delta_product, gated_delta_rule, iplr, kda
from rltrain_kernels.layers.chunked import (chunked_gated_delta_product, chunked_gated_delta_rule,
                                            chunked_iplr_delta_rule)
from rltrain_kernels.layers.recurrence import (recurrent_gated_delta_product, recurrent_gated_delta_rule,
                                               recurrent_iplr_delta_rule, recurrent_kda)
from rltrain_kernels.ops.gated_delta_product import naive_recurrent_gated_delta_product
from rltrain_kernels.ops.gated_delta_rule import naive_recurrent_gated_delta_rule
from rltrain_kernels.ops.iplr_delta_rule import naive_recurrent_iplr_delta_rule
from rltrain_kernels.ops.kda import naive_recurrent_kda
from tests.helpers import assert_rel_close

LENGTHS = [5, 0, 1, 9]   # packed rows: an empty and a one-token sequence among them
# per value head: weak to strong decay (g = −U(0, scale)); 40 over a 64-token chunk puts G_i − G_j past e^709
DECAY = torch.tensor([0.05, 1.0, 10.0, 40.0])


def inputs(op: str, dtype: torch.dtype, n_h: int = 2, T: int = 7, lengths: list[int] | None = None,
           decay: torch.Tensor | None = None):
    """(args, kwargs) of one call: B=2 sequences of T tokens padded, or one packed row of `lengths`; H=2 key heads,
    HV=4 value heads (IPLR: H=HV=2), K=8, V=6; g = −U(0, decay[head]) (decay 1 by default); every floating input
    requires grad."""
    packed = lengths is not None
    B, T = (1, sum(lengths)) if packed else (2, T)
    N = len(lengths) if packed else B
    H, HV, K, V = 2, (2 if op == "iplr" else 4), 8, 6
    steps = n_h if op == "gated_delta_product" else 1
    leaf = lambda *shape, fn=torch.randn: fn(*shape, dtype=dtype).requires_grad_()  # noqa: E731
    q, h0 = leaf(B, T, H, K), leaf(N, HV, K, V)
    cu_seqlens = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist()) if packed else None
    kwargs = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)
    if op == "iplr":
        a = torch.nn.functional.normalize(torch.randn(B, T, H, K, dtype=dtype), dim=-1).requires_grad_()
        b = (-torch.rand(B, T, H, 1, dtype=dtype) * 2 * a.detach()).requires_grad_()   # the stable regime
        return (q, leaf(B, T, H, K), leaf(B, T, H, V), a, b), kwargs
    if op == "kda":  # a decay per key channel: weak to strong across the channels of each head
        g = -torch.rand(B, T, HV, K, dtype=dtype) * torch.linspace(0.05, 10.0, K, dtype=dtype)
    else:
        g = -torch.rand(B, T, HV, dtype=dtype) * (1.0 if decay is None else decay.to(dtype))
    g = g.requires_grad_()
    args = (q, leaf(B, T * steps, H, K), leaf(B, T * steps, HV, V), g, leaf(B, T * steps, HV, fn=torch.rand))
    kwargs["use_qk_l2norm_in_kernel"] = True
    return (args + (n_h,), kwargs) if op == "gated_delta_product" else (args, kwargs)


def assert_matches(ours, naive, args, kwargs, dtype):
    """Outputs, final states and the gradients of every leaf input of ours against naive on the same call."""
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


FUNCTIONS = {"gated_delta_rule": (recurrent_gated_delta_rule, naive_recurrent_gated_delta_rule),
             "gated_delta_product": (recurrent_gated_delta_product, naive_recurrent_gated_delta_product),
             "iplr": (recurrent_iplr_delta_rule, naive_recurrent_iplr_delta_rule),
             "kda": (recurrent_kda, naive_recurrent_kda)}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("op", list(FUNCTIONS))
def test_recurrence_matches_the_naive_reference(op, packed, dtype):
    ours, naive = FUNCTIONS[op]
    args, kwargs = inputs(op, dtype, lengths=LENGTHS if packed else None)
    assert_matches(ours, naive, args, kwargs, dtype)


CHUNKED = {"gated_delta_rule": chunked_gated_delta_rule, "gated_delta_product": chunked_gated_delta_product,
           "iplr": chunked_iplr_delta_rule}
# (T, packed lengths): one chunk shorter than 64 and exactly 64; 100 = a chunk and a ragged one; packed rows of one
# to three chunks (the longest row 130) with a one-token and an empty sequence
SHAPES = {"T5": (5, None), "T64": (64, None), "T100": (100, None), "packed": (0, [70, 1, 0, 64, 9, 130])}
OPS = [("gated_delta_rule", 1), ("gated_delta_product", 1), ("gated_delta_product", 2), ("gated_delta_product", 3),
       ("iplr", 1)]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("op,n_h", OPS, ids=[f"{op}-nh{n_h}" for op, n_h in OPS])
def test_chunked_matches_the_naive_reference(op, n_h, shape):
    T, lengths = SHAPES[shape]
    args, kwargs = inputs(op, torch.float64, n_h=n_h, T=T, lengths=lengths, decay=DECAY)
    assert_matches(CHUNKED[op], FUNCTIONS[op][1], args, kwargs, torch.float64)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("op", list(CHUNKED))
def test_chunked_in_fp32(op, packed):
    """fp32 inputs compute in fp32 and return v's dtype, within fp32 rounding of the fp32 reference."""
    args, kwargs = inputs(op, torch.float32, lengths=LENGTHS if packed else None)
    assert_matches(CHUNKED[op], FUNCTIONS[op][1], args, kwargs, torch.float32)


# each layer module's two op names: (module, op name in it)
LAYER_OPS = {"gated_delta_rule": (gated_delta_rule, "gated_delta_rule"),
             "gated_delta_product": (gated_delta_product, "gated_delta_product"), "iplr": (iplr, "iplr_delta_rule")}


@pytest.mark.parametrize("op", list(LAYER_OPS))
def test_layers_run_chunked_for_whole_sequences_and_steps_from_a_cache(op):
    module, name = LAYER_OPS[op]
    assert getattr(module, f"torch_chunk_{name}") is CHUNKED[op]
    assert getattr(module, f"torch_recurrent_{name}") is FUNCTIONS[op][0]


def test_kda_layer_runs_the_recurrence_for_both_roles():
    """KDA has no chunked PyTorch form: whole sequences and cache steps both take the per-step recurrence."""
    assert kda.torch_chunk_kda is kda.torch_recurrent_kda is recurrent_kda


def test_no_final_state_unless_asked():
    for fn in (recurrent_gated_delta_rule, chunked_gated_delta_rule):
        args, kwargs = inputs("gated_delta_rule", torch.float32)
        kwargs["output_final_state"] = False
        o, state = fn(*args, **kwargs)
        assert state is None and o.shape == (2, 7, 4, 6)
