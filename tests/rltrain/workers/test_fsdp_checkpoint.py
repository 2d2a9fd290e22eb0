"""Sharded checkpoints across world sizes, over gloo (torch.multiprocessing, no Ray): an FSDP2 actor of 2 ranks makes
2 updates and saves, each rank writing its own shards; FSDP2 actors of 4 and of 1 rank and the single process (no
process group) load that checkpoint, and hold exactly its weights and optimizer state (gathered whole, bit for bit);
then each makes a third update like the 2 ranks' (to summation order: the saved AdamW step counts and moments are in
use). `python -m rltrain.export` makes an HF model with the saved weights from the 2 ranks' shards. A rank that
cannot see the checkpoint directory makes every rank raise, naming it. The single process's checkpoint loading into
2 ranks is in test_fsdp.py; the trainer's resume on another world size in tests/rltrain/test_multinode.py. About 1.5
minutes on 2 cores, mostly 7 processes starting."""

import copy
import socket

import pytest
import torch
import torch.multiprocessing as mp
from tensordict import TensorDict

from rltrain.algorithms.advantages import compute_advantages
from rltrain.algorithms.config import LossConfig
from rltrain.checkpoint import MODEL_DIR, OPTIMIZER_DIR, write_hf_files
from rltrain.distributed_checkpoint import CheckpointError
from rltrain.export import export
from rltrain.workers.actor import ActorWorker, FSDPActorWorker
from rltrain.workers.actor_config import ActorConfig
from rltrain.workers.policy import load_tokenizer
from tests.rltrain.tiny_job import save_tiny_policy

SAVED_WORLD, LOADED_WORLDS = 2, (4, 1)


def _config(strategy: str) -> ActorConfig:
    return ActorConfig(lr=1e-2, micro_batch_size=3, torch_threads=1, strategy=strategy)


def _batches(model_dir: str) -> dict[int, TensorDict]:
    """Steps 1-3's batches: 10 random responses in groups of 5, old log-probs from the initial policy."""
    initial = ActorWorker(_config("single"), LossConfig(), model_dir, "float32", None, temperature=1.0)
    vocab, batches = initial.model.config.vocab_size, {}
    for step in (1, 2, 3):
        generator = torch.Generator().manual_seed(step)
        mask = torch.ones(10, 6, dtype=torch.long)
        mask[3, 2:] = 0
        batch = TensorDict({"prompt_ids": torch.randint(4, vocab, (10, 5), generator=generator),
                            "prompt_mask": torch.ones(10, 5, dtype=torch.long),
                            "response_ids": torch.randint(4, vocab, (10, 6), generator=generator),
                            "response_mask": mask, "group_ids": torch.arange(10) // 5}, batch_size=[10])
        batch["advantages"] = compute_advantages("grpo", torch.rand(10, generator=generator), mask,
                                                 batch["group_ids"])
        batch["old_logprobs"] = initial.compute_logprobs(batch)
        batches[step] = batch
    return batches


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _whole(actor) -> dict:
    """The weights and optimizer state gathered whole (collectives: every rank calls it; rank 0 gets them), copied:
    the optimizer state's step counts are the live tensors, which the next update changes."""
    return copy.deepcopy({"weights": actor.state_dict(), "optimizer": actor.optimizer_state()})


def _save_main(rank, port, model_dir, batches, root):
    actor = FSDPActorWorker(rank, SAVED_WORLD, "127.0.0.1", port, _config("fsdp2"), LossConfig(), model_dir,
                            "float32", None, 1.0)
    for step in (1, 2):
        actor.update(batches[step], step)
    actor.save_checkpoint(f"{root}/checkpoint")
    saved = _whole(actor)
    actor.update(batches[3], 3)
    result = {"saved": saved, "after": _whole(actor)}
    if rank == 0:
        torch.save(result, f"{root}/world{SAVED_WORLD}.pt")


def _load_main(rank, world, port, model_dir, batches, root):
    actor = FSDPActorWorker(rank, world, "127.0.0.1", port, _config("fsdp2"), LossConfig(), model_dir, "float32",
                            None, 1.0)
    result = {}
    if world > 1:   # the last rank does not see the directory: every rank raises, naming it, and none hangs
        try:
            actor.load_checkpoint(f"{root}/checkpoint" if rank < world - 1 else f"{root}/not_mounted")
        except CheckpointError as err:
            result["error"] = str(err)
    actor.load_checkpoint(f"{root}/checkpoint")
    result["loaded"] = _whole(actor)
    actor.update(batches[3], 3)
    result["after"] = _whole(actor)
    if rank == 0:
        torch.save(result, f"{root}/world{world}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{world size or 'single': what it saved or loaded, and its state after update 3}."""
    root = tmp_path_factory.mktemp("fsdp_checkpoint")
    model_dir = save_tiny_policy(root / "policy")
    batches = _batches(model_dir)
    (root / "checkpoint").mkdir()   # as the trainer makes it (the checkpoint's temporary) before the ranks save
    mp.spawn(_save_main, args=(_free_port(), model_dir, batches, str(root)), nprocs=SAVED_WORLD, join=True)
    for world in LOADED_WORLDS:
        mp.spawn(_load_main, args=(world, _free_port(), model_dir, batches, str(root)), nprocs=world, join=True)
    results = {world: torch.load(root / f"world{world}.pt", weights_only=False)
               for world in (SAVED_WORLD, *LOADED_WORLDS)}
    (root / "checkpoint" / "hf").mkdir()   # what the trainer adds: config and tokenizer
    write_hf_files(root / "checkpoint" / "hf", model_dir, load_tokenizer(model_dir))
    single = ActorWorker(_config("single"), LossConfig(), model_dir, "float32", None, temperature=1.0)
    single.load_checkpoint(str(root / "checkpoint"))
    loaded = _whole(single)
    single.update(batches[3], 3)
    results["single"] = {"loaded": loaded, "after": _whole(single)}
    return root, results


def test_each_rank_writes_its_own_shards(runs):
    root, _ = runs
    for part in (MODEL_DIR, OPTIMIZER_DIR):
        files = sorted(p.name for p in (root / "checkpoint" / part).iterdir())
        assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"], (part, files)


@pytest.mark.parametrize("loader", [*LOADED_WORLDS, "single"], ids=lambda w: f"world{w}" if w != "single" else w)
def test_another_world_size_resumes_the_exact_state(runs, loader):
    _, results = runs
    saved, loaded = results[SAVED_WORLD]["saved"], results[loader]["loaded"]
    assert saved["weights"].keys() == loaded["weights"].keys()
    for name, tensor in saved["weights"].items():
        assert torch.equal(loaded["weights"][name], tensor), name
    assert loaded["optimizer"]["param_groups"][0]["params"] == saved["optimizer"]["param_groups"][0]["params"]
    assert loaded["optimizer"]["state"].keys() == saved["optimizer"]["state"].keys()
    for index, state in saved["optimizer"]["state"].items():
        assert float(state["step"]) == 2.0
        for key, value in state.items():
            assert torch.equal(loaded["optimizer"]["state"][index][key], value), (index, key)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("loader", [*LOADED_WORLDS, "single"], ids=lambda w: f"world{w}" if w != "single" else w)
def test_the_next_update_continues_the_saved_run(runs, loader):
    """Equal to the 2 ranks' third update up to summation order (fp32 on CPU: test_fsdp.py's bound); Adam's moments
    or step counts lost would move the weights by ~1e-2 of their norm."""
    _, results = runs
    expected, got = results[SAVED_WORLD]["after"], results[loader]["after"]
    for name, tensor in expected["weights"].items():
        assert rel_err(got["weights"][name], tensor) < 1e-4, name
    for index, state in expected["optimizer"]["state"].items():
        assert float(got["optimizer"]["state"][index]["step"]) == 3.0
        for key in ("exp_avg", "exp_avg_sq"):
            assert rel_err(got["optimizer"]["state"][index][key], state[key]) < 1e-4, (index, key)


def test_the_export_holds_the_saved_weights(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    root, results = runs
    model = AutoModelForCausalLM.from_pretrained(export(root / "checkpoint", tmp_path / "hf", max_shard_size="20KB"))
    state, saved = model.state_dict(), results[SAVED_WORLD]["saved"]["weights"]
    assert state.keys() == saved.keys() and len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 2
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name


def test_a_rank_that_cannot_see_the_directory_stops_every_rank(runs):
    root, results = runs
    world = max(LOADED_WORLDS)
    assert results[world]["error"].startswith(f"{root}/checkpoint is not visible to rank {world - 1} on ")
    assert "trainer.output_dir must be on a filesystem every node shares" in results[world]["error"]
