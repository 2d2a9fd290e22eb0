"""The ops: one folder per op, each with a plain-PyTorch reference (`naive.py`) beside its kernels.

Import an op's package to use it, e.g. `from rltrain_kernels.ops.rmsnorm import rms_norm`. Nothing is imported
here so that importing one op never pays for (or fails on) another.
"""
