"""Machinery shared across ops: the chunks of the delta-rule family, and the vocabulary tiles of the LM-head ops.

The LM-head ops (linear_logprobs, policy_loss, kl_div) share, without importing each other:
- `vocab_tiles`: chunk bounds, fp32-output GEMMs, the tile backends' contract, the torch row passes (the CPU/NPU
  path) and GemmConfig; imports no Triton.
- `row_pass`: the Triton row passes over an fp32 logits tile (`TritonTiles`).
- `vocab_gemm`: the persistent TMA GEMM with the row statistics (and the kept logits) in its epilogue (`FusedGemm`).
- `scale`: the backward's in-place scaling of gradients computed in the forward, skipped on the GPU when the
  upstream gradient is 1 (policy_loss, kl_div).

The delta-rule family (gated delta rule, IPLR, gated delta product):
- `chunking`: chunk bookkeeping for packed variable-length batches (cu_seqlens → per-chunk sequence/offset), CHUNK_SIZE
  (the chunked kernels' default chunk), and the two @triton.jit prologues every chunk kernel starts with:
  `chunk_program` (a chunk-parallel program's chunk and token rows) and `state_program` (a state pass's sequence,
  heads and state tile).
- `cumsum`: chunk-local (reverse) cumulative sums of log gates.
- `wy`: the WY representation of a chunk's Householder products (A, the UT transform
  T = (I + A)⁻¹ in registers via `solve_unit_lower`, w, u);
  `wy_bwd`: its backward.
- `state_pass`: the sequential inter-chunk state recurrence, forward and backward.
- `chunk_bwd`: the chunked backward the gated delta rule and the gated delta product share (the states recomputed,
  the reverse state pass, the per-chunk dq/dk/dw/dG pass, the WY backward), up to dG.
- `launch`: warps and pipeline stages of these kernels (and the gated delta rule's), in one table.
- `tuning`: the ops' `tuning` argument (`Tuning`): the launch choices, shipped by default, handed down to every
  launch, so a benchmark sweeps a setting by passing it.
- `inputs`: the argument checks they share (the tensors' dtypes and device, q's shape, GVA head groups, cu_seqlens
  packing, the initial state, the default scale, chunk sizes and tile dims, fla's state_v_first), each op's inputs.py
  built on them.
KDA (ops/kda: a decay per key channel) takes the chunk layout and prologues, precision, launch table, tuning, inputs,
`solve_unit_lower` and the gates' `softplus` (cumsum.py) from here; its intra-chunk, state-pass and backward kernels
are its own, since the per-channel decay enters every product the shared ones scale by one gate per row.

The row- and token-wise ops (rmsnorm, l2norm; short_conv, token_shift):
- `rows`: their row bookkeeping (rows with unit column stride, a packed row's per-token sequence index, and the
  @triton.jit `row_info` / `row_offset` of each token's sequence, position and element offset).

The delta-rule machinery works on the flattened token axis: [1, total_tokens, heads, dim] with cu_seqlens (a
non-varlen batch is the packed batch with equal lengths). For reuse (IPLR, gated delta product): `solve_unit_lower`
is a `@triton.jit` helper any kernel can call on its own strictly lower [64, 64] tile; the state pass takes w, u, k
and an optional gate cumsum (G=None for ungated ops).
"""
