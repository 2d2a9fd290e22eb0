"""What every role holding a policy copy shares: loading it (with the configured kernels swapped in) and
computing per-token log-probs of responses with `rltrain_kernels.linear_logprobs` (no logits materialised)."""

from __future__ import annotations

import logging
import os

import torch
from tensordict import TensorDict

from rltrain.workers.batch import IGNORE_INDEX, response_hidden, split

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def set_threads(num_threads: int) -> None:
    torch.set_num_threads(num_threads if num_threads > 0 else max(1, os.cpu_count() or 1))


def load_policy(path: str, dtype: str, kernel_config: dict | None, device: str):
    import transformers as tf
    from rltrain_kernels.registry import apply_kernel_config

    tf.utils.logging.disable_progress_bar()  # one bar per load and save per worker is noise in the run's log
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation="eager")
    model.to(device)
    applied = apply_kernel_config(model, kernel_config)
    logger.info("loaded policy %s (%s) on %s; kernels: %s", path, dtype, device, applied or "none")
    return model


def response_logprobs(model, batch: TensorDict, temperature: float, micro_batch_size: int) -> torch.Tensor:
    """log p(response token) under `model` at `temperature`, [B, R] fp32 on the CPU (0 where masked)."""
    from rltrain_kernels import linear_logprobs

    weight = model.get_output_embeddings().weight
    logps = []
    with torch.no_grad():
        for micro in split(batch, micro_batch_size):
            micro = micro.to(weight.device)
            labels = micro["response_ids"].masked_fill(micro["response_mask"] == 0, IGNORE_INDEX)
            logp, _ = linear_logprobs(response_hidden(model, micro), weight, labels, temperature=temperature,
                                      return_entropy=False)
            logps.append(logp.cpu())
    return torch.cat(logps)


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
