"""Checkpoints without Ray: a save that dies half-way leaves the previous checkpoint the newest complete one;
resume=auto's choice passes over incomplete checkpoint directories (a data file or metadata of model/ or optimizer/
missing, trainer_state.json cut short or missing, the layout before sharded checkpoints) and names them; two
processes saving the same step into one directory never share a temporary; the controller's RNG states (Python,
numpy, torch CPU; CUDA where initialised) survive a JSON round trip exactly; and an actor resumed from a checkpoint
written and read as the trainer does continues bit for bit, in fp32 and in bf16 with mixed precision (the checkpoint
holds the fp32 masters), full fine-tuning and LoRA (the adapters alone), with hf/ holding the config and tokenizer,
and with trainer.save_hf the weights too (sharded over max_shard_size: a shard missing makes the checkpoint
incomplete). Bad checkpoints' errors are in test_distributed_checkpoint.py, other world sizes in
workers/test_fsdp_checkpoint.py; the kill of a real run and its resume in test_trainer_e2e.py."""

import json
import os
import random

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from rltrain.algorithms.advantages import compute_advantages
from rltrain.algorithms.config import LossConfig
from rltrain.checkpoint import (
    holds_adapters, latest_checkpoint, load_trainer_state, newest_complete_checkpoint, rng_state, save_checkpoint,
    set_rng_state,
)
from rltrain.distributed_checkpoint import read_state, save_state
from rltrain.output_dir import remove_unfinished
from rltrain.workers.actor import ActorWorker
from rltrain.workers.actor_config import ActorConfig
from rltrain.workers.lora import LoraConfig
from rltrain.workers.policy import DTYPES, load_tokenizer
from tests.rltrain.tiny_job import save_tiny_policy


class _Tokenizer:
    def save_pretrained(self, path):
        (path / "tokenizer.json").write_text("{}")


def _save(output_dir, step, weight: float, fail=False, during=None):
    """save_checkpoint as the trainer calls it, the actor's part a one-tensor model and optimizer state; `during()`
    runs once they are written."""
    def save_state_of_actor(path):
        save_state({"w": torch.full((2, 3), weight)}, path / "model")
        if fail:
            raise KeyboardInterrupt("killed mid-save")
        save_state({"w.step": torch.tensor(float(step))}, path / "optimizer")
        if during is not None:
            during()

    model_dir = output_dir / "model_dir"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text('{"model_type": "qwen3"}')
    return save_checkpoint(str(output_dir), step, save_state_of_actor, str(model_dir), _Tokenizer(),
                           {"sampler": {"epoch": 0, "index": 4 * step}})


def _weight(path) -> torch.Tensor:
    return read_state(path / "model")["w"]


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
    newest = latest_checkpoint(str(tmp_path))
    assert newest.name == "step_000001"
    state = load_trainer_state(newest)
    assert torch.equal(_weight(newest), torch.full((2, 3), 1.0))
    assert read_state(newest / "optimizer")["w.step"].item() == 1 and state["step"] == 1
    assert state["sampler"]["index"] == 4
    assert {p.name for p in (newest / "hf").iterdir()} == {"config.json", "tokenizer.json"}  # no weights by default

    assert remove_unfinished(tmp_path) == [killed]  # the next run, holding the lock, clears it
    _save(tmp_path, 2, 2.0)
    assert _checkpoint_names(tmp_path) == ["step_000001", "step_000002"]
    assert latest_checkpoint(str(tmp_path)).name == "step_000002"


def test_resume_auto_takes_the_newest_complete_checkpoint_and_names_the_incomplete_ones(tmp_path):
    """What two runs sharing a directory left (issue 53), and an older rltrain: a step directory without a rank's
    data file, one without the optimizer's metadata, one whose trainer_state.json was cut short, one without it, one
    in the layout before sharded checkpoints; the newest complete checkpoint is older than all five."""
    for step in (1, 2, 3, 4, 5):
        _save(tmp_path, step, float(step))
    root = tmp_path / "checkpoints"
    (root / "step_000002" / "model" / "__0_0.distcp").unlink()
    (root / "step_000003" / "optimizer" / ".metadata").unlink()
    (root / "step_000004" / "trainer_state.json").write_text('{"step": 4, "rng": {"python": [1, 2')
    (root / "step_000005" / "trainer_state.json").unlink()
    former = root / "step_000006"   # hf/ weights + optimizer.pt
    (former / "hf").mkdir(parents=True)
    (former / "hf" / "model.safetensors").write_bytes(b"weights")
    (former / "optimizer.pt").write_bytes(b"state")
    (former / "trainer_state.json").write_text('{"step": 6}')
    path, skipped = newest_complete_checkpoint(str(tmp_path))
    assert path.name == "step_000001" and latest_checkpoint(str(tmp_path)) == path
    assert [(p.name, reason.split(" (")[0]) for p, reason in skipped] == [
        ("step_000006", "it has the layout before sharded checkpoints"),
        ("step_000005", "trainer_state.json is missing"), ("step_000004", "trainer_state.json is unreadable"),
        ("step_000003", "optimizer/.metadata is missing"), ("step_000002", "model/__0_0.distcp is missing")]
    assert f"model.path={former / 'hf'}" in skipped[0][1]
    with pytest.raises(FileNotFoundError, match="step_000002 is incomplete: model/__0_0.distcp is missing"):
        load_trainer_state(root / "step_000002")
    (root / "step_000001" / "model" / "__0_0.distcp").write_bytes(b"cut")
    assert newest_complete_checkpoint(str(tmp_path))[1][-1][1].startswith("model/__0_0.distcp is cut short (3 of ")
    _save(tmp_path, 2, 2.5)  # a save of an incomplete step replaces it
    assert latest_checkpoint(str(tmp_path)).name == "step_000002"
    assert torch.equal(_weight(root / "step_000002"), torch.full((2, 3), 2.5))


def test_two_processes_saving_the_same_step_never_share_a_temporary(tmp_path, monkeypatch):
    """Another process (another pid) saves step 1 completely while this one is half-way through its own save of step
    1: both complete, and the checkpoint is whole (the later save's)."""
    def other_process_saves():
        with monkeypatch.context() as other:
            other.setattr(os, "getpid", lambda: 4_000_000)
            _save(tmp_path, 1, 7.0)

    _save(tmp_path, 1, 1.0, during=other_process_saves)
    assert _checkpoint_names(tmp_path) == ["step_000001"]
    newest = latest_checkpoint(str(tmp_path))
    assert torch.equal(_weight(newest), torch.full((2, 3), 1.0)) and load_trainer_state(newest)["step"] == 1


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
    """Three updates straight through, against two, a checkpoint (save_checkpoint with the actor's save_checkpoint;
    load_checkpoint into a fresh actor) and the third: the trained weights (under bf16 the fp32 masters, which the
    checkpoint holds in fp32) and the model's own bf16 ones equal bit for bit. With LoRA the checkpoint holds the
    adapters alone, and hf/ an adapter_config.json naming the base."""
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
    path = save_checkpoint(str(tmp_path), 2, lambda p: first.save_checkpoint(str(p)), policy_dir,
                           load_tokenizer(policy_dir), {"lr_scheduler": first.lr_scheduler_state()},
                           LoraConfig(rank=lora, alpha=8.0))
    saved = read_state(path / "model")
    assert saved and all(tensor.dtype == torch.float32 for tensor in saved.values())
    assert holds_adapters(path) == bool(lora) and all((".lora_" in name) == bool(lora) for name in saved)
    hf = {p.name for p in (path / "hf").iterdir()}
    assert {"config.json", "tokenizer.json"} <= hf and ("adapter_config.json" in hf) == bool(lora)
    assert not any(name.endswith(".safetensors") for name in hf)
    state = load_trainer_state(path)
    resumed = actor()
    resumed.load_checkpoint(str(path))
    resumed.load_lr_scheduler_state(state["lr_scheduler"])
    train(resumed, [3])
    expected = through.state_dict()
    for name, tensor in resumed.state_dict().items():
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name
    expected = dict(through.model.named_parameters())
    for name, param in resumed.model.named_parameters():
        assert param.dtype == DTYPES[dtype], name
        assert torch.equal(param, expected[name]), name


def test_save_hf_adds_the_weights_and_a_missing_shard_is_named(tmp_path, policy_dir):
    """trainer.save_hf: hf/ also holds the policy, which transformers loads with the trained weights; a policy over
    save_pretrained's max_shard_size (50 GB: here 20 KB) is saved in shards with an index, and a checkpoint missing
    one of them is incomplete."""
    from transformers import AutoModelForCausalLM

    actor = ActorWorker(ActorConfig(torch_threads=1), LossConfig(), policy_dir, "float32", None, temperature=1.0)
    path = save_checkpoint(str(tmp_path), 1, lambda p: actor.save_checkpoint(str(p), save_hf=True), policy_dir,
                           load_tokenizer(policy_dir), {})
    loaded = AutoModelForCausalLM.from_pretrained(path / "hf").state_dict()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in actor.state_dict().items())

    def save_with_hf_shards(path):
        actor.save_checkpoint(str(path))
        actor.model.save_pretrained(path / "hf", max_shard_size="20KB")

    path = save_checkpoint(str(tmp_path), 2, save_with_hf_shards, policy_dir, load_tokenizer(policy_dir), {})
    shards = sorted(p.name for p in (path / "hf").glob("model-*.safetensors"))
    assert len(shards) > 2 and not (path / "hf" / "model.safetensors").exists()
    assert newest_complete_checkpoint(str(tmp_path)) == (path, [])
    (path / "hf" / shards[1]).unlink()
    assert newest_complete_checkpoint(str(tmp_path))[1] == [(path, f"hf/{shards[1]} is missing")]
