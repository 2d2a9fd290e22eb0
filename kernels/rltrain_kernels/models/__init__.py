"""transformers model families built on rltrain_kernels.layers (fla's layout: layers/ → models/<family>/), so a
delta-rule policy installs and loads with the kernel layer alone (plus transformers, which the models need).

Importing a family registers it with transformers' Auto classes:

    import rltrain_kernels.models  # noqa: F401  (registers every family)
    model = AutoModelForCausalLM.from_pretrained(path)

Families: `hybrid_delta` (HybridDeltaConfig, HybridDeltaForCausalLM): decoder layers chosen per layer from softmax
attention, Gated DeltaNet, Gated DeltaProduct and IPLR.
"""

from .hybrid_delta import HybridDeltaCache, HybridDeltaConfig, HybridDeltaForCausalLM, HybridDeltaModel

__all__ = ["HybridDeltaCache", "HybridDeltaConfig", "HybridDeltaForCausalLM", "HybridDeltaModel"]
