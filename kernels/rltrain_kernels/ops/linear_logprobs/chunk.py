"""Chunked forward/backward drivers for `linear_logprobs`, shared by the torch and the Triton paths.

The tokens × vocab logits are visited one tile of at most `token_chunk × vocab_chunk` fp32 values at a time:

    forward : tile = hidden_t @ weight_v.T (cuBLAS, fp32 out)     then a row pass folds the tile into per-row
              running (max, Σexp, Σexp·shifted-logit, label logit)        (online softmax across vocab tiles)
    backward: tile = hidden_t @ weight_v.T (recomputed)           then a row pass turns it, in place, into
              dlogits = ∂loss/∂logits (weight dtype);  grad_hidden_t += dlogits @ weight_v (fp32 accumulator),
              grad_weight_v += dlogits.T @ hidden_t

i.e. 4 GEMMs in total and one elementwise pass per GEMM output. What runs the GEMMs and the row passes is a tile
backend (ops/common/vocab_tiles.py, shared with the policy loss): TorchTiles (the CPU/NPU path and the readable
reference), row_pass.TritonTiles (cuBLAS + Triton row passes), or fused.FusedTiles (the row passes in the GEMMs'
epilogues, common/vocab_gemm.py).

Why 2-D tiles rather than whole-vocab token chunks: with token chunks alone, every chunk re-reads and re-writes all
of grad_weight (V·H·2 B = 1.2 GiB at V=151936, H=4096) in a GEMM whose reduction is only the chunk length;
at a 256 MiB fp32 budget that is 441 rows, and that GEMM is then bandwidth-bound (0.6 ms of traffic vs 0.7 ms of
math per chunk on H200). With 2048 × 16384 tiles each GEMM has K ≥ 2048 and the accumulator traffic is ~5% of the
math. The maths and the memory bound are written out in README.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rltrain_kernels.ops.common.vocab_tiles import GemmConfig, addmm_fp32, balanced_bounds


@dataclass(frozen=True)
class ChunkConfig:
    """Tile sizes. The workspace is token_chunk·vocab_chunk·4 B (fp32 logits tile) + token_chunk·H·4 B (fp32
    grad_hidden accumulator, backward only, not needed for fp32 inputs), whatever the number of tokens.

    Defaults: ≤ 2048 × 16384 × 4 B = 128 MiB tile (119 MiB at V=151936) + 32 MiB accumulator at H=4096, under
    the 0.3 GiB goal with room for cuBLAS' workspace. 2048 rows keep the grad_weight GEMM's K large (see module
    docstring) and make the grad_hidden GEMM 16×16 output tiles of 128×256 (1.9 waves on 132 SMs); 16384 columns
    split V=151936 into 10 balanced chunks of 15232 (no ragged tail).
    """

    token_chunk: int = 2048
    vocab_chunk: int = 16384
    block_v: int = 2048        # Triton row-pass block: 8 fp32 per thread at num_warps=8 (two 16 B loads)
    align: int = 128           # chunk sizes are rounded up to this (GEMM tile edge), capped by the limits above
    gemm: GemmConfig | None = None   # the fused path's blocks and launch; None: GemmConfig.default()

    def __post_init__(self):
        for key in ("token_chunk", "vocab_chunk", "block_v", "align"):
            if getattr(self, key) < 1:
                raise ValueError(f"ChunkConfig.{key} must be >= 1, got {getattr(self, key)}")
        if self.block_v & (self.block_v - 1):
            raise ValueError(f"ChunkConfig.block_v must be a power of two, got {self.block_v}")
        if self.gemm is not None and not isinstance(self.gemm, GemmConfig):
            raise TypeError(f"ChunkConfig.gemm must be a GemmConfig or None, got {type(self.gemm).__name__}")


DEFAULT_CHUNKS = ChunkConfig()


def fused_forward_blocks(vocab_chunk: int) -> int:
    """Column blocks per launch of the fused forward (fused.FusedTiles): ≤ vocab_chunk / 3, so its 12 B-per-block
    partials stay within the cuBLAS path's 4 B-per-logit fp32 tile."""
    return max(1, vocab_chunk // 3)


def workspace_bytes(n_tokens: int, vocab: int, hidden_size: int, dtype: torch.dtype,
                    config: ChunkConfig = DEFAULT_CHUNKS, backward: bool = True) -> int:
    """Bytes of scratch the CUDA paths allocate beyond inputs, outputs, gradients and O(N) row statistics: the
    larger of the cuBLAS path's fp32 tile and the fused path's half dlogits tile (≤ 2·vocab_chunk columns of whole
    column blocks, config.gemm's block_n or the shipped GemmConfig's) or stats partials, plus the fp32 grad_hidden
    accumulator. Bounded by config.token_chunk · (config.vocab_chunk + hidden_size) · 4 for every n_tokens."""
    rows = max((b - a for a, b in balanced_bounds(n_tokens, config.token_chunk, config.align)), default=0)
    cols = max((b - a for a, b in balanced_bounds(vocab, config.vocab_chunk, config.align)), default=0)
    tile = rows * cols * 4
    if dtype != torch.float32:   # the fused path (fused.py)
        block_n = (config.gemm or GemmConfig()).block_n
        blocks = -(-vocab // block_n)
        dlogits_cols = min(max(block_n, 2 * config.vocab_chunk // block_n * block_n), blocks * block_n)
        partials = 3 * rows * min(blocks, fused_forward_blocks(config.vocab_chunk)) * 4
        tile = max(tile, rows * dlogits_cols * 2 if backward else 0, partials)
    accumulator = rows * hidden_size * 4 if backward and dtype != torch.float32 else 0
    return tile + accumulator


# ----------------------------------------------------------------------------------------------------------------
@dataclass
class VocabShard:
    """Where this rank's weight rows sit in the global vocabulary (tp_group=None: the whole of it)."""

    group: object | None
    start: int
    total: int


def vocab_shard(weight: torch.Tensor, tp_group) -> VocabShard:
    if tp_group is None:
        return VocabShard(None, 0, weight.shape[0])
    world = dist.get_world_size(tp_group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=weight.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([weight.shape[0]], dtype=torch.int64, device=weight.device), group=tp_group)
    sizes = [int(x.item()) for x in sizes]
    rank = dist.get_rank(tp_group)
    return VocabShard(tp_group, sum(sizes[:rank]), sum(sizes))


def _combine_across_ranks(m, u, t, label_z, group) -> None:
    """Merge per-rank (max, Σexp − 1, Σexp·shift, label logit) over the vocab-parallel group, in place.
    Σexp = Σ_r (u_r + 1)·α_r with α_r = e^(m_r − M); the ranks holding the max contribute their 1 as an exact
    integer count, so u keeps its precision."""
    m_global = m.clone()
    dist.all_reduce(m_global, op=dist.ReduceOp.MAX, group=group)
    shift = m - m_global
    alpha = torch.exp(shift)
    at_max = m == m_global
    parts = [u * alpha + torch.where(at_max, 0.0, alpha), at_max.to(torch.float32), label_z]
    if t is not None:
        s = u + 1.0
        parts.append(alpha * (t + torch.where(s > 0, shift, 0.0) * s))
    stacked = torch.stack(parts)
    dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=group)
    m.copy_(m_global)
    u.copy_(stacked[0] + (stacked[1] - 1.0))
    label_z.copy_(stacked[2])
    if t is not None:
        t.copy_(stacked[3])


def forward_chunks(hidden, weight, labels, inv_temp, ignore_index, with_entropy, shard, tiles,
                   config: ChunkConfig = DEFAULT_CHUNKS):
    """hidden [N, H], weight [V_local, H], labels [N] (global ids) → (logprobs [N], entropy [N] or None,
    row_max [N], log_sum [N]) with lse = row_max + log_sum, kept apart for the backward's precision."""
    n, v = hidden.shape[0], weight.shape[0]
    f32 = dict(dtype=torch.float32, device=hidden.device)
    m = torch.full((n,), -math.inf, **f32)
    u = torch.full((n,), -1.0, **f32)      # Σexp − 1; −1 = empty
    t = torch.zeros(n, **f32) if with_entropy else None
    label_z = torch.zeros(n, **f32)
    row_chunks = balanced_bounds(n, config.token_chunk, config.align)
    if row_chunks:
        max_rows = max(b - a for a, b in row_chunks)
        col_chunks = tiles.vocab_bounds(v, max_rows, config, hidden.device, backward=False)
        workspace = tiles.workspace(max_rows, max(b - a for a, b in col_chunks), weight, backward=False)
        for r0, r1 in row_chunks:
            for c0, c1 in col_chunks:
                tiles.fold_logits(hidden[r0:r1], weight[c0:c1], workspace, labels[r0:r1], shard.start + c0,
                                  inv_temp, m[r0:r1], u[r0:r1], None if t is None else t[r0:r1], label_z[r0:r1])
        del workspace
    if shard.group is not None:
        _combine_across_ranks(m, u, t, label_z, shard.group)
    log_s = torch.log1p(u)
    ignored = labels == ignore_index
    # log p = (label_z − m) − log s: the first difference is exact for the max logit, so a dominating
    # label gives −log1p(u) ≈ −u rather than 0
    logprobs = torch.where(ignored, 0.0, (label_z - m) - log_s)
    # H = lse − E[z] = log s − t/s  (t = Σ e^(z−m)(z−m), so no large terms cancel)
    entropy = torch.where(ignored, 0.0, log_s - t / (u + 1.0)) if with_entropy else None
    return logprobs, entropy, m, log_s


def backward_chunks(hidden, weight, labels, row_max, log_sum, entropy, g_logprob, g_entropy, inv_temp, shard, tiles,
                    need_grad_hidden: bool, need_grad_weight: bool, config: ChunkConfig = DEFAULT_CHUNKS):
    """Gradients w.r.t. hidden [N, H] and weight [V_local, H]. g_logprob / g_entropy: [N] fp32 contiguous with
    ignored rows already zeroed, or None. With a tp_group the grad_hidden partial sums are all-reduced."""
    n, h = hidden.shape
    v = weight.shape[0]
    grad_hidden = torch.empty_like(hidden) if need_grad_hidden else None
    grad_weight = torch.empty_like(weight, memory_format=torch.contiguous_format) if need_grad_weight else None
    row_chunks = balanced_bounds(n, config.token_chunk, config.align)
    if not row_chunks:
        if grad_hidden is not None:
            grad_hidden.zero_()
        if grad_weight is not None:
            grad_weight.zero_()
        return grad_hidden, grad_weight
    f32 = dict(dtype=torch.float32, device=hidden.device)
    max_rows = max(b - a for a, b in row_chunks)
    col_chunks = tiles.vocab_bounds(v, max_rows, config, hidden.device, backward=True)
    workspace = tiles.workspace(max_rows, max(b - a for a, b in col_chunks), weight, backward=True)
    # fp32 inputs accumulate straight into grad_hidden; half inputs into one fp32 [rows, H] buffer per token chunk
    # (10 bf16 roundings at V=151936 would cost ~2.5e-3 relative error; the buffer costs 32 MiB at H=4096).
    direct = hidden.dtype == torch.float32
    accumulator = None if (direct or grad_hidden is None) else torch.empty(max_rows * h, **f32)
    for ti, (r0, r1) in enumerate(row_chunks):
        rows = r1 - r0
        hidden_t = hidden[r0:r1]
        if grad_hidden is not None:
            acc = grad_hidden[r0:r1] if direct else accumulator[: rows * h].view(rows, h)
        for vi, (c0, c1) in enumerate(col_chunks):
            weight_v = weight[c0:c1]
            dlogits = tiles.logits_grad_of(hidden_t, weight_v, workspace, labels[r0:r1], shard.start + c0, inv_temp,
                                           row_max[r0:r1], log_sum[r0:r1],
                                           None if entropy is None else entropy[r0:r1],
                                           None if g_logprob is None else g_logprob[r0:r1],
                                           None if g_entropy is None else g_entropy[r0:r1])
            if grad_hidden is not None:
                addmm_fp32(acc, dlogits, weight_v, beta=0.0 if vi == 0 else 1.0)
            if grad_weight is not None:
                torch.addmm(grad_weight[c0:c1], dlogits.t(), hidden_t, beta=0.0 if ti == 0 else 1.0,
                            out=grad_weight[c0:c1])
        if grad_hidden is not None:
            if shard.group is not None:
                dist.all_reduce(acc, group=shard.group)
            if not direct:
                grad_hidden[r0:r1].copy_(acc)
    return grad_hidden, grad_weight
