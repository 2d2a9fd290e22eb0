"""A side stream for the row passes, so that they overlap the GEMMs (linear_logprobs and policy_loss drivers).

The tiled drivers alternate a compute-bound cuBLAS GEMM with a memory-bound row pass over its fp32 output. On one
stream each row pass idles the tensor cores (~8% of a forward+backward at V=152k, H=4096) and each kernel boundary
drains the GPU for the next kernel's ramp. A `Lane` runs the row passes on a second, high-priority stream instead:
the driver issues GEMM k+1 on the current stream while row pass k runs beside it, and waits on a row pass only
where its result is read (the loss, or the dlogits of a gradient GEMM) or its buffer is about to be overwritten.

    lane = make_lane(device, enabled)
    mark = lane.submit(fn, *args)   # fn runs on the side stream after everything issued so far on the current one
    lane.wait(mark)                 # the current stream waits for that row pass (and every earlier one)
    lane.join()                     # ... for all of them; call before returning or freeing anything they touch

`lane.buffers` tells the driver how many tile buffers keep the GEMMs and row passes apart (1 when inline). Off CUDA,
or with `enabled=False`, the lane is inline: `submit` calls fn at once and the waits are no-ops, so the
driver's arithmetic and order of operations are the same on every path (the GPU test compares the two bit for bit).
Everything a row pass touches is allocated on the current stream before `submit` and lives until `join`, so the
caching allocator never hands its memory to another kernel while the side stream may still read it.
"""

from __future__ import annotations

import torch


class InlineLane:
    """Runs every submitted pass at once, on the current stream (CPU, NPU, or overlap turned off)."""

    buffers = 1

    def submit(self, fn, *args, **kwargs):
        fn(*args, **kwargs)

    def wait(self, mark) -> None:
        pass

    def join(self) -> None:
        pass


_SIDE_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        # high priority: a row pass's blocks are dispatched as soon as a GEMM's blocks retire, so a GEMM that
        # waits on it (dlogits → gradient GEMM) waits as little as possible
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index, priority=-1)
    return _SIDE_STREAMS[index]


class CudaLane:
    """Row passes on a side stream of `device`, ordered after the current stream's work at each submit."""

    buffers = 2

    def __init__(self, device: torch.device):
        self.main = torch.cuda.current_stream(device)
        self.side = _side_stream(device)

    def submit(self, fn, *args, **kwargs) -> "torch.cuda.Event":
        self.side.wait_stream(self.main)
        with torch.cuda.stream(self.side):
            fn(*args, **kwargs)
        done = torch.cuda.Event()
        done.record(self.side)
        return done

    def wait(self, mark) -> None:
        if mark is not None:
            self.main.wait_event(mark)

    def join(self) -> None:
        self.main.wait_stream(self.side)


def make_lane(device: torch.device, enabled: bool = True):
    """The side-stream lane on CUDA when enabled, else the inline one."""
    return CudaLane(device) if enabled and device.type == "cuda" else InlineLane()
