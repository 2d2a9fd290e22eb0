"""Every algorithm preset (config/algorithm/*.yaml) against its paper's objective, reimplemented densely in float64:
the advantages the trainer computes (rltrain.algorithms.advantages.batch_advantages, after DAPO's overlong filter)
and the actor's loss and gradients (packed micro-batches through fused_policy_loss, LossAccumulation's weighting) on
the tiny embedded model, against plain loops over responses and tokens on the same model in float64 with
transformers' own forward. Old log-probs are perturbed so that ratios leave the clip ranges.

    .venv/bin/python -m pytest tests/rltrain/algorithms/test_presets.py -q   # ~20 s on 2 cores
"""

import math
import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from rltrain.algorithms.advantages import batch_advantages
from rltrain.algorithms.config import AlgorithmConfig
from rltrain.algorithms.dapo import mask_truncated
from rltrain.config import from_mapping
from rltrain.data.sampler import encode_prompts
from rltrain.embedded.model import embedded_policy_dir
from rltrain.embedded.task import make_rows
from rltrain.workers.actor import ActorWorker
from rltrain.workers.actor_config import ActorConfig
from rltrain.workers.batch import model_inputs
from rltrain.workers.rollout import RolloutConfig, RolloutWorker
from tests.rltrain.tiny_job import compose, tiny_job

PRESETS = ["grpo", "drgrpo", "dapo", "gspo", "rloo", "reinforce_pp", "ppo"]
GROUP = 4
GENERATED, MAX_NEW_TOKENS = 5, 8   # responses of at most 5 tokens under a budget of 8 (Dr.GRPO's constant)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(model dir, 3 prompts × 4 responses with rewards, two of them marked truncated, and the float64 model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    job = tiny_job(tmp_path_factory.mktemp("presets"))
    model_dir = str(embedded_policy_dir(job.trainer.output_dir, job.model.embedded, job.data.task, 0))
    ids, mask = encode_prompts(make_rows(job.data.task)[0][:3], AutoTokenizer.from_pretrained(model_dir))
    rollout = RolloutWorker(RolloutConfig(n=GROUP, max_new_tokens=GENERATED, torch_threads=1), model_dir,
                            "float32", None)
    batch = rollout.generate(ids, mask, GROUP, 1.0, seed=0)
    batch["rewards"] = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    batch["truncated"] = torch.zeros(12, dtype=torch.bool)
    batch["truncated"][[1, 6]] = True
    dense = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    return model_dir, batch, dense


def _algorithm(preset: str) -> AlgorithmConfig:
    return from_mapping(AlgorithmConfig, OmegaConf.to_container(compose(f"algorithm={preset}").algorithm), "algorithm")


# ---------------------------------------------------------------- the papers, densely, in float64
def dense_advantages(preset, rewards, mask, old, ref, kl_coef, values=None) -> torch.Tensor:
    """[B, T] advantages, one response at a time."""
    rewards, B, T = rewards.double().tolist(), *mask.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    if preset == "ppo":   # Schulman et al. 2016's GAE at γ = λ = 1: A_t = r − V_t, whitened over the batch's tokens
        raw = {(i, t): rewards[i] - float(values[i, t]) for i in range(B) for t in range(T) if mask[i, t]}
        mean = sum(raw.values()) / len(raw)
        std = math.sqrt(sum((v - mean) ** 2 for v in raw.values()) / (len(raw) - 1))
        for (i, t), a in raw.items():
            adv[i, t] = (a - mean) / std
        return adv
    if preset == "reinforce_pp":   # Hu 2025: r_t = 1[t = last]·r − β·k1_t, G_t = Σ_{t' >= t} r_t', whitened
        returns = {}
        for i in range(B):
            tokens = [t for t in range(T) if mask[i, t]]
            per_token = {t: -kl_coef * float(old[i, t] - ref[i, t]) for t in tokens}
            per_token[tokens[-1]] += rewards[i]
            for t in tokens:
                returns[i, t] = sum(per_token[u] for u in tokens if u >= t)
        values = list(returns.values())
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        for (i, t), g in returns.items():
            adv[i, t] = (g - mean) / std
        return adv
    for i in range(B):
        group = rewards[i // GROUP * GROUP:(i // GROUP + 1) * GROUP]
        mean = sum(group) / GROUP
        if preset == "drgrpo":     # Liu et al. 2025: no std normalisation
            a = rewards[i] - mean
        elif preset == "rloo":     # Ahmadian et al. 2024: the others' mean as the baseline
            a = rewards[i] - (sum(group) - rewards[i]) / (GROUP - 1)
        else:                      # Shao et al. 2024 (grpo, and dapo, gspo): unbiased std
            a = (rewards[i] - mean) / (math.sqrt(sum((r - mean) ** 2 for r in group) / (GROUP - 1)) + 1e-6)
        adv[i] = a * mask[i]
    return adv


def dense_loss(preset, logp, old, adv, mask, clip_low, clip_high, max_new_tokens) -> torch.Tensor:
    """The surrogate loss (to minimise) of a mini-batch."""
    B, T = mask.shape

    def clipped(ratio, a):
        return torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip_low, 1 + clip_high))

    if preset == "gspo":   # Zheng et al. 2025: s_i = (Π_t r_it)^(1/|y_i|), −1/G Σ_i min(s_i A_i, clip(s_i) A_i)
        terms = []
        for i in range(B):
            tokens = mask[i].bool()
            if tokens.any():
                s = torch.exp((logp[i, tokens] - old[i, tokens]).mean())
                terms.append(clipped(s, adv[i, tokens][0]))
        return torch.stack(terms).mean()
    total = sum(clipped(torch.exp(logp[i, t] - old[i, t]), adv[i, t]) for i in range(B) for t in range(T)
                if mask[i, t])
    if preset == "drgrpo":  # Σ_i Σ_t / (G · L_max), the generation budget as the constant
        return total / (B * max_new_tokens)
    return total / mask.sum()  # token-mean (DAPO's, and verl's default for grpo / rloo / reinforce_pp)


# ---------------------------------------------------------------- the test
@pytest.mark.parametrize("preset", PRESETS)
def test_preset_matches_its_dense_float64_objective(setup, preset):
    model_dir, scored, dense = setup
    algorithm = _algorithm(preset)
    loss_config = algorithm.actor_loss(MAX_NEW_TOKENS)
    actor = ActorWorker(ActorConfig(torch_threads=1, grad_clip=1e9, max_tokens_per_micro_batch=30), loss_config,
                        model_dir, "float32", None, temperature=1.0)
    generator = torch.Generator().manual_seed(PRESETS.index(preset))
    # the trainer's order (rltrain/trainer.py train_step): overlong filter, old and ref log-probs, advantages
    batch = scored.clone()
    rollout_mask = batch["response_mask"].clone()
    if algorithm.overlong_filter:
        batch["response_mask"] = mask_truncated(batch["response_mask"], batch["truncated"])
    on_policy = actor.compute_logprobs(batch)
    if preset == "gspo":   # sequence ratios 1, 0.998 and 1.002 per response: inside and outside [1 − 3e-4, 1 + 4e-4]
        shift = torch.tensor([0.0, 2e-3, -2e-3]).repeat(4)[:, None]
    else:
        shift = 0.3 * torch.randn(on_policy.shape, generator=generator)
    batch["old_logprobs"] = (on_policy + shift) * batch["response_mask"]
    batch["ref_logprobs"] = (on_policy + 0.3 * torch.randn(on_policy.shape, generator=generator)) * \
        batch["response_mask"]
    batch["values"] = torch.randn(on_policy.shape, generator=generator) * batch["response_mask"]   # the critic's
    batch["advantages"], _ = batch_advantages(batch, algorithm)
    metrics = actor.update(batch)

    mask = rollout_mask.clone()
    if preset == "dapo":   # Yu et al. 2025's overlong filtering: truncated responses leave the loss
        mask[batch["truncated"]] = 0
    assert torch.equal(batch["response_mask"], mask) and mask.sum() > 0
    expected_adv = dense_advantages(preset, batch["rewards"], mask, batch["old_logprobs"].double(),
                                    batch["ref_logprobs"].double(), algorithm.loss.kl_coef, batch["values"])
    torch.testing.assert_close(batch["advantages"].double(), expected_adv, rtol=1e-5, atol=1e-5)

    dense.zero_grad(set_to_none=True)
    inputs = batch.clone()
    inputs["response_mask"] = rollout_mask   # the filtered responses' tokens are still there (their loss is 0)
    input_ids, attention_mask, position_ids = model_inputs(inputs)
    logits = dense(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    width = batch["prompt_ids"].shape[1]
    logp = torch.log_softmax(logits[:, width - 1:-1], -1).gather(-1, batch["response_ids"][..., None])[..., 0]
    loss = dense_loss(preset, logp, batch["old_logprobs"].double(), expected_adv, mask, algorithm.loss.clip_low,
                      algorithm.loss.clip_high, MAX_NEW_TOKENS)
    loss.backward()
    assert metrics["actor/loss"] == pytest.approx(loss.item(), rel=1e-4, abs=1e-7)
    assert 0 < metrics["actor/clipfrac"] < 1   # the clip ranges are reached, and not everywhere
    expected_grads = dict(dense.named_parameters())
    for name, parameter in actor.model.named_parameters():
        want, got = expected_grads[name].grad, parameter.grad.double()
        assert (got - want).norm() <= 1e-4 * want.norm() + 1e-9, name


def test_readme_table_names_a_paper_for_every_preset():
    """docs/algorithms.md's preset table has a row per preset file in config/algorithm/, each citing an arXiv paper."""
    root = Path(__file__).resolve().parents[3]
    presets = sorted(path.stem for path in (root / "config" / "algorithm").glob("*.yaml"))
    assert presets == sorted(PRESETS)
    section = (root / "docs" / "algorithms.md").read_text().split("## Algorithm presets", 1)[1].split("\n## ", 1)[0]
    rows = {match.group(1): line for line in section.splitlines() if (match := re.match(r"\| `(\w+)` \|", line))}
    assert sorted(rows) == presets
    for preset, line in rows.items():
        assert re.search(r"arXiv \d{4}\.\d{5}", line), preset
