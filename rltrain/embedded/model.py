"""The embedded policy: a small model built from a config — a Qwen3, or with `arch` a delta-rule policy of
rltrain_kernels.models' hybrid family — and its supervised warm start (cached on disk).

Archs (`model.embedded.arch`), each with its own layer count unless num_layers is set:
    qwen3    2 attention layers (transformers' Qwen3)
    hybrid   3 layers: 2 Gated DeltaNet (gated delta rule) then 1 attention; with more layers Qwen3-Next's mix,
             3 Gated DeltaNet : 1 attention, repeated; the last layer is attention whatever the count
    gdp      2 Gated DeltaProduct layers (2 Householder steps per token), no attention
    iplr     2 IPLR delta-rule layers, no attention
    kda      3 layers: 2 Kimi Delta Attention then 1 attention; with more layers Kimi Linear's mix, 3 KDA : 1
             attention, repeated; the last layer is attention whatever the count (as hybrid)
    qwen3_moe  2 attention layers whose MLP is a mixture of 4 experts, 2 per token (transformers' Qwen3-MoE)
The delta-rule archs keep Qwen3's attention, MLP and norms, and give their linear-attention layers num_heads heads
of head_dim (keys and values). The layer counts keep each arch's full default (300 steps) within 10 minutes on a
2-core CPU, Qwen3's budget (docs/delta-rule.md: the held-out gains per arch).
tests/rltrain/embedded/test_archs.py keeps each delta-rule arch's step time within a bound of the Qwen3's; not yet
kda's, whose layers train on the CPU through the per-step recurrence (no chunked PyTorch form yet: a layer's forward
+ backward on the default's batch costs about 2× a Gated DeltaNet layer's).

The warm start trains on the task's training prompts and answers until its greedy accuracy on a fixed sample of
training problems reaches `warmstart_target_accuracy` (checked every `warmstart_eval_every` steps), so RL starts
from a model that is right about that often, whatever the seed: supervised learning on this task improves in
sudden jumps, so a fixed step count gives starting points from 10% to 80% across seeds. It trains on the device
trainer.device resolves to (the GPU preset's 21M-parameter model in about a minute). The result is saved in HF format
under `<output_dir>/warmstart/<hash>` (written to a temporary of the process's own and renamed, under the trainer's
lock on the output directory) and reused by later runs with the same settings. The tool task
(data.task.kind=tool_arithmetic) warm-starts on the examples of rltrain/embedded/tool_task.py instead, with the
tokenizer's tool vocabulary, and its accuracy is that of episodes made to open with a calculator call. The code task
(data.task.kind=code_arithmetic) warm-starts on rltrain/embedded/code_task.py's mix of Python and math-notation
answers, and its accuracy is that of right transcriptions in either notation. The chain task
(data.task.kind=chain_arithmetic) warm-starts on rltrain/embedded/chain_task.py's worked answers, with `#` added to
the vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import shutil
from dataclasses import asdict
from pathlib import Path

import torch
import transformers as tf
from rltrain_kernels.models import HybridDeltaConfig

from rltrain.data.rows import PromptRow
from rltrain.data.sampler import encode_prompts
from rltrain.embedded import chain_task, code_task, tool_task
from rltrain.embedded.config import CONTEXT_LENGTH, EmbeddedModelConfig
from rltrain.embedded.task import make_rows
from rltrain.embedded.tokenizer import build_char_tokenizer
from rltrain.output_dir import temporary_dir
from rltrain.rewards.builtin import arithmetic_reward
from rltrain.workers.batch import IGNORE_INDEX, supervised_batch

logger = logging.getLogger(__name__)


# the token mixers of an arch's layers (rltrain/embedded/config.py ARCHS), repeated to num_layers; None: a Qwen3
ARCH_LAYERS = {"qwen3": None, "qwen3_moe": None, "hybrid": ("gated_delta_rule",) * 3 + ("full_attention",),
               "gdp": ("gated_delta_product",), "iplr": ("iplr",), "kda": ("kda",) * 3 + ("full_attention",)}
DEFAULT_LAYERS = {"qwen3": 2, "qwen3_moe": 2, "hybrid": 3, "gdp": 2, "iplr": 2, "kda": 3}
ENDS_ON_ATTENTION = ("hybrid", "kda")   # archs whose last layer is attention at any layer count
MOE = dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1)   # qwen3_moe


def layer_types(config: EmbeddedModelConfig) -> list[str] | None:
    """The arch's token mixer per layer (None for a Qwen3). A hybrid's (and kda's) last layer is always attention,
    so fewer than 4 layers still mix both kinds."""
    pattern = ARCH_LAYERS[config.arch]
    count = config.num_layers or DEFAULT_LAYERS[config.arch]
    if pattern is None:
        return None
    return [pattern[-1] if config.arch in ENDS_ON_ATTENTION and i == count - 1 else pattern[i % len(pattern)]
            for i in range(count)]


def build_model(config: EmbeddedModelConfig, tokenizer, seed: int):
    torch.manual_seed(seed)
    dims = dict(vocab_size=len(tokenizer), hidden_size=config.hidden_size, intermediate_size=2 * config.hidden_size,
                num_attention_heads=config.num_heads, num_key_value_heads=config.num_heads, head_dim=config.head_dim,
                max_position_embeddings=CONTEXT_LENGTH, tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
    mixers = layer_types(config)
    layers = config.num_layers or DEFAULT_LAYERS[config.arch]
    if config.arch == "qwen3_moe":   # each expert as wide as the dense MLP
        model_config = tf.Qwen3MoeConfig(num_hidden_layers=layers, moe_intermediate_size=2 * config.hidden_size,
                                         **MOE, **dims)
    elif mixers is None:
        model_config = tf.Qwen3Config(num_hidden_layers=layers, **dims)
    else:
        model_config = HybridDeltaConfig(layer_types=mixers, linear_num_heads=config.num_heads,
                                         linear_head_dim=config.head_dim, **dims)
    model_config._attn_implementation = "eager"
    return tf.AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)


def _sft_batch(rows: list[PromptRow], tokenizer):
    prompt_lens = [len(tokenizer(row.prompt).input_ids) for row in rows]
    enc = [tokenizer(row.prompt + str(row.ground_truth)).input_ids + [tokenizer.eos_token_id] for row in rows]
    # train on the answer and <eos> only
    labels = [[IGNORE_INDEX] * p + seq[p:] for seq, p in zip(enc, prompt_lens)]
    return supervised_batch(enc, labels, tokenizer.pad_token_id)


@torch.no_grad()
def greedy_accuracy(model, tokenizer, rows: list[PromptRow]) -> float:
    """Fraction of rows whose greedy answer (up to <eos>) the task's reward function scores as right."""
    ids, mask = encode_prompts(rows, tokenizer)
    out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), do_sample=False,
                         max_new_tokens=6, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    answers = tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
    return sum(arithmetic_reward(r.data_source, a, r.ground_truth) for a, r in zip(answers, rows)) / len(rows)


# per task kind: (the warm start's accuracy, its name in the log, its examples (rows, tokenizer, rng) -> batch)
WARM_STARTS = {
    "arithmetic": (greedy_accuracy, "greedy accuracy", lambda sample, tok, _: _sft_batch(sample, tok)),
    "tool_arithmetic": (tool_task.forced_call_accuracy, "forced-call accuracy", tool_task.sft_batch),
    "code_arithmetic": (code_task.transcription_accuracy, "transcription accuracy", code_task.sft_batch),
    "chain_arithmetic": (chain_task.greedy_accuracy, "greedy accuracy", chain_task.sft_batch),
}


def warm_start(model, tokenizer, rows: list[PromptRow], config: EmbeddedModelConfig, seed: int,
               kind: str = "arithmetic") -> float:
    """Supervised training on prompt -> answer, in place on the model's device, until the target accuracy (on 128
    training problems) or the step limit; returns the last measured accuracy. `kind` (data.task.kind) picks the
    examples and the accuracy (WARM_STARTS): the tool task's demonstrated calculator episodes and forced-call
    accuracy (rltrain/embedded/tool_task.py), the code task's answers in Python or math notation and their
    transcription accuracy (code_task.py), the chain task's worked answers (chain_task.py)."""
    rng = random.Random(seed)
    probe = rng.sample(rows, min(128, len(rows)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.warmstart_lr, weight_decay=0.0)
    measure, what, batch = WARM_STARTS[kind]
    accuracy = 0.0
    for step in range(1, config.warmstart_steps + 1):
        model.train()
        sample = rng.sample(rows, min(config.warmstart_batch_size, len(rows)))
        ids, mask, labels = (t.to(model.device) for t in batch(sample, tokenizer, rng))
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % config.warmstart_eval_every == 0 or step == config.warmstart_steps:
            model.eval()
            accuracy = measure(model, tokenizer, probe)
            logger.info("warm start step %d: loss %.3f, %s %.2f (target %.2f)", step, loss.item(), what,
                        accuracy, config.warmstart_target_accuracy)
            if accuracy >= config.warmstart_target_accuracy:
                break
    model.eval()
    if kind == "tool_arithmetic":
        logger.info("warm start done: the model opens a calculator call with probability %.3f",
                    tool_task.call_probability(model, tokenizer, probe))
    if kind == "code_arithmetic":
        logger.info("warm start done: %.3f of its greedy answers are in Python",
                    code_task.python_share(model, tokenizer, probe))
    return accuracy


def embedded_policy_dir(output_dir: str, config: EmbeddedModelConfig, task_config, seed: int,
                        device: str = "cpu") -> Path:
    """Build (or reuse) the warm-started embedded model; returns its HF-format directory. `device`: where the warm
    start trains (trainer.device resolved: a GPU preset's model warm-starts on the GPU, in seconds)."""
    mixers = layer_types(config)   # resolved: a change of an arch's default layer count makes a new warm start
    # the context length is part of the key: a model cached with a shorter one would fail the job's context check
    key = hashlib.sha256(json.dumps([asdict(config), asdict(task_config), seed, CONTEXT_LENGTH]
                                    + ([mixers] if mixers else []), sort_keys=True).encode())
    target = Path(output_dir) / "warmstart" / key.hexdigest()[:12]
    if (target / "config.json").is_file():
        logger.info("reusing the warm-started embedded model at %s", target)
        return target
    tokenizer = build_char_tokenizer(chain_task.CHAIN_CHARS if task_config.uses_chain else "",
                                     tools=task_config.uses_tools, code=task_config.uses_code)
    model = build_model(config, tokenizer, seed).to(device)
    train_rows, _ = make_rows(task_config)
    logger.info("warm-starting the embedded model (%d steps, on %s) -> %s", config.warmstart_steps, device, target)
    warm_start(model, tokenizer, train_rows, config, seed, task_config.kind)
    model.to("cpu")
    if device == "cuda":
        torch.cuda.empty_cache()   # the driver keeps no GPU blocks the model roles could use
    tmp = temporary_dir(target.parent, target.name)   # this process's own: renamed into place whole
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise
        # another process finished the same warm start first (the trainer's output-dir lock rules that out for
        # runs; direct callers may race): theirs is the same model
        logger.info("reusing the warm-started embedded model another process saved at %s first", target)
    return target
