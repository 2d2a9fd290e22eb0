"""The critic (rltrain/workers/critic.py): a zeroed value head's first values, packed rows against padded ones, the
clipped value loss against its definition, fitting fixed returns, fp32 masters of a bf16 critic, a checkpoint
round trip, FSDP2 over 2 gloo processes against the single process (values, metrics, weights), and critic.lora:
adapters on the backbone with the value head trained whole beside them, the frozen weights unchanged, its checkpoint
holding both, FSDP2 equal to the single process."""

import copy
import socket

import pytest
import torch
import torch.multiprocessing as mp

from rltrain.algorithms.config import LossConfig
from rltrain.data.sampler import encode_prompts
from rltrain.embedded.model import embedded_policy_dir
from rltrain.embedded.task import make_rows
from rltrain.workers.actor_config import ActorConfig
from rltrain.workers.critic import CriticConfig, CriticWorker, FSDPCriticWorker, value_loss, value_metrics
from rltrain.workers.lora import LoraConfig
from rltrain.workers.rollout import RolloutConfig, RolloutWorker
from tests.helpers import rel_error
from tests.rltrain.tiny_job import tiny_job


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(model dir, a batch of 3 prompts × 4 responses with V_old = 0 and random returns)."""
    from transformers import AutoTokenizer

    job = tiny_job(tmp_path_factory.mktemp("critic"))
    model_dir = str(embedded_policy_dir(job.trainer.output_dir, job.model.embedded, job.data.task, 0))
    ids, mask = encode_prompts(make_rows(job.data.task)[0][:3], AutoTokenizer.from_pretrained(model_dir))
    rollout = RolloutWorker(RolloutConfig(n=4, max_new_tokens=5, torch_threads=1), model_dir, "float32", None)
    batch = rollout.generate(ids, mask, 4, 1.0, seed=0)
    batch["response_mask"][1] = 0   # a response with no tokens
    generator = torch.Generator().manual_seed(0)
    batch["values"] = torch.zeros(batch["response_mask"].shape)
    batch["returns"] = torch.randn(batch["response_mask"].shape, generator=generator) * batch["response_mask"]
    return model_dir, batch


def _critic(model_dir, dtype="float32", packed=True, **config) -> CriticWorker:
    actor = ActorConfig(torch_threads=1, use_remove_padding=packed, max_tokens_per_micro_batch=30 if packed else 0)
    critic = CriticConfig(**{"lr": 1e-2, "micro_batch_size": 5, **config})
    return CriticWorker(critic.worker_config(actor), LossConfig(), model_dir, dtype, None, 1.0, cliprange_value=0.5)


def test_values_start_at_zero_and_packed_rows_equal_padded(setup):
    model_dir, batch = setup
    packed, padded = _critic(model_dir, packed=True), _critic(model_dir, packed=False)
    assert packed.batching.packed and not padded.batching.packed
    assert (packed.compute_values(batch) == 0).all()
    metrics = packed.update(batch), padded.update(batch)
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm"):
        assert metrics[0][key] == pytest.approx(metrics[1][key], rel=1e-5, abs=1e-7), key
    assert metrics[0]["critic/vpred_mean"] == 0.0 and metrics[0]["critic/vf_loss"] > 0
    values = packed.compute_values(batch), padded.compute_values(batch)
    mask = batch["response_mask"] != 0
    assert values[0][mask].abs().min() > 0 and (values[0][~mask] == 0).all()
    assert rel_error(values[0], values[1]) < 1e-5
    assert set(packed.model.state_dict()) >= {"value_head.weight", "value_head.bias"}


def test_value_loss_is_the_clipped_definition():
    generator = torch.Generator().manual_seed(1)
    shape = (4, 7)
    values = torch.randn(shape, generator=generator, dtype=torch.float64, requires_grad=True)
    old, returns = torch.randn(shape, generator=generator, dtype=torch.float64), \
        torch.randn(shape, generator=generator, dtype=torch.float64)
    mask = (torch.rand(shape, generator=generator) > 0.3).long()
    loss, stats = value_loss(values, old, returns, mask, 0.2, n_tokens=40)
    expected, clipped_count = 0.0, 0
    for b in range(shape[0]):
        for t in range(shape[1]):
            if not mask[b, t]:
                continue
            v, o, r = values[b, t].item(), old[b, t].item(), returns[b, t].item()
            clipped = o + min(max(v - o, -0.2), 0.2)
            expected += 0.5 * max((v - r) ** 2, (clipped - r) ** 2)
            clipped_count += (clipped - r) ** 2 > (v - r) ** 2
    assert loss.item() == pytest.approx(expected / 40, rel=1e-12)
    assert stats["vf_clipfrac"] == pytest.approx(clipped_count / 40, rel=1e-12)
    loss.backward()   # no gradient through masked tokens or through a clipped term that wins
    assert (values.grad[mask == 0] == 0).all()


def test_the_critic_fits_fixed_returns(setup):
    """PPO's loop on one batch: values refreshed as V_old before each update; the loss falls and the explained
    variance rises."""
    model_dir, batch = setup
    critic, batch = _critic(model_dir, lr=3e-2), batch.clone()
    losses = []
    for step in range(25):
        batch["values"] = critic.compute_values(batch)
        losses.append(critic.update(batch, step)["critic/vf_loss"])
    batch["values"] = critic.compute_values(batch)
    assert losses[-1] < 0.2 * losses[0], losses
    assert value_metrics(batch)["critic/vf_explained_var"] > 0.5


def test_a_bf16_critic_trains_fp32_masters(setup):
    model_dir, batch = setup
    critic = _critic(model_dir, dtype="bfloat16")
    assert critic.master is not None and critic.model.value_head.weight.dtype == torch.bfloat16
    assert critic.master.masters["value_head.weight"].dtype == torch.float32
    critic.update(batch)
    assert critic.master.masters["value_head.weight"].abs().sum() > 0


def test_checkpoint_round_trip(setup, tmp_path):
    model_dir, batch = setup
    critic = _critic(model_dir)
    critic.update(batch)
    critic.save_checkpoint(str(tmp_path))
    restored = _critic(model_dir)
    restored.load_checkpoint(str(tmp_path))
    assert torch.equal(restored.compute_values(batch), critic.compute_values(batch))
    # the optimizer state came back too: the next update moves both alike
    assert restored.update(batch)["critic/vf_loss"] == pytest.approx(critic.update(batch)["critic/vf_loss"], rel=1e-6)


LORA = {"rank": 4, "alpha": 8.0}


def test_a_lora_critic_trains_adapters_and_the_whole_value_head(setup, tmp_path):
    model_dir, batch = setup
    critic = _critic(model_dir, lora=LoraConfig(**LORA))
    trained = {name for name, param in critic.model.named_parameters() if param.requires_grad}
    assert {"value_head.weight", "value_head.bias"} <= trained
    assert all("lora_" in name or name.startswith("value_head.") for name in trained)
    assert not any(name.startswith("value_head.") and "lora_" in name for name in critic.model.state_dict())
    frozen = {n: p.detach().clone() for n, p in critic.model.named_parameters() if not p.requires_grad}
    assert (critic.compute_values(batch) == 0).all()
    for step in range(3):
        batch["values"] = critic.compute_values(batch)
        critic.update(batch, step)
    assert critic.compute_values(batch).abs().sum() > 0
    assert all(torch.equal(p, frozen[n]) for n, p in critic.model.named_parameters() if n in frozen)
    critic.save_checkpoint(str(tmp_path))
    restored = _critic(model_dir, lora=LoraConfig(**LORA))
    restored.load_checkpoint(str(tmp_path))
    assert torch.equal(restored.compute_values(batch), critic.compute_values(batch))
    saved = set(restored._model_checkpoint_state())
    assert {"value_head.weight", "value_head.bias"} <= saved and all("lora_" in n or "value_head" in n for n in saved)


def _rank_main(rank, port, model_dir, batch, out, lora):
    actor = ActorConfig(torch_threads=1, strategy="fsdp2", use_remove_padding=True, max_tokens_per_micro_batch=30)
    config = CriticConfig(lr=1e-2, mini_batch_size=7, lora=LoraConfig(**lora)).worker_config(actor)   # 2 steps
    critic = FSDPCriticWorker(rank, 2, "127.0.0.1", port, config, LossConfig(), model_dir, "float32", None, 1.0,
                              cliprange_value=0.5)
    metrics = critic.update(batch)
    values = critic.compute_values(batch)
    weights = critic.state_dict()
    if rank == 0:
        torch.save({"metrics": metrics, "values": values, "weights": weights}, out)


@pytest.mark.parametrize("lora", [{}, LORA], ids=["full", "lora"])
def test_fsdp2_critic_equals_the_single_process(setup, tmp_path, lora):
    model_dir, batch = setup
    config = CriticConfig(lr=1e-2, mini_batch_size=7, lora=LoraConfig(**lora))
    single = CriticWorker(config.worker_config(ActorConfig(torch_threads=1)), LossConfig(), model_dir, "float32", None,
                          1.0, cliprange_value=0.5)
    expected = {"metrics": single.update(batch), "values": single.compute_values(batch),
                "weights": copy.deepcopy(single.state_dict())}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_rank_main, args=(port, model_dir, batch, str(tmp_path / "rank0.pt"), lora), nprocs=2, join=True)
    sharded = torch.load(tmp_path / "rank0.pt", weights_only=False)
    for key, value in expected["metrics"].items():
        assert sharded["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-7), key
    assert rel_error(sharded["values"], expected["values"]) < 1e-4
    for name, value in expected["weights"].items():
        assert rel_error(sharded["weights"][name], value) < 1e-4, name
