"""Model integration: how each kernel id is swapped into a transformers model, one module per kernel id.

Every module here registers its per-device implementations with `@register_kernel` when imported;
`rltrain_kernels.registry.discover_kernels()` imports them all. `families.py` is the table of supported model
families (which classes are the RMSNorm, SwiGLU MLP, attention and MoE experts modules) and the class-swap helper
they share. `qwen3_next.py` registers no kernel: it is the forward that lets Qwen3-Next's Gated DeltaNet take a
packed row's boundaries (installed by rltrain for packed batches, and built into the `gated_delta_rule` swap).
Kernels themselves live in `rltrain_kernels.ops`; nothing here computes anything.
"""
