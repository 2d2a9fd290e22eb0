"""The delta-rule family's shared bookkeeping (ops/common): chunk layouts (padded batches cached by shape, packed ones
by their cu_seqlens tensor), the packed offsets' validation (once per cu_seqlens tensor), the state passes' choice
of value block, the gated delta rule / product ops' recurrence_dot argument reaching the WY and state-pass
launches (common/precision.py), and the ops' tuning argument reaching every launch (common/tuning.py)."""

import gc

import pytest
import torch
import torch.nn.functional as F

from rltrain_kernels.ops.common import state_pass
from rltrain_kernels.ops.common.chunking import chunk_layout
from rltrain_kernels.ops.common.inputs import check_packing
from tests.helpers import spy_launches


def test_padded_layouts_are_cached_by_shape():
    a = chunk_layout(2, 130, None, 64, torch.device("cpu"))
    assert chunk_layout(2, 130, None, 64, torch.device("cpu")) is a
    assert a.num_chunks == 6 and a.cu_seqlens.tolist() == [0, 130, 260]
    assert a.chunk_indices.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]


def test_packed_layouts_are_cached_by_their_cu_seqlens_tensor(monkeypatch):
    """Every layer of a forward gets the same cu_seqlens tensor: its layout is read (a host sync on a GPU) once. An
    in-place change, another tensor with other lengths, another chunk size, an inference-mode tensor and a freed
    tensor whose memory comes back each get a layout of their own lengths."""
    cpu = torch.device("cpu")
    cu = torch.tensor([0, 1, 65, 200])
    packed = chunk_layout(1, 200, cu, 64, cpu)
    assert packed.chunk_offsets.tolist() == [0, 1, 2, 5] and packed.max_len == 135
    reads = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or real_tolist(t))
    for _ in range(3):
        assert chunk_layout(1, 200, cu, 64, cpu) is packed
    assert reads == []
    assert chunk_layout(1, 200, cu, 32, cpu).chunk_offsets.tolist() == [0, 1, 3, 8]
    steps = chunk_layout(1, 200, cu, 64, cpu, steps=2)  # the gated delta product's n_h rows per token
    assert steps.cu_seqlens.tolist() == [0, 2, 130, 400] and steps.chunk_offsets.tolist() == [0, 1, 3, 8]
    assert chunk_layout(2, 100, None, 64, cpu, steps=3).cu_seqlens.tolist() == [0, 300, 600]
    cu[2] = 100  # in place: the version counter moves
    moved = chunk_layout(1, 200, cu, 64, cpu)
    assert moved.chunk_offsets.tolist() == [0, 1, 3, 5] and moved.max_len == 100
    assert chunk_layout(1, 200, torch.tensor([0, 200]), 64, cpu).num_chunks == 4
    with torch.inference_mode():
        frozen = torch.tensor([0, 7, 200])
        assert chunk_layout(1, 200, frozen, 64, cpu) is not chunk_layout(1, 200, frozen, 64, cpu)
    del cu, moved
    gc.collect()
    again = torch.tensor([0, 150, 200])  # may reuse the freed tensor's id and memory
    assert chunk_layout(1, 200, again, 64, cpu).chunk_offsets.tolist() == [0, 3, 4]


def test_packed_offsets_are_validated_once_per_cu_seqlens_tensor(monkeypatch):
    """The ops' argument checks read cu_seqlens (a host sync on a GPU) once per tensor and T, not at every layer: an
    in-place change is read, and rejected, again; a wrong T or an inference-mode tensor is read every time."""
    reads = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or real_tolist(t))
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    assert [check_packing(1, 10, cu) for _ in range(3)] == [2, 2, 2]
    assert len(reads) == 1
    with pytest.raises(ValueError, match=r"end at T=12, got \[0, 3, 10\]"):
        check_packing(1, 12, cu)
    cu[1] = 11  # in place: read again, and now wrong
    with pytest.raises(ValueError, match=r"non-decreasing and end at T=10, got \[0, 11, 10\]"):
        check_packing(1, 10, cu)
    with pytest.raises(ValueError, match="non-decreasing"):
        check_packing(1, 10, cu)
    with torch.inference_mode():
        frozen = torch.tensor([0, 4, 10])
    reads.clear()
    assert [check_packing(1, 10, frozen) for _ in range(2)] == [2, 2]
    assert len(reads) == 2


def test_state_pass_value_block():
    """The state passes' value columns per program, with the occupancy rule as on an H100 (132 SMs)."""
    cpu = torch.device("cpu")

    def launch(name, programs, K, V):
        return state_pass.state_launch(name, programs, K, V, cpu, sm_count=132)
    # 8 sequences × 16 heads × 128/64 = 256 programs fill 132 SMs: the 64-column settings
    assert launch("state_pass_fwd", 128, 128, 128) == ("state_pass_fwd_wide", 128, 64)
    # 2 × 16 × 2 = 64 programs would leave SMs idle: NARROW_BV's columns (the forward 16), 32 for the passes it
    # does not list (the reverse pass, IPLR's forward)
    assert state_pass.NARROW_BV == {"state_pass_fwd": 16}
    assert launch("state_pass_bwd", 32, 128, 128) == ("state_pass_bwd", 128, 32)
    assert launch("state_pass_fwd", 32, 128, 128) == ("state_pass_fwd", 128, 16)
    assert launch("iplr_state_pass_fwd", 32, 128, 128) == ("iplr_state_pass_fwd", 128, 32)
    # wide keys stay narrow; a dimension below launch.MIN_TILE still gets 32-wide tiles (16-wide ones miscompiled
    # on Hopper with Triton 3.6), except the forward pass's tuned 16 value columns
    assert launch("state_pass_bwd", 512, 256, 128) == ("state_pass_bwd", 256, 32)
    assert launch("state_pass_bwd", 512, 64, 16) == ("state_pass_bwd", 64, 32)
    assert launch("iplr_state_pass_fwd", 512, 16, 16) == ("iplr_state_pass_fwd", 32, 32)
    assert launch("state_pass_fwd", 512, 16, 16) == ("state_pass_fwd", 32, 16)
    # the interpreter counts one SM: wide whenever V allows it
    assert state_pass.state_launch("state_pass_bwd", 1, 128, 128, cpu) == ("state_pass_bwd_wide", 128, 64)


# The kernels that carry the recurrence, which take the ops' recurrence_dot (common/precision.py), and the others,
# which take their dot.
RECURRENCE_KERNELS = {"common.wy": "gated_wy_fwd_kernel", "common.wy_bwd": "gated_wy_bwd_kernel",
                      "common.state_pass": ("state_pass_fwd_kernel", "state_pass_bwd_kernel")}
OTHER_KERNELS = {"common.state_pass": ("local_dv_kernel",), "gated_delta_rule.chunk_fwd": ("chunk_output_fwd_kernel",),
                 "common.chunk_bwd": ("chunk_dqkwg_kernel",),
                 "gated_delta_product.chunk_fwd": ("strided_output_fwd_kernel",)}
RECURRENCE_OPS = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_gated_delta_product",
                  "fused_recurrent_gated_delta_product"]


def recurrence_op_call(op: str, device):
    """(call(**kwargs) -> (o, final state), leaves): `op` on fresh bf16 inputs, T = 50 (sub-steps for the product,
    n_h = 2), K = V = 32 (the narrow state passes on the interpreter: local_dv_kernel runs too)."""
    import importlib

    package = "gated_delta_product" if op.endswith("product") else "gated_delta_rule"
    fn = getattr(importlib.import_module(f"rltrain_kernels.ops.{package}"), op)
    n_h = 2 if package == "gated_delta_product" else 1
    T, D = 50, 32
    q = torch.randn(1, T // n_h, 1, D, device=device)
    k = F.normalize(torch.randn(1, T, 1, D, device=device), dim=-1)
    v = torch.randn(1, T, 1, D, device=device)
    g = F.logsigmoid(torch.randn(1, T // n_h, 1, device=device))
    beta = torch.rand(1, T, 1, device=device)
    leaves = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v, g, beta)]
    h0 = torch.randn(1, 1, D, D, device=device, requires_grad=True)
    leaves.append(h0)
    extra = (n_h,) if n_h > 1 else ()

    def call(**kwargs):
        return fn(*leaves[:5], *extra, initial_state=h0, output_final_state=True, **kwargs)
    return call, leaves


@pytest.mark.parametrize("op", RECURRENCE_OPS)
def test_recurrence_dot_reaches_the_wy_and_state_pass_launches(op, device, monkeypatch):
    """recurrence_dot="tf32" on bf16 inputs launches the WY and state-pass kernels with tf32 dots, forward and backward
    (the fused-recurrent ops' backward runs the chunked kernels), T stored fp32 for them, every other kernel (and the
    reverse pass's chunk-local Pᵀ dO) with its bf16 dots; dot="tf32" launches every kernel with tf32 dots (the
    recurrence's "auto" follows it); without the arguments, bf16 everywhere. A spy on the launches: the interpreter
    ignores input_precision, so only the gradients' bf16 rounding shows it."""
    import importlib

    launched: dict[str, set] = {}

    def record(name):
        def run(args, kwargs):
            launched.setdefault(name, set()).add(kwargs["DOT_PREC"].removesuffix("_interpreted"))
            if "LOCAL_PREC" in kwargs:
                launched.setdefault("LOCAL_PREC", set()).add(kwargs["LOCAL_PREC"].removesuffix("_interpreted"))
            if name == "gated_wy_fwd_kernel":
                launched.setdefault("T dtype", set()).add(args[3].dtype)
        return run

    for table in (RECURRENCE_KERNELS, OTHER_KERNELS):
        for module_name, names in table.items():
            module = importlib.import_module(f"rltrain_kernels.ops.{module_name}")
            for name in (names,) if isinstance(names, str) else names:
                spy_launches(monkeypatch, module, name, record(name))
    recurrence = {"gated_wy_fwd_kernel", "gated_wy_bwd_kernel", "state_pass_fwd_kernel", "state_pass_bwd_kernel"}
    chunked_forward = op.startswith("chunk")
    gradients = {}
    # mode: (arguments, the recurrence kernels' dots, the others')
    modes = {"auto": ({}, "bf16", "bf16"), "tf32": ({"recurrence_dot": "tf32"}, "tf32", "bf16"),
             "dot-tf32": ({"dot": "tf32"}, "tf32", "tf32")}
    for mode, (kwargs, dot_prec, other_prec) in modes.items():
        call, leaves = recurrence_op_call(op, device)
        launched.clear()
        o, ht = call(**kwargs)
        forward = dict(launched)
        launched.clear()
        (o.float().square().sum() + ht.sum()).backward()
        backward = dict(launched)
        # the chunked forward solves for T and runs the forward state pass; the fused-recurrent one runs no dots
        assert recurrence & forward.keys() == ({"gated_wy_fwd_kernel", "state_pass_fwd_kernel"} if chunked_forward
                                                else set()), forward
        # the backward recomputes the states (and T, after a fused-recurrent forward), then the reverse passes
        assert {"state_pass_fwd_kernel", "state_pass_bwd_kernel", "gated_wy_bwd_kernel", "local_dv_kernel",
                "chunk_dqkwg_kernel"} <= backward.keys(), backward
        for phase in (forward, backward):
            for name, values in phase.items():
                if name == "T dtype":
                    assert values == {torch.float32 if dot_prec == "tf32" else torch.bfloat16}, (mode, values)
                else:
                    assert values == ({dot_prec} if name in recurrence else {other_prec}), (mode, name, values)
        gradients[mode] = [t.grad for t in leaves]
    for mode in ("tf32", "dot-tf32"):  # each does something
        assert any(not torch.equal(a, b) for a, b in zip(gradients["auto"], gradients[mode])), mode


@pytest.mark.parametrize("op", RECURRENCE_OPS)
@pytest.mark.parametrize("argument", ["recurrence_dot", "dot"])
@pytest.mark.parametrize("bad", ["fp8", "TF32", None])
def test_dot_arguments_are_validated_naming_the_argument(op, argument, bad):
    call, _ = recurrence_op_call(op, "cpu")
    with pytest.raises(ValueError, match=rf"{argument} must be one of auto, bf16, tf32; got {bad!r}"):
        call(**{argument: bad})


# The modules under rltrain_kernels.ops whose Triton kernels the chunked delta-rule ops launch with a DOT_PREC.
DELTA_RULE_KERNEL_MODULES = ("common.wy", "common.wy_bwd", "common.state_pass", "common.chunk_bwd",
                             "gated_delta_rule.chunk_fwd", "gated_delta_product.chunk_fwd",
                             "iplr_delta_rule.chunk_fwd", "iplr_delta_rule.chunk_bwd")


def chunked_op_calls(device):
    """{op: call(tuning)} for the three chunked ops' forward+backward on fresh bf16 inputs (K = V = 64: the state
    passes' wide launch on one SM, the narrow one on 132)."""
    from rltrain_kernels.ops.gated_delta_product import chunk_gated_delta_product
    from rltrain_kernels.ops.gated_delta_rule import chunk_gated_delta_rule
    from rltrain_kernels.ops.iplr_delta_rule import chunk_iplr_delta_rule

    def leaves(*shapes):
        return [torch.randn(*s, device=device).to(torch.bfloat16).requires_grad_() for s in shapes]

    def run(fn, tensors, *extra, tuning):
        o, ht = fn(*tensors, *extra, initial_state=torch.zeros(1, 1, 64, 64, device=device), output_final_state=True,
                   tuning=tuning)
        (o.float().sum() + ht.sum()).backward()

    x, gate = (1, 70, 1, 64), (1, 70, 1)
    return {"gated_delta_rule": lambda t: run(chunk_gated_delta_rule, leaves(x, x, x, gate, gate), tuning=t),
            "gated_delta_product": lambda t: run(chunk_gated_delta_product, leaves(x, (1, 140, 1, 64), (1, 140, 1, 64),
                                                                                    gate, (1, 140, 1)), 2, tuning=t),
            "iplr_delta_rule": lambda t: run(chunk_iplr_delta_rule, leaves(x, x, x, x, x), tuning=t)}


def test_tuning_reaches_every_launch(device, monkeypatch):
    """A Tuning (common/tuning.py) reaches every launch of the chunked ops, forward and backward, in both state-pass
    launches: each LAUNCH entry's warps and stages, and `dots` for every kernel that takes a DOT_PREC. The launches
    are recorded, not run (outputs stay unset): the settings are invalid ones no device would take."""
    import importlib

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from rltrain_kernels.ops.common.launch import LAUNCH
    from rltrain_kernels.ops.common.tuning import Tuning

    dot_kernels = {name for path in DELTA_RULE_KERNEL_MODULES
                   for name, obj in vars(importlib.import_module(f"rltrain_kernels.ops.{path}")).items()
                   if name.endswith("_kernel") and "DOT_PREC" in getattr(obj, "arg_names", ())}
    launched = {}

    def record(self, *args, grid, warmup, **kwargs):
        launched.setdefault(self.fn.__name__, set()).add(
            (kwargs.get("DOT_PREC"), kwargs.get("num_warps"), kwargs.get("num_stages")))

    for cls in (JITFunction, InterpretedFunction):
        monkeypatch.setattr(cls, "run", record)
    for sm_count in (1, 132):
        tuning = Tuning(launches={name: (3, 7) for name in LAUNCH}, dots={name: "ieee" for name in dot_kernels},
                        sm_count=sm_count)
        for call in chunked_op_calls(device).values():
            call(tuning)
    assert len(dot_kernels) == 13 and dot_kernels <= launched.keys(), sorted(dot_kernels - launched.keys())
    for name in dot_kernels:
        # the gated delta product's strided output pass has no LAUNCH entry: Triton's default warps and stages
        settings = {(None, None)} if name == "strided_output_fwd_kernel" else {(3, 7)}
        assert launched[name] == {("ieee", *s) for s in settings}, (name, launched[name])


@pytest.mark.parametrize("fields, words", [
    (dict(launches={"no_such": (4, 2)}), "Tuning.launches: 'no_such'"),
    (dict(launches={"wy_bwd": (4,)}), "must be (warps, stages)"),
    (dict(value_block="half"), "Tuning.value_block must be one of auto, wide, narrow; got 'half'"),
    (dict(output_blocks=(48, 64)), "Tuning.output_blocks must be (BK, BV)"),
    (dict(iplr_a_in_registers={"wide": True}), "Tuning.iplr_a_in_registers must map 'wide' and 'narrow'"),
    (dict(dots={"local_dv_kernel": "fp8"}), "Tuning.dots: 'local_dv_kernel': 'fp8' must be one of ieee, tf32, bf16"),
    (dict(sm_count=0), "Tuning.sm_count must be a positive int"),
], ids=["launch-name", "launch-pair", "value-block", "output-blocks", "registers", "dots", "sm-count"])
def test_tuning_is_validated_naming_the_field(fields, words):
    import re

    from rltrain_kernels.ops.common.tuning import Tuning

    with pytest.raises(ValueError, match=re.escape(words)):
        Tuning(**fields)


def test_tuning_is_read_only_and_typed():
    """A Tuning's settings cannot be changed after construction (the default is shared by every call), and the ops
    refuse anything else as their tuning."""
    import dataclasses

    from rltrain_kernels.ops.common.tuning import DEFAULT_TUNING, Tuning

    tuning = Tuning(launches={"wy_bwd": [8, 2]})
    assert tuning.launches["wy_bwd"] == (8, 2)
    with pytest.raises(TypeError):
        tuning.launches["wy_fwd"] = (8, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_TUNING.value_block = "wide"
    for op in RECURRENCE_OPS[::2]:  # the chunked ones
        call, _ = recurrence_op_call(op, "cpu")
        with pytest.raises(TypeError, match="tuning must be a rltrain_kernels.ops.common.tuning.Tuning; got dict"):
            call(tuning={"value_block": "wide"})
