"""LoRA RL through the real trainer (Ray actors on CPU, the tiny embedded job): with actor.lora.rank > 0 and a KL term
no ReferenceWorker starts (the actor's base with adapters disabled is the reference) while the KL runs; every
checkpoint holds the adapters alone, no full model; a run resumed from its step-1 checkpoint makes the same step 2
(metrics and adapters) as the uninterrupted run; a LoRA checkpoint refuses a resume with LoRA off, naming the key.
Under actor.strategy=fsdp2 on 2 CPU ranks a run trains, checkpoints the adapters from both ranks and exports them
merged. The in-process details (base frozen, adapters-only push, rollout equal to the actor, PEFT loading, export)
are in tests/rltrain/workers/test_lora.py.

    .venv/bin/python -m pytest tests/rltrain/test_trainer_lora.py -q   # about 1.5 minutes on 2 cores
"""

import json
import shutil

import pytest
import ray
import torch

from rltrain import trainer as trainer_module
from rltrain.config import ConfigError
from rltrain.distributed_checkpoint import read_state
from rltrain.main_grpo import run
from tests.rltrain.tiny_job import tiny_job

# lr: large enough that one update changes what the rollout samples next, so a resume that left the rollout on
# stale adapters makes a different step 2
LORA = {"lora": {"rank": 4, "alpha": 8.0}, "lr": 5e-2}


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


def _train_records(output_dir) -> dict[int, dict]:
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if "train/reward_mean" in r}


def _job(out, actor=LORA, **trainer):
    plugin = out.parent / "reward.py"   # 0 or 1 about evenly over random responses: non-zero advantages
    plugin.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(sum(map(ord, solution_str)) % 2)\n")
    return tiny_job(out, actor=actor, trainer={"save_every": 1, **trainer}, rollout={"temperature": 1.5},
                    reward={"path": str(plugin), "name": "score"}, algorithm={"loss": {"kl_coef": 0.05}})


def test_lora_run_uses_no_reference_worker_saves_adapters_and_resumes(tmp_path, monkeypatch):
    started, start_role = [], trainer_module.start_role
    monkeypatch.setattr(trainer_module, "start_role", lambda cls, *args, **kwargs: (
        started.append(cls.__name__), start_role(cls, *args, **kwargs))[1])
    out = tmp_path / "run"
    assert run(_job(out))["step"] == 2
    assert started == ["ActorWorker"]  # kl_coef > 0, yet no ReferenceWorker
    uninterrupted = _train_records(out)
    assert list(uninterrupted) == [1, 2]
    for record in uninterrupted.values():
        assert "actor/ref_kl" in record and record["time/ref_s"] > 0
    assert any(r["actor/grad_norm"] > 0 for r in uninterrupted.values())
    assert uninterrupted[2]["actor/ref_kl"] != 0  # after one update the policy has left its base
    checkpoints = out / "checkpoints"
    for step in (1, 2):
        files = {p.name for p in (checkpoints / f"step_{step:06d}" / "hf").iterdir()}
        assert {"adapter_config.json", "tokenizer.json"} <= files, files
        assert not any(name.endswith(".safetensors") for name in files)   # no HF weights (trainer.save_hf)
    final = read_state(checkpoints / "step_000002" / "model")
    assert final and all(".lora_A." in name or ".lora_B." in name for name in final)
    first = read_state(checkpoints / "step_000001" / "model")
    assert any(not torch.equal(first[name], final[name]) for name in final)
    shutil.copytree(checkpoints / "step_000002", tmp_path / "uninterrupted_step_2")

    assert run(_job(out, resume=str(checkpoints / "step_000001")))["step"] == 2
    resumed = _train_records(out)[2]  # metrics.jsonl appends: the last step-2 record is the resumed run's
    for key in ("train/reward_mean", "train/response_len_mean", "actor/loss", "actor/entropy", "actor/grad_norm",
                "actor/ref_kl"):
        assert resumed[key] == pytest.approx(uninterrupted[2][key], rel=1e-6, abs=1e-7), key
    again = read_state(checkpoints / "step_000002" / "model")
    assert again.keys() == final.keys()
    for name, tensor in final.items():
        torch.testing.assert_close(again[name], tensor, rtol=1e-6, atol=1e-7, msg=name)

    with pytest.raises(ConfigError, match=r"trainer.resume: checkpoint .*step_000002' holds LoRA adapters, but "
                                          r"actor.lora.rank is 0"):
        run(_job(out, actor={}, total_steps=3))


def test_lora_under_fsdp2_on_two_ranks_saves_sharded_adapters_that_export(tmp_path, monkeypatch):
    """trainer.n_gpus_per_node=2 actor.strategy=fsdp2 on CPU: 2 FSDPActorWorker ranks (gloo), no ReferenceWorker with
    the KL on, the adapters pushed into the 2 rollout processes; each checkpoint holds the adapters alone, written
    by both ranks, which `python -m rltrain.export` merges into a full HF model."""
    from transformers import AutoModelForCausalLM

    from rltrain.export import main as export_main

    started, start_role = [], trainer_module.start_role
    monkeypatch.setattr(trainer_module, "start_role", lambda cls, *args, **kwargs: (
        started.append(cls.__name__), start_role(cls, *args, **kwargs))[1])
    out = tmp_path / "run"
    assert run(_job(out, actor={**LORA, "strategy": "fsdp2"}, n_gpus_per_node=2))["step"] == 2
    assert started == ["FSDPActorWorker"]
    records = _train_records(out)
    assert list(records) == [1, 2] and records[2]["actor/ref_kl"] != 0
    assert all(r["actor/grad_norm"] > 0 for r in records.values())
    checkpoint = out / "checkpoints" / "step_000002"
    assert {p.name for p in (checkpoint / "model").glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    final = read_state(checkpoint / "model")
    assert final and all(".lora_A." in name or ".lora_B." in name for name in final)
    assert export_main([str(checkpoint), str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    assert not any(".lora_" in name or "base_layer" in name for name in merged)
