"""A model directory's transformers config as every role loads it, mended where a transformers release in our
supported range lacks an attribute its own model code reads.

transformers 5.17's Qwen3NextConfig declares no `pad_token_id` (later releases default it to None) while
Qwen3NextModel reads `config.pad_token_id` when it builds its embedding, so a Qwen3-Next release whose config.json
states none (as released) fails to load there with an AttributeError from inside transformers. The mended config
holds None, what later releases read.
"""

from __future__ import annotations

import rltrain_kernels.models  # noqa: F401  (registers the delta-rule families with the Auto classes)
import transformers as tf

# attributes a model's __init__ reads that some configs in our transformers range lack, and the value later
# releases default them to
DEFAULTED = {"pad_token_id": None}


def load_config(path: str) -> tf.PreTrainedConfig:
    """tf.AutoConfig.from_pretrained(path), with DEFAULTED's attributes set where the config (or its text_config)
    lacks them."""
    return mend(tf.AutoConfig.from_pretrained(path))


def from_pretrained(auto_class, path: str, **kwargs):
    """auto_class.from_pretrained(path, **kwargs) (a transformers Auto model class) with load_config's config."""
    return auto_class.from_pretrained(path, config=load_config(path), **kwargs)


def mend(config: tf.PreTrainedConfig) -> tf.PreTrainedConfig:
    """`config` (in place) with DEFAULTED's attributes set where it or its text_config lacks them."""
    for section in (config, getattr(config, "text_config", None)):
        if section is None:
            continue
        for name, value in DEFAULTED.items():
            if not hasattr(section, name):
                setattr(section, name, value)
    return config
