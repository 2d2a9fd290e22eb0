"""What every role holding a policy copy shares: the `model` config section (ModelConfig), loading the policy (its
attention implementation chosen, the configured kernels swapped in), running it on padded rows or a packed row, and
computing per-token log-probs of responses with `rltrain_kernels.linear_logprobs` (no logits materialised)."""

from __future__ import annotations

from contextlib import nullcontext

import importlib.util
import logging
import os
from dataclasses import dataclass, field

import rltrain_kernels.models  # noqa: F401  (registers the delta-rule families with the Auto classes)
import torch
import transformers as tf
from rltrain_kernels import linear_logprobs
from rltrain_kernels.integrations.qwen3_next import takes_packed_rows, use_packed_linear_attention
from rltrain_kernels.registry import KernelConfig, apply_kernel_config, get_applied_kernels
from rltrain_kernels.sequence_parallel import SequenceParallel
from tensordict import TensorDict

from rltrain.config import require
from rltrain.embedded.config import EmbeddedModelConfig
from rltrain.workers.attention import (
    ATTN_IMPLEMENTATIONS, resolve_attn_implementation, use_packed_attention, varlen_kwargs,
)
from rltrain.workers.batch import IGNORE_INDEX, response_hidden
from rltrain.workers.hf_config import from_pretrained
from rltrain.workers.packing import MicroBatching, Packing

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelConfig:
    path: str | None = None          # a local transformers model directory; null = the embedded default
    # the compute dtype of every role (rltrain.job.resolve_dtype): auto (bfloat16 on cuda, else float32) | float32 |
    # bfloat16 | float16; the actor's trained weights stay fp32 under actor.mixed_precision
    dtype: str = "auto"
    attn_implementation: str = "auto"   # auto (= sdpa) | sdpa | eager | flash_attention_2 | flex_attention
    embedded: EmbeddedModelConfig = field(default_factory=EmbeddedModelConfig)

    def validate(self):
        *others, last = ("auto", *DTYPES)
        require(self.dtype == "auto" or self.dtype in DTYPES, "dtype", f"must be {', '.join(others)} or {last}",
                self.dtype)
        require(self.attn_implementation in ATTN_IMPLEMENTATIONS, "attn_implementation",
                f"must be one of {', '.join(ATTN_IMPLEMENTATIONS)}", self.attn_implementation)
        require(self.attn_implementation != "flash_attention_2" or importlib.util.find_spec("flash_attn") is not None,
                "attn_implementation", "'flash_attention_2' needs the flash-attn package, which is not installed; "
                "auto (SDPA, with torch's varlen flash attention for packed batches) needs none")


def set_threads(num_threads: int) -> None:
    torch.set_num_threads(num_threads if num_threads > 0 else max(1, os.cpu_count() or 1))


def release_cached_memory() -> None:
    """Hand this process's cached, unused GPU blocks back to the driver, so that a colocated vLLM engine waking next
    (weights, then KV cache) finds them free; PyTorch's allocator keeps the peak of the last call otherwise (Qwen3-1.7B
    shapes on one GPU, vLLM at gpu_memory_utilization 0.5: the KV cache's wake after step 2's update ran out of
    memory). Called at the end of the last GPU work of a step in each role's process."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def load_tokenizer(path: str, **kwargs):
    """A model directory's tokenizer. The delta-rule families are registered (at import, above): transformers reads
    the directory's config.json to pick the tokenizer and warns about a model_type it does not know."""
    return tf.AutoTokenizer.from_pretrained(path, **kwargs)


def load_policy(path: str, dtype: str, kernel_config: KernelConfig | None, device: str,
                attn_implementation: str = "auto"):
    tf.utils.logging.disable_progress_bar()  # one bar per load and save per worker is noise in the run's log
    attn = resolve_attn_implementation(attn_implementation)
    model = from_pretrained(tf.AutoModelForCausalLM, path, dtype=DTYPES[dtype], attn_implementation=attn)
    model.to(device)
    apply_kernel_config(model, kernel_config)
    # Qwen3-Next's Gated DeltaNet: a forward that also takes packed rows, whatever the kernels (a no-op elsewhere;
    # calls without cu_seqlens, decoding included, run transformers' forward as before)
    use_packed_linear_attention(model)
    applied = get_applied_kernels(model)
    logger.info("loaded policy %s (%s, %s attention) on %s; kernels: %s", path, dtype, attn, device,
                applied or "none")
    return model


def can_pack(model) -> bool:
    """Whether every layer of `model` takes a packed row's sequence boundaries: attention layers (cu_seqlens), a model
    that declares it (`supports_cu_seqlens`: rltrain_kernels.models' hybrid delta-rule family, whose linear-attention
    layers take them too), or linear-attention layers reached through transformers that have a packed forward
    (Qwen3-Next's Gated DeltaNet, which load_policy gives one: rltrain_kernels/integrations/qwen3_next.py). Any other
    layer would carry state from one sequence of a packed row into the next: such models run on padded rows."""
    if getattr(model, "supports_cu_seqlens", False):
        return True
    layer_types = getattr(model.config, "layer_types", None) or ()
    others = set(layer_types) - {"full_attention", "sliding_attention"}
    return not others or (others == {"linear_attention"} and takes_packed_rows(model))


def resolve_batching(model, batching: MicroBatching) -> MicroBatching:
    """`batching`, unpacked (with one log line) where the model cannot take a packed row. A packed one switches
    the model's attention to variable-length (use_packed_attention): the worker runs it on packed rows only."""
    if batching.packed and not can_pack(model):
        logger.warning("actor.use_remove_padding: %s has layers that take no sequence boundaries (layer_types "
                       "%s); running padded rows", type(model).__name__, sorted(set(model.config.layer_types)))
        return MicroBatching(batching.rows, False, batching.max_tokens)
    if batching.packed:
        use_packed_attention(model)
    return batching


def packed_hidden(model, packing: Packing) -> torch.Tensor:
    """Final hidden states of a packed row, [1, T, H] (position t predicts the token at t + 1), on a model
    resolve_batching switched to packed attention; under sequence parallelism this rank's slice of them."""
    inputs = packing.model_inputs()
    varlen = varlen_kwargs(inputs.pop("cu_seqlens"), inputs.pop("max_seqlen"))
    return model.base_model(**inputs, use_cache=False, **varlen).last_hidden_state


def policy_hidden(model, micro: TensorDict, packing: Packing | None) -> torch.Tensor:
    """The hidden states a loss head takes: [1, T, H] of the packed row, or [B, R, H] at the padded rows'
    response-predicting positions."""
    return response_hidden(model, micro) if packing is None else packed_hidden(model, packing)


def response_labels(micro: TensorDict, packing: Packing | None) -> torch.Tensor:
    """The labels beside policy_hidden's states: the response tokens the mask keeps, IGNORE_INDEX elsewhere, [1, T]
    on the packed row or [B, R] on the padded rows."""
    ids, mask = micro["response_ids"], micro["response_mask"]
    return ids.masked_fill(mask == 0, IGNORE_INDEX) if packing is None else packing.labels(ids, mask)


def micro_logprobs(model, micro: TensorDict, packed: bool, temperature: float, head=None,
                   sequence_parallel: SequenceParallel | None = None) -> torch.Tensor:
    """log p(response token) of one micro-batch (on the model's device), [B, R] fp32, 0 where masked. `head`
    (FSDP2) runs the model and a (hidden, weight) → result function in one sharded forward; with sequence_parallel
    each rank of the group scores its slice of the packed row and every rank returns the whole."""
    packing = Packing.of(micro, sequence_parallel) if packed else None
    labels = response_labels(micro, packing)

    def logprobs(hidden, weight):
        return linear_logprobs(hidden, weight, labels, temperature=temperature, return_entropy=False)[0]

    if head is None:
        logp = logprobs(policy_hidden(model, micro, packing), model.get_output_embeddings().weight)
    else:
        logp = head(micro, packing, logprobs)
    return logp if packing is None else packing.rows(logp)


def response_logprobs(model, batch: TensorDict, temperature: float, batching: MicroBatching,
                      around=None) -> torch.Tensor:
    """log p(response token) under `model` at `temperature`, [B, R] fp32 on the CPU (0 where masked). `around(micro)`:
    a context each micro-batch's forward runs in (the actor's routing replay)."""
    device = model.get_output_embeddings().weight.device
    parts = []
    with torch.no_grad():
        for rows in batching.groups(batch):
            micro = batching.take(batch, rows).to(device)
            with around(micro) if around is not None else nullcontext():
                parts.append((rows, micro_logprobs(model, micro, batching.packed, temperature).cpu()))
    return assemble_rows(batch, parts)


def assemble_rows(batch: TensorDict, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """[B, R] fp32 on the CPU from (row indices, values [rows, ≤ R]: micro-batches trim their padding) parts,
    0 where the response mask is."""
    out = torch.zeros(batch["response_ids"].shape, dtype=torch.float32)
    for rows, values in parts:
        out[rows, :values.shape[1]] = values.float().cpu()
    return out * (batch["response_mask"] != 0)


def untied_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """model.state_dict() without the later names of tied parameters (Qwen3-0.6B's lm_head.weight is its
    embed_tokens.weight: a fifth of its bytes). A receiver loads the first name once: vLLM skips lm_head when the
    embeddings are tied, and the transformers engine's tied head shares that parameter's storage."""
    kept = {name for name, _ in model.named_parameters()}  # each parameter once, under its first name
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - kept
    return {name: tensor for name, tensor in model.state_dict().items() if name not in tied}


def plan_buckets(state_dict: dict[str, torch.Tensor], bucket_mb: int) -> list[list[str]]:
    """The names of `state_dict` in order, cut into buckets of at most bucket_mb MB (a larger tensor alone), so a
    weight push holds one bucket of full tensors at a time. Sizes are the full (unsharded) ones for DTensors."""
    limit, buckets, size = bucket_mb * 2**20, [[]], 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if buckets[-1] and size + nbytes > limit:
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += nbytes
    return [b for b in buckets if b]
