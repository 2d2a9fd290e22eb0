"""rltrain_kernels: the kernel layer shared by every rltrain role.

- `rltrain_kernels.ops.<op>`: one folder per op (`function.py` the public entry with its autograd Functions and
  modules, `naive.py` the plain-PyTorch reference, the Triton kernels beside them).
- `rltrain_kernels.registry`: device-neutral kernel ids, device detection, and `apply_default_kernels(model)`,
  which swaps a transformers model's modules for this device's kernels.
"""

__version__ = "0.1.0"

from rltrain_kernels.ops.kl_div import linear_kl_div  # noqa: F401
from rltrain_kernels.ops.linear_logprobs import linear_logprobs  # noqa: F401
from rltrain_kernels.ops.policy_loss import fused_policy_loss  # noqa: F401
