"""Convergence (Liger's test/convergence): a tiny Qwen3, built from its config in fp32, trained through rltrain's
ActorWorker with kernel_config.include_kernels=none and with the fused kernels swapped in, on the same seed and
batches: every update's loss and the log-probs the actor computes (the old log-probs before each update, and after
the last) agree within fp32 tolerance. A run at another learning rate, otherwise the same, must not agree: the
comparison can fail.

Cases, by the kernel config of the run with kernels:
- `auto`: the device's default kernels. On CPU those are the plain-torch references (get_default_kernels("cpu"):
  fused_rmsnorm, fused_swiglu, fused_rope, and fused_gated_rmsnorm, which a Qwen3 has no module for); on a GPU the
  Triton kernels.
- `triton` (CPU only): the Triton kernels of the same three ids (kernel_config.name=cuda) through the interpreter
  (TRITON_INTERPRET=1, tests/conftest.py), over fewer updates, since each takes ~10 s there (on a GPU `auto` is this).
Updates run two mini-batches each, so the second one's ratio is not 1 and the clipping is live.

    .venv/bin/python -m pytest tests/rltrain/test_convergence.py   # ~40 s on 2 CPU cores, ~15 s on an H100
"""

from __future__ import annotations

import pytest
import torch
from rltrain_kernels.registry import KernelConfig, get_applied_kernels
from tensordict import TensorDict

from rltrain.algorithms.config import LossConfig
from rltrain.workers.actor import ActorWorker
from rltrain.workers.actor_config import ActorConfig
from tests.helpers import ON_GPU, rel_error

VOCAB, ROWS, PROMPT_WIDTH, RESPONSE_WIDTH = 128, 8, 6, 10
LR = 1e-3
# fp32 agreement. CPU: the references match transformers' modules bit for bit; the Triton kernels through the
# interpreter come within 1e-7 (3 updates: losses 5.7e-8, log-probs 7.3e-8; 10: 1.1e-7, 2.0e-7). H100: auto within
# 1e-6 (losses 1.8e-7, log-probs 8.2e-7), two plain runs identical. A learning rate 1.5x is off by 3e-3 or more
# (10 updates: losses 3.1e-3, log-probs 1.4e-2, CPU and H100; 3: 4.8e-3, 5.8e-3), above 100 * RTOL.
RTOL = 1e-5
CASES = {
    "auto": (KernelConfig(include_kernels="auto"), 10),
    "triton": (KernelConfig(name="cuda", include_kernels="fused_rmsnorm,fused_swiglu,fused_rope"), 3),
}
SWAPPED = {"fused_rmsnorm", "fused_swiglu", "fused_rope"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A 2-layer Qwen3 (GQA: 4 query heads, 2 key/value heads; q/k norms), its weights drawn from a fixed seed."""
    import transformers as tf

    config = tf.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                            tie_word_embeddings=False)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = tmp_path_factory.mktemp("convergence") / "qwen3"
    model.save_pretrained(path)
    return str(path)


def scored_batch(step: int) -> TensorDict:
    """Step `step`'s batch, the same in every run: left-padded prompts, right-padded responses of random lengths, one
    advantage per response (groups of 4), as the rollout and the advantage estimator leave them."""
    g = torch.Generator().manual_seed(1000 + step)
    prompt_len = torch.randint(2, PROMPT_WIDTH + 1, (ROWS,), generator=g)
    response_len = torch.randint(3, RESPONSE_WIDTH + 1, (ROWS,), generator=g)
    prompt_mask = (torch.arange(PROMPT_WIDTH)[None] >= PROMPT_WIDTH - prompt_len[:, None]).long()
    response_mask = (torch.arange(RESPONSE_WIDTH)[None] < response_len[:, None]).long()
    advantages = torch.randn(ROWS, 1, generator=g) * response_mask
    return TensorDict({
        "prompt_ids": torch.randint(1, VOCAB, (ROWS, PROMPT_WIDTH), generator=g) * prompt_mask,
        "prompt_mask": prompt_mask,
        "response_ids": torch.randint(1, VOCAB, (ROWS, RESPONSE_WIDTH), generator=g) * response_mask,
        "response_mask": response_mask,
        "advantages": advantages,
        "group_ids": torch.arange(ROWS) // 4,
    }, batch_size=[ROWS])


def train(model_dir: str, kernels: KernelConfig, updates: int, device: str, lr: float = LR):
    """(kernels applied, the loss of each update [updates], the log-probs before each update and after the last
    [updates + 1, ROWS, RESPONSE_WIDTH]), as the trainer drives the actor: old log-probs, then the update."""
    actor = ActorWorker(ActorConfig(lr=lr, mini_batch_size=ROWS // 2, torch_threads=1), LossConfig(entropy_coef=0.01),
                        model_dir, "float32", kernels, temperature=1.0, device=device, seed=0)
    losses, logprobs = [], []
    for step in range(updates):
        batch = scored_batch(step)
        batch["old_logprobs"] = actor.compute_logprobs(batch)
        logprobs.append(batch["old_logprobs"])
        losses.append(actor.update(batch, step)["actor/loss"])
    logprobs.append(actor.compute_logprobs(scored_batch(updates)))
    return get_applied_kernels(actor.model), torch.tensor(losses, dtype=torch.float64), torch.stack(logprobs)


@pytest.mark.parametrize("case", CASES)
def test_fused_kernels_train_like_plain_transformers(model_dir, device, case):
    kernels, updates = CASES[case]
    if case == "triton" and ON_GPU:
        pytest.skip("on a GPU, auto runs the Triton kernels")
    plain = train(model_dir, KernelConfig(include_kernels="none"), updates, device)
    fused = train(model_dir, kernels, updates, device)
    assert plain[0] == {}
    assert set(fused[0]) == SWAPPED and all(count > 0 for count in fused[0].values()), fused[0]
    assert rel_error(fused[1], plain[1]) <= RTOL, (fused[1], plain[1])
    assert rel_error(fused[2], plain[2]) <= RTOL
    other = train(model_dir, KernelConfig(include_kernels="none"), updates, device, lr=1.5 * LR)
    assert rel_error(other[1], plain[1]) > 100 * RTOL
    assert rel_error(other[2], plain[2]) > 100 * RTOL
