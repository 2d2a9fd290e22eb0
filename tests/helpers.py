"""Shared test helpers: relative-error asserts with per-dtype thresholds, NaN checks, poisoned buffers, case ids, the
decay gradients' check (dA_log / ddt_bias against the per-token terms they sum), and waiting for processes to exit.

The error metric is ‖actual − expected‖ / ‖expected‖ computed in float64 (fla's convention), which is scale-free
and does not hide large errors in a few elements the way a loose atol does.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

# Per-dtype relative-error thresholds for element-wise / row-wise kernels compared against a float64 reference.
REL_THRESHOLD = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1e-2,
}

ON_GPU = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖₂ / ‖expected‖₂ in float64 (plain ‖actual‖ when expected is all zeros)."""
    a = actual.detach().to(torch.float64).cpu()
    e = expected.detach().to(torch.float64).cpu()
    denom = e.norm().item()
    diff = (a - e).norm().item()
    return diff / denom if denom > 0 else diff


def assert_finite(t: torch.Tensor, name: str = "tensor") -> None:
    bad = ~torch.isfinite(t.detach())
    if bad.any():
        idx = bad.nonzero()[0].tolist()
        raise AssertionError(f"{name}: {int(bad.sum())} non-finite values (first at {idx}) of {t.numel()}")


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, *, dtype: torch.dtype | None = None,
                     threshold: float | None = None, name: str = "tensor") -> float:
    """Assert shape match, no NaN/inf, and relative error within the threshold for `dtype` (default: actual's)."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert_finite(actual, name)
    if threshold is None:
        threshold = REL_THRESHOLD[dtype or actual.dtype]
    err = rel_error(actual, expected)
    assert err <= threshold, f"{name}: relative error {err:.3e} > {threshold:.1e}"
    return err


def record_decay_terms(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """For each module of `model` with the decay g = −exp(A_log)·softplus(z), z = a + dt_bias per token and head: a
    dict, keyed by parameter name as model.named_parameters() spells it, that every later backward through the model
    adds per-head Σ_tokens |term| of dA_log and ddt_bias to, from the gradient reaching a (dz_t for dt_bias,
    dg_t·g_t = dz_t·softplus(z_t)/sigmoid(z_t) for A_log). Each gradient is a sum over every token whose terms can
    cancel, so its relative error alone can exceed any fp32 bar at random; judged against Σ|term| it cannot.
    a is rltrain's layers' a_proj(x) (KDA's f_proj(x), per head and key channel: its A_log terms summed over the
    channels of each head), or the `a` half of transformers' Qwen3-Next Gated DeltaNet's in_proj_ba(x)."""
    totals: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        if not (hasattr(module, "A_log") and hasattr(module, "dt_bias")):
            continue
        if hasattr(module, "a_proj") or hasattr(module, "f_proj"):
            projection, decay_input = getattr(module, "a_proj", None) or module.f_proj, lambda out: out
        elif hasattr(module, "in_proj_ba"):
            projection, decay_input = module.in_proj_ba, _qwen3_next_decay_input(module)
        else:
            raise ValueError(f"{type(module).__name__} has A_log and dt_bias but no decay projection this recorder "
                             "knows (a_proj, in_proj_ba): add it to record_decay_terms")
        names = {role: f"{prefix}.{role}" if prefix else role for role in ("dt_bias", "A_log")}
        projection.register_forward_hook(_decay_term_hook(module, decay_input, names, totals))
    return totals


def _decay_term_hook(layer: torch.nn.Module, decay_input, names: dict[str, str], totals: dict):
    """record_decay_terms' forward hook on one layer's decay projection (a function per layer: no late binding)."""

    def add(dz: torch.Tensor, z: torch.Tensor) -> None:
        for role, term in (("dt_bias", dz), ("A_log", dz * F.softplus(z) / torch.sigmoid(z))):
            total = term.detach().abs().flatten(0, -2).sum(0).double().cpu()
            total = total.view(getattr(layer, role).numel(), -1).sum(-1)  # KDA's A_log: over each head's channels
            totals[names[role]] = totals.get(names[role], 0) + total

    def on_forward(projection, args, out) -> None:  # returns None: the output stays as it is
        z = (decay_input(out) + layer.dt_bias).detach()
        out.register_hook(lambda dout: add(decay_input(dout), z))

    return on_forward


def _qwen3_next_decay_input(layer: torch.nn.Module):
    """in_proj_ba's output (or its gradient) [..., 2·H] -> a [..., H], split by the layer's own
    fix_query_key_value_ordering (b and a interleave per key-head group), with a stand-in for the qkvz half."""
    qkvz_width = layer.in_proj_qkvz.out_features

    def decay_input(ba: torch.Tensor) -> torch.Tensor:
        a = layer.fix_query_key_value_ordering(ba.new_zeros(*ba.shape[:-1], qkvz_width), ba.contiguous())[-1]
        assert a.shape[-1] == layer.dt_bias.numel(), (tuple(a.shape), layer.dt_bias.shape)
        return a

    return decay_input


def assert_decay_grad_close(grad: torch.Tensor, expected: torch.Tensor, terms: torch.Tensor, threshold: float,
                            name: str) -> float:
    """dA_log / ddt_bias against `expected` by ‖error‖ / ‖Σ_tokens |term|‖ (record_decay_terms)."""
    assert grad.shape == expected.shape == terms.shape, (name, grad.shape, expected.shape, terms.shape)
    assert_finite(grad, name)
    err = ((grad.double().cpu() - expected.double().cpu()).norm() / terms.norm()).item()
    assert err <= threshold, f"{name}: error over the per-token terms' magnitudes {err:.3e} > {threshold:.1e}"
    return err


def poisoned(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An output buffer filled with NaN, so any element a kernel fails to write shows up."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def case_id(**dims) -> str:
    """Readable parametrize ids: case_id(B=2, T=75) -> 'B2-T75'."""
    return "-".join(f"{k}{v}" for k, v in dims.items())


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def outputs_and_grads_per_setting(fn, inputs, do, settings, apply) -> dict:
    """{setting: [o, final state, every input's gradient]} of fn on fresh leaf copies of `inputs` (the op's five
    tensors, then the initial state) for the loss ⟨o, do⟩ + Σ final state², after apply(setting) for each setting:
    the same call under switches that must not change a number."""
    results = {}
    for setting in settings:
        apply(setting)
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        o, ht = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True)
        ((o.float() * do.float()).sum() + ht.square().sum()).backward()
        results[setting] = [o, ht] + [t.grad for t in leaves]
    return results


def assert_bitwise_equal(first: list, second: list, names: list[str], what: str) -> None:
    """Each pair of tensors identical to the bit; the message names the first that differs and by how much."""
    for name, a, b in zip(names, first, second, strict=True):
        assert torch.equal(a, b), f"{name} changed with {what}: {(a.float() - b.float()).abs().max()}"


def state_pass_batch(value_block: str, heads: int, V: int, device) -> int:
    """The batch size (sequences of `heads` heads, `V` value columns) at which ops/common/state_pass.py launches its
    state passes with 64 value columns per program ("wide": enough sequence-heads to fill every SM, as at the timed
    B8 H16) or its NARROW_BV ("narrow": 2 sequences), chosen by the shape as the host code chooses, and asserted.
    Triton 3.6 miscompiled one launch setting of a state pass on Hopper (1 stage, bf16 dots, no gate:
    ops/common/launch.py), so the GPU tests hold every launch the host can pick."""
    from rltrain_kernels.ops.common import state_pass

    device = torch.device(device)
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    batch = -(-sm_count // (heads * -(-V // 64))) if value_block == "wide" else 2
    name = state_pass.state_launch("state_pass_bwd", batch * heads, 128, V, device)[0]
    assert name.endswith("_wide") == (value_block == "wide"), (value_block, batch, name)
    return batch


def spy_launches(monkeypatch, module, name: str, record) -> None:
    """Replace the Triton kernel module.name by one that calls record(args, kwargs) before each launch, then launches:
    a test's check that a switch reaches (or skips) a kernel."""
    kernel = getattr(module, name)

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                record(args, kwargs)
                return kernel[grid](*args, **kwargs)
            return run

    monkeypatch.setattr(module, name, Spy())


def alive(pid: int) -> bool:
    """Whether process `pid` runs (Linux: read from /proc; a zombie has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def alive_after(pids, timeout_s: float) -> list[int]:
    """The processes of `pids` still running once all have exited or `timeout_s` has passed (polled every 0.1 s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.1)
    return [pid for pid in pids if alive(pid)]


def processes_running(marker: str) -> list[int]:
    """The running processes (zombies excluded) whose command line holds `marker`, this one excepted."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if marker.encode() in cmdline and alive(int(entry)):
                found.append(int(entry))
    return found


def sandbox_unavailable() -> str | None:
    """Why no sandbox backend works on this machine (what the tests that need one skip with), or None."""
    from rltrain.sandbox import SandboxUnavailable, probe
    try:
        probe()
    except SandboxUnavailable as exc:
        return str(exc)
    return None
