"""The models the framework's benchmarks run on: Qwen3 shapes built from config with random weights, saved as a
checkpoint directory with a word-level tokenizer ("t0 t1 ...") of the full vocabulary, so every role loads it as it
would a real one (the rollout engines read the tokenizer's end-of-sequence and pad ids). Not a script: the bench_*.py
scripts beside it import it (python puts a script's own directory on the import path).

    from checkpoints import QWEN3_SIZES, build_checkpoint
    path = build_checkpoint("1.7b", root)            # root/qwen3-1.7b: config, bf16 weights, tokenizer
"""

from __future__ import annotations

import os

import torch

VOCAB = 151936   # Qwen3's vocabulary size
QWEN3_SIZES = {  # Qwen3-0.6B / 1.7B shapes (tied embeddings, GQA 16/8 heads of 128); tiny: CPU dry runs
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=VOCAB),
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=VOCAB),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, vocab_size=512),
}
QWEN3_COMMON = dict(max_position_embeddings=40960, tie_word_embeddings=True, rope_theta=1e6)


def word_tokenizer(vocab: int):
    """A word-level tokenizer of `vocab` ids: "t0" .. "t{vocab - 4}", then <unk>, the pad <|endoftext|> (vocab - 2)
    and the end of sequence <|im_end|> (vocab - 1)."""
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<unk>", "<|endoftext|>", "<|im_end|>"]
    words = {f"t{i}": i for i in range(vocab - len(specials))}
    words.update({token: vocab - len(specials) + i for i, token in enumerate(specials)})
    core = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tf.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<|endoftext|>",
                                      eos_token="<|im_end|>")


def build_checkpoint(size: str, root: str) -> str:
    """A random-weight (seed 0) bf16 Qwen3 of `size`'s shape and its word_tokenizer, saved in root/qwen3-<size>."""
    import transformers as tf

    shape = QWEN3_SIZES[size]
    tokenizer = word_tokenizer(shape["vocab_size"])
    config = tf.Qwen3Config(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                            bos_token_id=None, **QWEN3_COMMON, **shape)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    path = os.path.join(root, f"qwen3-{size}")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
