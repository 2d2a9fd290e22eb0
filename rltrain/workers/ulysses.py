"""Ulysses sequence parallelism for the FSDP2 actor and reference (`actor.ulysses_sequence_parallel_size`, verl's
name; the reference follows it): groups of that many consecutive ranks share each packed row, every rank running a
contiguous slice of its tokens, so a row's activations are spread over the group and rows longer than one GPU holds
train.

The ranks form a data × sequence mesh (world / size, size). Each data rank takes its share of the rows
(rank_micro_batches), every rank of its sequence group the same micro-batches, cut by size × the token budget
(actor.max_tokens_per_micro_batch stays a per-rank budget, as verl's ppo_max_token_len_per_gpu); a rank runs its slice
of each packed row (rltrain/workers/packing.py: the row padded to a multiple of size, position ids and cu_seqlens the
whole row's). Token-local layers (embeddings, norms, MLPs, the projections) run on the slice as they are; a token
mixer switches to a slice of the heads over the whole row by an all-to-all and back after
(rltrain_kernels.sequence_parallel): softmax attention in `rltrain_varlen` (rltrain/workers/attention.py), the
delta-rule layers of rltrain_kernels' hybrid_delta family in their own forward. The fused LM-head ops run on the
rank's tokens: log-probs are gathered over the group, and the loss of a slice takes the whole row's aggregation
weights (fused_policy_loss's loss_weights), so the slices' losses are partial sums of the micro-batch's loss.

FSDP2 shards over all ranks, as verl does, not over the data axis alone: the ranks of a sequence group hold the same
model and their gradients are partial sums of one loss, which must be summed anyway, and FSDP's reduce-scatter over
every rank (a sum, divide factor 1) sums over both axes at once, while each rank keeps the smallest shard (1 / world
of the parameters, gradients and optimizer state; sharding over the data axis would hold size × as much and need a
second all-reduce over the sequence axis). `actor.fsdp.fsdp_size` (HSDP) applies unchanged. A sequence group is
consecutive ranks, one node's GPUs where size divides them: its all-to-alls move activations in every layer.

Refused, naming the key: a model whose config.layer_types name token mixers without such a path (Qwen3-Next's
linear_attention), heads the group's size does not divide, attention implementations other than rltrain_varlen
(model.attn_implementation flash_attention_2 / flex_attention), padded batches and GSPO's sequence-level ratio
(rltrain/job.py). tests/rltrain/workers/test_ulysses.py checks log-probs, loss and gradients against the single
process over gloo.
"""

from __future__ import annotations

from dataclasses import replace

from rltrain_kernels.sequence_parallel import SequenceParallel
from torch.distributed.device_mesh import init_device_mesh

from rltrain.config import ConfigError
from rltrain.workers.attention import VARLEN
from rltrain.workers.packing import MicroBatching

KEY = "actor.ulysses_sequence_parallel_size"
# layer types (config.layer_types) whose token mixer is softmax attention: they run through rltrain_varlen
ATTENTION_LAYERS = {"full_attention", "sliding_attention"}


def sequence_parallel_group(rank: int, world_size: int, size: int, device: str) -> tuple[SequenceParallel, int]:
    """(this rank's sequence group, its data rank): the (world_size / size, size) mesh's row and column (a collective:
    every rank calls it)."""
    if world_size % size:
        raise ConfigError(f"{KEY}: must divide the {world_size} ranks (got {size})")
    mesh = init_device_mesh(device, (world_size // size, size), mesh_dim_names=("data", "sequence"))
    return SequenceParallel(mesh["sequence"].get_group()), rank // size


def sequence_parallel_batching(batching: MicroBatching, size: int) -> MicroBatching:
    """A sequence group's micro-batches: packed rows of size × the per-rank token budget (0, by rows, stays)."""
    return replace(batching, max_tokens=batching.max_tokens * size)


def check_model(model, size: int) -> None:
    """Refuse a model this rank cannot run on a slice of a row's tokens (module docstring), naming the key; `model`
    as resolve_batching left it (packed attention)."""
    config = model.config
    name = f"{type(model).__name__} (model_type {config.model_type!r})"
    others = set(getattr(config, "layer_types", None) or ()) - ATTENTION_LAYERS
    if others and not getattr(model, "supports_sequence_parallel", False):
        raise ConfigError(f"{KEY}: {name} has {', '.join(sorted(others))} layers, which have no sequence-parallel "
                          "path; softmax-attention models and the hybrid_delta family have one: set it to 1")
    if config._attn_implementation != VARLEN:
        raise ConfigError(f"{KEY}: > 1 runs attention through {VARLEN}; model.attn_implementation "
                          f"{config._attn_implementation!r} has no sequence-parallel path: use auto, sdpa or eager")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % size or (kv_heads % size and size % kv_heads):
        raise ConfigError(f"{KEY}: {size} must divide {name}'s {heads} attention heads and divide or be a multiple "
                          f"of its {kv_heads} key/value heads (each rank runs whole heads)")
    check_layers = getattr(model, "check_sequence_parallel", None)
    if check_layers is not None:
        try:
            check_layers(size)
        except ValueError as err:
            raise ConfigError(f"{KEY}: {name}: {err}") from None
