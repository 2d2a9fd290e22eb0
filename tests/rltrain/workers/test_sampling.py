"""Sampling is the config's alone (rltrain/workers/sampling.py): the end-of-sequence set of a checkpoint (lists in
generation_config.json, as Qwen3 / Qwen2.5 / Llama-3.x ship), the checkpoint's sampling defaults ignored by the hf
engine, response masks ending at the first of any end id, and the job's refusal of off-policy settings whose rollout
log-probs a reshaped sampling distribution would bias.

    .venv/bin/python -m pytest tests/rltrain/workers/test_sampling.py -q   # ~15 s on 2 cores
"""

import json
import shutil
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from rltrain.config import ConfigError
from rltrain.embedded.tokenizer import build_char_tokenizer
from rltrain.job import load_job_config
from rltrain.workers.rollout import RolloutConfig, RolloutWorker
from rltrain.workers.sampling import EndOfSequence, distortions, end_of_sequence, response_mask_and_truncation
from tests.rltrain.tiny_job import compose, save_tiny_policy


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_policy(tmp_path_factory.mktemp("policy"), build_char_tokenizer())


def _with_generation_config(model_dir, path, **values) -> str:
    shutil.copytree(model_dir, path)
    (path / "generation_config.json").write_text(json.dumps(values))
    return str(path)


def _generate(model_dir, **config):
    worker = RolloutWorker(RolloutConfig(n=4, max_new_tokens=12, torch_threads=1, **config), model_dir, "float32",
                           None)
    prompts = torch.tensor([[5, 6, 7, 8], [0, 9, 10, 11], [0, 0, 12, 13]])
    return worker.engine, worker.generate(prompts, (prompts != 0).long(), 4, 1.0, seed=11)


def test_end_of_sequence_merges_every_source_in_order():
    tokenizer = SimpleNamespace(eos_token_id=7, pad_token_id=None)
    eos = EndOfSequence.of({"eos_token_id": [5, 3]}, {"eos_token_id": 3}, tokenizer)
    assert eos == EndOfSequence((5, 3, 7), 5)   # no pad anywhere: the first end id
    assert EndOfSequence.of({"eos_token_id": 4, "pad_token_id": 9}, {}, tokenizer) == EndOfSequence((4, 7), 9)
    assert EndOfSequence.of({}, {"eos_token_id": [1, 2]}, SimpleNamespace(eos_token_id=None, pad_token_id=0)) \
        == EndOfSequence((1, 2), 0)
    with pytest.raises(ValueError, match="names no end-of-sequence token"):
        EndOfSequence.of({}, {}, SimpleNamespace(eos_token_id=None, pad_token_id=None))


def test_response_mask_ends_at_the_first_of_any_end_id():
    ids = torch.tensor([[4, 9, 2, 9], [4, 3, 4, 9], [4, 4, 4, 4], [9, 3, 3, 3]])
    mask, truncated = response_mask_and_truncation(ids, [9, 3])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert truncated.tolist() == [False, False, True, False]
    assert response_mask_and_truncation(ids, 3)[0].tolist() == [[1] * 4, [1, 1, 0, 0], [1] * 4, [1, 1, 0, 0]]


def test_the_checkpoints_generation_defaults_are_ignored(model_dir, tmp_path):
    """Qwen2.5-Instruct-like defaults (repetition penalty, top_k, top_p, temperature) and others a checkpoint may
    carry (no repeated tokens, suppressed tokens) change nothing: the same seed draws the same responses as from
    the checkpoint without them."""
    tokenizer = build_char_tokenizer()
    _, plain = _generate(model_dir)
    common = Counter(plain["response_ids"][plain["response_mask"] != 0].tolist()).most_common(2)
    shipped = _with_generation_config(model_dir, tmp_path / "shipped", eos_token_id=tokenizer.eos_token_id,
                                      do_sample=True, repetition_penalty=1.3, top_k=2, top_p=0.5, temperature=0.3,
                                      no_repeat_ngram_size=1, suppress_tokens=[t for t, _ in common])
    _, with_defaults = _generate(shipped)
    assert torch.equal(plain["response_ids"], with_defaults["response_ids"])


def test_responses_end_at_any_id_of_an_eos_list(model_dir, tmp_path):
    """A generation config listing two end ids: the responses stop at either (the second being a token the
    policy samples often, so some responses end there), masks included."""
    tokenizer = build_char_tokenizer()
    _, plain = _generate(model_dir)
    common = Counter(plain["response_ids"][plain["response_mask"] != 0].tolist())
    second = next(t for t, _ in common.most_common() if t != tokenizer.eos_token_id)
    listed = _with_generation_config(model_dir, tmp_path / "listed", eos_token_id=[tokenizer.eos_token_id, second])
    engine, batch = _generate(listed)
    assert engine.eos_token_ids == [tokenizer.eos_token_id, second]
    assert end_of_sequence(listed).ids == (tokenizer.eos_token_id, second)
    ends = 0
    for ids, mask, truncated in zip(batch["response_ids"], batch["response_mask"], batch["truncated"]):
        kept = ids[mask.bool()].tolist()
        stops = [i for i, t in enumerate(kept) if t in (tokenizer.eos_token_id, second)]
        assert stops == ([] if truncated else [len(kept) - 1])
        ends += bool(kept) and kept[-1] == second
    assert ends > 0


def test_distortions_name_the_keys():
    neutral = RolloutConfig()
    assert distortions(neutral) == []
    config = RolloutConfig(top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.05)
    assert distortions(config) == ["rollout.top_p=0.9", "rollout.top_k=20", "rollout.min_p=0.05",
                                   "rollout.repetition_penalty=1.05"]


def test_old_logprobs_auto_follows_the_mode():
    assert load_job_config(compose()).old_logprobs == "update"   # sync, one optimizer step: the update's forward
    for overrides in (("actor.ppo_epochs=2",), ("actor.mini_batch_size=8",), ("algorithm=reinforce_pp",),
                      ("algorithm.rollout_correction.mode=truncate",), ("algorithm.old_logprobs=actor",)):
        assert load_job_config(compose(*overrides)).old_logprobs == "actor", overrides
    full = compose("data.batch_size=4", "rollout.n=2", "actor.mini_batch_size=8")   # a mini-batch of the whole batch
    assert load_job_config(full).old_logprobs == "update"
    for mode in ("one_step_off", "async"):
        job = load_job_config(compose(f"trainer.mode={mode}", "rollout.placement=separate"))
        assert job.old_logprobs == "rollout" and job.algorithm.old_logprobs == "auto"
    for correction in ("algorithm.loss.decoupled=true", "algorithm.rollout_correction.mode=truncate"):
        assert load_job_config(compose("trainer.mode=async", correction)).old_logprobs == "actor"
    assert load_job_config(compose("trainer.mode=async", "algorithm.old_logprobs=actor")).old_logprobs == "actor"


@pytest.mark.parametrize("overrides, message", [
    (("trainer.mode=one_step_off", "rollout.placement=separate"), r"'update' needs trainer.mode=sync"),
    (("actor.ppo_epochs=2",), r"'update' needs an update of one optimizer step: actor.ppo_epochs=1 \(got 2\)"),
    (("actor.mini_batch_size=8",), r".* at least data.batch_size × rollout.n = 512 \(got 8\)"),
    (("algorithm=reinforce_pp",), r".*, but algorithm.kl_in_reward=true reads them before it"),
], ids=["mode", "epochs", "mini-batch", "kl-in-reward"])
def test_old_logprobs_update_is_refused_where_pi_old_is_not_the_trained_policy(overrides, message):
    with pytest.raises(ConfigError, match=rf"^algorithm.old_logprobs: {message}"):
        load_job_config(compose("algorithm.old_logprobs=update", *overrides))


@pytest.mark.parametrize("overrides, key", [
    (("trainer.mode=one_step_off", "rollout.top_p=0.9"), "rollout.top_p"),
    (("algorithm.old_logprobs=rollout", "rollout.top_k=20"), "rollout.top_k"),
    (("algorithm.rollout_correction.mode=truncate", "rollout.repetition_penalty=1.05"), "rollout.repetition_penalty"),
    (("algorithm.loss.decoupled=true", "rollout.min_p=0.1"), "rollout.min_p"),
], ids=["auto-top_p", "rollout-top_k", "tis-penalty", "decoupled-min_p"])
def test_reshaped_sampling_with_a_behaviour_reader_is_refused(overrides, key):
    with pytest.raises(ConfigError, match=rf"^{key}: .* reshapes the sampling distribution"):
        load_job_config(compose(*overrides))


def test_reshaped_sampling_without_a_reader_is_accepted():
    for overrides in (("rollout.top_p=0.9",), ("trainer.mode=async", "rollout.top_k=5", "algorithm.old_logprobs=actor")):
        load_job_config(compose(*overrides))
