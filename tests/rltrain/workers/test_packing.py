"""Packed (padding-free) actor and reference batches: the packed row's maps, the token-budget split, and — on a
small GQA Qwen3 built from a config, fp32 — log-probs and gradients equal to the padded rows' (relative error
≤ 1e-5) for every loss aggregation, GSPO's sequence ratio, token-budget micro-batches, a sliding window and the
delta-rule policies (rltrain_kernels.models' hybrid family, every layer type; Qwen3-Next through transformers, its
Gated DeltaNet given the packed forward of rltrain_kernels/integrations/qwen3_next.py).

Run: `pytest tests/rltrain/workers/test_packing.py` (CPU, ~20 s).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from rltrain_kernels.registry import KernelConfig
from tensordict import TensorDict

from rltrain.algorithms.config import LossConfig
from rltrain.workers.actor import ActorWorker
from rltrain.workers.actor_config import ActorConfig
from rltrain.workers.batch import IGNORE_INDEX
from rltrain.workers.packing import (
    MicroBatching, Packing, balanced_groups, response_lengths, sequence_lengths, token_budget_groups, trim_padding,
)
from rltrain.workers.policy import can_pack
from rltrain.workers.reference import ReferenceWorker
from tests.helpers import assert_rel_close

VOCAB = 61


def random_batch(rows=7, prompt_width=6, response_width=9, seed=None) -> TensorDict:
    """Left-padded prompts (1..prompt_width tokens) and right-padded responses of random lengths, one response
    fully masked (as the overlong filter leaves it) and one of full width; advantages, old/ref log-probs random."""
    g = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(1 << 30, ())))
    prompt_len = torch.randint(1, prompt_width + 1, (rows,), generator=g)
    response_len = torch.randint(1, response_width + 1, (rows,), generator=g)
    response_len[0] = response_width
    positions_p, positions_r = torch.arange(prompt_width), torch.arange(response_width)
    prompt_mask = (positions_p[None] >= prompt_width - prompt_len[:, None]).long()
    response_mask = (positions_r[None] < response_len[:, None]).long()
    response_mask[2] = 0
    batch = TensorDict({
        "prompt_ids": torch.randint(1, VOCAB, (rows, prompt_width), generator=g) * prompt_mask,
        "prompt_mask": prompt_mask,
        "response_ids": torch.randint(1, VOCAB, (rows, response_width), generator=g) * response_mask,
        "response_mask": response_mask,
        "advantages": torch.randn(rows, response_width, generator=g) * response_mask,
        "group_ids": torch.arange(rows) // 2,
    }, batch_size=[rows])
    batch["old_logprobs"] = (-torch.rand(rows, response_width, generator=g) * 3) * response_mask
    batch["ref_logprobs"] = (-torch.rand(rows, response_width, generator=g) * 3) * response_mask
    return batch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A 2-layer Qwen3 with grouped-query attention (4 query heads, 2 key/value heads)."""
    import transformers as tf

    config = tf.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                            tie_word_embeddings=False)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen3") / "model"
    tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return str(path)


# ---------------------------------------------------------------- the packed row's maps
def test_packing_layout():
    batch = random_batch()
    packing = Packing.of(batch)
    lengths = sequence_lengths(batch)
    assert packing.num_tokens == int(lengths.sum())
    assert packing.cu_seqlens.tolist() == [0] + lengths.cumsum(0).tolist()
    for i, (start, end) in enumerate(zip(packing.cu_seqlens[:-1].tolist(), packing.cu_seqlens[1:].tolist())):
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i] != 0]
        response = batch["response_ids"][i][: int(response_lengths(batch)[i])]
        assert packing.input_ids[0, start:end].tolist() == prompt.tolist() + response.tolist()
        assert packing.position_ids[0, start:end].tolist() == list(range(end - start))
    labels = packing.labels(batch["response_ids"], batch["response_mask"])
    scored = labels != IGNORE_INDEX
    assert int(scored.sum()) == int(batch["response_mask"].sum())
    # position t is labelled with the token at t + 1
    assert torch.equal(labels[scored], packing.input_ids[0, 1:][scored[0, :-1]])
    values = torch.randn(batch["response_ids"].shape) * batch["response_mask"]
    assert torch.equal(packing.rows(packing.tokens(values)), values)


def test_response_rows_gathers_predicting_states():
    batch = random_batch()
    packing = Packing.of(batch)
    hidden = torch.randn(1, packing.num_tokens, 3)
    rows = packing.response_rows(hidden)
    expected = packing.rows(hidden[0, :, 0]) * batch["response_mask"]
    assert torch.equal(rows[..., 0] * batch["response_mask"], expected)


def test_empty_prompt_is_refused():
    batch = random_batch()
    batch["prompt_mask"][1] = 0
    with pytest.raises(ValueError, match="at least one prompt token"):
        Packing.of(batch)


def fewest_groups(lengths: list[int], budget: int) -> int:
    """The exact bin-packing optimum (a sequence over budget alone), by dynamic programming over subsets."""
    over = sum(length > budget for length in lengths)
    items = [length for length in lengths if length <= budget]
    best = {0: (1, 0)}   # subset mask -> (groups, tokens in the last one), the fewest groups first
    for mask in range(1, 1 << len(items)):
        options = []
        for i, length in enumerate(items):
            if mask >> i & 1:
                groups, used = best[mask ^ 1 << i]
                options.append((groups, used + length) if used + length <= budget else (groups + 1, length))
        best[mask] = min(options)
    return over + (best[(1 << len(items)) - 1][0] if items else 0)


@pytest.mark.parametrize("budget", [1, 7, 20, 1000])
def test_token_budget_groups(budget):
    lengths = torch.randint(1, 15, (11,)).tolist()
    groups = token_budget_groups(lengths, budget)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in g) <= budget or len(g) == 1 for g in groups)
    assert len(groups) <= 11 / 9 * fewest_groups(lengths, budget) + 6 / 9   # first-fit decreasing's bound


def test_token_budget_groups_where_the_balanced_split_wastes_room():
    # LPT puts 12 and 9 apart, then no two groups take 8, 6 and 5: three groups; the optimum is 12+8, 9+6+5
    assert token_budget_groups([6, 9, 5, 8, 12], 20) == [[0, 1, 2], [3, 4]]
    # 13 rows over half the budget, then two 10s that fit none of them: 14 groups, the optimum (one draw of the
    # random case above at 23 rows, which a bound of ceil(sum / budget) + 2 refused)
    lengths = [7, 12, 1, 2, 7, 12, 10, 12, 7, 11, 1, 2, 11, 13, 14, 6, 12, 14, 11, 14, 13, 13, 10]
    assert len(token_budget_groups(lengths, 20)) == 14


def test_balanced_groups_spread_tokens():
    lengths = [100, 90, 10, 10, 10, 10, 5, 80]
    groups = balanced_groups(lengths, 3)
    sums = sorted(sum(lengths[i] for i in g) for g in groups)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert sums[-1] - sums[0] <= max(lengths)


def test_micro_batching_skips_unscored_rows():
    batch = random_batch()
    groups = MicroBatching(rows=3, packed=True, max_tokens=0).groups(batch)
    assert 2 not in torch.cat(groups).tolist()
    assert sorted(torch.cat(groups).tolist()) == [i for i in range(7) if i != 2]


def test_padded_micro_batches_group_similar_lengths_and_trim_their_padding():
    batch = random_batch(rows=8, prompt_width=6, response_width=9)
    groups = MicroBatching(rows=3, packed=False).groups(batch)
    lengths = sequence_lengths(batch)
    assert sorted(torch.cat(groups).tolist()) == list(range(8))
    assert all(lengths[a].max() <= lengths[b].min() for a, b in zip(groups, groups[1:]))
    for rows in groups:
        micro = trim_padding(batch[rows])
        prompt_used = int(batch[rows]["prompt_mask"].sum(1).max())
        assert micro["prompt_ids"].shape[1] == prompt_used == micro["prompt_mask"].shape[1]
        assert micro["response_ids"].shape[1] == max(int(response_lengths(batch[rows]).max()), 1)
        for key in ("response_mask", "advantages", "old_logprobs", "ref_logprobs"):
            assert micro[key].shape == micro["response_ids"].shape
        # the kept columns are the original ones: the last prompt columns, the first response columns
        assert torch.equal(micro["prompt_ids"], batch[rows]["prompt_ids"][:, 6 - prompt_used:])
        assert torch.equal(micro["old_logprobs"], batch[rows]["old_logprobs"][:, :micro["response_ids"].shape[1]])


def test_linear_attention_models_run_padded():
    hybrid = SimpleNamespace(config=SimpleNamespace(layer_types=["linear_attention", "full_attention"]))
    assert not can_pack(hybrid)
    assert can_pack(SimpleNamespace(config=SimpleNamespace(layer_types=["full_attention", "sliding_attention"])))
    assert can_pack(SimpleNamespace(config=SimpleNamespace()))
    assert can_pack(SimpleNamespace(supports_cu_seqlens=True, config=hybrid.config))


def test_qwen3_next_packs_once_its_gated_deltanets_take_boundaries(qwen3_next_dir, caplog):
    """transformers' Gated DeltaNet takes no cu_seqlens; load_policy gives it the packed forward whatever the kernel
    config, and resolve_batching keeps the batches packed."""
    from rltrain.workers.policy import load_policy, resolve_batching
    from tests.model_factory import tiny_qwen3_next

    assert not can_pack(tiny_qwen3_next())
    for kernels in (None, KernelConfig(include_kernels="none"), KernelConfig()):
        model = load_policy(qwen3_next_dir, "float32", kernels, "cpu")
        assert can_pack(model)
        assert resolve_batching(model, MicroBatching(rows=4, packed=True)).packed
    assert "running padded rows" not in caplog.text


# ---------------------------------------------------------------- packed == padded, through the model
def make_actor(model_dir, packed: bool, max_tokens: int = 0, loss: LossConfig | None = None,
               checkpointing: bool = False):
    config = ActorConfig(micro_batch_size=64, torch_threads=1, grad_clip=1e9, use_remove_padding=packed,
                         max_tokens_per_micro_batch=max_tokens, gradient_checkpointing=checkpointing)
    return ActorWorker(config, loss or LossConfig(), model_dir, "float32", None, temperature=0.9)


def gradient(actor, batch) -> torch.Tensor:
    actor.update(batch)
    return torch.cat([p.grad.flatten() for p in actor.model.parameters() if p.grad is not None])


def test_packed_logprobs_equal_padded(model_dir):
    batch = random_batch(rows=9)
    padded = make_actor(model_dir, packed=False).compute_logprobs(batch)
    packed = make_actor(model_dir, packed=True, max_tokens=30).compute_logprobs(batch)
    reference = ReferenceWorker(model_dir, "float32", None, 0.9, MicroBatching(rows=4, packed=True), torch_threads=1)
    assert batch["response_mask"].sum() > 0 and padded.abs().sum() > 0
    assert_rel_close(packed, padded, threshold=1e-5, name="actor packed logprobs")
    assert_rel_close(reference.compute_logprobs(batch), padded, threshold=1e-5, name="reference packed logprobs")
    assert torch.all(packed[batch["response_mask"] == 0] == 0)


@pytest.mark.parametrize("loss", [
    LossConfig(loss_agg="token-mean", kl_coef=0.1, entropy_coef=0.01),
    LossConfig(loss_agg="seq-mean-token-mean"),
    LossConfig(loss_agg="seq-mean-token-sum"),
    LossConfig(loss_agg="seq-mean-token-sum-norm"),
    LossConfig(loss_agg="seq-mean-token-mean", importance_level="sequence"),
], ids=["token-mean-kl-entropy", "seq-mean-token-mean", "seq-mean-token-sum", "drgrpo", "gspo"])
def test_packed_gradients_equal_padded(model_dir, loss):
    """One update's gradient: padded rows in one micro-batch vs packed rows in micro-batches of ≤ 25 tokens."""
    batch = random_batch(rows=8)
    padded = gradient(make_actor(model_dir, packed=False, loss=loss), batch)
    packed = gradient(make_actor(model_dir, packed=True, max_tokens=25, loss=loss), batch)
    assert padded.norm() > 0
    assert_rel_close(packed, padded, threshold=1e-5, name="gradient")


def test_packed_gradient_checkpointing(model_dir):
    """Checkpointed layers recompute their forward in backward, which must take the packed attention path too."""
    batch = random_batch(rows=6)
    plain = gradient(make_actor(model_dir, packed=True, max_tokens=30), batch)
    checkpointed = gradient(make_actor(model_dir, packed=True, max_tokens=30, checkpointing=True), batch)
    assert_rel_close(checkpointed, plain, threshold=1e-5, name="gradient")


@pytest.mark.parametrize("loss", [LossConfig(loss_agg="token-mean"), LossConfig(loss_agg="seq-mean-token-sum-norm")],
                         ids=["token-mean", "drgrpo"])
def test_trimmed_padded_micro_batches_equal_one_padded_batch(model_dir, loss):
    """Padded micro-batches of 2 rows (sorted by length, each cut to its own width) give the log-probs and the
    gradient of the whole batch in one padded micro-batch."""
    batch = random_batch(rows=8)
    whole, small = make_actor(model_dir, packed=False, loss=loss), make_actor(model_dir, packed=False, loss=loss)
    small.batching = MicroBatching(rows=2, packed=False)
    assert_rel_close(small.compute_logprobs(batch), whole.compute_logprobs(batch), threshold=1e-5, name="logprobs")
    assert_rel_close(gradient(small, batch), gradient(whole, batch), threshold=1e-5, name="gradient")


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    """A delta-rule policy of rltrain_kernels.models: IPLR, attention, gated delta product, Gated DeltaNet."""
    from rltrain_kernels.models import HybridDeltaConfig, HybridDeltaForCausalLM

    config = HybridDeltaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=8, linear_num_heads=2, linear_head_dim=16,
                               layer_types=["iplr", "full_attention", "gated_delta_product", "gated_delta_rule"])
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hybrid") / "model"
    HybridDeltaForCausalLM(config).save_pretrained(path)
    return str(path)


def test_delta_rule_policy_packed_equals_padded(hybrid_dir):
    """Every layer of the hybrid family keeps a packed row's sequences apart: log-probs and one update's gradient
    equal the padded rows' (token-budget micro-batches of <= 25 tokens)."""
    batch = random_batch(rows=8)
    padded_actor, packed_actor = make_actor(hybrid_dir, packed=False), make_actor(hybrid_dir, packed=True,
                                                                                  max_tokens=25)
    assert packed_actor.batching.packed
    assert_rel_close(packed_actor.compute_logprobs(batch), padded_actor.compute_logprobs(batch), threshold=1e-5,
                     name="hybrid packed logprobs")
    padded, packed = gradient(padded_actor, batch), gradient(packed_actor, batch)
    assert padded.norm() > 0
    assert_rel_close(packed, padded, threshold=1e-5, name="hybrid gradient")


@pytest.fixture(scope="module")
def qwen3_next_dir(tmp_path_factory):
    """A Qwen3-Next (tests/model_factory.py): Gated DeltaNet and attention layers, dense and MoE MLPs."""
    from tests.model_factory import tiny_qwen3_next

    path = tmp_path_factory.mktemp("qwen3_next") / "model"
    tiny_qwen3_next(vocab_size=VOCAB).save_pretrained(path)
    return str(path)


def test_qwen3_next_packed_equals_padded(qwen3_next_dir):
    """Qwen3-Next through transformers (its Gated DeltaNet given the packed forward, sequences restarting its conv
    and state): the actor's and the reference's packed log-probs and one update's gradient equal the padded rows'
    (token-budget micro-batches of <= 25 tokens), with gradient checkpointing too."""
    batch = random_batch(rows=8)
    padded_actor, packed_actor = make_actor(qwen3_next_dir, packed=False), make_actor(qwen3_next_dir, packed=True,
                                                                                      max_tokens=25)
    assert packed_actor.batching.packed and not padded_actor.batching.packed
    padded_logprobs = padded_actor.compute_logprobs(batch)
    reference = ReferenceWorker(qwen3_next_dir, "float32", None, 0.9, MicroBatching(rows=3, packed=True),
                                torch_threads=1)
    assert reference.batching.packed and padded_logprobs.abs().sum() > 0
    assert_rel_close(packed_actor.compute_logprobs(batch), padded_logprobs, threshold=1e-5,
                     name="Qwen3-Next actor packed logprobs")
    assert_rel_close(reference.compute_logprobs(batch), padded_logprobs, threshold=1e-5,
                     name="Qwen3-Next reference packed logprobs")
    padded = gradient(padded_actor, batch)
    assert padded.norm() > 0
    assert_rel_close(gradient(packed_actor, batch), padded, threshold=1e-5, name="Qwen3-Next gradient")
    checkpointed = make_actor(qwen3_next_dir, packed=True, max_tokens=25, checkpointing=True)
    assert_rel_close(gradient(checkpointed, batch), padded, threshold=1e-5, name="Qwen3-Next checkpointed gradient")


def test_sliding_window_packed_equals_padded(tmp_path):
    import transformers as tf

    config = tf.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=4, head_dim=8, max_position_embeddings=64,
                            use_sliding_window=True, sliding_window=3, max_window_layers=0,
                            layer_types=["sliding_attention", "full_attention"])
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    batch = random_batch(rows=5)
    padded = make_actor(str(tmp_path), packed=False).compute_logprobs(batch)
    packed = make_actor(str(tmp_path), packed=True).compute_logprobs(batch)
    assert_rel_close(packed, padded, threshold=1e-5, name="sliding-window logprobs")


# ---------------------------------------------------------------- GPU: torch's varlen flash attention, bf16
def per_sequence_sdpa(q, k, v, cu_seqlens, scale: float, sliding_window: int | None) -> torch.Tensor:
    """The reference: causal SDPA over each sequence of a packed row in turn ([T, H, D] in and out)."""
    pieces = []
    groups = q.shape[1] // k.shape[1]
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))   # [H, L, D]
        ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
        i = torch.arange(end - start, device=q.device)
        allowed = i[None, :] <= i[:, None]
        if sliding_window is not None:
            allowed &= i[None, :] > i[:, None] - sliding_window
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scale)
        pieces.append(o.transpose(0, 1))
    return torch.cat(pieces)


@pytest.mark.parametrize("window", [None, 3])
def test_cpu_varlen_attention_matches_per_sequence_sdpa(window):
    """The CPU path (one batched SDPA over the sequences gathered into rows), GQA, with and without a sliding
    window, empty and one-token sequences among them: outputs and input gradients, fp32."""
    from rltrain.workers.attention import varlen_attention_forward

    lengths = [5, 0, 1, 9, 3]
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(1, heads, sum(lengths), 8, requires_grad=True) for heads in (4, 2, 2))
    out, _ = varlen_attention_forward(SimpleNamespace(), q, k, v, None, scaling=0.3, sliding_window=window,
                                      cu_seq_lens_q=cu_seqlens, max_length_q=9, max_length_k=9)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    expected = per_sequence_sdpa(*(t[0].transpose(0, 1) for t in leaves), cu_seqlens, 0.3, window)
    grad = torch.randn_like(expected)
    out.backward(grad[None])
    expected.backward(grad)
    assert_rel_close(out[0], expected, threshold=1e-5, name="output")
    for name, got, ref in zip("qkv", (q, k, v), leaves):
        assert_rel_close(got.grad, ref.grad, threshold=1e-5, name=f"d{name}")


@pytest.mark.gpu
def test_varlen_flash_attention_matches_per_sequence_sdpa():
    """torch's varlen kernel (bf16, GQA) against causal SDPA per sequence in fp32, outputs and input gradients."""
    from rltrain.workers.attention import varlen_attention_forward

    lengths = [700, 1, 1300, 64, 2000]
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0).to(torch.int32).cuda()
    T = sum(lengths)
    q, k, v = (torch.randn(1, heads, T, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for heads in (16, 8, 8))
    out, _ = varlen_attention_forward(SimpleNamespace(), q, k, v, None, scaling=128 ** -0.5,
                                      cu_seq_lens_q=cu_seqlens, max_length_q=max(lengths), max_length_k=max(lengths))
    leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    expected = per_sequence_sdpa(*(t[0].transpose(0, 1) for t in leaves), cu_seqlens, 128 ** -0.5, None)
    grad = torch.randn_like(expected)
    out.backward(grad[None].to(out.dtype))
    expected.backward(grad)
    assert_rel_close(out[0].float(), expected, threshold=1e-2, name="output")
    for name, got, ref in zip("qkv", (q, k, v), leaves):
        assert_rel_close(got.grad.float(), ref.grad, threshold=2e-2, name=f"d{name}")


@pytest.mark.gpu
def test_packed_bf16_logprobs_as_accurate_as_padded(model_dir):
    """bf16 on CUDA with the fused kernels: the packed row's log-probs are as close to fp32 padded ones as the
    padded bf16 rows' are (torch varlen flash attention vs SDPA)."""
    batch = random_batch(rows=16, prompt_width=64, response_width=300)
    exact = ReferenceWorker(model_dir, "float32", None, 1.0, MicroBatching(packed=False), device="cuda")
    expected = exact.compute_logprobs(batch)
    errors = {}
    for packed in (False, True):
        worker = ReferenceWorker(model_dir, "bfloat16", KernelConfig(), 1.0,
                                 MicroBatching(packed=packed, max_tokens=2048), device="cuda")
        errors[packed] = float((worker.compute_logprobs(batch) - expected).norm() / expected.norm())
    assert errors[True] <= 2 * errors[False] + 1e-3, errors


@pytest.mark.gpu
def test_qwen3_next_packed_bf16_logprobs_as_accurate_as_padded(qwen3_next_dir):
    """Qwen3-Next in bf16 on CUDA with the default kernels (the gated_delta_rule kernel's packed forward: the short conv
    and chunked delta rule kernels with cu_seqlens): the packed row's log-probs are as close to fp32 padded ones as
    the padded bf16 rows' are."""
    from rltrain_kernels.registry import get_applied_kernels

    batch = random_batch(rows=16, prompt_width=64, response_width=300)
    exact = ReferenceWorker(qwen3_next_dir, "float32", None, 1.0, MicroBatching(packed=False), device="cuda")
    expected = exact.compute_logprobs(batch)
    errors = {}
    for packed in (False, True):
        worker = ReferenceWorker(qwen3_next_dir, "bfloat16", KernelConfig(), 1.0,
                                 MicroBatching(packed=packed, max_tokens=2048), device="cuda")
        assert worker.batching.packed == packed
        assert get_applied_kernels(worker.model)["gated_delta_rule"] == 2
        errors[packed] = float((worker.compute_logprobs(batch) - expected).norm() / expected.norm())
    assert errors[True] <= 2 * errors[False] + 1e-3, errors
