"""Checkpoints without Ray: a save that dies half-way leaves the previous checkpoint the newest complete one;
resume=auto's choice passes over incomplete checkpoint directories and names them; two processes saving the same step
into one directory never share a temporary; the controller's RNG states (Python, numpy, torch CPU; CUDA where
initialised) survive a JSON round trip exactly, and an actor resumed from a checkpoint written and read as the trainer
does continues bit for bit, in fp32 and in bf16 with mixed precision (the checkpoint holds the fp32 masters), full
fine-tuning and LoRA, and from a policy saved in shards (over save_pretrained's max_shard_size); a shard missing makes
the checkpoint incomplete. The kill of a real run and its
resume are in tests/rltrain/test_trainer_e2e.py."""

import json
import os
import random

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from tensordict import TensorDict

from rltrain.algorithms.advantages import compute_advantages
from rltrain.algorithms.config import LossConfig
from rltrain.checkpoint import (
    latest_checkpoint, load_checkpoint, newest_complete_checkpoint, rng_state, save_checkpoint, set_rng_state,
)
from rltrain.output_dir import remove_unfinished
from rltrain.workers.actor import ActorConfig, ActorWorker
from rltrain.workers.lora import LoraConfig
from rltrain.workers.policy import DTYPES, load_tokenizer
from tests.rltrain.tiny_job import save_tiny_policy


class _Tokenizer:
    def save_pretrained(self, path):
        (path / "tokenizer.json").write_text("{}")


def _save(output_dir, step, weight: float, fail=False, during=None):
    """save_checkpoint as the trainer calls it; `during()` runs once the policy's weights are written."""
    def save_policy(path):
        save_file({"w": torch.full((2, 3), weight)}, f"{path}/model.safetensors")
        if fail:
            raise KeyboardInterrupt("killed mid-save")
        if during is not None:
            during()

    return save_checkpoint(str(output_dir), step, save_policy, {"state": {0: {"step": torch.tensor(step)}}},
                           _Tokenizer(), {"sampler": {"epoch": 0, "index": 4 * step}})


def _checkpoint_names(output_dir) -> list[str]:
    return sorted(p.name for p in (output_dir / "checkpoints").iterdir())


def test_a_save_killed_half_way_leaves_the_previous_checkpoint(tmp_path):
    _save(tmp_path, 1, 1.0)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 2, 2.0, fail=True)
    assert _checkpoint_names(tmp_path) == ["step_000001"]  # a save that raised removed its temporary
    killed = tmp_path / "checkpoints" / ".tmp_step_000002_otherhost_123"  # what a SIGKILL mid-save leaves
    (killed / "hf").mkdir(parents=True)
    (killed / "trainer_state.json").write_text('{"step": 2}')
    assert latest_checkpoint(str(tmp_path)).name == "step_000001"
    model, optimizer, state = load_checkpoint(latest_checkpoint(str(tmp_path)))
    assert torch.equal(model["w"], torch.full((2, 3), 1.0))
    assert optimizer["state"][0]["step"].item() == 1 and state["step"] == 1 and state["sampler"]["index"] == 4

    assert remove_unfinished(tmp_path) == [killed]  # the next run, holding the lock, clears it
    _save(tmp_path, 2, 2.0)
    assert _checkpoint_names(tmp_path) == ["step_000001", "step_000002"]
    assert latest_checkpoint(str(tmp_path)).name == "step_000002"


def test_resume_auto_takes_the_newest_complete_checkpoint_and_names_the_incomplete_ones(tmp_path):
    """What two runs sharing a directory left (issue 53): a step directory without its weights, one whose
    trainer_state.json was cut short, one without it; the newest complete checkpoint is older than all three."""
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, float(step))
    root = tmp_path / "checkpoints"
    (root / "step_000002" / "hf" / "model.safetensors").unlink()
    (root / "step_000003" / "trainer_state.json").write_text('{"step": 3, "rng": {"python": [1, 2')
    (root / "step_000004" / "trainer_state.json").unlink()
    path, skipped = newest_complete_checkpoint(str(tmp_path))
    assert path.name == "step_000001" and latest_checkpoint(str(tmp_path)) == path
    assert [(p.name, reason.split(" (")[0]) for p, reason in skipped] == [
        ("step_000004", "trainer_state.json is missing"), ("step_000003", "trainer_state.json is unreadable"),
        ("step_000002", "hf/model.safetensors is missing")]
    with pytest.raises(FileNotFoundError, match="step_000002 is incomplete: hf/model.safetensors is missing"):
        load_checkpoint(root / "step_000002")
    _save(tmp_path, 2, 2.5)  # a save of an incomplete step replaces it
    assert latest_checkpoint(str(tmp_path)).name == "step_000002"
    assert torch.equal(load_checkpoint(root / "step_000002")[0]["w"], torch.full((2, 3), 2.5))


def test_two_processes_saving_the_same_step_never_share_a_temporary(tmp_path, monkeypatch):
    """Another process (another pid) saves step 1 completely while this one is half-way through its own save of step
    1: both complete, and the checkpoint is whole (the later save's)."""
    def other_process_saves():
        with monkeypatch.context() as other:
            other.setattr(os, "getpid", lambda: 4_000_000)
            _save(tmp_path, 1, 7.0)

    _save(tmp_path, 1, 1.0, during=other_process_saves)
    assert _checkpoint_names(tmp_path) == ["step_000001"]
    model, _, state = load_checkpoint(latest_checkpoint(str(tmp_path)))
    assert torch.equal(model["w"], torch.full((2, 3), 1.0)) and state["step"] == 1


def _draws():
    return (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist(),
            torch.rand(2, device="cuda").tolist() if torch.cuda.is_available() else None)


def test_rng_states_round_trip_through_json():
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    np.random.standard_normal()  # leaves numpy's cached second Gaussian pending: part of the state
    if torch.cuda.is_available():
        torch.cuda.init()
    saved = json.loads(json.dumps(rng_state()))
    assert saved["numpy"]["has_gauss"] == 1
    assert ("cuda" in saved) == torch.cuda.is_available()
    expected = _draws()
    assert _draws() != expected
    set_rng_state(saved)
    assert _draws() == expected


def test_states_saved_before_numpy_and_cuda_still_restore():
    saved = json.loads(json.dumps(rng_state()))
    old = {key: saved[key] for key in ("python", "python_version", "torch")}
    expected = (random.random(), torch.rand(2).tolist())
    set_rng_state(old)
    assert (random.random(), torch.rand(2).tolist()) == expected


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return save_tiny_policy(tmp_path_factory.mktemp("policy"))


def _batch(vocab: int, step: int) -> TensorDict:
    """Step `step`'s batch: 3 prompts × 4 responses of random tokens, GRPO advantages."""
    generator = torch.Generator().manual_seed(step)
    mask = torch.ones(12, 6, dtype=torch.long)
    mask[5, 3:] = 0
    batch = TensorDict({"prompt_ids": torch.randint(4, vocab, (12, 5), generator=generator),
                        "prompt_mask": torch.ones(12, 5, dtype=torch.long),
                        "response_ids": torch.randint(4, vocab, (12, 6), generator=generator), "response_mask": mask,
                        "group_ids": torch.arange(12) // 4}, batch_size=[12])
    batch["advantages"] = compute_advantages("grpo", torch.rand(12, generator=generator), mask, batch["group_ids"])
    return batch


@pytest.mark.parametrize("dtype, lora", [("float32", 0), ("bfloat16", 0), ("bfloat16", 4)],
                         ids=["fp32", "bf16-mixed", "bf16-mixed-lora"])
def test_an_actor_resumed_from_a_checkpoint_continues_bit_exactly(tmp_path, policy_dir, dtype, lora):
    """Three updates straight through, against two, a checkpoint (save_checkpoint with the actor's save_pretrained and
    optimizer state; load_checkpoint into a fresh actor) and the third: the trained weights (under bf16 the fp32
    masters, which the checkpoint's hf/ holds in fp32) and the model's own bf16 ones equal bit for bit."""
    def actor() -> ActorWorker:
        config = ActorConfig(lr=1e-3, torch_threads=1, micro_batch_size=5, lora=LoraConfig(rank=lora, alpha=8.0))
        return ActorWorker(config, LossConfig(), policy_dir, dtype, None, temperature=1.0, total_steps=3)

    def train(worker: ActorWorker, steps) -> None:
        for step in steps:
            batch = _batch(worker.model.config.vocab_size, step)
            batch["old_logprobs"] = worker.compute_logprobs(batch)
            worker.update(batch, step)

    through, first = actor(), actor()
    train(through, [1, 2, 3])
    train(first, [1, 2])
    path = save_checkpoint(str(tmp_path), 2, first.save_pretrained, first.optimizer_state(),
                           load_tokenizer(policy_dir), {"lr_scheduler": first.lr_scheduler_state()})
    model_state, optimizer_state, state = load_checkpoint(path)
    assert model_state and all(tensor.dtype == torch.float32 for tensor in model_state.values())
    resumed = actor()
    resumed.load_checkpoint(model_state, optimizer_state)
    resumed.load_lr_scheduler_state(state["lr_scheduler"])
    train(resumed, [3])
    expected = through.state_dict()
    for name, tensor in resumed.state_dict().items():
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name
    expected = dict(through.model.named_parameters())
    for name, param in resumed.model.named_parameters():
        assert param.dtype == DTYPES[dtype], name
        assert torch.equal(param, expected[name]), name


def test_a_policy_saved_in_shards_resumes_and_a_missing_shard_is_named(tmp_path, policy_dir):
    """save_pretrained shards a policy above max_shard_size (50 GB by default: 14B parameters as fp32 masters);
    load_checkpoint reads every shard its index names, and a checkpoint missing one is incomplete, naming it."""
    actor = ActorWorker(ActorConfig(torch_threads=1), LossConfig(), policy_dir, "float32", None, temperature=1.0)

    def save_in_shards(path):
        actor.model.save_pretrained(path, max_shard_size="20KB")

    path = save_checkpoint(str(tmp_path), 1, save_in_shards, actor.optimizer_state(), load_tokenizer(policy_dir), {})
    shards = sorted(p.name for p in (path / "hf").glob("model-*.safetensors"))
    assert len(shards) > 2 and not (path / "hf" / "model.safetensors").exists()
    model_state, _, state = load_checkpoint(path)
    expected = actor.model.state_dict()
    assert state["step"] == 1 and set(model_state) <= set(expected) and len(model_state) >= len(expected) - 1
    for name, tensor in model_state.items():
        assert torch.equal(tensor, expected[name]), name
    (path / "hf" / shards[1]).unlink()
    assert newest_complete_checkpoint(str(tmp_path)) == (None, [(path, f"hf/{shards[1]} is missing")])
