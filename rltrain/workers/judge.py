"""The generative judge (reward.judge): a causal LM reads each (prompt, response, ground truth) through a template and
gives a verdict, which a named parser turns into a score in [0, 1]; the trainer adds it, weighted, to the reward so far
(the function's, plus the reward model's where there is one): reward = rule_weight · reward + weight · judge, with
reward/judge_mean and reward/judge_failed_mean (the share of verdicts that did not parse) logged per step.

The judge is `reward.judge.path` (a model directory) or `policy` (the policy's starting checkpoint, frozen), run in a
Ray process of its own placed with the model roles, greedy, on `reward.judge.engine`: transformers (hf) or vLLM
(rltrain/workers/judge_vllm.py: the step's whole batch in one call); auto follows rollout.engine. The template
(`reward.judge.template`, a text file, else DEFAULT_TEMPLATE) is formatted with {prompt}, {response} and
{ground_truth} and rendered as one user message with the judge's chat template (plain text where it has none).
Parsers:

- `yes_no`: P(yes) / (P(yes) + P(no)) of its first reply token, each the probability summed over the tokens that
  begin "Yes", "yes", " Yes", " yes" (and the same for no; a token beginning both, such as a lone space, counts for
  neither): a calibrated score, 0.5 when the judge cannot tell (it fails only where both probabilities underflow
  to 0).
- `score`: the first number of its greedy reply (up to max_new_tokens), divided by `max_score` and clipped to [0, 1];
  a reply with no number is a failed verdict.

A failed verdict scores 0 and counts; a batch past `timeout_s` scores 0 for every sample and counts each one as
failed (the judge's next call waits for it to finish).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers as tf

from rltrain.config import ConfigError, require
from rltrain.workers.judge_vllm import VLLMJudgeModel
from rltrain.workers.group import PLACEMENTS
from rltrain.workers.hf_config import from_pretrained
from rltrain.workers.policy import DTYPES, load_tokenizer, release_cached_memory, set_threads

PARSERS = ("yes_no", "score")
ENGINES = ("auto", "hf", "vllm")
DEFAULT_TEMPLATE = ("Question:\n{prompt}\n\nReference answer: {ground_truth}\n\nResponse:\n{response}\n\n"
                    "Is the response correct? Answer Yes or No.")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
YES, NO = ("Yes", "yes", " Yes", " yes"), ("No", "no", " No", " no")


@dataclass
class JudgeConfig:
    path: str | None = None          # a causal-LM directory, or `policy` (the policy's starting checkpoint); null = none
    engine: str = "auto"             # auto (rollout.engine's kind) | hf | vllm (rltrain/workers/judge_vllm.py)
    template: str | None = None      # a text file with {prompt}, {response}, {ground_truth}; null = DEFAULT_TEMPLATE
    parser: str = "yes_no"           # yes_no | score
    max_score: float = 10.0          # score: the number that means 1
    max_new_tokens: int = 16         # score: the reply's length (greedy)
    weight: float = 1.0              # the judge's weight in the reward
    rule_weight: float = 1.0         # the weight of the reward before the judge (function, reward model)
    micro_batch_size: int = 8        # hf: conversations per forward / generate call
    timeout_s: float = 600.0         # one batch's verdicts; past it every sample scores 0 (and counts as failed)
    placement: str = "colocated"     # colocated (a share of the first model-role GPU) | separate (a GPU of its own)
    gpu_memory_utilization: float | None = None  # vllm: its GPU's share (weights + KV cache); null = memory_share
    kv_cache_gb: float | None = None     # vllm: KV cache size in GiB; null = from gpu_memory_utilization (CPU: set it)
    enforce_eager: bool = False          # vllm: no CUDA graphs (starts faster)

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def validate(self):
        if self.path is None:
            return
        require(self.path == "policy" or (Path(self.path).expanduser() / "config.json").is_file(), "path",
                "must be `policy` or a model directory holding config.json", self.path)
        require(self.engine in ENGINES, "engine", f"must be one of {', '.join(ENGINES)}", self.engine)
        require(self.placement in PLACEMENTS, "placement", f"must be one of {', '.join(PLACEMENTS)}", self.placement)
        require(self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization <= 1,
                "gpu_memory_utilization", "must be null or in (0, 1]", self.gpu_memory_utilization)
        require(self.kv_cache_gb is None or self.kv_cache_gb > 0, "kv_cache_gb", "must be null or > 0",
                self.kv_cache_gb)
        require(self.parser in PARSERS, "parser", f"must be one of {', '.join(PARSERS)}", self.parser)
        require(self.max_score > 0, "max_score", "must be > 0", self.max_score)
        require(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1", self.max_new_tokens)
        require(math.isfinite(self.weight), "weight", "must be a finite number", self.weight)
        require(math.isfinite(self.rule_weight), "rule_weight", "must be a finite number", self.rule_weight)
        require(self.micro_batch_size >= 1, "micro_batch_size", "must be >= 1", self.micro_batch_size)
        require(self.timeout_s > 0, "timeout_s", "must be > 0", self.timeout_s)
        template = self.template_text()
        try:
            template.format(prompt="", response="", ground_truth="")
        except (KeyError, IndexError, ValueError) as err:
            raise ConfigError(f"reward.judge.template: {self.template}: a placeholder other than {{prompt}}, "
                              f"{{response}}, {{ground_truth}} ({type(err).__name__}: {err}); write a literal brace "
                              "as {{ or }}") from None

    @property
    def memory_share(self) -> float:
        """vLLM's gpu_memory_utilization: as set, else a share beside the model roles or most of a GPU of its own."""
        if self.gpu_memory_utilization is not None:
            return self.gpu_memory_utilization
        return 0.85 if self.placement == "separate" else 0.2

    def template_text(self) -> str:
        if self.template is None:
            return DEFAULT_TEMPLATE
        try:
            return Path(self.template).expanduser().read_text()
        except OSError as err:
            raise ConfigError(f"reward.judge.template: cannot read {self.template!r} ({err.strerror})") from None


def prompt_text(prompt: str | list[dict]) -> str:
    """A row's prompt as text: itself, or its chat messages' contents, one per line."""
    return prompt if isinstance(prompt, str) else "\n".join(str(m.get("content", "")) for m in prompt)


def parse_score(reply: str, max_score: float) -> float | None:
    """The first number of `reply` over max_score, clipped to [0, 1]; None when it holds no number."""
    match = NUMBER.search(reply)
    return None if match is None else min(max(float(match.group()) / max_score, 0.0), 1.0)


def first_token_ids(tokenizer, words) -> list[int]:
    """The ids of the tokens each of `words` begins with (its first token alone), without duplicates."""
    ids = [tokenizer(word, add_special_tokens=False).input_ids[:1] for word in words]
    return sorted({i[0] for i in ids if i})


class JudgeWorker:
    """`engine`: hf or vllm (the trainer resolves `auto` to rollout.engine)."""

    def __init__(self, config: JudgeConfig, model_path: str, dtype: str, device: str = "cpu", torch_threads: int = 0,
                 engine: str = "hf"):
        set_threads(torch_threads)
        self.config, self.device = config, device
        self.template = config.template_text()
        self.tokenizer = load_tokenizer(model_path, padding_side="left")
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # a token that begins both words (a lone space where " Yes" is no token of its own) tells neither apart
        yes, no = first_token_ids(self.tokenizer, YES), first_token_ids(self.tokenizer, NO)
        self.yes, self.no = sorted(set(yes) - set(no)), sorted(set(no) - set(yes))
        if config.parser == "yes_no" and not (self.yes and self.no):
            raise ConfigError(f"reward.judge.parser: yes_no needs the judge's tokenizer ({model_path}) to begin "
                              f"'Yes' and 'No' with tokens of their own (got {yes} and {no}); use score")
        self.model = self.engine = None
        if engine == "vllm":
            self.engine = VLLMJudgeModel(config, model_path, dtype, self.yes, self.no)
        else:
            self.model = from_pretrained(tf.AutoModelForCausalLM, model_path, dtype=DTYPES[dtype]).to(device).eval()
            self.model.requires_grad_(False)

    def render(self, prompt: str | list[dict], response: str, ground_truth) -> str:
        content = self.template.format(prompt=prompt_text(prompt), response=response,
                                       ground_truth="" if ground_truth is None else ground_truth)
        if self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                      add_generation_prompt=True)
        return content

    @torch.no_grad()
    def score(self, prompts: list, responses: list[str], ground_truths: list) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores [B] in [0, 1], failed [B] bool) of the responses."""
        texts = [self.render(p, r, g) for p, r, g in zip(prompts, responses, ground_truths)]
        if self.engine is not None:  # the whole batch in one call: vLLM schedules it
            ids = self.tokenizer(texts, add_special_tokens=False).input_ids
            verdicts = self.engine.yes_no(ids) if self.config.parser == "yes_no" else \
                [parse_score(reply, self.config.max_score) for reply in self.engine.replies(ids)]
        else:
            verdicts, size = [], self.config.micro_batch_size
            try:
                for start in range(0, len(texts), size):
                    enc = self.tokenizer(texts[start:start + size], return_tensors="pt", padding=True,
                                         add_special_tokens=False).to(self.device)
                    verdicts += self._yes_no(enc) if self.config.parser == "yes_no" else self._score(enc)
            finally:
                release_cached_memory()
        return (torch.tensor([0.0 if v is None else v for v in verdicts], dtype=torch.float32),
                torch.tensor([v is None for v in verdicts], dtype=torch.bool))

    def timed_score(self, prompts: list, responses: list[str], ground_truths: list):
        """score()'s (scores, failed) and the seconds it took (reward.judge.timeout_s applies to them)."""
        start = time.monotonic()
        scores, failed = self.score(prompts, responses, ground_truths)
        return scores, failed, time.monotonic() - start

    def _yes_no(self, enc) -> list[float | None]:
        logits = self.model(**enc).logits[:, -1].float()
        probs = torch.softmax(logits, dim=-1)
        yes, no = probs[:, self.yes].sum(-1), probs[:, self.no].sum(-1)
        verdict = yes / (yes + no).clamp(min=1e-30)
        return [None if total <= 0 else float(v) for v, total in zip(verdict, (yes + no).tolist())]

    def _score(self, enc) -> list[float | None]:
        out = self.model.generate(**enc, do_sample=False, max_new_tokens=self.config.max_new_tokens,
                                  pad_token_id=self.tokenizer.pad_token_id)
        replies = self.tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        return [parse_score(reply, self.config.max_score) for reply in replies]
