"""RoPE: the Triton kernels (interpreted on CPU, native on GPU) against a float64 run of the naive reference,
outputs and the q/k gradients, in both layouts and under GQA; the naive reference against HF's own function.

Run: `pytest tests/kernels/ops/test_rope.py` (CPU through the Triton interpreter: ~5-20 s; the three op files
together ~25 s of CPU time); `gpu`-marked tests run real sizes on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from rltrain_kernels.ops.rope import apply_rotary_pos_emb
from rltrain_kernels.ops.rope.naive import naive_apply_rotary_pos_emb
from tests.helpers import assert_rel_close, case_id, dtype_id

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (B, T, Hq, Hk, D): the smallest head, GQA, a head dim whose half (40) is not a power of two, more q heads (40)
# than one 2048-value tile holds at D=128 (two loop steps), MHA.
SHAPES = [(1, 1, 1, 1, 2), (2, 3, 4, 2, 64), (3, 2, 6, 2, 80), (1, 2, 40, 8, 128), (2, 3, 3, 3, 32)]
LAYOUTS = {
    # HF's usual case: projections viewed as [B, T, H, D] and transposed to [B, H, T, D] (non-contiguous).
    "bhtd_transposed": dict(unsqueeze_dim=1, transposed=True),
    "bhtd_contiguous": dict(unsqueeze_dim=1, transposed=False),
    "bthd": dict(unsqueeze_dim=2, transposed=False),
}


def make_qk(B, T, H, D, dtype, device, layout):
    """A q or k leaf in the layout's logical shape ([B, H, T, D] for unsqueeze_dim=1, [B, T, H, D] for 2)."""
    spec = LAYOUTS[layout]
    if spec["unsqueeze_dim"] == 2:
        t = torch.randn(B, T, H, D, dtype=dtype, device=device)
    elif spec["transposed"]:
        t = torch.randn(B, T, H, D, dtype=dtype, device=device).transpose(1, 2)
    else:
        t = torch.randn(B, H, T, D, dtype=dtype, device=device)
    return t.requires_grad_()


def make_cos_sin(cos_batch, T, D, dtype, device):
    """Random angles per (position, dim) so that the two halves of cos/sin differ (the kernel must load all D)."""
    angles = 10 * torch.rand(cos_batch, T, D, device=device)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def random_upstream(like: torch.Tensor) -> torch.Tensor:
    """A fresh gradient with a non-contiguous layout (padded last dim)."""
    return torch.randn(*like.shape[:-1], like.shape[-1] + 3, dtype=like.dtype, device=like.device)[..., : like.shape[-1]]


def check_against_reference(q, k, cos, sin, unsqueeze_dim, dq_embed, dk_embed, out_dtype):
    q_embed, k_embed = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    dq, dk = torch.autograd.grad((q_embed, k_embed), (q, k), (dq_embed, dk_embed))
    q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))
    q_want, k_want = naive_apply_rotary_pos_emb(q64, k64, cos.double(), sin.double(), unsqueeze_dim=unsqueeze_dim)
    dq_want, dk_want = torch.autograd.grad((q_want, k_want), (q64, k64), (dq_embed.double(), dk_embed.double()))
    assert q_embed.dtype == out_dtype and k_embed.dtype == out_dtype
    assert dq.dtype == q.dtype and dk.dtype == k.dtype
    threshold_dtype = q.dtype  # values are rounded to q's dtype at the input; fp32 outputs do not recover that
    assert_rel_close(q_embed, q_want, dtype=threshold_dtype, name="q_embed")
    assert_rel_close(k_embed, k_want, dtype=threshold_dtype, name="k_embed")
    assert_rel_close(dq, dq_want, dtype=threshold_dtype, name="dq")
    assert_rel_close(dk, dk_want, dtype=threshold_dtype, name="dk")
    return q_embed, k_embed


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: case_id(B=s[0], T=s[1], Hq=s[2], Hk=s[3], D=s[4]))
def test_rope_matches_float64_reference(shape, dtype, layout, device):
    B, T, Hq, Hk, D = shape
    q, k = make_qk(B, T, Hq, D, dtype, device, layout), make_qk(B, T, Hk, D, dtype, device, layout)
    cos, sin = make_cos_sin(B, T, D, dtype, device)
    q_embed, k_embed = check_against_reference(q, k, cos, sin, LAYOUTS[layout]["unsqueeze_dim"],
                                               random_upstream(q), random_upstream(k), dtype)
    assert q_embed.shape == q.shape and k_embed.shape == k.shape


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("cos_batch", [1, 2], ids=["cos_B1", "cos_B2"])
@pytest.mark.parametrize("grad_layout", ["transposed", "expanded", "zero"])
def test_rope_cos_broadcast_and_upstream_grads(cos_batch, grad_layout, device):
    B, T, Hq, Hk, D, dtype = 2, 4, 4, 2, 48, torch.bfloat16
    q, k = (make_qk(B, T, H, D, dtype, device, "bhtd_transposed") for H in (Hq, Hk))
    cos, sin = make_cos_sin(cos_batch, T, D, dtype, device)
    # cos/sin as strided views too (a slice of a longer position table).
    cos, sin = (torch.cat([t, t], dim=1)[:, T // 2: T // 2 + T] for t in (cos, sin))
    if grad_layout == "transposed":  # contiguous [B, H, T, D] while the outputs are laid out [B, T, H, D]
        dq_embed, dk_embed = (torch.randn(B, H, T, D, dtype=dtype, device=device) for H in (Hq, Hk))
    elif grad_layout == "expanded":
        dq_embed, dk_embed = (torch.randn(1, 1, 1, D, dtype=dtype, device=device).expand(B, H, T, D) for H in (Hq, Hk))
    else:
        dq_embed, dk_embed = (torch.zeros(B, H, T, D, dtype=dtype, device=device) for H in (Hq, Hk))
    check_against_reference(q, k, cos, sin, 1, dq_embed, dk_embed, dtype)


def test_rope_fp32_tables_promote_like_hf(device):
    """bf16 q/k with fp32 cos/sin: HF's formula promotes to fp32, and so does the kernel; grads stay bf16."""
    B, T, Hq, Hk, D = 2, 5, 4, 1, 64
    q, k = (make_qk(B, T, H, D, torch.bfloat16, device, "bhtd_transposed") for H in (Hq, Hk))
    cos, sin = make_cos_sin(1, T, D, torch.float32, device)
    dq_embed, dk_embed = (torch.randn(B, H, T, D, device=device) for H in (Hq, Hk))
    check_against_reference(q, k, cos, sin, 1, dq_embed, dk_embed, torch.float32)


def test_rope_with_k_embed_unused(device):
    B, T, Hq, Hk, D = 2, 4, 4, 2, 32
    q, k = (make_qk(B, T, H, D, torch.float32, device, "bhtd_transposed") for H in (Hq, Hk))
    cos, sin = make_cos_sin(B, T, D, torch.float32, device)
    dq_embed = torch.randn(B, Hq, T, D, device=device)
    q_embed, _ = apply_rotary_pos_emb(q, k, cos, sin)
    (q_embed * dq_embed).sum().backward()
    q64 = q.detach().double().requires_grad_()
    q_want, _ = naive_apply_rotary_pos_emb(q64, k.detach().double(), cos.double(), sin.double())
    (q_want * dq_embed.double()).sum().backward()
    assert_rel_close(q.grad, q64.grad, name="dq")
    assert k.grad is None


def test_rope_cos_sin_requiring_grad_fall_back_to_naive(device):
    """Differentiable cos/sin (e.g. learned scaling) take the naive path: every gradient, cos/sin included."""
    B, T, Hq, Hk, D = 1, 5, 2, 1, 16
    q, k = (make_qk(B, T, H, D, torch.float32, device, "bhtd_transposed") for H in (Hq, Hk))
    cos, sin = (t.requires_grad_() for t in make_cos_sin(1, T, D, torch.float32, device))
    grads_out = [torch.randn(B, H, T, D, device=device) for H in (Hq, Hk)]
    outs = apply_rotary_pos_emb(q, k, cos, sin)
    grads = torch.autograd.grad(outs, (q, k, cos, sin), grads_out)
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, cos, sin)]
    outs64 = naive_apply_rotary_pos_emb(*leaves64)
    grads64 = torch.autograd.grad(outs64, leaves64, [g.double() for g in grads_out])
    for name, got, want in zip(["q_embed", "k_embed", "dq", "dk", "dcos", "dsin"], [*outs, *grads],
                               [*outs64, *grads64]):
        assert_rel_close(got, want, dtype=torch.float32, name=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_naive_matches_hf_apply_rotary_pos_emb(dtype, device):
    """Our reference is HF's function bit for bit, with the cos/sin of HF's own rotary embedding."""
    modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    B, T, Hq, Hk, D = 2, 9, 4, 2, 32
    config = LlamaConfig(hidden_size=Hq * D, num_attention_heads=Hq, num_key_value_heads=Hk, head_dim=D)
    rotary = modeling_llama.LlamaRotaryEmbedding(config).to(device)
    q, k = (torch.randn(B, T, H, D, dtype=dtype, device=device).transpose(1, 2) for H in (Hq, Hk))
    position_ids = torch.randint(0, 4096, (B, T), device=device)
    cos, sin = rotary(q, position_ids)
    want = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    got = naive_apply_rotary_pos_emb(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    kernel = apply_rotary_pos_emb(q, k, cos, sin)
    exact = naive_apply_rotary_pos_emb(q.double(), k.double(), cos.double(), sin.double())
    for name, a, b in zip(["q_embed", "k_embed"], kernel, exact):
        assert_rel_close(a, b, dtype=dtype, name=name)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bhtd_transposed", "bthd"])
@pytest.mark.parametrize("shape", [(1, 16384, 32, 8, 128), (4, 2048, 28, 4, 128), (2, 1000, 16, 16, 256)],
                         ids=lambda s: case_id(B=s[0], T=s[1], Hq=s[2], Hk=s[3], D=s[4]))
def test_rope_gpu_real_sizes(shape, layout, device):
    B, T, Hq, Hk, D = shape
    dtype = torch.bfloat16
    q, k = make_qk(B, T, Hq, D, dtype, device, layout), make_qk(B, T, Hk, D, dtype, device, layout)
    cos, sin = make_cos_sin(1, T, D, dtype, device)
    check_against_reference(q, k, cos, sin, LAYOUTS[layout]["unsqueeze_dim"], random_upstream(q),
                            random_upstream(k), dtype)
