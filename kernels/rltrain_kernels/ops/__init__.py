"""The ops: one folder per op, every folder the same shape (fla's `ops/`):

- `__init__.py` re-exports the op's public names, and nothing else;
- `function.py` is the public entry: the user-facing functions and modules and their autograd Functions (the delta
  rules: `chunk_*` for training and prefill, `fused_recurrent_*` for decoding);
- `naive.py` is the plain-PyTorch reference: the ground truth the tests hold the kernels to, and the fallback where
  the kernels cannot run;
- the rest are the op's Triton kernels and their host functions (the delta rules: `chunk_fwd.py`, `chunk_bwd.py`,
  `fused_recurrent.py`, and `inputs.py` for their argument checks), and a README.md with the maths where the op is
  non-obvious.

No op imports another op's internals: what two ops share lives in `common/` (an op may call another's public
function, as the delta rules call `l2norm`). tests/kernels/ops/test_op_folders.py holds the package to this.

Import an op's package to use it, e.g. `from rltrain_kernels.ops.rmsnorm import rms_norm`. Nothing is imported
here so that importing one op never pays for (or fails on) another.

- LM head: `linear_logprobs`, `policy_loss`, `kl_div`
- transformer blocks: `rmsnorm` (plain, residual, gated), `swiglu`, `rope`, `fused_moe`
- linear attention: `gated_delta_rule`, `gated_delta_product`, `iplr_delta_rule`; and fla's modules around them:
  `short_conv` (causal depthwise conv with decode step), `l2norm`, `token_shift`
- `common`: machinery the ops share
"""
