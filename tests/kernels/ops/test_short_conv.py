"""Short convolution: the Triton kernels (interpreted on CPU, native on GPU) against a float64 run of the naive
reference (outputs, final states, every gradient: x, weight, bias, residual, initial state); packed rows against a
loop over their sequences; the decode step against the full forward; fla-style wider states; bad arguments.

Run: `pytest tests/kernels/ops/test_short_conv.py` (CPU through the Triton interpreter: ~1-2 min); `gpu`-marked
tests run real sizes on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from rltrain_kernels.ops.short_conv import naive_short_conv, naive_short_conv_update, short_conv, short_conv_update
from rltrain_kernels.ops.common.rows import sequence_ids
from rltrain_kernels.ops.short_conv.kernel_bwd import short_conv_backward
from tests.helpers import assert_rel_close, case_id, dtype_id

# (B, T, C, W): awkward channel counts (two channel blocks at C = 130), sequences shorter than the window (T = 3 at
# W = 5: the final state keeps initial-state columns), the widest kernel (W = 8), one token.
SHAPES = [(2, 37, 40, 4), (3, 9, 130, 2), (1, 20, 16, 8), (2, 3, 8, 5), (1, 1, 24, 3)]


def shape_id(shape) -> str:
    B, T, C, W = shape
    return case_id(B=B, T=T, C=C, W=W)


def leaf(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().requires_grad_()


def as_float64(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().double().requires_grad_()


def make_inputs(B, T, C, W, dtype, device, *, bias=True, residual=False, state=False, N=None):
    """Leaves (x, weight, bias, residual, initial_state): weight and bias fp32 (a model's parameters under bf16
    activations), the state in x's dtype."""
    N = B if N is None else N
    return (torch.randn(B, T, C, dtype=dtype, device=device, requires_grad=True),
            (torch.randn(C, W, device=device) / W ** 0.5).requires_grad_(),
            torch.randn(C, device=device, requires_grad=True) if bias else None,
            torch.randn(B, T, C, dtype=dtype, device=device, requires_grad=True) if residual else None,
            torch.randn(N, C, W - 1, dtype=dtype, device=device, requires_grad=True) if state else None)


def outputs_and_grads(fn, inputs, dy, dfinal, activation, cu_seqlens=None):
    """[y, final, then the gradient of every input that is not None] for the loss ⟨y, dy⟩ + ⟨final, dfinal⟩."""
    y, final = fn(*inputs, output_final_state=True, activation=activation, cu_seqlens=cu_seqlens)
    leaves = [t for t in inputs if t is not None]
    grads = torch.autograd.grad((y.double() * dy.double()).sum() + (final.double() * dfinal.double()).sum(), leaves)
    return [y, final, *grads]


def names_of(inputs) -> list[str]:
    return ["y", "final state"] + [name for name, t in zip(["dx", "dweight", "dbias", "dresidual", "dstate"], inputs)
                                   if t is not None]


def check_against_float64(inputs, dtype, activation, cu_seqlens=None, threshold=None):
    x = inputs[0]
    N = x.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
    dy = torch.randn_like(x)
    dfinal = torch.randn(N, x.shape[-1], inputs[1].shape[1] - 1, dtype=dtype, device=x.device)
    got = outputs_and_grads(short_conv, inputs, dy, dfinal, activation, cu_seqlens)
    want = outputs_and_grads(naive_short_conv, [as_float64(t) for t in inputs], dy, dfinal, activation, cu_seqlens)
    assert got[0].dtype == dtype and got[1].dtype == dtype
    for name, a, b in zip(names_of(inputs), got, want, strict=True):
        assert_rel_close(a, b, dtype=dtype, threshold=threshold, name=name)


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("activation", [None, "silu"], ids=["linear", "silu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_short_conv_matches_float64_reference(shape, dtype, activation, device):
    """Outputs, final state and every gradient (x, weight, bias, initial state) vs float64; NaN-poisoned buffers."""
    B, T, C, W = shape
    check_against_float64(make_inputs(B, T, C, W, dtype, device, state=True), dtype, activation)


@pytest.mark.parametrize("tile", [(8, 16, 2), (16, 32, 4)], ids=["BT8", "BT16"])
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
@pytest.mark.parametrize("width", [2, 4, 8])
def test_backward_small_tiles_match_float64(width, packed, tile, device):
    """The backward's blocks overlap by W − 1 rows (each yields BT − (W − 1) rows of dx from one dz tile read at W
    shifts; BT rises to 2W where smaller): small tiles, so blocks straddle sequence starts and ends and a program
    walks several blocks. dx, dweight, dbias and dstate against float64 autograd through the naive convolution."""
    C = 20
    cu = torch.tensor([0, 5, 5, 7, 30, 31, 48], device=device, dtype=torch.int32) if packed else None
    B, T = (1, 48) if packed else (2, 23)
    N = len(cu) - 1 if packed else B
    x, weight, bias, _, state = make_inputs(B, T, C, width, torch.float32, device, state=True, N=N)
    dy, dfinal = torch.randn_like(x), torch.randn(N, C, width - 1, device=device)
    seq_ids = sequence_ids(cu, T) if packed else None
    got = short_conv_backward(dy, dfinal, x.detach(), weight.detach(), bias.detach(), state.detach(), "silu", cu,
                              seq_ids, N, compute_dw=True, compute_db=True, compute_dstate=True, tile=tile)
    leaves = [as_float64(t) for t in (x, weight, bias, state)]
    y, final = naive_short_conv(leaves[0], leaves[1], leaves[2], initial_state=leaves[3], output_final_state=True,
                                activation="silu", cu_seqlens=cu)
    want = torch.autograd.grad((y * dy.double()).sum() + (final * dfinal.double()).sum(), leaves)
    for name, a, b in zip(["dx", "dweight", "dbias", "dstate"], got, want, strict=True):
        assert_rel_close(a, b, dtype=torch.float32, name=name)


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("state", [False, True], ids=["zero-state", "state"])
def test_short_conv_residual_without_bias(state, device):
    """fla's Canon form: y = act(conv(x)) + residual, no bias; with and without an initial state."""
    inputs = make_inputs(2, 13, 24, 4, torch.float32, device, bias=False, residual=True, state=state)
    check_against_float64(inputs, torch.float32, "swish")


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("state", [False, True], ids=["zero-state", "state"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_short_conv_packed_rows_match_float64_and_each_sequence_alone(dtype, state, device):
    """A packed row (empty sequences, one shorter than the window, one spanning several tiles) against float64, and
    against short_conv on each sequence alone with its own initial state row: no tap crosses a boundary."""
    C, W = 20, 4
    cu_seqlens = torch.tensor([0, 5, 5, 7, 30, 31, 48], device=device, dtype=torch.int32)
    N, T = len(cu_seqlens) - 1, int(cu_seqlens[-1])
    inputs = make_inputs(1, T, C, W, dtype, device, state=state, N=N)
    check_against_float64(inputs, dtype, "silu", cu_seqlens)

    x, weight, bias, _, h0 = inputs
    y, final = short_conv(x, weight, bias, initial_state=h0, output_final_state=True, activation="silu",
                          cu_seqlens=cu_seqlens)
    offsets = cu_seqlens.tolist()
    for n, (start, end) in enumerate(zip(offsets, offsets[1:])):
        y_n, final_n = short_conv(x[:, start:end], weight, bias, initial_state=None if h0 is None else h0[n:n + 1],
                                  output_final_state=True, activation="silu")
        assert torch.equal(y[:, start:end], y_n), f"sequence {n}: output differs from the sequence alone"
        assert torch.equal(final[n:n + 1], final_n), f"sequence {n}: final state differs"


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_packed_gradients_equal_the_sequence_loop(dtype, device):
    """Gradients of a packed call against the sum over per-sequence calls (B = 1 each): x, weight, bias, state."""
    C, W = 12, 3
    cu_seqlens = torch.tensor([0, 1, 9, 9, 26], device=device)
    N, T = len(cu_seqlens) - 1, int(cu_seqlens[-1])
    x, weight, bias, _, h0 = make_inputs(1, T, C, W, dtype, device, state=True, N=N)
    dy, dfinal = torch.randn_like(x), torch.randn(N, C, W - 1, dtype=dtype, device=device)
    packed = outputs_and_grads(short_conv, (x, weight, bias, None, h0), dy, dfinal, "silu", cu_seqlens)[2:]
    y_parts, final_parts = [], []
    offsets = cu_seqlens.tolist()
    for n, (start, end) in enumerate(zip(offsets, offsets[1:])):
        y_n, f_n = short_conv(x[:, start:end], weight, bias, initial_state=h0[n:n + 1], output_final_state=True,
                              activation="silu")
        y_parts.append(y_n)
        final_parts.append(f_n)
    loss = (torch.cat(y_parts, 1).double() * dy.double()).sum() + (torch.cat(final_parts).double() * dfinal.double()).sum()
    looped = torch.autograd.grad(loss, (x, weight, bias, h0))
    for name, a, b in zip(["dx", "dweight", "dbias", "dstate"], packed, looped, strict=True):
        assert_rel_close(a, b, threshold=1e-6, name=name)


@pytest.mark.parametrize("width", ["W-1", "fla's W"])
def test_decode_steps_continue_the_prefill(width, device):
    """Prefill T0 tokens, then short_conv_update token by token: the outputs equal the full forward's, and the
    state ends as the full forward's final state; also with an fla-style [B, C, W] state (first column unused)."""
    B, T, T0, C, W = 3, 11, 4, 40, 4
    x, weight, bias, _, h0 = (t.detach() if t is not None else None
                              for t in make_inputs(B, T, C, W, torch.float32, device, state=True))
    y_full, final_full = short_conv(x, weight, bias, initial_state=h0, output_final_state=True, activation="silu")
    _, state = short_conv(x[:, :T0], weight, bias, initial_state=h0, output_final_state=True, activation="silu")
    if width == "fla's W":
        state = torch.cat([torch.full_like(state[..., :1], 1e4), state], -1)  # a first column that must not count
    steps = [short_conv_update(x[:, t], state, weight, bias, activation="silu") for t in range(T0, T)]
    assert_rel_close(torch.stack(steps, 1), y_full[:, T0:], threshold=1e-6, name="decoded outputs")
    assert torch.equal(state[..., -(W - 1):], final_full), "conv_state after decoding != the final state"
    if width == "fla's W":
        assert torch.equal(state[..., :1], x[:, T - W, :, None]), "the wider state shifts as a whole"


@pytest.mark.parametrize("activation", [None, "silu"], ids=["linear", "silu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_decode_step_matches_reference(dtype, activation, device):
    """short_conv_update (kernel) against naive_short_conv_update: y, and the state updated in place; [B, 1, C]
    input keeps its shape; a bf16 state with fp32 weights."""
    B, C, W = 5, 130, 4
    x = torch.randn(B, 1, C, dtype=dtype, device=device)
    weight, bias = torch.randn(C, W, device=device), torch.randn(C, device=device)
    state = torch.randn(B, C, W - 1, dtype=dtype, device=device)
    want_state = state.clone()
    y = short_conv_update(x, state, weight, bias, activation)
    want = naive_short_conv_update(x.double(), want_state, weight.double(), bias.double(), activation)
    assert y.shape == x.shape and y.dtype == dtype
    assert_rel_close(y, want, dtype=dtype, name="y")
    assert torch.equal(state, want_state), "state update"


@pytest.mark.parametrize("extra", [-1, 0, 2], ids=["S=W-1", "S=W", "S=W+2"])
def test_decode_step_strided_state_and_input(extra, device):
    """The decode kernel on a state stored token-major ([B, S, C] seen as [B, C, S]: channel stride 1, column
    stride C) and on x a channel slice of a wider projection (row stride 3C): y, and the state updated in place in
    its own storage, against the float64 reference; a second call with the same shapes reuses the compiled kernel."""
    B, C, W = 3, 40, 4
    S = W + extra
    fused = torch.randn(B, 3 * C, dtype=torch.bfloat16, device=device)
    x = fused[:, C:2 * C]
    weight, bias = torch.randn(C, W, device=device), torch.randn(C, device=device)
    storage = torch.randn(B, S, C, dtype=torch.bfloat16, device=device)
    state = storage.transpose(1, 2)
    for _ in range(2):
        want_state = state.double()
        want = naive_short_conv_update(x.double(), want_state, weight.double(), bias.double(), "silu")
        y = short_conv_update(x, state, weight, bias, activation="silu")
        assert_rel_close(y, want, dtype=torch.bfloat16, name="y")
        assert torch.equal(storage.transpose(1, 2).double(), want_state), "state update in its own storage"
        x = x.roll(1, 0)


def test_decode_step_with_gradients_uses_the_reference(device):
    """With gradients wanted, the decode step is differentiable (the reference path) and still updates the state."""
    B, C, W = 2, 16, 3
    x = torch.randn(B, C, device=device, requires_grad=True)
    weight = torch.randn(C, W, device=device, requires_grad=True)
    state = torch.randn(B, C, W - 1, device=device)
    before = state.clone()
    y = short_conv_update(x, state, weight, activation="silu")
    dx, dw = torch.autograd.grad(y.sum(), (x, weight))
    x64, w64 = as_float64(x), as_float64(weight)
    want = naive_short_conv_update(x64, before.double(), w64, activation="silu")
    want_dx, want_dw = torch.autograd.grad(want.sum(), (x64, w64))
    assert_rel_close(dx, want_dx, name="dx")
    assert_rel_close(dw, want_dw, name="dweight")
    assert torch.equal(state[..., -1], x.detach()) and torch.equal(state[..., :-1], before[..., 1:])


@pytest.mark.usefixtures("poison_allocations")
def test_strided_inputs_and_one_output_unused(device):
    """x as a channel slice of a fused projection (token stride 3C, read in place), a transposed upstream gradient,
    an fla-style wider initial state; then the loss through the final state only, and through y only."""
    B, T, C, W = 2, 15, 24, 4
    fused = torch.randn(B, T, 3 * C, dtype=torch.bfloat16, device=device, requires_grad=True)
    weight = torch.randn(C, W, device=device, requires_grad=True)
    h0 = torch.randn(B, C, W + 2, dtype=torch.bfloat16, device=device, requires_grad=True)
    dy = torch.randn(C, T, B, dtype=torch.bfloat16, device=device).permute(2, 1, 0)
    dfinal = torch.randn(B, C, W - 1, dtype=torch.bfloat16, device=device)
    fused64, weight64, h064 = (as_float64(t) for t in (fused, weight, h0))
    for used in ("both", "final only", "y only"):
        results = []
        for f, w, h in ((fused, weight, h0), (fused64, weight64, h064)):
            fn = short_conv if f.dtype == torch.bfloat16 else naive_short_conv
            y, final = fn(f[..., C:2 * C], w, None, None, h, True, "silu")
            loss = (final.double() * dfinal.double()).sum() if used != "y only" else 0
            loss = loss + ((y.double() * dy.double()).sum() if used != "final only" else 0)
            results.append([y, final, *torch.autograd.grad(loss, (f, w, h), allow_unused=True,
                                                            materialize_grads=True)])
        for name, a, b in zip(["y", "final", "dfused", "dweight", "dstate"], *results):
            assert_rel_close(a, b, dtype=torch.bfloat16, name=f"{used}: {name}")
        assert results[0][4][..., :3].abs().max() == 0, "state columns before the window get no gradient"


def test_fully_expanded_upstream_gradient(device):
    """y.sum() hands backward a gradient with every stride 0 (verl's kernel asserts contiguity there; ours copes)."""
    x, weight, bias, _, h0 = make_inputs(2, 9, 16, 3, torch.bfloat16, device, state=True)
    got = torch.autograd.grad(short_conv(x, weight, bias, initial_state=h0, activation="silu")[0].sum(),
                              (x, weight, bias, h0))
    leaves = [as_float64(t) for t in (x, weight, bias, h0)]
    want = torch.autograd.grad(naive_short_conv(*leaves[:3], initial_state=leaves[3], activation="silu")[0].sum(),
                               leaves)
    for name, a, b in zip(["dx", "dweight", "dbias", "dstate"], got, want, strict=True):
        assert_rel_close(a, b, dtype=torch.bfloat16, name=name)


def test_float64_falls_back_to_the_reference(device):
    x, weight = torch.randn(2, 7, 5, dtype=torch.float64, device=device), torch.randn(5, 3, device=device)
    got = short_conv(x, weight, activation="silu", output_final_state=True)
    want = naive_short_conv(x, weight, activation="silu", output_final_state=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("bad, match", [
    (dict(x=torch.randn(4, 8)), "x must be"),
    (dict(weight=torch.randn(8, 4, 1)), "weight must be"),
    (dict(weight=torch.randn(7, 4)), "weight must be"),
    (dict(weight=torch.randn(8, 9)), "kernel width W"),
    (dict(weight=torch.randn(8, 1)), "kernel width W"),
    (dict(bias=torch.randn(7)), "bias must be"),
    (dict(residual=torch.randn(2, 5, 7)), "residual must"),
    (dict(initial_state=torch.randn(2, 8, 2)), "initial_state must"),
    (dict(initial_state=torch.randn(3, 8, 3)), "initial_state must"),
    (dict(activation="gelu"), "activation must"),
    (dict(cu_seqlens=torch.tensor([0, 5])), "cu_seqlens requires B=1"),
], ids=["x-2d", "weight-3d", "weight-channels", "width-9", "width-1", "bias", "residual", "state-width",
        "state-count", "activation", "cu_seqlens-batch"])
def test_bad_arguments_name_the_argument(bad, match, device):
    args = dict(x=torch.randn(2, 5, 8), weight=torch.randn(8, 4), bias=None, residual=None, initial_state=None,
                activation=None, cu_seqlens=None)
    args.update(bad)
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with pytest.raises(ValueError, match=match):
        short_conv(args.pop("x"), args.pop("weight"), **{k: v for k, v in args.items() if k != "cu_seqlens"},
                   cu_seqlens=args["cu_seqlens"])


def test_packed_offsets_must_cover_the_row(device):
    x, weight = torch.randn(1, 6, 4, device=device), torch.randn(4, 2, device=device)
    with pytest.raises(ValueError, match="cu_seqlens must"):
        short_conv(x, weight, cu_seqlens=torch.tensor([0, 4, 5], device=device))


@pytest.mark.parametrize("bad, match", [
    (dict(x=torch.randn(2, 3, 8)), "x must be"),
    (dict(conv_state=torch.randn(2, 8, 2)), "conv_state must"),
    (dict(conv_state=torch.randn(3, 8, 3)), "conv_state must"),
    (dict(weight=torch.randn(8, 1)), "kernel width W"),
    (dict(activation="relu"), "activation must"),
], ids=["x-tokens", "state-width", "state-batch", "width", "activation"])
def test_decode_step_bad_arguments(bad, match, device):
    args = dict(x=torch.randn(2, 8), conv_state=torch.randn(2, 8, 3), weight=torch.randn(8, 4), activation=None)
    args.update(bad)
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with pytest.raises(ValueError, match=match):
        short_conv_update(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True], ids=["batched", "packed"])
@pytest.mark.parametrize("shape", [(4, 2048, 4096, 4), (2, 1024, 8192, 4), (1, 4096, 2048, 2)], ids=shape_id)
def test_short_conv_gpu_real_sizes(shape, packed, device):
    B, T, C, W = shape
    if packed:  # the same tokens as uneven sequences in one row
        cuts = sorted(torch.randint(1, B * T, (7,)).tolist())
        cu_seqlens = torch.tensor([0, *cuts, B * T], device=device, dtype=torch.int32)
        inputs = make_inputs(1, B * T, C, W, torch.bfloat16, device, state=True, N=len(cu_seqlens) - 1)
    else:
        cu_seqlens = None
        inputs = make_inputs(B, T, C, W, torch.bfloat16, device, state=True)
    check_against_float64(inputs, torch.bfloat16, "silu", cu_seqlens)


@pytest.mark.gpu
def test_decode_step_gpu_real_size(device):
    B, C, W = 64, 8192, 4
    x = torch.randn(B, C, dtype=torch.bfloat16, device=device)
    weight, state = torch.randn(C, W, device=device), torch.randn(B, C, W - 1, dtype=torch.bfloat16, device=device)
    want_state = state.clone()
    y = short_conv_update(x, state, weight, activation="silu")
    want = naive_short_conv_update(x.double(), want_state, weight.double(), activation="silu")
    assert_rel_close(y, want, dtype=torch.bfloat16, name="y")
    assert torch.equal(state, want_state)
