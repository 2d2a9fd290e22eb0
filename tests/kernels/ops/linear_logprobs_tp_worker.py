"""Worker for the 2-process gloo test of linear_logprobs(tp_group=...): each rank holds a contiguous vocab slice.

Lives in its own module (not the test file) so that spawned processes can import it by name.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, port: int, workdir: str, split: int, temperature: float) -> None:
    os.environ.pop("TRITON_INTERPRET", None)  # torch path only; keep triton out of the child
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        from rltrain_kernels.ops.linear_logprobs import ChunkConfig, linear_logprobs

        cases = torch.load(os.path.join(workdir, "inputs.pt"))
        config = ChunkConfig(token_chunk=16, vocab_chunk=256, block_v=256, align=1)
        results = {}
        for name, case in cases.items():
            weight = case["weight"]
            rows = slice(0, split) if rank == 0 else slice(split, weight.shape[0])
            hidden = case["hidden"].clone().requires_grad_()
            weight_slice = weight[rows].clone().requires_grad_()
            logprobs, entropy = linear_logprobs(hidden, weight_slice, case["labels"], temperature,
                                                tp_group=dist.group.WORLD, impl="torch", chunk_config=config)
            torch.autograd.backward([logprobs, entropy], [case["g_logprob"], case["g_entropy"]])
            results[name] = {"logprobs": logprobs.detach(), "entropy": entropy.detach(),
                             "grad_hidden": hidden.grad, "grad_weight": weight_slice.grad}
        torch.save(results, os.path.join(workdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_two_ranks(workdir, port: int, cases: dict, split: int, temperature: float, timeout_s: float) -> list[dict]:
    """Spawn 2 gloo ranks on localhost, wait at most timeout_s, return each rank's {case: outputs and gradients}.
    cases: {name: {hidden, weight (full vocab; rank 0 takes rows [0, split)), labels, g_logprob, g_entropy}}."""
    workdir = str(workdir)
    torch.save(cases, os.path.join(workdir, "inputs.pt"))
    context = mp.spawn(_worker, args=(2, port, workdir, split, temperature), nprocs=2, join=False)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
            raise TimeoutError(f"gloo ranks did not finish within {timeout_s} s")
    return [torch.load(os.path.join(workdir, f"rank{r}.pt")) for r in range(2)]
