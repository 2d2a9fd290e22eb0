"""Ulysses sequence parallelism (actor.ulysses_sequence_parallel_size) over gloo against the single process, fp32, with
test_fsdp.py's machinery: old and reference log-probs, the update's metrics (loss included), every gradient, the
weights and optimizer state after the step, a checkpoint loaded into the shards and an on-policy update from it. Each
packed row is split over the sequence group, and the cases assert that sequences cross the cuts between ranks.
Groups: 2 ranks (sp=2), 4 ranks (sp=4, on a GQA model with one key/value head, repeated to one per rank) and 4 ranks
as 2 data × 2 sequence (with HSDP); softmax attention (Qwen3) and the hybrid delta-rule family (Gated DeltaNet +
attention; the three delta-rule layers alone: tests/kernels/layers/test_sequence_parallel.py). Also the config and
model checks, each naming the key, and a 2-step main_grpo run through Ray whose actor and reference both split rows.

Run: `pytest tests/rltrain/workers/test_ulysses.py` (~1 min on 2 cores, mostly process starts).
"""

import shutil
from types import SimpleNamespace

import json

import pytest
import ray
import torch
import transformers as tf

from rltrain import trainer as trainer_module
from rltrain.config import ConfigError
from rltrain.job import load_job_config
from rltrain.main_grpo import run
from rltrain.workers.actor_config import ActorConfig
from rltrain.workers.fsdp import rank_micro_batches
from rltrain.workers.packing import Packing
from rltrain.workers.policy import load_policy, resolve_batching
from rltrain.workers.ulysses import check_model, sequence_parallel_batching
from tests.rltrain.tiny_job import compose, tiny_job
from tests.rltrain.workers.test_fsdp import SHARDED_REFERENCE, TOLERANCES, _configs, check_case, run_cases

# test_fsdp.py's CASES entries: (rows, micro_batch_size, mini_batch_size, loss_agg, kl_coef, gradient checkpointing,
# packed token budget); all packed, every loss aggregation
CASES = {
    "rows11-packed30-token-mean-kl": (11, 0, 0, "token-mean", 0.1, False, 30),
    "rows11-packed20-seq-mean-token-mean": (11, 0, 0, "seq-mean-token-mean", 0.0, False, 20),
    "rows11-packed30-seq-mean-token-sum-norm-kl": (11, 0, 0, "seq-mean-token-sum-norm", 0.1, False, 30),
    "rows12-packed40-mini7-seq-mean-token-sum": (12, 0, 7, "seq-mean-token-sum", 0.0, False, 40),  # 2 steps
    "rows8-packed30-token-mean-checkpointing": (8, 0, 0, "token-mean", 0.0, True, 30),  # all-to-alls recomputed
    "rows1-packed30-token-mean": (1, 0, 0, "token-mean", 0.0, False, 30),   # a data rank with no rows
}
EMBEDDED = {"num_heads": 4, "num_layers": 2}   # heads that 2 and 4 ranks divide


def crossings(batch, spec, data_ranks: int, size: int) -> int:
    """Sequences of the sharded micro-batches (actor and reference) that span a cut between two ranks' slices."""
    _, config, _ = _configs(spec, sharded=True)
    count = 0
    for batching in (sequence_parallel_batching(b, size) for b in (config.micro_batching, SHARDED_REFERENCE)):
        for data_rank in range(data_ranks):
            for rows in rank_micro_batches(batch, data_rank, data_ranks, batching)[0]:
                packing = Packing.of(batching.take(batch, rows), SimpleNamespace(rank=0, size=size))
                cuts = torch.arange(1, size) * (packing.padded_tokens // size)
                starts, ends = packing.cu_seqlens[:-1, None], packing.cu_seqlens[1:, None]
                count += int(((starts < cuts) & (cuts < ends)).sum())
    return count


def gqa_variant(model_dir: str, root) -> str:
    """The model with one key/value head for its 4 query heads, weights drawn afresh (tokenizer files kept)."""
    out = root / "gqa"
    shutil.copytree(model_dir, out)
    config = tf.AutoConfig.from_pretrained(model_dir)
    config.num_key_value_heads = 1
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return str(out)


def check_results(results, world: int, size: int):
    for case, (single, sharded, checkpoint) in results.items():
        check_case(single, sharded, checkpoint, TOLERANCES["cpu"])
        if single["batch"]["response_mask"].sum(1).gt(0).sum() > 1:
            assert crossings(single["batch"], CASES[case], world // size, size) > 0, case


SP2 = list(CASES)
SP4 = ["rows11-packed30-token-mean-kl", "rows11-packed20-seq-mean-token-mean"]
SP2_DP2 = ["rows11-packed30-seq-mean-token-sum-norm-kl", "rows1-packed30-token-mean"]


def test_sequence_parallel_2_ranks_matches_single_process(tmp_path):
    """sp=2 on 2 ranks (one data rank): every case."""
    results = run_cases(tmp_path, "cpu", cases={c: CASES[c] for c in SP2}, world=2, sequence_parallel=2,
                        embedded=EMBEDDED)
    check_results(results, 2, 2)


def test_sequence_parallel_4_ranks_gqa_matches_single_process(tmp_path):
    """sp=4 on 4 ranks, 4 query heads and 1 key/value head: the key/value head repeated to one per rank."""
    results = run_cases(tmp_path, "cpu", cases={c: CASES[c] for c in SP4}, world=4, sequence_parallel=4,
                        embedded=EMBEDDED, variant=gqa_variant)
    check_results(results, 4, 4)


def test_sequence_parallel_2_by_data_parallel_2_matches_single_process(tmp_path):
    """4 ranks as 2 data × 2 sequence ranks, the parameters hybrid-sharded (fsdp_size 2): a data rank with no rows
    runs padding micro-batches in both its sequence ranks."""
    results = run_cases(tmp_path, "cpu", cases={c: CASES[c] for c in SP2_DP2}, world=4, fsdp_size=2,
                        sequence_parallel=2, embedded=EMBEDDED)
    check_results(results, 4, 2)


HYBRID = ["rows11-packed30-token-mean-kl", "rows11-packed20-seq-mean-token-mean"]


def test_sequence_parallel_delta_rule_policy_matches_single_process(tmp_path):
    """sp=2 on the hybrid family (a Gated DeltaNet layer, then attention): its convolutions read across the cut, its
    recurrence runs on every token of half the heads."""
    results = run_cases(tmp_path, "cpu", arch="hybrid", cases={c: CASES[c] for c in HYBRID}, world=2,
                        sequence_parallel=2, embedded=EMBEDDED)
    check_results(results, 2, 2)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("arch, dtype", [("qwen3", "float32"), ("qwen3", "bfloat16"), ("hybrid", "bfloat16")])
def test_sequence_parallel_over_nccl_matches_single_process(tmp_path, arch, dtype):
    """sp=2 on 2 GPUs over NCCL (torch's varlen flash attention in bf16, the short convolutions' Triton kernels)
    against the fp32 single process on one GPU."""
    results = run_cases(tmp_path, "cuda", dtype=dtype, arch=arch, cases={c: CASES[c] for c in HYBRID}, world=2,
                        sequence_parallel=2, embedded=EMBEDDED)
    for single, sharded, checkpoint in results.values():
        check_case(single, sharded, checkpoint, TOLERANCES["cuda-fp32" if dtype == "float32" else "cuda-bf16"])


def test_trainer_runs_the_actor_and_reference_sequence_parallel(tmp_path, monkeypatch):
    """main_grpo through Ray on 2 CPU ranks with actor.strategy=fsdp2 and ulysses_sequence_parallel_size=2: both the
    actor and the reference (KL on) start with the group size, and 2 steps train with a KL and a gradient."""
    started, start_role = {}, trainer_module.start_role

    def record(cls, *args, **kwargs):
        config = kwargs.get("config")
        started[cls.__name__] = kwargs.get("sequence_parallel_size", getattr(config, "ulysses_sequence_parallel_size",
                                                                             None))
        return start_role(cls, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "start_role", record)
    job = tiny_job(tmp_path / "run", trainer={"n_gpus_per_node": 2},
                   actor={"strategy": "fsdp2", "ulysses_sequence_parallel_size": 2},
                   algorithm={"loss": {"kl_coef": 0.05}})
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        assert run(job)["step"] == 2
    finally:
        ray.shutdown()
    assert started["FSDPActorWorker"] == 2 and started["FSDPReferenceWorker"] == 2
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "actor/grad_norm" in r]
    assert len(trained) == 2 and all(r["actor/grad_norm"] > 0 and r["actor/ref_kl"] >= 0 for r in trained)


@pytest.mark.parametrize("overrides, message", [
    ("actor.ulysses_sequence_parallel_size=0", "actor.ulysses_sequence_parallel_size: must be >= 1 (1 = off)"),
    ("actor.ulysses_sequence_parallel_size=2", "actor.ulysses_sequence_parallel_size: > 1 needs actor.strategy=fsdp2"),
    ("actor.strategy=fsdp2 actor.use_remove_padding=false actor.ulysses_sequence_parallel_size=2",
     "actor.ulysses_sequence_parallel_size: > 1 splits packed rows: needs actor.use_remove_padding=true"),
    ("trainer.device=cpu trainer.n_gpus_per_node=4 ray.num_cpus=4 actor.strategy=fsdp2 "
     "actor.ulysses_sequence_parallel_size=3", "actor.ulysses_sequence_parallel_size: must divide trainer.nnodes × "
     "trainer.n_gpus_per_node = 4"),
    ("trainer.device=cpu trainer.n_gpus_per_node=2 ray.num_cpus=4 actor.strategy=fsdp2 "
     "actor.ulysses_sequence_parallel_size=2 algorithm=gspo", "actor.ulysses_sequence_parallel_size: > 1 needs "
     "algorithm.loss.importance_level=token"),
    ("trainer.device=cpu trainer.n_gpus_per_node=2 ray.num_cpus=4 actor.strategy=fsdp2 "
     "actor.ulysses_sequence_parallel_size=2 model.attn_implementation=flex_attention",
     "actor.ulysses_sequence_parallel_size: > 1 runs attention through rltrain_varlen"),
    ("trainer.device=cpu trainer.n_gpus_per_node=2 ray.num_cpus=4 actor.strategy=fsdp2 "
     "actor.ulysses_sequence_parallel_size=2 algorithm=ppo",
     "actor.ulysses_sequence_parallel_size: > 1 is the actor's and the reference's: the critic"),
], ids=["zero", "single", "padded", "indivisible", "gspo", "flex", "critic"])
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        load_job_config(compose(*overrides.split()))


def test_valid_config_loads():
    job = load_job_config(compose("trainer.device=cpu", "trainer.n_gpus_per_node=4", "ray.num_cpus=4",
                                  "actor.strategy=fsdp2", "actor.ulysses_sequence_parallel_size=2"))
    assert job.actor.ulysses_sequence_parallel_size == 2 and ActorConfig().ulysses_sequence_parallel_size == 1


def _packed_model(tmp_path, **config):
    """A tiny transformers model saved and loaded as the workers load it, packed attention switched on."""
    torch.manual_seed(0)
    model_type = config.pop("model_type")
    model_config = tf.AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=2, head_dim=8, **config)
    tf.AutoModelForCausalLM.from_config(model_config).save_pretrained(tmp_path)
    model = load_policy(str(tmp_path), "float32", None, "cpu")
    return model, resolve_batching(model, ActorConfig().micro_batching)


def test_model_checks_name_the_key(tmp_path):
    """Heads the group does not divide, key/value heads it neither divides nor is a multiple of, linear-attention
    heads of the hybrid family it does not divide, and a model whose linear-attention layers have no sequence-parallel
    path (Qwen3-Next's Gated DeltaNet) are refused naming actor.ulysses_sequence_parallel_size."""
    model, _ = _packed_model(tmp_path / "qwen3", model_type="qwen3", num_attention_heads=6, num_key_value_heads=3)
    check_model(model, 3)
    check_model(model, 6)
    with pytest.raises(ConfigError, match=r"^actor.ulysses_sequence_parallel_size: 4 must divide .*'qwen3'.*6 "
                                          r"attention heads"):
        check_model(model, 4)
    with pytest.raises(ConfigError, match=r"^actor.ulysses_sequence_parallel_size: 2 must divide .*3 key/value"):
        check_model(model, 2)
    model, _ = _packed_model(tmp_path / "hybrid", model_type="hybrid_delta", num_attention_heads=4,
                             num_key_value_heads=4, layer_types=["gated_delta_rule", "full_attention"],
                             linear_num_heads=6, linear_head_dim=8)
    check_model(model, 2)
    with pytest.raises(ConfigError, match=r"^actor.ulysses_sequence_parallel_size: .*'hybrid_delta'.*: 4 must divide "
                                          r"the linear-attention layers' 6 heads"):
        check_model(model, 4)
    model, _ = _packed_model(tmp_path / "next", model_type="qwen3_next", num_attention_heads=4,
                             num_key_value_heads=2, linear_num_value_heads=4, linear_num_key_heads=2,
                             linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=16, shared_expert_intermediate_size=16,
                             layer_types=["linear_attention", "full_attention"])
    with pytest.raises(ConfigError, match=r"^actor.ulysses_sequence_parallel_size: .*'qwen3_next'.* "
                                          r"linear_attention layers"):
        check_model(model, 2)
