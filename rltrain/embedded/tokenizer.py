"""A character-level tokenizer built in code (no hub): digits, operators, a few letters, <pad>/<eos>/<unk>.

It is a transformers `PreTrainedTokenizerFast`, so it saves and loads like any hub tokenizer, and its chat
template concatenates message contents (chat-format prompts render to the same text as plain ones).
"""

from __future__ import annotations

CHARS = list("0123456789+-*=() ,.?abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ:\n")
SPECIAL = ["<pad>", "<eos>", "<unk>"]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def build_char_tokenizer(extra_chars: str = ""):
    """`extra_chars`: characters added after the default ones (tests of tool calls need `<>{}"_/`)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + CHARS + [c for c in dict.fromkeys(extra_chars)
                                                                      if c not in CHARS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>", padding_side="left")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
