"""rltrain/distributed_checkpoint.py in one process: states round-trip exactly (dtypes and shapes kept); `.metadata`
is read by a restricted unpickler, which refuses a pickle calling anything else (the call never runs); and bad input
fails with one line naming the path: no metadata, unreadable metadata, values that are not tensors, and a checkpoint
that does not fit the model (another architecture, another size, LoRA adapters into a full model) listing what
differs. Several ranks: workers/test_fsdp_checkpoint.py."""

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from rltrain.algorithms.config import LossConfig
from rltrain.distributed_checkpoint import (
    CheckpointError, check_visible_on_every_rank, load_state, read_metadata, read_state, save_state,
    unreadable_reason,
)
from rltrain.workers.actor import ActorWorker
from rltrain.workers.actor_config import ActorConfig
from rltrain.workers.lora import LoraConfig
from tests.rltrain.tiny_job import save_tiny_policy


def test_states_round_trip_exactly(tmp_path):
    state = {"a.weight": torch.randn(3, 4), "a.step": torch.tensor(7.0), "b": torch.randn(5).bfloat16(),
             "ids": torch.arange(6).reshape(2, 3)}
    save_state(state, tmp_path / "state")
    assert unreadable_reason(tmp_path / "state") is None
    read = read_state(tmp_path / "state")
    assert read.keys() == state.keys()
    for name, tensor in state.items():
        assert read[name].dtype == tensor.dtype and torch.equal(read[name], tensor), name
    into = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
    load_state(into, tmp_path / "state", "the test state")
    assert all(torch.equal(into[name], tensor) for name, tensor in state.items())


class _Remove:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.remove, (self.path,)


def test_metadata_is_unpickled_with_an_allow_list(tmp_path):
    canary = tmp_path / "canary"
    canary.write_text("still here")
    directory = tmp_path / "state"
    directory.mkdir()
    (directory / ".metadata").write_bytes(pickle.dumps(_Remove(str(canary))))
    with pytest.raises(CheckpointError, match=r"\.metadata is unreadable \(UnpicklingError: posix\.remove is not "
                                              r"part of a checkpoint's metadata\)"):
        read_metadata(directory)
    assert canary.read_text() == "still here"
    (directory / ".metadata").write_bytes(b"\x80\x04 cut")
    assert unreadable_reason(directory).startswith(".metadata is unreadable (")
    assert unreadable_reason(tmp_path / "nothing") == ".metadata is missing"
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'nothing'}: no .metadata"):
        read_state(tmp_path / "nothing")


@pytest.mark.filterwarnings("ignore:torch.distributed is")
def test_values_that_are_not_tensors_are_refused(tmp_path):
    dcp.save({"w": torch.ones(2), "lr": 0.1}, checkpoint_id=str(tmp_path / "state"), no_dist=True)
    with pytest.raises(CheckpointError, match=r"holds values that are not tensors \(lr\)"):
        read_state(tmp_path / "state")


def test_a_state_that_does_not_fit_lists_what_differs(tmp_path):
    save_state({"a": torch.ones(2, 3), "b": torch.ones(4), "c": torch.ones(1)}, tmp_path / "state")
    into = {"a": torch.zeros(3, 2), "b": torch.zeros(4), "d": torch.zeros(1)}
    with pytest.raises(CheckpointError) as err:
        load_state(into, tmp_path / "state", "the model")
    assert str(err.value) == (f"{tmp_path / 'state'} does not fit the model of this run (another model.path or "
                              "actor.lora?); tensors 1 missing from it: d; 1 it holds that this run lacks: c; "
                              "1 of other shapes (checkpoint vs this run): a (2, 3) vs (3, 2)")
    assert torch.equal(into["b"], torch.zeros(4))   # nothing was read


def test_a_single_process_sees_its_own_directory(tmp_path):
    check_visible_on_every_rank(tmp_path)
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'elsewhere'} is not visible to rank 0 on "):
        check_visible_on_every_rank(tmp_path / "elsewhere")


def _actor(policy_dir, lora: int = 0) -> ActorWorker:
    return ActorWorker(ActorConfig(torch_threads=1, lora=LoraConfig(rank=lora, alpha=8.0)), LossConfig(), policy_dir,
                       "float32", None, temperature=1.0)


def test_an_actor_refuses_a_checkpoint_of_another_model(tmp_path):
    """Another hidden size: every weight's shape differs; LoRA adapters into a full model: none of its weights is
    there. Either way CheckpointError names the directory before anything is read."""
    small, large = save_tiny_policy(tmp_path / "small"), save_tiny_policy(tmp_path / "large", hidden_size=64)
    for name, actor in (("small", _actor(small)), ("lora", _actor(small, lora=4))):
        (tmp_path / name).mkdir(exist_ok=True)
        actor.save_checkpoint(str(tmp_path / name))
    target = _actor(large)
    before = target.state_dict()
    with pytest.raises(CheckpointError, match=rf"^{tmp_path / 'small' / 'model'} does not fit the model of this "
                                              r"run .* tensors \d+ of other shapes \(checkpoint vs this run\): "
                                              r"lm_head.weight \(\d+, 32\) vs \(\d+, 64\)"):
        target.load_checkpoint(str(tmp_path / "small"))
    with pytest.raises(CheckpointError, match=r"tensors 25 missing from it: .*; 28 it holds that this run lacks: "
                                              r"model.layers.0.*lora_A"):
        _actor(small).load_checkpoint(str(tmp_path / "lora"))
    assert all(torch.equal(tensor, before[name]) for name, tensor in target.state_dict().items())
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'nothing'} is not visible to rank 0"):
        target.load_checkpoint(str(tmp_path / "nothing"))
