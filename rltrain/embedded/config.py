"""The embedded default's config sections, `model.embedded` (EmbeddedModelConfig: rltrain/embedded/model.py builds
it) and `data.task` (TaskConfig: rltrain/embedded/task.py makes its rows). They are apart from the code that uses
them so that the generic sections holding them (ModelConfig in rltrain/workers/policy.py, DataConfig in
rltrain/data/sampler.py) import settings only, never the demo's model, task or warm start."""

from __future__ import annotations

from dataclasses import dataclass

from rltrain.config import require

ARCHS = ("qwen3", "qwen3_moe", "hybrid", "gdp", "iplr", "kda")
# the model's max_position_embeddings: data.max_prompt_length's default 256 + rollout.max_new_tokens must fit (the
# job's context check); RoPE's frequencies do not depend on it, so the trained weights are those of any other length
CONTEXT_LENGTH = 1024
# chain_arithmetic draws this many distinct problems (train + held out) from a space far larger than a run samples
CHAIN_PROBLEMS = 50_000
KINDS = ("arithmetic", "tool_arithmetic", "code_arithmetic", "chain_arithmetic")


@dataclass
class EmbeddedModelConfig:
    arch: str = "qwen3"                    # qwen3 | qwen3_moe | hybrid | gdp | iplr | kda (rltrain/embedded/model.py)
    hidden_size: int = 128
    num_layers: int = 0                    # 0 = the arch's own (rltrain/embedded/model.py DEFAULT_LAYERS)
    num_heads: int = 4
    head_dim: int = 32
    warmstart_steps: int = 600             # upper bound on supervised steps
    warmstart_target_accuracy: float = 0.15  # stop once greedy accuracy on training problems reaches this
    warmstart_eval_every: int = 20
    warmstart_batch_size: int = 64
    warmstart_lr: float = 3e-3

    def validate(self):
        require(self.arch in ARCHS, "arch", f"must be one of {', '.join(ARCHS)}", self.arch)
        require(self.num_layers >= 0, "num_layers", "must be >= 0 (0 = the arch's own)", self.num_layers)
        for key in ("hidden_size", "num_heads", "head_dim", "warmstart_batch_size"):
            require(getattr(self, key) >= 1, key, "must be >= 1", getattr(self, key))
        require(self.warmstart_steps >= 0, "warmstart_steps", "must be >= 0", self.warmstart_steps)
        require(0 < self.warmstart_target_accuracy <= 1, "warmstart_target_accuracy", "must be in (0, 1]",
                self.warmstart_target_accuracy)
        require(self.warmstart_eval_every >= 1, "warmstart_eval_every", "must be >= 1", self.warmstart_eval_every)


@dataclass
class TaskConfig:
    kind: str = "arithmetic"    # arithmetic | tool_arithmetic | code_arithmetic | chain_arithmetic (task.py)
    min_operand: int = 0        # operands drawn from [min_operand, max_operand]
    max_operand: int = 49
    operators: str = "+"        # any of "+-*" (code_arithmetic: of "+-", the sign between its terms; chain: of "+-")
    min_terms: int = 3          # chain_arithmetic: terms per problem, from [min_terms, max_terms]
    max_terms: int = 6
    num_val: int = 200          # held-out problems (never trained on)
    seed: int = 0

    def validate(self):
        require(self.kind in KINDS, "kind", f"must be one of {', '.join(KINDS)}", self.kind)
        require(self.min_operand >= 0, "min_operand", "must be >= 0", self.min_operand)
        require(self.max_operand >= max(1, self.min_operand), "max_operand", f"must be >= 1 and >= min_operand "
                f"({self.min_operand})", self.max_operand)
        require(bool(self.operators) and set(self.operators) <= set("+-*"), "operators",
                "must be a non-empty subset of '+-*'", self.operators)
        require(len(set(self.operators)) == len(self.operators), "operators", "must not repeat an operator (the "
                "problems are counted and drawn per operator)", self.operators)
        require(not self.uses_code or set(self.operators) <= set("+-"), "operators", "must be a non-empty subset of "
                "'+-' with kind=code_arithmetic (the sign between a formula's terms)", self.operators)
        require(not self.uses_chain or set(self.operators) <= set("+-"), "operators", "must be a non-empty subset of "
                "'+-' with kind=chain_arithmetic", self.operators)
        require(self.min_terms >= 2, "min_terms", "must be >= 2", self.min_terms)
        require(self.max_terms >= self.min_terms, "max_terms", f"must be >= min_terms ({self.min_terms})",
                self.max_terms)
        require(self.num_val >= 1, "num_val", "must be >= 1", self.num_val)
        operands = self.max_operand - self.min_operand + 1
        if self.uses_chain:   # CHAIN_PROBLEMS are drawn from this space (rltrain/embedded/chain_task.py)
            problems = min(CHAIN_PROBLEMS, self.chain_space)
        else:
            forms = 3 if self.uses_code else 1   # code_arithmetic: linear, square, factored (code_task.py)
            problems = forms * len(self.operators) * operands ** 2
        require(self.num_val < problems, "num_val", f"leaves no training problems (the task has {problems})",
                self.num_val)

    @property
    def uses_tools(self) -> bool:
        return self.kind == "tool_arithmetic"

    @property
    def uses_code(self) -> bool:
        return self.kind == "code_arithmetic"

    @property
    def uses_chain(self) -> bool:
        return self.kind == "chain_arithmetic"

    @property
    def chain_space(self) -> int:
        """How many distinct chain problems the settings allow (terms, operands and operators between them)."""
        operands = self.max_operand - self.min_operand + 1
        return sum(operands ** n * len(self.operators) ** (n - 1) for n in range(self.min_terms, self.max_terms + 1))
