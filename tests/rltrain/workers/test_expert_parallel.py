"""Expert parallelism (actor.expert_parallel_size) over gloo against the single process, fp32, with test_fsdp.py's
machinery: old and reference log-probs, the update's metrics (loss, gradient norm), every gradient (the experts'
gathered over the groups), the weights and optimizer state after one or two optimizer steps, a single-process
checkpoint loaded into the split experts, and an on-policy update from it. Beside that, on every rank: each holds
only its block of experts (n / E of every layer, the values of that block); its sharded checkpoint loads into the
single process and its HF export (save_pretrained) reloads as the same weights. Layouts: 2 ranks as one EP group of
2, and 4 ranks as 2 groups of 2 (the experts FSDP-sharded over the 2 replicas), on the embedded qwen3_moe (4 experts,
2 per token), and 2 ranks on transformers models built from small configs: a Qwen3-MoE of 8 experts, 3 per token, a
Qwen3-Next (a shared expert beside the routed ones, Gated DeltaNet layers) and a Mixtral. R3 on 2 EP ranks: the
rollout's recorded routing replayed gives the engine's log-probs. Also the config checks, each naming the key, and a
2-step main_grpo run through Ray with EP=2. On 2+ GPUs (@pytest.mark.gpu) the 2-rank cases run over NCCL in fp32.

Run: `pytest tests/rltrain/workers/test_expert_parallel.py`.
"""

import os
import shutil
import socket

import pytest
import ray
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers as tf

from rltrain import trainer as trainer_module
from rltrain.config import ConfigError
from rltrain.embedded.model import embedded_policy_dir
from rltrain.job import load_job_config
from rltrain.main_grpo import run
from rltrain.data.sampler import encode_prompts
from rltrain.embedded.task import make_rows
from rltrain.workers.actor import ActorWorker, FSDPActorWorker
from rltrain.workers.actor_config import ActorConfig, RouterReplayConfig
from rltrain.algorithms.config import LossConfig
from rltrain.workers.expert_parallel import check_model, experts_modules
from rltrain.workers.policy import load_policy
from tests.model_factory import tiny_qwen3_next
from tests.rltrain.workers.test_router import second_choice_rollouts
from tests.rltrain.tiny_job import compose, tiny_job
from tests.rltrain.workers.test_fsdp import TOLERANCES, check_case, rel_err, run_cases

# test_fsdp.py's CASES entries: (rows, micro_batch_size, mini_batch_size, loss_agg, kl_coef, gradient checkpointing,
# packed token budget)
CASES = {
    "rows11-micro5-token-mean": (11, 5, 0, "token-mean", 0.0, False, None),   # rank 1: a padding micro-batch
    "rows12-packed40-mini7-seq-mean-token-mean-kl": (12, 0, 7, "seq-mean-token-mean", 0.1, False, 40),  # 2 steps
    "rows8-micro3-token-mean-checkpointing": (8, 3, 0, "token-mean", 0.0, True, None),  # all-to-alls recomputed
}
MOE = {"arch": "qwen3_moe"}


def ep_state(actor, directory: str) -> dict:
    """On every rank: its experts are its block of the gathered ones; a checkpoint and an HF export for the single
    process to read back."""
    ep = actor.expert_parallel
    full = actor.state_dict()   # a collective; rank 0's
    holder = [full]
    dist.broadcast_object_list(holder, src=0)
    for name, param in actor.model.named_parameters():
        if name in ep.names:
            per_rank = param.shape[0]   # over the replicas: this group member's experts
            whole = holder[0][name]
            assert per_rank * ep.size == whole.shape[0], name
            assert torch.equal(param.full_tensor().cpu(), whole[ep.index * per_rank:(ep.index + 1) * per_rank]), name
    assert ep.names and len(ep.names) == 2 * len(experts_modules(actor.model))
    os.makedirs(f"{directory}-ep", exist_ok=True)
    actor.save_checkpoint(f"{directory}-ep", save_hf=True)
    return {"final_weights": full}


def check(single, sharded, checkpoint, tolerances: str = "cpu"):
    """check_case without actor/router_*: each rank's routers measure their own micro-batches (as under FSDP2 without
    EP: the routers run before the exchange), which differ from the single process's."""
    metrics = {k: v for k, v in single["metrics"].items() if not k.startswith("actor/router_")}
    assert len(metrics) < len(single["metrics"])
    check_case(dict(single, metrics=metrics), sharded, checkpoint, TOLERANCES[tolerances])


def check_read_back(results, root, case: str):
    """The single process loads the EP ranks' checkpoint and their HF export: the ranks' gathered weights."""
    _, sharded, _ = results[case]
    config = ActorConfig(torch_threads=1)
    model_dir = str(root / "hf-of-ep")
    shutil.copytree(root / f"{case}-ep" / "hf", model_dir)
    actor = ActorWorker(config, LossConfig(), model_dir, "float32", None, temperature=1.0)
    for name, value in sharded["final_weights"].items():
        assert torch.equal(actor.state_dict()[name], value), name   # the export
    actor.load_checkpoint(str(root / f"{case}-ep"))
    for name, value in sharded["final_weights"].items():
        assert torch.equal(actor.state_dict()[name], value), name   # the sharded checkpoint


@pytest.fixture(scope="module")
def ep2_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep2")
    return root, run_cases(root, "cpu", cases=CASES, arch="qwen3_moe", embedded=MOE, expert_parallel=2,
                           after=ep_state)


@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_2_ranks_matches_single_process(ep2_results, case):
    root, results = ep2_results
    check(*results[case])
    if case == "rows11-micro5-token-mean":
        check_read_back(results, root, case)


def test_expert_parallel_2_groups_of_2_matches_single_process(tmp_path):
    """4 ranks: 2 EP groups whose experts modules are FSDP2 units over the 2 replicas (gradients summed there)."""
    cases = {case: CASES[case] for case in ("rows12-packed40-mini7-seq-mean-token-mean-kl",)}
    results = run_cases(tmp_path, "cpu", cases=cases, arch="qwen3_moe", embedded=MOE, world=4, expert_parallel=2,
                        after=ep_state)
    for case in cases:
        check(*results[case])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_expert_parallel_over_nccl_matches_single_process(tmp_path):
    """The 2-rank cases over NCCL against the single process on one GPU, fp32 (TF32 matmuls) at test_fsdp.py's CUDA
    bars: the all-to-alls on NCCL, the local experts in transformers' code (no kernels, as test_fsdp.py's cases;
    benchmarks/bench_parallel_layouts.py runs them through fused_moe). Not bf16 against fp32 per
    tensor: a router near-tie sends a token to another expert under other bf16 rounding (measured on CPU and on an
    H200: two experts of the last layer off by one token's contribution, the same absolute error each)."""
    results = run_cases(tmp_path, "cuda", dtype="float32", cases=CASES, arch="qwen3_moe", embedded=MOE,
                        expert_parallel=2, after=ep_state)
    for case in CASES:
        check(*results[case], tolerances="cuda-fp32")


def wide_moe_variant(model_dir: str, root) -> str:
    """A transformers Qwen3-MoE of 8 experts, 3 per token, unnormalised top-k, drawn afresh (tokenizer kept)."""
    out = root / "wide-moe"
    shutil.copytree(model_dir, out)
    config = tf.AutoConfig.from_pretrained(model_dir)
    config.num_experts, config.num_experts_per_tok, config.norm_topk_prob = 8, 3, False
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return str(out)


def released_moe_variant(model_type: str):
    """variant(model_dir, root): a transformers model of `model_type` drawn afresh at the embedded tokenizer's
    vocabulary: Qwen3-Next (Gated DeltaNet and attention, 4 experts top 2 with a shared expert in its sparse layers,
    tests/model_factory.py) or Mixtral (4 experts, top 2, every layer sparse)."""
    def variant(model_dir: str, root) -> str:
        out = root / model_type
        shutil.copytree(model_dir, out)
        vocab = tf.AutoConfig.from_pretrained(model_dir).vocab_size
        if model_type == "qwen3_next":
            model = tiny_qwen3_next(vocab_size=vocab, seed=0)
        else:
            torch.manual_seed(0)
            config = tf.MixtralConfig(vocab_size=vocab, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                      num_experts_per_tok=2, max_position_embeddings=512, tie_word_embeddings=False)
            model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(out)
        return str(out)
    return variant


@pytest.mark.parametrize("model_type", ["qwen3_next", "mixtral"])
def test_expert_parallel_released_moe_layouts_match_single_process(tmp_path, model_type):
    """The MoE layouts of released models beyond Qwen3-MoE: Qwen3-Next (shared expert beside the routed ones, Gated
    DeltaNet layers) and Mixtral (every layer sparse)."""
    cases = {case: CASES[case] for case in ("rows11-micro5-token-mean",)}
    results = run_cases(tmp_path, "cpu", cases=cases, arch="qwen3_moe", embedded=MOE, expert_parallel=2,
                        variant=released_moe_variant(model_type), after=ep_state)
    for case in cases:
        check(*results[case])


def _r3_rank(rank, port, model_dir, batch, out_dir):
    """One of 2 EP ranks: old log-probs with the rollout's routing replayed and with the ranks' own."""
    os.environ["LOCAL_RANK"] = str(rank)
    result = {}
    for mode in ("R3", "disabled"):
        config = ActorConfig(torch_threads=1, strategy="fsdp2", expert_parallel_size=2, use_remove_padding=True,
                             max_tokens_per_micro_batch=40, router_replay=RouterReplayConfig(mode))
        actor = FSDPActorWorker(rank, 2, "127.0.0.1", port, config, LossConfig(), model_dir, "float32", None, 1.0)
        result[mode] = actor.compute_logprobs(batch)
        if mode == "R3":   # on-policy: the update's own forward replays too
            result["update"] = actor.update(batch.exclude("rollout_logprobs"))
        del actor
    if rank == 0:
        torch.save(result, f"{out_dir}/r3.pt")


def test_r3_replays_the_rollouts_routing_under_expert_parallelism(tmp_path):
    """test_router.py's R3 check on 2 EP ranks: the engine routes every token to its 2nd and 3rd likeliest experts and
    records that; the EP actor replaying it (each rank its own tokens, before their exchange) computes the engine's
    log-probs at fp32, and its own routing does not."""
    from transformers import AutoTokenizer

    job = tiny_job(tmp_path, model={"embedded": {**MOE, "num_layers": 2}})
    model_dir = str(embedded_policy_dir(job.trainer.output_dir, job.model.embedded, job.data.task, 0))
    ids, mask = encode_prompts(make_rows(job.data.task)[0][:3], AutoTokenizer.from_pretrained(model_dir))
    batch = second_choice_rollouts(model_dir, ids, mask)
    batch["advantages"] = torch.randn(12, 1).expand_as(batch["response_mask"]).contiguous()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_r3_rank, args=(port, model_dir, batch, str(tmp_path)), nprocs=2, join=True)
    result = torch.load(tmp_path / "r3.pt", weights_only=False)
    valid, engine_logprobs = batch["response_mask"].bool(), batch["rollout_logprobs"]
    assert (result["R3"] - engine_logprobs)[valid].abs().max() < 1e-5
    assert (result["disabled"] - engine_logprobs)[valid].abs().max() > 1e-3
    assert (result["update"]["old_logprobs"] - engine_logprobs)[valid].abs().max() < 1e-5
    assert result["update"]["actor/router_replay_mismatch"] == pytest.approx(1.0)


def test_expert_parallel_transformers_qwen3_moe_matches_single_process(tmp_path):
    cases = {case: CASES[case] for case in ("rows11-micro5-token-mean",)}
    results = run_cases(tmp_path, "cpu", cases=cases, arch="qwen3_moe", embedded=MOE, expert_parallel=2,
                        variant=wide_moe_variant, after=ep_state)
    for case in cases:
        check(*results[case])
        assert rel_err(results[case][1]["grads"]["model.layers.0.mlp.experts.down_proj"],
                       results[case][0]["grads"]["model.layers.0.mlp.experts.down_proj"]) < 1e-5


def test_trainer_runs_the_actor_expert_parallel(tmp_path, monkeypatch):
    """main_grpo through Ray on 2 CPU ranks with actor.strategy=fsdp2 and expert_parallel_size=2 (KL on: the
    reference FSDP2 beside it): 2 steps, each pushing the gathered experts to the rollout engine."""
    started, start_role = {}, trainer_module.start_role

    def record(cls, *args, **kwargs):
        started[cls.__name__] = getattr(kwargs.get("config"), "expert_parallel_size", None)
        return start_role(cls, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "start_role", record)
    job = tiny_job(tmp_path / "run", trainer={"n_gpus_per_node": 2}, model={"embedded": MOE},
                   actor={"strategy": "fsdp2", "expert_parallel_size": 2}, algorithm={"loss": {"kl_coef": 0.05}})
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        assert run(job)["step"] == 2
    finally:
        ray.shutdown()
    assert started["FSDPActorWorker"] == 2 and "FSDPReferenceWorker" in started


FSDP2 = ("trainer.device=cpu trainer.n_gpus_per_node=4 ray.num_cpus=4 actor.strategy=fsdp2 "
         "model.embedded.arch=qwen3_moe ")


@pytest.mark.parametrize("overrides, message", [
    ("actor.expert_parallel_size=2", "actor.expert_parallel_size: > 1 needs actor.strategy=fsdp2 (got 'single')"),
    (FSDP2 + "actor.expert_parallel_size=0", "actor.expert_parallel_size: must be >= 1"),
    (FSDP2 + "actor.expert_parallel_size=3", "actor.expert_parallel_size: must divide trainer.nnodes × "
     "trainer.n_gpus_per_node = 4"),
    (FSDP2 + "actor.expert_parallel_size=2 model.embedded.arch=qwen3", "actor.expert_parallel_size: > 1 splits a "
     "mixture-of-experts policy's experts; this policy is dense"),
    (FSDP2 + "actor.expert_parallel_size=2 actor.lora.rank=8", "actor.expert_parallel_size: > 1 is not supported "
     "with actor.lora"),
    (FSDP2 + "actor.expert_parallel_size=2 actor.ulysses_sequence_parallel_size=2", "actor.expert_parallel_size: > 1 "
     "is not supported with actor.ulysses_sequence_parallel_size > 1"),
    (FSDP2 + "actor.expert_parallel_size=2 actor.fsdp.fsdp_size=2", "actor.expert_parallel_size: > 1 is not "
     "supported with HSDP"),
], ids=["single", "zero", "ranks", "dense", "lora", "ulysses", "hsdp"])
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        load_job_config(compose(*overrides.split()))


def test_valid_config_loads():
    job = load_job_config(compose(*(FSDP2 + "actor.expert_parallel_size=4").split()))
    assert job.actor.expert_parallel_size == 4


def test_model_checks_name_the_key(tmp_path):
    """The expert count (known once the model loads) and a dense checkpoint."""
    job = tiny_job(tmp_path, model={"embedded": MOE})
    moe = load_policy(str(embedded_policy_dir(job.trainer.output_dir, job.model.embedded, job.data.task, 0)),
                      "float32", None, "cpu", "auto")
    assert len(check_model(moe, 4)) == moe.config.num_hidden_layers
    with pytest.raises(ConfigError, match=r"^actor.expert_parallel_size: 8 must divide .*'qwen3_moe'.*'s 4 experts"):
        check_model(moe, 8)
    dense = tiny_job(tmp_path / "dense", model={"embedded": {"arch": "qwen3"}})
    model = load_policy(str(embedded_policy_dir(dense.trainer.output_dir, dense.model.embedded, dense.data.task, 0)),
                        "float32", None, "cpu", "auto")
    with pytest.raises(ConfigError, match=r"^actor.expert_parallel_size: .*'qwen3'.* no stacked experts"):
        check_model(model, 2)
