"""LoRA under FSDP2 (actor.strategy=fsdp2 with actor.lora.rank > 0) over 2 gloo processes (torch.multiprocessing, no
Ray) against the single-process LoRA actor, fp32 on CPU:

- the same initial adapters; after an update the adapters' gradients (the base gets none: it is frozen and holds no
  gradient), the metrics and the adapters themselves; the optimizer holds the adapters alone;
- the policy's and the reference's log-probs (the reference: adapters disabled, sharded like the old log-probs);
- the weight push: the same bucket names (adapters only) and the full adapter tensors;
- the PEFT adapter directory save_pretrained writes (trainer.save_hf);
- a checkpoint the 2 ranks write (adapters + optimizer, DCP) resumes on them with the same next update as the run
  that went on, and loads into the single process, whose next update is the single process's own.

A bf16 actor (model.dtype=bfloat16 under actor.mixed_precision) shards its frozen base in bf16 beside fp32 adapter
shards, updates, and pushes bf16 adapters. One spawn runs it all (~30 s on 2 cores, mostly process start and
imports). With 2 GPUs (@pytest.mark.gpu) the same runs over NCCL.

    pytest tests/rltrain/workers/test_fsdp_lora.py -q
"""

import copy
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from tensordict import TensorDict

from rltrain.algorithms.advantages import compute_advantages
from rltrain.algorithms.config import LossConfig
from rltrain.workers.actor import ActorWorker, FSDPActorWorker
from rltrain.workers.actor_config import ActorConfig
from rltrain.workers.lora import LoraConfig, adapter_weights, is_adapter_weight
from tests.rltrain.tiny_job import save_tiny_policy
from tests.rltrain.workers.test_fsdp import TOLERANCES, rel_err

WORLD = 2
# packed micro-batches of at most 3 rows (11 tokens each): each rank runs 2
CONFIG = dict(torch_threads=1, lr=1e-2, lora=LoraConfig(rank=4, alpha=8.0), max_tokens_per_micro_batch=35)
LOSS = LossConfig(kl_coef=0.1)


def _batch(vocab: int) -> TensorDict:
    """3 prompts × 4 responses of random tokens (a few masked, one empty), non-zero GRPO advantages."""
    generator = torch.Generator().manual_seed(0)
    response_mask = torch.ones(12, 6, dtype=torch.long)
    response_mask[1, 4:] = 0
    response_mask[7] = 0
    batch = TensorDict({"prompt_ids": torch.randint(4, vocab, (12, 5), generator=generator),
                        "prompt_mask": torch.ones(12, 5, dtype=torch.long),
                        "response_ids": torch.randint(4, vocab, (12, 6), generator=generator),
                        "response_mask": response_mask, "group_ids": torch.arange(3).repeat_interleave(4)},
                       batch_size=[12])
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    batch["advantages"] = compute_advantages("grpo", rewards, response_mask, batch["group_ids"])
    return batch


def _adapters(actor) -> dict[str, torch.Tensor]:
    """The actor's adapters, whole, on the CPU (under FSDP2 gathered: a collective)."""
    names = list(adapter_weights(actor.model))
    if isinstance(actor, FSDPActorWorker):
        return {n: t.cpu() for n, t in actor._full_tensors(names).items()}
    return {n: t.detach().clone() for n, t in adapter_weights(actor.model).items()}


def _run(actor, batch, out_dir, tag: str) -> dict:
    """One update, then what the comparisons need; a checkpoint of the updated actor in out_dir/tag, then a second
    update from it."""
    result = {"initial": _adapters(actor), "metrics": actor.update(batch, step=1)}
    grads = {}
    for name, param in actor.model.named_parameters():
        if param.grad is not None:
            grad = param.grad
            grads[name] = (grad.to(actor.device).full_tensor() if hasattr(grad, "full_tensor") else grad).cpu()
    names = [name for bucket in actor.bucket_names(1) for name in bucket]
    result.update(grads=grads, weights=_adapters(actor), old=actor.compute_logprobs(batch),
                  ref=actor.compute_ref_logprobs(batch), bucket_names=names,
                  pushed={n: t.cpu().clone() for n, t in actor.full_weights(names).items()},
                  optimizer=copy.deepcopy(actor.optimizer_state()),
                  trained=len([p for g in actor.optimizer.param_groups for p in g["params"]]))
    Path(f"{out_dir}/{tag}").mkdir(exist_ok=True)
    actor.save_checkpoint(f"{out_dir}/{tag}")
    actor.save_pretrained(f"{out_dir}/{tag}-peft")
    actor.update(batch, step=2)
    result["second"] = _adapters(actor)
    return result


def _rank_main(rank, port, device, model_dir, batch, out_dir):
    import os

    os.environ["LOCAL_RANK"] = str(rank)  # this rank's GPU (under Ray each rank sees only its own)
    actor = FSDPActorWorker(rank, WORLD, "127.0.0.1", port, ActorConfig(strategy="fsdp2", **CONFIG), LOSS, model_dir,
                            "float32", None, 1.0, device=device)
    frozen = [p for n, p in actor.model.named_parameters() if not is_adapter_weight(n)]
    assert frozen and not any(p.requires_grad for p in frozen)
    result = _run(actor, batch, out_dir, "sharded")
    actor.load_checkpoint(f"{out_dir}/sharded")   # resume on the 2 ranks that wrote it
    actor.update(batch, step=2)
    result["resumed_second"] = _adapters(actor)

    # bf16 under mixed precision: a bf16 base sharded beside fp32 adapter shards, bf16 compute and push
    bf16 = FSDPActorWorker(rank, WORLD, "127.0.0.1", port, ActorConfig(strategy="fsdp2", **CONFIG), LOSS, model_dir,
                           "bfloat16", None, 1.0, device=device)
    dtypes = {is_adapter_weight(n): p.dtype for n, p in bf16.model.named_parameters()}
    result["bf16"] = {"dtypes": dtypes, "metrics": bf16.update(batch, step=1),
                      "pushed": {t.dtype for t in bf16.full_weights(bf16.bucket_names(256)[0]).values()}}
    if rank == 0:
        torch.save(result, f"{out_dir}/sharded.pt")


def run_both(root, device: str) -> tuple[dict, dict, dict]:
    """(the single process's results, the 2 ranks', the single process's resumed from the ranks' checkpoint)."""
    save_tiny_policy(root / "base")
    model_dir = str(root / "base")
    single = ActorWorker(ActorConfig(**CONFIG), LOSS, model_dir, "float32", None, temperature=1.0, device=device)
    batch = _batch(single.model.config.vocab_size)
    batch["old_logprobs"] = single.compute_logprobs(batch)
    ref = single.compute_ref_logprobs(batch)   # the adapters start at zero: the reference is the policy
    batch["ref_logprobs"] = ref + 0.05 * torch.randn_like(ref) * batch["response_mask"]   # a non-zero KL term
    expected = _run(single, batch, root, "single")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_rank_main, args=(port, device, model_dir, batch, str(root)), nprocs=WORLD, join=True)
    sharded = torch.load(root / "sharded.pt", weights_only=False)
    resumed = ActorWorker(ActorConfig(**CONFIG), LOSS, model_dir, "float32", None, temperature=1.0, device=device,
                          seed=1)   # other initial adapters: all must come from the checkpoint
    resumed.load_checkpoint(str(root / "sharded"))
    loaded = _adapters(resumed)
    resumed.update(batch, step=2)
    return expected, sharded, {"loaded": loaded, "second": _adapters(resumed)}


def check(single, sharded, resumed, tol):
    assert single["initial"].keys() == sharded["initial"].keys() and single["initial"]
    assert all(torch.equal(sharded["initial"][n], t) for n, t in single["initial"].items())
    assert set(sharded["grads"]) == set(single["grads"]) == set(single["initial"])   # the adapters alone
    for name, grad in single["grads"].items():
        assert rel_err(sharded["grads"][name], grad) < tol["grads"], name
    assert sharded["trained"] == single["trained"] == len(single["initial"])
    for key, value in single["metrics"].items():
        assert sharded["metrics"][key] == pytest.approx(value, rel=tol["metrics"], abs=tol["metrics"] / 100), key
    for name, value in single["weights"].items():
        assert rel_err(sharded["weights"][name], value) < tol["weights"], name
    for key in ("old", "ref"):
        assert rel_err(sharded[key], single[key]) < tol["logprobs"], key
    assert (single["old"] - single["ref"]).abs().max() > 1e-3   # the adapters moved: disabling them matters
    assert sharded["bucket_names"] == single["bucket_names"] and all(map(is_adapter_weight, single["bucket_names"]))
    for name, value in single["pushed"].items():
        assert rel_err(sharded["pushed"][name], value) < tol["weights"], name
    for index, state in single["optimizer"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert rel_err(sharded["optimizer"]["state"][index][key], state[key].cpu()) < tol["optimizer"], (index, key)
    # resumed on the 2 ranks: the second update the uninterrupted ranks made, to the bit
    assert all(torch.equal(sharded["resumed_second"][n], t) for n, t in sharded["second"].items())
    # loaded into 1 process: exactly the ranks' adapters, then the single process's own second update
    assert all(torch.equal(resumed["loaded"][n], t) for n, t in sharded["weights"].items())
    for name, value in single["second"].items():
        assert rel_err(resumed["second"][name], value) < tol["weights"], name
    bf16 = sharded["bf16"]
    assert bf16["dtypes"] == {False: torch.bfloat16, True: torch.float32} and bf16["pushed"] == {torch.bfloat16}
    # one bf16 step against the fp32 single process's (bf16 compute: ~3 significant digits). Not the adapters:
    # Adam's first step is lr × sign(gradient), which flips where a gradient is near 0 (18% rel. error seen)
    for key in ("actor/loss", "actor/grad_norm", "actor/ref_kl"):
        assert bf16["metrics"][key] == pytest.approx(single["metrics"][key], rel=TOLERANCES["cpu-bf16"]["metrics"])


def check_peft_directories(root):
    """save_pretrained under FSDP2 writes the single process's PEFT adapter directory: the same tensor names and
    values."""
    single = load_file(root / "single-peft" / "adapter_model.safetensors")
    sharded = load_file(root / "sharded-peft" / "adapter_model.safetensors")
    assert single.keys() == sharded.keys() and single
    for name, value in single.items():
        assert rel_err(sharded[name], value) < TOLERANCES["cpu"]["weights"], name
    assert (root / "sharded-peft" / "adapter_config.json").is_file()


def test_lora_fsdp2_over_gloo_matches_single_process(tmp_path):
    check(*run_both(tmp_path, "cpu"), TOLERANCES["cpu"])
    check_peft_directories(tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_lora_fsdp2_over_nccl_matches_single_process(tmp_path):
    check(*run_both(tmp_path, "cuda"), TOLERANCES["cuda-fp32"])
