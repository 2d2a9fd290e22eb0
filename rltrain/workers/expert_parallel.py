"""Expert parallelism for the FSDP2 actor (`actor.expert_parallel_size` = E): each group of E consecutive ranks holds
every MoE layer's experts split E ways, rank j of a group the experts [j·n/E, (j+1)·n/E), and a token's hidden state
travels by all-to-all to the rank that holds its expert and back, so an expert's weights, gradients and optimizer
state live on 1 / E of the ranks instead of being gathered on all of them in every layer.

The ranks form a (world / E) × E grid: the expert axis (a group of E, exchanging tokens) and the replica axis (the
world / E ranks holding the same experts, one per group). The dense part (attention, norms, routers, embeddings) is
FSDP2 over all ranks as without EP; each experts module is its own FSDP2 unit over its replica axis (torchtitan's
layout), so its gradients are summed over the replicas by that unit's reduce-scatter, and within a group the
all-to-all's backward already brings every token's contribution home: the sum over the world's tokens, as the
single process computes it. Per MoE layer forward, over the (token, slot) pairs the router chose:

    sort pairs by owner rank → all-to-all of the hidden rows (and local expert ids) → the local experts module's own
    forward on them with unit weights (fused_moe where the kernel is applied) → all-to-all back → × the router's
    top-k weights, summed over the k slots

The router runs before the exchange on each rank's own tokens, so the load-balancing loss, actor/router_* metrics and
routing replay (R3) are those of FSDP2 without EP. Everything that reads whole weights (the weight push, state_dict,
HF export, checkpoints) sees each experts tensor as one DTensor over the (expert, replica) mesh with the full
[n, ...] shape (`global_view`): DCP writes and reads each rank's block, so checkpoints resume on any strategy.

The reference stays plain FSDP2 (its experts sharded over all ranks like dense weights): it runs forwards only, where
EP saves no optimizer state. Refused (ConfigError naming the key): a dense policy, E not dividing the ranks or the
experts, LoRA, Ulysses sequence parallelism and HSDP (actor.fsdp.fsdp_size). Tests:
tests/rltrain/workers/test_expert_parallel.py.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from rltrain.config import ConfigError

KEY = "actor.expert_parallel_size"
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def experts_modules(model) -> dict[str, torch.nn.Module]:
    """The stacked-experts modules of `model` by name (transformers 5's Qwen3-MoE, Qwen3-Next, Mixtral experts:
    gate_up_proj [n, 2I, H], down_proj [n, H, I], num_experts)."""
    return {name: m for name, m in model.named_modules()
            if isinstance(getattr(m, "num_experts", None), int) and all(
                isinstance(getattr(m, w, None), torch.nn.Parameter) and getattr(m, w).dim() == 3
                for w in EXPERT_WEIGHTS)}


def check_model(model, size: int) -> dict[str, torch.nn.Module]:
    """experts_modules(model), refusing a model without any or whose expert count `size` does not divide."""
    modules = experts_modules(model)
    name = f"{type(model).__name__} (model_type {model.config.model_type!r})"
    if not modules:
        raise ConfigError(f"{KEY}: {name} has no stacked experts modules to split (a dense policy): set it to 1")
    counts = {m.num_experts for m in modules.values()}
    if any(count % size for count in counts):
        raise ConfigError(f"{KEY}: {size} must divide {name}'s {min(counts)} experts per layer (each rank holds an "
                          "equal share)")
    return modules


class AllToAll(torch.autograd.Function):
    """all_to_all_single of rows, differentiable: the backward sends the gradients back along the same splits."""

    @staticmethod
    def forward(ctx, rows, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (in_splits, out_splits), group
        return _exchange(rows, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        in_splits, out_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


def _exchange(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
    return out


class ExpertParallel:
    """This rank's place in the (replica, expert) grid and what it does to a model's experts (module docstring)."""

    def __init__(self, rank: int, world_size: int, size: int, device: str):
        if world_size % size:
            raise ConfigError(f"{KEY}: must divide the {world_size} ranks (got {size})")
        self.size, self.index = size, rank % size
        # mesh dims in the order experts tensors split: first into the E groups' blocks, then over the replicas
        grid = torch.arange(world_size).reshape(world_size // size, size).T
        self.mesh = DeviceMesh(device, grid, mesh_dim_names=("expert", "replica"))
        self.group = self.mesh["expert"].get_group()
        self.replicas = self.mesh["replica"]   # the experts modules' FSDP2 mesh
        self.names: set[str] = set()           # the experts' parameter names (state_dict names)

    def shard(self, model) -> list[torch.nn.Module]:
        """Keep this rank's share of every experts module (parameters sliced, num_experts the local count, the
        forward routed through the all-to-all); returns the modules, for their own FSDP2 units."""
        modules = check_model(model, self.size)
        for name, module in modules.items():
            local = module.num_experts // self.size
            for weight in EXPERT_WEIGHTS:
                full = getattr(module, weight)
                block = full.detach()[self.index * local:(self.index + 1) * local].clone()
                setattr(module, weight, torch.nn.Parameter(block, requires_grad=full.requires_grad))
                self.names.add(f"{name}.{weight}" if name else weight)
            module.num_experts = local
            module.forward = partial(self._forward, module, type(module).forward, local)
        return list(modules.values())

    def _forward(self, module, local_forward, local: int, hidden_states, top_k_index, top_k_weights):
        """The experts' output for this rank's tokens, each (token, slot) pair computed where its expert lives."""
        tokens, k = top_k_index.shape[0], top_k_index.shape[-1]
        experts = top_k_index.reshape(-1)
        owner = torch.div(experts, local, rounding_mode="floor")
        order = torch.argsort(owner, stable=True)
        sent = torch.bincount(owner, minlength=self.size)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=self.group)
        sent, received = sent.tolist(), received.tolist()
        rows = AllToAll.apply(hidden_states[order // k], received, sent, self.group)
        ids = _exchange((experts[order] % local)[:, None], received, sent, self.group)
        out = local_forward(module, rows, ids, rows.new_ones(rows.shape[0], 1))
        back = AllToAll.apply(out, sent, received, self.group)[torch.argsort(order)]
        weighted = back.float().view(tokens, k, -1) * top_k_weights.float().reshape(tokens, k, 1)
        return weighted.sum(1).to(hidden_states.dtype)

    def global_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """An experts tensor (its FSDP2 DTensor over the replicas, a parameter, gradient or optimizer state) as one
        DTensor of the full [n, ...] shape over the (expert, replica) mesh, sharing this rank's storage."""
        block = tensor.shape[0]   # this group member's experts (the DTensor's global size over the replicas)
        shape = (block * self.size, *tensor.shape[1:])
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(tensor.to_local(), self.mesh, [Shard(0), Shard(0)], run_check=False, shape=shape,
                                  stride=stride)

    def full_tensor(self, tensor: DTensor) -> torch.Tensor:
        """An experts tensor (its FSDP2 DTensor over the replicas) whole, [n, ...] on every rank (a collective): its
        block gathered over the replicas, then the group's blocks in expert order. Not global_view's full_tensor():
        on NCCL, torch 2.11's redistribute planner refuses that 2-D layout (mesh dims not in ascending order)."""
        block = tensor.full_tensor()
        blocks = [torch.empty_like(block) for _ in range(self.size)]
        dist.all_gather(blocks, block.contiguous(), group=self.group)
        return torch.cat(blocks)

    def global_views(self, state: dict[str, torch.Tensor], suffix: bool = False) -> dict[str, torch.Tensor]:
        """`state` with the experts' entries as global_view; suffix: names are `<parameter>.<key>` (optimizer)."""
        def owner(name):
            return name.rsplit(".", 1)[0] if suffix else name
        return {name: self.global_view(t) if owner(name) in self.names and isinstance(t, DTensor) else t
                for name, t in state.items()}

    def grad_norm(self, dense: list[torch.Tensor], experts: list[torch.Tensor], device: str) -> torch.Tensor:
        """The gradient norm over the whole model: the dense part's, and each group member's experts summed over
        the group (their replicas hold the same sums)."""
        def squared(grads):
            if not grads:
                return torch.zeros((), device=device)
            norm = torch.nn.utils.get_total_norm(grads)
            return (norm.full_tensor() if isinstance(norm, DTensor) else norm).to(device).float() ** 2
        experts_sq = squared(experts)
        dist.all_reduce(experts_sq, group=self.group)
        return (squared(dense) + experts_sq).sqrt()
