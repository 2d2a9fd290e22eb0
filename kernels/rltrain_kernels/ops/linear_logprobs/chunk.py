"""Chunked forward/backward drivers for `linear_logprobs`, shared by the torch and the Triton paths.

The tokens × vocab logits are visited one tile of at most `token_chunk × vocab_chunk` fp32 values at a time:

    forward : tile = hidden_t @ weight_v.T (cuBLAS, fp32 out)     then a row pass folds the tile into per-row
              running (max, Σexp, Σexp·shifted-logit, label logit)        (online softmax across vocab tiles)
    backward: tile = hidden_t @ weight_v.T (recomputed)           then a row pass turns it, in place, into
              dlogits = ∂loss/∂logits (weight dtype);  grad_hidden_t += dlogits @ weight_v (fp32 accumulator),
              grad_weight_v += dlogits.T @ hidden_t

i.e. 4 GEMMs in total and one elementwise pass per GEMM output. What runs the row passes is a "tile backend":
`TorchTiles` below (the CPU/NPU path and the readable reference for the Triton kernels in kernel.py).

Why 2-D tiles rather than whole-vocab token chunks: with token chunks alone, every chunk re-reads and re-writes all
of grad_weight (V·H·2 B = 1.2 GiB at V=151936, H=4096) in a GEMM whose reduction is only the chunk length;
at a 256 MiB fp32 budget that is 441 rows, and that GEMM is then bandwidth-bound (0.6 ms of traffic vs 0.7 ms of
math per chunk on H200). With 2048 × 16384 tiles each GEMM has K ≥ 2048 and the accumulator traffic is ~5% of the
math. The maths and the memory bound are written out in README.md.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist


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

    def __post_init__(self):
        for key in ("token_chunk", "vocab_chunk", "block_v", "align"):
            if getattr(self, key) < 1:
                raise ValueError(f"ChunkConfig.{key} must be >= 1, got {getattr(self, key)}")
        if self.block_v & (self.block_v - 1):
            raise ValueError(f"ChunkConfig.block_v must be a power of two, got {self.block_v}")


DEFAULT_CHUNKS = ChunkConfig()
# The fused path's (fused.py) column block, fused.GemmConfig.block_n's default: here, where the workspace bounds
# are computed without importing Triton.
FUSED_BLOCK_N = 256


def _balanced_bounds(total: int, limit: int, align: int) -> list[tuple[int, int]]:
    """Split [0, total) into ceil(total/limit) nearly equal chunks, each a multiple of `align` (but ≤ limit)."""
    if total == 0:
        return []
    n_chunks = math.ceil(total / limit)
    size = math.ceil(total / n_chunks)
    size = min(limit, math.ceil(size / align) * align)
    return [(start, min(start + size, total)) for start in range(0, total, size)]


def fused_forward_blocks(vocab_chunk: int) -> int:
    """Column blocks per launch of the fused forward (fused.FusedTiles): ≤ vocab_chunk / 3, so its 12 B-per-block
    partials stay within the cuBLAS path's 4 B-per-logit fp32 tile."""
    return max(1, vocab_chunk // 3)


def shifted_row_bytes(vocab: int, block_n: int = FUSED_BLOCK_N) -> int:
    """Workspace bytes per row of fused.FusedTiles.shifted_workspace (the policy loss' kept logits,
    policy_loss/chunk.ShiftedChunkLogits): fp16 y with its row stride padded to 16 B, plus 12 B of block
    statistics per block_n columns (fused.py passes its GemmConfig's)."""
    return 2 * -(-vocab // 8) * 8 + 12 * -(-vocab // block_n)


def workspace_bytes(n_tokens: int, vocab: int, hidden_size: int, dtype: torch.dtype,
                    config: ChunkConfig = DEFAULT_CHUNKS, backward: bool = True) -> int:
    """Bytes of scratch the CUDA paths allocate beyond inputs, outputs, gradients and O(N) row statistics: the
    larger of the cuBLAS path's fp32 tile and the fused path's half dlogits tile (≤ 2·vocab_chunk columns of whole
    FUSED_BLOCK_N-column blocks) or stats partials, plus the fp32 grad_hidden accumulator. Bounded by
    config.token_chunk · (config.vocab_chunk + hidden_size) · 4 for every n_tokens."""
    rows = max((b - a for a, b in _balanced_bounds(n_tokens, config.token_chunk, config.align)), default=0)
    cols = max((b - a for a, b in _balanced_bounds(vocab, config.vocab_chunk, config.align)), default=0)
    tile = rows * cols * 4
    if dtype != torch.float32:   # the fused path (fused.py)
        block_n = FUSED_BLOCK_N
        blocks = -(-vocab // block_n)
        dlogits_cols = min(max(block_n, 2 * config.vocab_chunk // block_n * block_n), blocks * block_n)
        partials = 3 * rows * min(blocks, fused_forward_blocks(config.vocab_chunk)) * 4
        tile = max(tile, rows * dlogits_cols * 2 if backward else 0, partials)
    accumulator = rows * hidden_size * 4 if backward and dtype != torch.float32 else 0
    return tile + accumulator


# ----------------------------------------------------------------------------------------------------------------
# GEMMs with an fp32 result. On CUDA, half inputs go through cuBLAS' fp32-output mode (`out_dtype`, torch ≥ 2.8):
# fp32 accumulate and no rounding of the logits to bf16, which at logit std 10 would cost ~3% relative error in
# entropy and gradients. Elsewhere (CPU, NPU) the small operands are upcast instead.
_NATIVE = {"mm": True, "accumulate": True}


def _fall_back(kind: str, err: Exception) -> None:
    _NATIVE[kind] = False
    warnings.warn(f"cuBLAS fp32-output GEMM ({kind}) unavailable in this torch ({type(err).__name__}: {err}); "
                  "using a slower fallback", RuntimeWarning, stacklevel=3)


def _half_on_cuda(a: torch.Tensor) -> bool:
    return a.is_cuda and a.dtype in (torch.bfloat16, torch.float16)


def mm_fp32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (fp32) = a @ b."""
    if a.dtype == torch.float32:
        return torch.mm(a, b, out=out)
    if _half_on_cuda(a) and _NATIVE["mm"]:
        try:
            return torch.mm(a, b, out_dtype=torch.float32, out=out)
        except (RuntimeError, TypeError, NotImplementedError) as err:
            _fall_back("mm", err)
    return torch.mm(a.float(), b.float(), out=out)


def addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float) -> torch.Tensor:
    """acc (fp32) = beta·acc + a @ b; beta=0 ignores acc's contents (NaN included).

    On CUDA through baddbmm's fp32-output overload (addmm's requires self in the input dtype); if this torch lacks
    it, the product is rounded to the input dtype once per call and added (one extra rounding per vocab chunk)."""
    if a.dtype == torch.float32:
        return torch.addmm(acc, a, b, beta=beta, out=acc)
    if _half_on_cuda(a):
        if _NATIVE["accumulate"]:
            try:
                acc3 = acc.unsqueeze(0)
                torch.baddbmm(acc3, a.unsqueeze(0), b.unsqueeze(0), out_dtype=torch.float32, beta=beta, out=acc3)
                return acc
            except (RuntimeError, TypeError, NotImplementedError) as err:
                _fall_back("accumulate", err)
        product = torch.mm(a, b)
        return acc.copy_(product) if beta == 0 else acc.add_(product)
    return torch.addmm(acc, a.float(), b.float(), beta=beta, out=acc)


# ----------------------------------------------------------------------------------------------------------------
class GemmThenRowPass:
    """A tile backend: what the drivers below call per tile. This base runs a logits GEMM (fp32 out, into the
    workspace) and then the subclass' row pass (`fold_stats` / `logits_grad`); fused.FusedTiles overrides the
    four methods to do both steps in one kernel per launch."""

    def vocab_bounds(self, vocab: int, rows: int, config: ChunkConfig, device, backward: bool):
        """The vocabulary chunks a token chunk of `rows` rows is visited in."""
        return _balanced_bounds(vocab, config.vocab_chunk, config.align)

    def workspace(self, rows: int, cols: int, weight: torch.Tensor, backward: bool) -> torch.Tensor:
        """The one scratch buffer of a pass, reused for every tile of at most rows × cols."""
        return torch.empty(rows * cols, dtype=torch.float32, device=weight.device)

    def fold_logits(self, hidden_t, weight_v, workspace, labels, vocab_start, inv_temp, m, u, t, label_z):
        """Fold the logits hidden_t @ weight_v.T into the running row statistics (see TorchTiles.fold_stats)."""
        tile = workspace[: hidden_t.shape[0] * weight_v.shape[0]].view(hidden_t.shape[0], weight_v.shape[0])
        mm_fp32(hidden_t, weight_v.t(), out=tile)
        self.fold_stats(tile, labels, vocab_start, inv_temp, m, u, t, label_z)

    def logits_grad_of(self, hidden_t, weight_v, workspace, labels, vocab_start, inv_temp, row_max, log_sum,
                       entropy, g_logprob, g_entropy) -> torch.Tensor:
        """dlogits [rows, cols] in the weight dtype (a view into the workspace) of the logits hidden_t @ weight_v.T
        (see TorchTiles.logits_grad)."""
        rows, cols = hidden_t.shape[0], weight_v.shape[0]
        tile = workspace[: rows * cols].view(rows, cols)
        mm_fp32(hidden_t, weight_v.t(), out=tile)
        return self.logits_grad_in_place(tile, weight_v.dtype, labels, vocab_start, inv_temp, row_max, log_sum,
                                         entropy, g_logprob, g_entropy)

    def logits_grad_in_place(self, tile, dtype, labels, vocab_start, inv_temp, row_max, log_sum, entropy, g_logprob,
                             g_entropy) -> torch.Tensor:
        """The fp32 logits tile → dlogits in `dtype`, written over it (a view of the tile's memory): row r's
        half-width output lies inside row r's fp32 input and the row pass writes block j only after reading
        blocks ≤ j, so no extra buffer is needed."""
        dlogits = tile if dtype == torch.float32 else tile.view(dtype)[:, : tile.shape[1]]
        # keyword arguments into the row passes: a reordering there fails loudly instead of silently
        self.logits_grad(tile, dlogits, labels=labels, vocab_start=vocab_start, inv_temp=inv_temp, row_max=row_max,
                         log_sum=log_sum, entropy=entropy, g_logprob=g_logprob, g_entropy=g_entropy)
        return dlogits


class TorchTiles(GemmThenRowPass):
    """Row passes in plain torch (CPU/NPU path). Same contract as kernel.TritonTiles; allocates a few tile-sized
    temporaries per call (so its workspace is ~4 tiles, still independent of N)."""

    @staticmethod
    def fold_stats(tile, labels, vocab_start, inv_temp, m, u, t, label_z):
        """Fold one [rows, cols] fp32 logits tile into the running per-row statistics of z = logits·inv_temp,
        in place: m = max z; u = Σ exp(z − m) − 1, stored without the leading 1 so that log1p(u) is exact when
        one logit dominates (else entropy ≈ V·e^−M loses its log-sum term, a 1/M relative error); t = Σ exp(z −
        m)·(z − m), relative to the max so |z| ≫ 1 does not cancel (None: no entropy); label_z = z[label] when
        the label falls in this tile."""
        z = tile * inv_temp
        block_max = z.amax(dim=1)
        m_new = torch.maximum(m, block_max)
        new_max = block_max > m
        shift = m - m_new                                   # ≤ 0; −inf on the first tile
        alpha = torch.exp(shift)
        is_max = z == block_max.unsqueeze(1)
        n_max = is_max.sum(dim=1, dtype=torch.float32)
        y = z.sub_(m_new.unsqueeze(1))                      # z − m_new, in place
        e = torch.exp(y)
        if t is not None:
            s = u + 1.0
            t.copy_(alpha * (t + torch.where(s > 0, shift, 0.0) * s) + (e * y).sum(dim=1))
        rest = e.masked_fill_(is_max, 0.0).sum(dim=1)
        u.copy_(u * alpha + rest + torch.where(new_max, alpha + (n_max - 1.0), n_max * torch.exp(block_max - m_new)))
        m.copy_(m_new)
        local = labels - vocab_start
        inside = (local >= 0) & (local < tile.shape[1])
        picked = tile.gather(1, local.clamp(0, tile.shape[1] - 1).unsqueeze(1)).squeeze(1) * inv_temp
        label_z.copy_(torch.where(inside, picked, label_z))

    @staticmethod
    def logits_grad(tile, out, labels, vocab_start, inv_temp, row_max, log_sum, entropy, g_logprob, g_entropy):
        """out = ∂loss/∂logits for the tile, from z = tile·inv_temp, log p = (z − row_max) − log_sum (in this
        order: z − max is exact near the max, z − lse would carry lse's rounding, 3e-5 at |z| ≈ 300, into every p):
        ∂/∂z_j = g_lp·(δ_j,label − p_j) − g_ent·p_j·(log p_j + H); times inv_temp for ∂/∂logits.
        g_logprob / g_entropy may be None (that output unused). `out` may alias `tile`."""
        y = (tile * inv_temp - row_max.unsqueeze(1)).sub_(log_sum.unsqueeze(1))   # log p
        p = torch.exp(y)
        coef = torch.zeros_like(row_max) if g_logprob is None else g_logprob
        coef = coef.unsqueeze(1)
        if g_entropy is not None:
            coef = coef + g_entropy.unsqueeze(1) * (y + entropy.unsqueeze(1))
        d = -p * coef
        if g_logprob is not None:
            local = labels - vocab_start
            inside = (local >= 0) & (local < tile.shape[1])
            d.scatter_add_(1, local.clamp(0, tile.shape[1] - 1).unsqueeze(1),
                           torch.where(inside, g_logprob, torch.zeros_like(g_logprob)).unsqueeze(1))
        out.copy_(d.mul_(inv_temp))


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
    row_chunks = _balanced_bounds(n, config.token_chunk, config.align)
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
    row_chunks = _balanced_bounds(n, config.token_chunk, config.align)
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
