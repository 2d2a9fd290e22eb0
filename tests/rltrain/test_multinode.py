"""Multi-node runs on a simulated 2-node Ray cluster (ray.cluster_utils.Cluster, one CPU per node): a 2-step
main_grpo job with actor.strategy=fsdp2 whose actor and reference ranks land one per node through the placement
groups, each rank writing its own shards of the checkpoint, which a one-rank job resumes for a third step (and a job
of another model refuses in one line); resource requests the cluster cannot hold fail with a message naming the
keys, at once when no node could ever hold them and after ray.placement_timeout_s when the resources exist but are
taken; the commands documented in examples/multinode/ are valid configs. 1 to 2.5 minutes on 2 cores (with them to
itself or shared), most of it starting the worker processes of the three jobs."""

import importlib.util
import json
import re
import shlex
import time
from pathlib import Path

import pytest
import ray
from hydra import compose, initialize_config_dir
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, remove_placement_group

from rltrain.checkpoint import latest_checkpoint
from rltrain.config import ConfigError
from rltrain.distributed_checkpoint import CheckpointError
from rltrain.job import load_job_config
from rltrain.main_grpo import run
from rltrain.trainer import GRPOTrainer
from rltrain.workers.group import PlacementError, place_model_roles
from tests.rltrain.tiny_job import tiny_job


@pytest.fixture(scope="module")
def two_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"head_node": 1}})
    cluster.add_node(num_cpus=1, resources={"second_node": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def _node_of(handle):
    return ray.get(handle.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))


def test_fsdp2_job_spans_both_nodes(two_nodes, tmp_path):
    job = tiny_job(tmp_path, trainer={"nnodes": 2, "n_gpus_per_node": 1},
                   actor={"strategy": "fsdp2"}, algorithm={"loss": {"kl_coef": 0.05, "entropy_coef": 0.01}})
    trainer = GRPOTrainer(job)
    try:
        groups = trainer.placement.node_ids()
        assert len(set(groups)) == 2
        assert [_node_of(w) for w in trainer.actor.workers] == groups
        assert [_node_of(w) for w in trainer.reference.workers] == groups
        assert [_node_of(p) for p in trainer.rollout.processes] == groups[:1]  # one replica (rollout.replicas: 1)
        result = trainer.fit()
    finally:
        trainer.close()
    assert result["step"] == 2
    train = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if "train/reward_mean" in line]
    assert [r["step"] for r in train] == [1, 2]
    for record in train:
        assert record["actor/grad_norm"] > 0 and "actor/ref_kl" in record  # entropy bonus: a gradient at step 1
    checkpoint = latest_checkpoint(str(tmp_path))
    assert checkpoint.name == "step_000002"
    for part in ("model", "optimizer"):   # each rank wrote its own shards, on its own node
        assert sorted(p.name for p in (checkpoint / part).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    _wait_for_cpus(2)

    # resumed on one rank (FSDP2 on one node): each step logged once, the third trained
    result = run(tiny_job(tmp_path, trainer={"total_steps": 3}, actor={"strategy": "fsdp2"},
                          algorithm={"loss": {"kl_coef": 0.05, "entropy_coef": 0.01}}))
    assert result["step"] == 3
    train = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if "train/reward_mean" in line]
    assert [r["step"] for r in train] == [1, 2, 3] and train[2]["actor/grad_norm"] > 0
    _wait_for_cpus(2)

    # a checkpoint of another model: one line naming it and what differs, not a worker's traceback
    with pytest.raises(CheckpointError) as err:
        run(tiny_job(tmp_path / "other", trainer={"resume": str(checkpoint)}, actor={"strategy": "fsdp2"},
                     model={"embedded": {"hidden_size": 64, "head_dim": 32}}))
    assert str(err.value).startswith(f"trainer.resume: {checkpoint / 'model'} does not fit the model of this run")
    assert "Traceback" not in str(err.value)
    _wait_for_cpus(2)


def _wait_for_cpus(cpus: int) -> None:
    """The placement groups are given back (Ray frees them asynchronously)."""
    deadline = time.monotonic() + 20
    while ray.available_resources().get("CPU") != cpus and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == cpus


def test_requests_no_node_can_hold_fail_at_once(two_nodes):
    for nnodes, per_node, device in ((3, 1, "cpu"), (1, 2, "cpu"), (1, 1, "cuda")):
        start = time.monotonic()
        with pytest.raises(PlacementError) as err:
            place_model_roles(nnodes, per_node, device, timeout_s=60)
        assert time.monotonic() - start < 10
        message = str(err.value)
        assert f"trainer.nnodes={nnodes}" in message and f"trainer.n_gpus_per_node={per_node}" in message
        assert "2 alive node(s)" in message and "second_node 1" in message, message


def test_taken_resources_fail_after_the_timeout(two_nodes):
    taken = placement_group([{"CPU": 1, "second_node": 1}])
    ray.get(taken.ready())
    try:
        start = time.monotonic()
        with pytest.raises(PlacementError, match=r"ray.placement_timeout_s=2 s"):
            place_model_roles(2, 1, "cpu", timeout_s=2)
        assert time.monotonic() - start < 15
    finally:
        remove_placement_group(taken)
    placement = place_model_roles(2, 1, "cpu", timeout_s=30)  # the failed attempt left nothing reserved
    placement.remove()


def test_several_ranks_need_fsdp2(tmp_path):
    with pytest.raises(ConfigError, match=r"^actor.strategy: 'single' runs one process.*= 2"):
        tiny_job(tmp_path, trainer={"nnodes": 2})


def test_documented_commands_are_valid_configs(monkeypatch):
    """The overrides of the `python -m rltrain.main_grpo` commands in examples/multinode/README.md's shell blocks
    compose and validate (rollout.engine=vllm counts as installed: it is, on the GPU machines they are for)."""
    root = Path(__file__).resolve().parents[2]
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: object() if name == "vllm" else find_spec(name, *args))
    blocks = re.findall(r"```bash\n(.*?)```", (root / "examples" / "multinode" / "README.md").read_text(), flags=re.S)
    lines = re.sub(r"\\\n", " ", "".join(blocks)).splitlines()
    commands = [line.split("rltrain.main_grpo", 1)[1] for line in lines if "python -m rltrain.main_grpo" in line]
    assert commands
    for command in commands:
        overrides = [arg for arg in shlex.split(command.split(" #")[0]) if "=" in arg]
        with initialize_config_dir(config_dir=str(root / "config"), version_base="1.3"):
            job = load_job_config(compose(config_name="grpo", overrides=overrides))
        assert job.trainer.nnodes == 2 and job.actor.strategy == "fsdp2", command
