"""The routed rows sorted by expert, and the row tiles the grouped GEMMs walk: computed on the device with a few torch
ops and no host sync (the grid is a static upper bound; tiles past the last real one exit at once).

A routed row is one (token, slot) pair: flat index p = token·k + slot of top_k_index.view(-1). Sorting the flat
expert ids (stably) gives `order`: sorted row r holds flat pair order[r], so its token is order[r] // k and its
routing weight top_k_weights.view(-1)[order[r]]; expert e owns sorted rows [expert_start[e], expert_start[e + 1]).
Each expert's rows are cut into tiles of block_m rows; tile j covers rows [tile_row[j], min(tile_row[j] + block_m,
expert_start[e + 1])) of expert tile_expert[j], −1 marking the padding tiles after the last real one. Their count
Σ_e ⌈n_e / block_m⌉ is at most ⌊TK / block_m⌋ + min(E, TK), the grid's size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Routing:
    order: torch.Tensor          # [TK] int64: the flat (token·k + slot) pair of each sorted row
    tile_expert: torch.Tensor    # [n_tiles] int32: the tile's expert, −1 for a padding tile
    tile_row: torch.Tensor       # [n_tiles] int32: the tile's first sorted row
    expert_start: torch.Tensor   # [E + 1] int32: expert e's sorted rows start at expert_start[e]
    top_k: int
    block_m: int

    @property
    def n_tiles(self) -> int:
        return self.tile_expert.shape[0]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensor fields in order (as the kernels take them, and Routing(*tensors, ...) rebuilds it)."""
        return self.order, self.tile_expert, self.tile_row, self.expert_start


def sort_by_expert(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> Routing:
    """Routing of top_k_index [T, k] (expert ids in [0, num_experts)) for row tiles of block_m rows."""
    n_tokens, top_k = top_k_index.shape
    device = top_k_index.device
    flat = top_k_index.reshape(-1).to(torch.int64)
    routed = flat.numel()
    sorted_ids, order = torch.sort(flat, stable=True)
    experts = torch.arange(num_experts + 1, device=device, dtype=torch.int64)
    expert_start = torch.searchsorted(sorted_ids, experts)                      # [E + 1]
    counts = expert_start[1:] - expert_start[:-1]
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)                                           # inclusive, per expert
    n_tiles = routed // block_m + min(num_experts, routed)
    tile = torch.arange(n_tiles, device=device, dtype=torch.int64)
    expert = torch.searchsorted(tile_end, tile, right=True)                     # E past the last real tile
    real = expert < num_experts
    owner = expert.clamp(max=num_experts - 1)
    first_tile = tile_end[owner] - tiles[owner]
    row = expert_start[owner] + (tile - first_tile) * block_m
    return Routing(order=order,
                   tile_expert=torch.where(real, expert, -1).to(torch.int32),
                   tile_row=torch.where(real, row, 0).to(torch.int32),
                   expert_start=expert_start.to(torch.int32),
                   top_k=top_k, block_m=block_m)
