"""FSDP2 actor and reference over 2 gloo processes (torch.multiprocessing, no Ray) against the single process, fp32:
gradients after an update, metrics, sharded old/reference log-probs, the gathered weights and optimizer state after
the step, a single-process checkpoint (whole tensors, torch.distributed.checkpoint) loaded into the shards and an
on-policy update from it (no old_logprobs: the update's own log-probs gathered on rank 0). Cases cover uneven
micro-batches (a rank with fewer micro-batches than rank 0 runs padding ones), a rank with no rows, two mini-batches,
each loss aggregation, the KL term, gradient checkpointing, and packed micro-batches cut by a token budget (rows
shared by tokens; the sharded reference packed against the single process's padded one); two of them again on a
delta-rule policy (Gated DeltaNet + attention), and two in bf16 mixed precision over gloo (model.dtype=bfloat16 with
actor.mixed_precision: fp32 shards, bf16 compute; the reference sharded in bf16) against the fp32 single process.
One spawn runs every case of a fixture (~30 s in all on 2 cores, mostly process start and imports). With 2 GPUs
(@pytest.mark.gpu) the same cases run over NCCL, fp32 and bf16 mixed precision, the latter also with the shards,
gradients and optimizer state offloaded to the CPU (actor.fsdp.cpu_offload, or param_offload and optimizer_offload
between phases), and the hybrid cases in bf16.
benchmarks/bench_multi_gpu.py does the same at real sizes with the fused kernels."""

import copy
import socket

import pytest
import torch
import torch.multiprocessing as mp
from tensordict import TensorDict

from rltrain.algorithms.advantages import compute_advantages
from rltrain.algorithms.config import LossConfig
from rltrain.data.sampler import encode_prompts
from rltrain.embedded.model import embedded_policy_dir
from rltrain.embedded.task import make_rows
from rltrain.config import ConfigError
from rltrain.workers.actor import ActorWorker, FSDPActorWorker
from rltrain.workers.actor_config import ActorConfig
from rltrain.workers.fsdp import FSDPConfig, rank_micro_batches
from rltrain.workers.packing import MicroBatching
from rltrain.workers.policy import DTYPES
from rltrain.workers.reference import FSDPReferenceWorker, ReferenceWorker
from rltrain.workers.rollout import RolloutConfig, RolloutWorker
from tests.rltrain.tiny_job import tiny_job

WORLD = 2
# id: (rows, micro_batch_size, mini_batch_size, loss_agg, kl_coef, gradient checkpointing on the FSDP2 side,
#      packed token budget: None = padded rows of micro_batch_size)
CASES = {
    "rows11-micro5-token-mean": (11, 5, 0, "token-mean", 0.0, False, None),   # rank 1 runs one padding micro-batch
    "rows11-micro5-seq-mean-token-mean": (11, 5, 0, "seq-mean-token-mean", 0.0, False, None),
    "rows11-micro5-seq-mean-token-sum-norm-kl": (11, 5, 0, "seq-mean-token-sum-norm", 0.1, False, None),
    "rows12-micro2-mini7-token-mean-kl": (12, 2, 7, "token-mean", 0.1, False, None),  # 2 optimizer steps
    "rows1-micro4-token-mean": (1, 4, 0, "token-mean", 0.0, False, None),   # rank 1 has no rows at all
    "rows8-micro3-token-mean-checkpointing": (8, 3, 0, "token-mean", 0.0, True, None),
    "rows11-packed30-token-mean-kl": (11, 0, 0, "token-mean", 0.1, False, 30),
    "rows11-packed20-seq-mean-token-mean": (11, 0, 0, "seq-mean-token-mean", 0.0, False, 20),
    "rows1-packed30-token-mean": (1, 0, 0, "token-mean", 0.0, False, 30),   # rank 1 has no rows at all
}
# a delta-rule policy (rltrain_kernels.models' hybrid family: Gated DeltaNet, then attention), padded and packed
HYBRID_CASES = ["rows11-micro5-token-mean", "rows11-packed30-token-mean-kl"]
# the reference: padded rows in the single process, packed rows (token budget) under FSDP2
SINGLE_REFERENCE, SHARDED_REFERENCE = MicroBatching(rows=3, packed=False), MicroBatching(packed=True, max_tokens=25)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _configs(spec, sharded: bool):
    """(rows, ActorConfig, LossConfig) of a CASES entry."""
    rows, micro, mini, loss_agg, kl, checkpointing, budget = spec
    # the single process runs padded rows in one micro-batch of the whole mini-batch when the case packs
    packed = budget is not None
    actor = ActorConfig(micro_batch_size=micro or 64, mini_batch_size=mini, torch_threads=1,
                        strategy="fsdp2" if sharded else "single", gradient_checkpointing=checkpointing and sharded,
                        use_remove_padding=packed and sharded, max_tokens_per_micro_batch=budget or 0)
    return rows, actor, LossConfig(loss_agg=loss_agg, kl_coef=kl)


def _rank_main(rank, port, device, dtype, offload, model_dir, batches, out_dir, world=WORLD, fsdp_size=-1,
               specs=CASES, sequence_parallel=1, expert_parallel=1, after=None):
    import os

    os.environ["LOCAL_RANK"] = str(rank)  # this rank's GPU (under Ray each rank sees only its own)

    fsdp = FSDPConfig(fsdp_size=fsdp_size, **{key: True for key in offload})
    reference = FSDPReferenceWorker(rank, world, "127.0.0.1", port, model_dir, dtype, None, 1.0,
                                    SHARDED_REFERENCE, fsdp=fsdp, device=device, torch_threads=1,
                                    sequence_parallel_size=sequence_parallel)
    assert all(p.dtype == DTYPES[dtype] for p in reference.model.parameters())  # frozen: no fp32 copy
    for case, batch in batches.items():
        _, config, loss = _configs(specs[case], sharded=True)
        config.fsdp, config.ulysses_sequence_parallel_size = fsdp, sequence_parallel
        config.expert_parallel_size = expert_parallel
        actor = FSDPActorWorker(rank, world, "127.0.0.1", port, config, loss, model_dir, dtype, None, 1.0,
                                device=device)
        assert all(p.dtype == torch.float32 for p in actor.model.parameters())  # the shards: fp32 in every case
        # HSDP: every parameter on the 2-D mesh, sharded over its last dimension, replicated over the first
        assert {p.device_mesh.ndim for p in actor.model.parameters()} == {1 if fsdp_size in (-1, world) else 2}
        result = {"old": actor.compute_logprobs(batch), "ref": reference.compute_logprobs(batch)}
        _offload(actor, fsdp)   # param_offload: the update's forward brings the shards back
        result["metrics"] = actor.update(batch)
        _offload(actor, fsdp)   # the gradients, full weights and checkpoints below read offloaded shards
        # offloaded shards live on the CPU: to the GPU for NCCL's all-gather (a no-op otherwise)
        grads = {n: actor.gathered(n, p.grad).cpu() for n, p in actor.model.named_parameters()}
        pushed = actor.full_weights(actor.bucket_names(256)[0])  # the weight push's tensors: model.dtype
        assert all(t.dtype == DTYPES[dtype] for t in pushed.values() if t.is_floating_point())
        # a copy: the step counts are the live tensors, which the load below overwrites in place
        result.update(grads=grads, weights=actor.state_dict(), optimizer=copy.deepcopy(actor.optimizer_state()))
        actor.load_checkpoint(f"{out_dir}/single-{case}")   # the single process's checkpoint, resharded over 2 ranks
        # a copy: the gathered state shares its `step` counters with the optimizer, which the next update moves
        result.update(loaded_weights=actor.state_dict(), loaded_optimizer=copy.deepcopy(actor.optimizer_state()))
        if config.mini_batch_size == 0:   # one optimizer step: on-policy from the loaded checkpoint
            on_policy = actor.update(batch.exclude("old_logprobs"))
            result.update(on_policy=on_policy and on_policy.pop("old_logprobs"), on_policy_weights=actor.state_dict())
        if after is not None:   # the caller's checks of the ranks' state, its results beside ours
            result.update(after(actor, f"{out_dir}/{case}"))
        if rank == 0:
            torch.save(result, f"{out_dir}/{case}.pt")


def _offload(actor, fsdp: FSDPConfig) -> None:
    """actor.offload(), checking what it and optimizer_offload leave in GPU memory: not the shards, gradients or
    optimizer state they offload."""
    actor.offload()
    if fsdp.param_offload:
        assert all(p.device.type == "cpu" for p in actor.model.parameters())
        assert all(p.grad is None or p.grad.device.type == "cpu" for p in actor.model.parameters())
    if fsdp.optimizer_offload:
        assert all(value.device.type == "cpu" for state in actor.optimizer.state.values()
                   for value in state.values() if torch.is_tensor(value))


def run_cases(root, device: str, dtype: str = "float32", offload: tuple[str, ...] = (), arch: str = "qwen3",
              cases=tuple(CASES), world: int = WORLD, fsdp_size: int = -1, sequence_parallel: int = 1,
              embedded: dict | None = None, variant=None, expert_parallel: int = 1, after=None) -> dict:
    """Per case: (the fp32 single process's results, the `world`-rank FSDP2 ones (HSDP with fsdp_size, Ulysses
    groups of `sequence_parallel` ranks) at model.dtype=`dtype` with actor.mixed_precision, the checkpoint the ranks
    loaded), on the embedded model of `arch` (2 layers for a delta-rule arch; `embedded`: other settings of it;
    `variant(model_dir, root)`: the directory of another model made from it; expert_parallel: actor.expert_parallel_size;
    `after(actor, directory)`, a module-level function, runs on every rank at the end of each case and returns what
    rank 0 adds to its results). `cases`: names in CASES, or a dict of
    name: CASES-style entry."""
    specs = cases if isinstance(cases, dict) else {case: CASES[case] for case in cases}
    job = tiny_job(root, model={"embedded": {"arch": arch, "num_layers": 1 if arch == "qwen3" else 2,
                                             **(embedded or {})}})
    model_dir = str(embedded_policy_dir(job.trainer.output_dir, job.model.embedded, job.data.task, 0))
    if variant is not None:
        model_dir = variant(model_dir, root)
    train, _ = make_rows(job.data.task)
    from transformers import AutoTokenizer

    ids, mask = encode_prompts(train[:3], AutoTokenizer.from_pretrained(model_dir))
    rollout = RolloutWorker(RolloutConfig(n=4, max_new_tokens=5, torch_threads=1), model_dir, "float32", None)
    full = rollout.generate(ids, mask, 4, 1.0, seed=0)
    full["response_mask"][1] = 0   # a response with no tokens: valid-sequence counts differ from row counts
    full["rewards"] = torch.rand(full.batch_size[0])
    full["advantages"] = compute_advantages("grpo", full["rewards"], full["response_mask"], full["group_ids"])
    single, batches, states = {}, {}, {}
    for case in specs:
        rows, config, loss = _configs(specs[case], sharded=False)
        actor = ActorWorker(config, loss, model_dir, "float32", None, temperature=1.0, device=device)
        reference = ReferenceWorker(model_dir, "float32", None, 1.0, SINGLE_REFERENCE, device=device,
                                    torch_threads=1)
        batch = full[:rows].clone()
        old, ref = actor.compute_logprobs(batch), reference.compute_logprobs(batch)
        batch["old_logprobs"] = old
        batch["ref_logprobs"] = ref + 0.05 * torch.randn_like(ref) * batch["response_mask"]
        metrics = actor.update(batch)
        single[case] = copy.deepcopy({"old": old, "ref": ref, "metrics": metrics, "weights": actor.state_dict(),
                                      "grads": {n: p.grad.cpu() for n, p in actor.model.named_parameters()},
                                      "optimizer": actor.optimizer_state()})  # copies: the next update changes them
        # a checkpoint for the shards to load: other weights and a second optimizer step's state
        actor.update(batch)
        (root / f"single-{case}").mkdir()
        actor.save_checkpoint(str(root / f"single-{case}"))
        states[case] = copy.deepcopy((actor.state_dict(), _to_cpu(actor.optimizer_state())))
        if config.mini_batch_size == 0:  # algorithm.old_logprobs=update from that checkpoint
            single[case].update(on_policy=actor.update(batch.exclude("old_logprobs"))["old_logprobs"],
                                on_policy_weights=actor.state_dict())
        single[case]["optimizer"] = _to_cpu(single[case]["optimizer"])
        single[case]["batch"] = batches[case] = batch
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_rank_main, args=(port, device, dtype, offload, model_dir, batches, str(root), world, fsdp_size,
                               specs, sequence_parallel, expert_parallel, after), nprocs=world, join=True)
    return {case: (single[case], torch.load(root / f"{case}.pt", weights_only=False), states[case])
            for case in specs}


def _to_cpu(optimizer_state: dict) -> dict:
    return {"state": {i: {k: v.cpu() if torch.is_tensor(v) else v for k, v in state.items()}
                      for i, state in optimizer_state["state"].items()},
            "param_groups": optimizer_state["param_groups"]}


# relative-error bounds: fp32 on CPU is exact up to summation order; on GPU the Triton dots of both sides run in
# TF32, and bf16 compute (mixed precision) against the fp32 single process is off by bf16's 3 significant digits
TOLERANCES = {"cpu": dict(logprobs=1e-6, grads=1e-5, weights=1e-4, optimizer=1e-5, metrics=1e-5),
              # measured: logprobs 1.2e-4, grads 1.2e-2, weights 2.5e-3 (a lost Adam step: ~2.5e-2), optimizer 1.5e-2
              "cpu-bf16": dict(logprobs=2e-3, grads=3e-2, weights=1e-2, optimizer=5e-2, metrics=5e-2),
              "cuda-fp32": dict(logprobs=1e-4, grads=2e-3, weights=1e-2, optimizer=4e-3, metrics=2e-3),
              "cuda-bf16": dict(logprobs=2e-2, grads=5e-2, weights=5e-2, optimizer=1e-1, metrics=5e-2)}


def check_case(single, sharded, checkpoint, tol):
    (loaded_model, loaded_optimizer) = checkpoint
    assert sharded["old"].shape == single["old"].shape
    assert rel_err(sharded["old"], single["old"]) < tol["logprobs"]
    assert rel_err(sharded["ref"], single["ref"]) < tol["logprobs"]
    assert set(sharded["grads"]) == set(single["grads"])
    for name, grad in single["grads"].items():
        assert grad.norm() > 0, name
        assert rel_err(sharded["grads"][name], grad) < tol["grads"], name
    for key, value in single["metrics"].items():
        assert sharded["metrics"][key] == pytest.approx(value, rel=tol["metrics"], abs=tol["metrics"] / 100), key
    for name, value in single["weights"].items():
        # Adam's first step amplifies the noise of near-zero gradients (one element off by 0.3% of a step seen on
        # CPU); a step lost or applied twice would be off by ~1e-2
        assert rel_err(sharded["weights"][name], value) < tol["weights"], name
    # the gathered optimizer state is the single process's, parameter index for parameter index
    for gathered, expected in ((sharded["optimizer"], single["optimizer"]),
                               (sharded["loaded_optimizer"], loaded_optimizer)):
        assert gathered["param_groups"][0]["params"] == expected["param_groups"][0]["params"]
        assert set(gathered["state"]) == set(expected["state"])
        for index, state in expected["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert rel_err(gathered["state"][index][key], state[key]) < tol["optimizer"], (index, key)
            assert float(gathered["state"][index]["step"]) == float(state["step"])
    for name, value in loaded_model.items():
        assert torch.equal(sharded["loaded_weights"][name], value), name
    if "on_policy" in single:   # an on-policy update (no old_logprobs): its log-probs gathered on rank 0
        assert rel_err(sharded["on_policy"], single["on_policy"]) < tol["logprobs"]
        for name, value in single["on_policy_weights"].items():
            assert rel_err(sharded["on_policy_weights"][name], value) < tol["weights"], name


@pytest.fixture(scope="module")
def cpu_results(tmp_path_factory):
    return run_cases(tmp_path_factory.mktemp("fsdp"), "cpu")


@pytest.mark.parametrize("case", list(CASES))
def test_fsdp2_over_gloo_matches_single_process(cpu_results, case):
    check_case(*cpu_results[case], TOLERANCES["cpu"])


@pytest.fixture(scope="module")
def cpu_hybrid_results(tmp_path_factory):
    return run_cases(tmp_path_factory.mktemp("fsdp-hybrid"), "cpu", arch="hybrid", cases=HYBRID_CASES)


@pytest.mark.parametrize("case", HYBRID_CASES)
def test_fsdp2_shards_a_delta_rule_policy(cpu_hybrid_results, case):
    """Each HybridDeltaDecoderLayer a shard unit; gradients, log-probs, weights and checkpoints as the single
    process's."""
    check_case(*cpu_hybrid_results[case], TOLERANCES["cpu"])


# HSDP: 4 ranks, two groups of 2 that each hold the model in shards; a rank with no rows, packed rows
HSDP_CASES = ["rows11-micro5-seq-mean-token-sum-norm-kl", "rows1-micro4-token-mean", "rows11-packed30-token-mean-kl"]


@pytest.fixture(scope="module")
def cpu_hsdp_results(tmp_path_factory):
    return run_cases(tmp_path_factory.mktemp("fsdp-hsdp"), "cpu", cases=HSDP_CASES, world=4, fsdp_size=2)


@pytest.mark.parametrize("case", HSDP_CASES)
def test_hybrid_sharding_over_4_gloo_ranks_matches_single_process(cpu_hsdp_results, case):
    """actor.fsdp.fsdp_size=2 on 4 ranks (a 2 × 2 mesh: replicate × shard): gradients summed over all four, the same
    update, log-probs, weights, checkpoint load and on-policy update as the single process."""
    check_case(*cpu_hsdp_results[case], TOLERANCES["cpu"])


# padded and packed (with the KL term: the bf16 reference), one spawn
BF16_CASES = ["rows11-micro5-token-mean", "rows11-packed30-token-mean-kl"]


@pytest.fixture(scope="module")
def cpu_bf16_results(tmp_path_factory):
    return run_cases(tmp_path_factory.mktemp("fsdp-bf16"), "cpu", dtype="bfloat16", cases=BF16_CASES)


@pytest.mark.parametrize("case", BF16_CASES)
def test_fsdp2_mixed_precision_over_gloo_matches_fp32(cpu_bf16_results, case):
    """model.dtype=bfloat16 under actor.mixed_precision: fp32 shards and optimizer state (checkpoints load into them
    exactly), bf16 compute through MixedPrecisionPolicy, the weight push in bf16; gradients, weights and log-probs
    within bf16's error of the fp32 single process."""
    check_case(*cpu_bf16_results[case], TOLERANCES["cpu-bf16"])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-cpu_offload", "bf16-param_offload-optimizer_offload",
                                       "bf16-hybrid"])
def test_fsdp2_over_nccl_matches_single_process(tmp_path, precision):
    """Offload: cpu_offload all the time; param_offload's shards offloaded after the old log-probs (the update's
    forward brings them back) and after the update (gradients, full weights and checkpoints read them offloaded)."""
    hybrid = precision.endswith("hybrid")
    cases = HYBRID_CASES if hybrid else list(CASES)
    results = run_cases(tmp_path, "cuda", dtype="float32" if precision == "fp32" else "bfloat16",
                        offload=tuple(key for key in precision.split("-") if key.endswith("offload")),
                        arch="hybrid" if hybrid else "qwen3", cases=cases)
    for case in cases:
        check_case(*results[case], TOLERANCES["cuda-fp32" if precision == "fp32" else "cuda-bf16"])


def test_fsdp_size_gives_the_mesh():
    assert FSDPConfig().mesh_shape(4) == (4,) and FSDPConfig(fsdp_size=4).mesh_shape(4) == (4,)
    assert FSDPConfig(fsdp_size=2).mesh_shape(8) == (4, 2)
    with pytest.raises(ConfigError, match=r"^actor.fsdp.fsdp_size: must divide the 4 ranks \(got 3\)"):
        FSDPConfig(fsdp_size=3).mesh_shape(4)


def test_rank_micro_batches_count_the_most_any_rank_runs():
    """Padded: contiguous rows per rank, micro_batch_size rows each; the count is the largest rank's. Packed: rows
    balanced by tokens, the unscored row left out, each rank's micro-batches within the budget."""
    td = TensorDict({"prompt_mask": torch.ones(5, 2, dtype=torch.long),
                     "response_mask": torch.ones(5, 3, dtype=torch.long)}, batch_size=[5])
    padded = MicroBatching(rows=2, packed=False)
    rows0, count = rank_micro_batches(td, 0, 2, padded)
    rows1, _ = rank_micro_batches(td, 1, 2, padded)
    assert [r.tolist() for r in rows0] == [[0, 1], [2]] and [r.tolist() for r in rows1] == [[3, 4]] and count == 2
    assert rank_micro_batches(td[:1], 1, 2, padded) == ([], 1)
    td["response_mask"][2] = 0
    td["response_mask"][4, 1:] = 0
    packed = MicroBatching(packed=True, max_tokens=5)
    shares = [rank_micro_batches(td, rank, 2, packed) for rank in range(2)]
    rows = sorted(int(i) for micro_rows, _ in shares for r in micro_rows for i in r)
    assert rows == [0, 1, 3, 4]
    assert all(count == max(len(micro_rows) for micro_rows, _ in shares) for _, count in shares)
    lengths = {0: 5, 1: 5, 3: 5, 4: 3}
    assert all(sum(lengths[int(i)] for i in r) <= 5 for micro_rows, _ in shares for r in micro_rows)
