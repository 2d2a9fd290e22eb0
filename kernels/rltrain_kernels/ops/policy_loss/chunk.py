"""Token-chunked policy loss with the gradients computed in the forward pass; shared by every chunked path.

Per chunk of `rows` tokens, over the whole vocabulary at once (README.md has the maths):

    logits = hidden_c @ weight.T, kept     GEMM 1 + the row statistics  (DenseChunkLogits: cuBLAS fp32 tile, then
                                           a row pass; shifted.py: the statistics in the fused Triton GEMM's
                                           epilogue, which keeps y = z − block max in fp16)
    logp, entropy, log Σ; per-token loss, ∂L/∂logp    O(rows) kernels (kernel.py / TorchLossOps below)
    kept logits → dlogits in place (weight dtype)     a row pass
    grad_hidden_c  = dlogits @ weight                GEMM 2 (one full-V reduction: one rounding)
    grad_weight   += dlogits.T @ hidden_c            GEMM 3

Three GEMMs in all, because the loss is known inside the forward. Unlike linear_logprobs' 2-D tiles (which need a
4th GEMM to recompute logits in the backward), a chunk spans the whole vocabulary, so the workspace is rows·V·4 B
(dense) or ~rows·V·2 B (fused). The default `rows` keeps it under 640 MiB: 1024 rows at V=151936 dense (594 MiB),
2048 fused (607 MiB); GEMM 3's reduction K = rows then stays ≥ 2× the ~400 flop/B at which a bf16 GEMM with a
bf16 read-modify-write output turns bandwidth-bound on H100/H200 (K/2 flop per byte of grad_weight traffic).

GSPO (importance_level="sequence") couples every token of a sequence through its ratio, so ∂L/∂logp is known only
after the whole sequence's logp. When a sequence fits in a chunk (T ≤ rows), chunks are cut at sequence
boundaries and the pass above is unchanged. Otherwise a first pass computes logp for all tokens (GEMM 1 + stats
only), then the ratios, then a second pass recomputes the logits for the gradient: 4 GEMMs (+33% time, same
workspace). Raise `workspace_bytes` so that rows ≥ T to avoid it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from rltrain_kernels.ops.common.vocab_tiles import GemmConfig, balanced_bounds, mm_fp32
from rltrain_kernels.ops.policy_loss.options import K3_BOUND, K3_LOG_RATIO_BOUND, PolicyLossOptions


@dataclass(frozen=True)
class PolicyLossChunkConfig:
    """How many tokens one chunk holds (and the kernels' blocks). The workspace is rows·V·4 B (the fp32 logits tile,
    turned into dlogits in place) whatever B·T is; plus O(B·T) fp32 per-token vectors (~60 B/token)."""

    workspace_bytes: int = 640 * 2**20   # → rows = 1024 at V=151936 (see module docstring)
    token_chunk: int | None = None       # explicit rows per chunk (overrides workspace_bytes)
    align: int = 128                     # rows are a multiple of this (GEMM tile edge)
    block_v: int = 2048                  # Triton row-pass block (linear_logprobs' choice: 8 fp32 per thread)
    gemm: GemmConfig | None = None       # the fused path's blocks and launch; None: GemmConfig.default()

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "gemm" and value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"PolicyLossChunkConfig.{f.name} must be a positive int, got {value!r}")
        if self.block_v & (self.block_v - 1):
            raise ValueError(f"PolicyLossChunkConfig.block_v must be a power of two, got {self.block_v}")
        if self.gemm is not None and not isinstance(self.gemm, GemmConfig):
            raise TypeError(f"PolicyLossChunkConfig.gemm must be a GemmConfig or None, got "
                            f"{type(self.gemm).__name__}")

    def rows(self, vocab: int, row_bytes: int | None = None) -> int:
        """Tokens per chunk: token_chunk, else as many whole `align`s as fit workspace_bytes at row_bytes per row
        (default: the fp32 tile's 4·vocab)."""
        if self.token_chunk is not None:
            return self.token_chunk
        per_row = 4 * vocab if row_bytes is None else row_bytes
        return max(self.align, self.workspace_bytes // per_row // self.align * self.align)


DEFAULT_CHUNKS = PolicyLossChunkConfig()


def shifted_row_bytes(vocab: int, block_n: int = GemmConfig.block_n) -> int:
    """Workspace bytes per row of the fused path's kept logits (shifted.ShiftedChunkLogits, scaled.py): fp16 y with
    its row stride padded to 16 B, plus 12 B of block statistics per block_n columns (the GemmConfig's)."""
    return 2 * -(-vocab // 8) * 8 + 12 * -(-vocab // block_n)


def workspace_bytes(n_tokens: int, vocab: int, config: PolicyLossChunkConfig = DEFAULT_CHUNKS) -> int:
    """Bytes of the logits workspace (the only allocation that grows with V) on whichever path is larger: the
    fp32 tile (rows·V·4 B) or the fused path's fp16 y + block statistics (~rows·V·2 B, twice the rows). Without
    token_chunk both fit config.workspace_bytes, for any n_tokens. The fused path's blocks: config.gemm's, else the
    shipped GemmConfig's."""
    kept = shifted_row_bytes(vocab, (config.gemm or GemmConfig()).block_n)
    return max(min(n_tokens, config.rows(vocab)) * vocab * 4, min(n_tokens, config.rows(vocab, kept)) * kept)


@dataclass
class LossBuffers:
    """Per-token fp32 vectors [N] (N = B·T, row-major): inputs, the running softmax statistics, the outputs."""

    mask: torch.Tensor
    adv: torch.Tensor
    old: torch.Tensor
    ref: torch.Tensor | None
    weight: torch.Tensor             # aggregation weight w: loss = Σ w·L (aggregation_weights)
    g_entropy: torch.Tensor | None   # ∂loss/∂entropy = −entropy_coef·w (None when entropy_coef == 0)
    on_policy: bool = False          # old_logprobs=None: `old` receives logp as each chunk finalizes
    m: torch.Tensor = None           # running max of z = logits / temperature
    u: torch.Tensor = None           # Σ exp(z − m) − 1
    t: torch.Tensor = None           # Σ exp(z − m)·(z − m)
    label_z: torch.Tensor = None
    logp: torch.Tensor = None
    entropy: torch.Tensor = None
    log_sum: torch.Tensor = None     # log Σ exp(z − m); lse = m + log_sum, kept apart for the dlogits' precision
    g_logp: torch.Tensor = None      # ∂loss/∂logp
    contrib: torch.Tensor = None     # w·L
    clipped: torch.Tensor = None     # 1.0 where the clipped branch is active (masked tokens: 0)

    def __post_init__(self):
        if self.m is None:
            f32 = dict(dtype=torch.float32, device=self.mask.device)
            n = self.mask.numel()
            self.m = torch.full((n,), -math.inf, **f32)
            self.u = torch.full((n,), -1.0, **f32)
            self.t = torch.zeros(n, **f32)
            self.label_z = torch.zeros(n, **f32)
            for name in ("logp", "entropy", "log_sum", "g_logp", "contrib", "clipped"):
                # NaN-filled (24 B/token, noise): an element a kernel fails to write shows up in every test
                setattr(self, name, torch.full((n,), math.nan, **f32))

    def rows(self, r0: int, r1: int) -> "LossBuffers":
        def part(value):
            return value[r0:r1] if isinstance(value, torch.Tensor) else value

        return LossBuffers(**{f.name: part(getattr(self, f.name)) for f in fields(self)})


def aggregation_weights(m: torch.Tensor, opts: PolicyLossOptions,
                        cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """w [B, T] with loss = Σ w·L for every loss_agg (each is linear in L and its weights depend on the mask only).
    Zero denominators give w = 0 (then every mask value they divide is 0 too). cu_seqlens: m is [1, T] holding
    len(cu_seqlens) − 1 sequences back to back, each a row of the formulas."""

    def div(x, d):
        return torch.where(d > 0, x / torch.where(d > 0, d, 1.0), 0.0)

    if opts.loss_agg == "token-mean":
        return div(m, m.sum()) if opts.norm_tokens is None else m / opts.norm_tokens
    if cu_seqlens is None:
        B, T = m.shape
        counts = m.sum(1)
        seq_tokens = counts[:, None]
    else:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        B, T = len(lengths), lengths.max()
        seq_of_token = torch.repeat_interleave(torch.arange(B, device=m.device), lengths, output_size=m.shape[1])
        counts = torch.zeros(B, dtype=m.dtype, device=m.device).index_add_(0, seq_of_token, m[0])
        seq_tokens = counts[seq_of_token][None]
    if opts.loss_agg == "seq-mean-token-sum-norm":
        return m / (B * (T if opts.norm_len is None else opts.norm_len))
    n_seqs = (counts > 0).sum().to(m.dtype)
    per_seq = m if opts.loss_agg == "seq-mean-token-sum" else div(m, seq_tokens)
    return div(per_seq, n_seqs)


# ----------------------------------------------------------------------------------------------------------------
def pg_terms(ratio, adv, opts: PolicyLossOptions):
    """pg = max(−A·r, −A·clamp(r)) [then min(pg, −A·c) where A < 0]; returns (pg, ∂pg/∂r, clipped)."""
    clamped = ratio.clamp(1.0 - opts.clip_low, 1.0 + opts.clip_high)
    unclipped_loss, clipped_loss = -adv * ratio, -adv * clamped
    clipped = clipped_loss > unclipped_loss
    pg = torch.maximum(unclipped_loss, clipped_loss)
    dpg = torch.where(clipped, 0.0, -adv)   # equal branches inside the clip range: both have slope −A
    if opts.dual_clip is not None:
        cap = -adv * opts.dual_clip
        capped = (adv < 0) & (cap < pg)
        pg, dpg = torch.where(capped, cap, pg), torch.where(capped, 0.0, dpg)
    return pg, dpg, clipped


def kl_terms(diff, kl_index: int):
    """diff = logp − ref → (kl, ∂kl/∂logp) for k1/k2/k3 (kl_index 1/2/3)."""
    if kl_index == 1:
        return diff, torch.ones_like(diff)
    if kl_index == 2:
        return 0.5 * diff * diff, diff
    x = (-diff).clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)  # k3 clamped as verl's low_var_kl
    e = torch.exp(x)
    kl = e - x - 1.0
    live = (x == -diff) & (kl <= K3_BOUND)
    return kl.clamp(max=K3_BOUND), torch.where(live, 1.0 - e, 0.0)


class TorchLossOps:
    """The O(tokens) steps in plain torch (CPU/NPU path; the readable twin of kernel.TritonLossOps)."""

    @staticmethod
    def scale_unless_one(grad: torch.Tensor, scale: torch.Tensor) -> None:
        """grad *= scale in place (fp32 product, rounded once), skipped when scale == 1 (a host read: no sync on
        CPU; the Triton twin decides on the GPU)."""
        if bool(scale != 1.0):
            torch.mul(grad, scale.to(torch.float32), out=grad)

    @staticmethod
    def finalize(b: LossBuffers) -> None:
        """Running stats → logp = (z_label − m) − log s, entropy = log s − t/s, log_sum = log s (s = u + 1);
        log1p keeps precision when one logit dominates. Masked tokens get logp = entropy = 0."""
        log_s = torch.log1p(b.u)
        valid = b.mask != 0
        b.logp.copy_(torch.where(valid, (b.label_z - b.m) - log_s, 0.0))
        b.entropy.copy_(torch.where(valid, log_s - b.t / (b.u + 1.0), 0.0))
        b.log_sum.copy_(log_s)

    @staticmethod
    def loss(b: LossBuffers, opts: PolicyLossOptions, seq_len: int | None) -> None:
        """contrib = w·L, clipped and g_logp = ∂(Σ w·L)/∂logp. seq_len: GSPO, `b` holds whole sequences."""
        valid = b.mask != 0
        log_ratio = torch.where(valid, b.logp - b.old, 0.0)
        if seq_len is not None:
            mask2d = b.mask.view(-1, seq_len)
            n = mask2d.sum(1)
            n_safe = torch.where(n > 0, n, 1.0)
            seq_ratio = torch.exp(torch.where(n > 0, (log_ratio.view(-1, seq_len) * mask2d).sum(1) / n_safe, 0.0))
            ratio = seq_ratio.repeat_interleave(seq_len)
        else:
            ratio = torch.exp(log_ratio)
        pg, dpg, clipped = pg_terms(ratio, b.adv, opts)
        per_token, g_kl = pg, 0.0
        if opts.kl_index:
            kl, dkl = kl_terms(torch.where(valid, b.logp - b.ref, 0.0), opts.kl_index)
            per_token, g_kl = per_token + opts.kl_coef * kl, opts.kl_coef * dkl
        if opts.entropy_coef != 0.0:
            per_token = per_token - opts.entropy_coef * b.entropy
        b.contrib.copy_(b.weight * per_token)
        b.clipped.copy_((valid & clipped).to(torch.float32))
        if seq_len is None:
            b.g_logp.copy_(b.weight * (dpg * ratio + g_kl))
        else:   # ∂/∂logp_t of Σ_t' w_t'·pg(r_s) = (Σ_t' w_t'·∂pg/∂r)·r_s·m_t / n_s
            scale = (b.weight * dpg).view(-1, seq_len).sum(1) * seq_ratio / n_safe
            b.g_logp.copy_(b.weight * g_kl + (scale.unsqueeze(1) * mask2d).reshape(-1))


# ----------------------------------------------------------------------------------------------------------------
def _sequence_bounds(n_seqs: int, seq_len: int, rows: int) -> list[tuple[int, int]]:
    """Chunks of whole sequences, ≤ rows tokens each (needs seq_len ≤ rows), balanced in size."""
    per_chunk = max(1, rows // seq_len)
    n_chunks = math.ceil(n_seqs / per_chunk)
    per_chunk = math.ceil(n_seqs / n_chunks)
    return [(s * seq_len, min(s + per_chunk, n_seqs) * seq_len) for s in range(0, n_seqs, per_chunk)]


class DenseChunkLogits:
    """A chunk's logits as an fp32 [rows, V] tile from cuBLAS (CPU: upcast operands), then `tiles`' row passes
    over it (ops/common: vocab_tiles.TorchTiles / row_pass.TritonTiles): the statistics pass reads the tile, the
    dlogits pass reads it again and writes dlogits over it in the weight dtype. 4 B per logit of workspace."""

    def __init__(self, tiles):
        self.tiles = tiles

    def row_bytes(self, vocab: int) -> int:
        return 4 * vocab

    def workspace(self, rows: int, vocab: int, device):
        return torch.empty(rows * vocab, dtype=torch.float32, device=device)

    def logits(self, workspace, hidden_c, weight, labels_c, c: "LossBuffers", inv_temp, fold: bool,
               keep: bool = True):
        """GEMM 1 for the chunk; fold=True also folds the row statistics into c (m, u, t, label_z). Returns what
        `dlogits` takes (keep=False: the caller will not take the gradient from it; the tile is kept anyway)."""
        rows, v = hidden_c.shape[0], weight.shape[0]
        tile = workspace[: rows * v].view(rows, v)
        mm_fp32(hidden_c, weight.t(), out=tile)
        if fold:
            self.tiles.fold_stats(tile, labels=labels_c, vocab_start=0, inv_temp=inv_temp, m=c.m, u=c.u, t=c.t,
                                  label_z=c.label_z)
        return tile

    def dlogits(self, tile, weight, labels_c, c: "LossBuffers", inv_temp):
        """(dlogits [rows, V] in the weight dtype, None): the gradient GEMMs' operand and its row scale (none)."""
        return self.tiles.logits_grad_in_place(tile, weight.dtype, labels_c, 0, inv_temp, c.m, c.log_sum, c.entropy,
                                               c.g_logp, c.g_entropy), None


def _chunk_grads(dlogits, row_scale, weight, hidden_c, grad_hidden_c, grad_weight, first: bool,
                 accumulator) -> None:
    """GEMMs 2 and 3 of a chunk: grad_hidden_c = dlogits @ weight, grad_weight (+)= dlogits.T @ hidden_c, where
    the chunk's dlogits are diag(row_scale) · `dlogits` when row_scale [rows] is given (scaled.py)."""
    if grad_hidden_c is not None:
        if accumulator is None:     # fp32 inputs
            torch.mm(dlogits, weight, out=grad_hidden_c)
            if row_scale is not None:
                grad_hidden_c.mul_(row_scale[:, None])
        else:
            # fp32 output, rounded once: a bf16-output GEMM with K = V lets cuBLAS reduce its split-K partials in
            # bf16, which put grad_hidden 1.1e-2 off fp32 at B=8 T=1024 V=151936 (H200)
            acc = mm_fp32(dlogits, weight, out=accumulator[: grad_hidden_c.numel()].view(grad_hidden_c.shape))
            if row_scale is None:
                grad_hidden_c.copy_(acc)
            else:
                torch.mul(acc, row_scale[:, None], out=grad_hidden_c)
    if grad_weight is not None:
        operand = hidden_c
        if row_scale is not None:
            # diag(row_scale)·hidden_c in the accumulator's memory, free once grad_hidden_c is written (the same
            # stream orders the two), else a new buffer: no more than the fp32 accumulator's bytes at peak
            out = (torch.empty_like(hidden_c) if accumulator is None else
                   accumulator.view(hidden_c.dtype)[: hidden_c.numel()].view(hidden_c.shape))
            operand = torch.mul(hidden_c, row_scale[:, None], out=out)
        torch.addmm(grad_weight, dlogits.t(), operand, beta=0.0 if first else 1.0, out=grad_weight)


def policy_loss_chunks(hidden, weight, labels, b: LossBuffers, seq_len: int, opts: PolicyLossOptions, chunk_logits,
                       loss_ops, config: PolicyLossChunkConfig, need_grad_hidden: bool, need_grad_weight: bool):
    """hidden [N, H], weight [V, H], labels [N] int64, b: LossBuffers over N = n_seqs·seq_len tokens;
    chunk_logits: DenseChunkLogits, shifted.ShiftedChunkLogits or scaled.ScaledChunkLogits. Fills b and returns
    (grad_hidden [N, H] or None, grad_weight [V, H] or None) of loss = Σ b.contrib."""
    n, v = hidden.shape[0], weight.shape[0]
    inv_temp = 1.0 / opts.temperature
    rows = config.rows(v, chunk_logits.row_bytes(v))
    sequence = opts.importance_level == "sequence"
    one_pass = not sequence or seq_len <= rows
    if sequence and one_pass:
        bounds = _sequence_bounds(n // max(seq_len, 1), seq_len, rows) if n else []
    else:
        bounds = balanced_bounds(n, rows, config.align)
    grad_hidden = torch.empty_like(hidden) if need_grad_hidden else None
    grad_weight = torch.empty_like(weight, memory_format=torch.contiguous_format) if need_grad_weight else None
    if not bounds:
        for g in (grad_hidden, grad_weight):
            if g is not None:
                g.zero_()
        return grad_hidden, grad_weight
    grads = need_grad_hidden or need_grad_weight
    max_rows = max(r1 - r0 for r0, r1 in bounds)
    workspace = chunk_logits.workspace(max_rows, v, hidden.device)
    half = need_grad_hidden and hidden.dtype != torch.float32
    accumulator = torch.empty(max_rows * hidden.shape[1], dtype=torch.float32, device=hidden.device) if half else None

    def grads_of(i, r0, r1, kept):
        c = b.rows(r0, r1)
        dlogits, row_scale = chunk_logits.dlogits(kept, weight, labels[r0:r1], c, inv_temp)
        _chunk_grads(dlogits, row_scale, weight, hidden[r0:r1], None if grad_hidden is None else grad_hidden[r0:r1],
                     grad_weight, first=i == 0, accumulator=accumulator)

    for i, (r0, r1) in enumerate(bounds):
        c = b.rows(r0, r1)
        kept = chunk_logits.logits(workspace, hidden[r0:r1], weight, labels[r0:r1], c, inv_temp, fold=True,
                                   keep=one_pass and grads)
        loss_ops.finalize(c)
        if b.on_policy:
            c.old.copy_(c.logp)
        if one_pass:
            loss_ops.loss(c, opts, seq_len if sequence else None)
            if grads:
                grads_of(i, r0, r1, kept)
    if not one_pass:   # GSPO with sequences longer than a chunk: ratios need every logp first
        loss_ops.loss(b, opts, seq_len)
        if grads:
            for i, (r0, r1) in enumerate(bounds):
                kept = chunk_logits.logits(workspace, hidden[r0:r1], weight, labels[r0:r1], b.rows(r0, r1),
                                           inv_temp, fold=False)
                grads_of(i, r0, r1, kept)
    return grad_hidden, grad_weight


def loss_and_metrics(b: LossBuffers) -> tuple[torch.Tensor, torch.Tensor]:
    """loss = Σ w·L (fp32 scalar) and the metrics [clipfrac, ppo_kl, ref_kl, entropy] as one fp32 tensor."""
    valid = b.mask != 0
    parts = [b.clipped, torch.where(valid, b.old - b.logp, 0.0)]
    if b.ref is not None:
        parts.append(kl_terms(torch.where(valid, b.logp - b.ref, 0.0), 3)[0])
    else:
        parts.append(torch.zeros_like(b.logp))
    parts.append(b.entropy)
    sums = (torch.stack(parts) * b.mask).sum(1)
    n = b.mask.sum()
    metrics = torch.where(n > 0, sums / torch.where(n > 0, n, 1.0), 0.0)
    return b.contrib.sum(), metrics
