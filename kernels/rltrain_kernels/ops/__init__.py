"""The ops: one folder per op, each with a plain-PyTorch reference (`naive.py`) beside its kernels.

Import an op's package to use it, e.g. `from rltrain_kernels.ops.rmsnorm import rms_norm`. Nothing is imported
here so that importing one op never pays for (or fails on) another.

- LM head: `linear_logprobs`, `policy_loss`
- transformer blocks: `rmsnorm` (plain, residual, gated), `swiglu`, `rope`
- linear attention: `gated_delta_rule`, `gated_delta_product`, `iplr_delta_rule`; and fla's modules around them:
  `short_conv` (causal depthwise conv with decode step), `l2norm`, `token_shift`
- `common`: machinery the ops share
"""
