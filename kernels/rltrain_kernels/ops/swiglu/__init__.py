"""SwiGLU activation, silu(gate) * up: public function, autograd Function and nn.Module.

    from rltrain_kernels.ops.swiglu import swiglu, SwiGLU
    h = swiglu(gate_proj(x), up_proj(x))          # then down_proj(h)

Maths in fp32, output in the inputs' dtype; differentiable w.r.t. gate and up. Tensors the Triton kernels cannot
take (CPU tensors outside the interpreter, float64) go to `naive_swiglu`, which computes the same function.
"""

from rltrain_kernels.ops.swiglu.function import SwiGLU, SwiGLUFunction, swiglu
from rltrain_kernels.ops.swiglu.naive import naive_swiglu

__all__ = ["SwiGLU", "SwiGLUFunction", "naive_swiglu", "swiglu"]
