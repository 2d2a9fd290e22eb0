"""The config every role loads a model with: attributes a transformers release in our range lacks get the value later
releases default them to (transformers 5.17's Qwen3NextConfig has no pad_token_id, which its model reads)."""

import pytest
import transformers as tf

from rltrain.workers.hf_config import load_config, mend
from rltrain.workers.policy import load_policy
from tests.fixtures.releases import build_release


class Bare(tf.PreTrainedConfig):   # transformers 5's base config declares no token ids
    model_type = "rltrain_test_bare"


def test_a_missing_pad_token_id_becomes_none_and_a_stated_one_stays():
    config = mend(Bare())
    assert config.pad_token_id is None
    stated = Bare()
    stated.pad_token_id = 7
    assert mend(stated).pad_token_id == 7
    nested = Bare()
    nested.text_config = Bare()
    assert mend(nested).text_config.pad_token_id is None


def as_in_transformers_5_17(monkeypatch):
    """Qwen3NextConfig as transformers 5.17 has it: no pad_token_id unless config.json states one."""
    init = tf.Qwen3NextConfig.__init__

    def without_pad(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if "pad_token_id" not in kwargs:
            self.__dict__.pop("pad_token_id", None)

    monkeypatch.setattr(tf.Qwen3NextConfig, "__init__", without_pad)
    monkeypatch.delattr(tf.Qwen3NextConfig, "pad_token_id")


def test_a_qwen3_next_release_loads_where_its_config_class_has_no_pad_token_id(tmp_path, monkeypatch):
    path = build_release("qwen3-next", tmp_path / "qwen3-next")   # config.json without pad_token_id, as released
    as_in_transformers_5_17(monkeypatch)
    assert not hasattr(tf.AutoConfig.from_pretrained(path), "pad_token_id")
    with pytest.raises(AttributeError, match="pad_token_id"):   # what transformers alone does there
        tf.AutoModelForCausalLM.from_pretrained(path)
    assert load_config(path).pad_token_id is None
    model = load_policy(str(path), "float32", None, "cpu")
    assert type(model).__name__ == "Qwen3NextForCausalLM" and model.config.pad_token_id is None
