"""examples/chat_arithmetic: the data it writes loads as verl rows with chat-message prompts, its reward plug-in
scores the last integer, and its warm start of a release-layout checkpoint keeps the release's files (sharded
weights, generation_config.json, tokenizer) and trains the answer after the prompt as the trainer renders it."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from rltrain.data.rows import load_rows, prompt_ids
from rltrain.rewards.plugin import load_reward_fn
from rltrain.workers.policy import load_tokenizer
from tests.fixtures.releases import build_release

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "chat_arithmetic"


def test_reward_scores_the_last_integer():
    score = load_reward_fn(str(EXAMPLE / "reward.py"), "compute_score")
    assert score("chat_arithmetic", "82", "82") == 1.0
    assert score("chat_arithmetic", "<think>\n37+45 is 82? no, 81\n</think>\n\n37+45 = 82", "82") == 1.0
    assert score("chat_arithmetic", "82 or 81", "82") == 0.0
    assert score("chat_arithmetic", "no number", "82") == 0.0


def test_prepare_writes_data_and_warm_starts_a_release_checkpoint(tmp_path):
    source = build_release("llama-3.2-instruct", tmp_path / "llama")
    out = tmp_path / "arith"
    subprocess.run([sys.executable, str(EXAMPLE / "prepare.py"), "--out", str(out), "--model", source,
                    "--warm-start-steps", "3", "--batch-size", "8", "--max-operand", "9", "--num-val", "20"],
                   check=True, capture_output=True, timeout=300)
    train, val = load_rows([str(out / "train.jsonl")]), load_rows([str(out / "val.jsonl")])
    assert (len(train), len(val)) == (80, 20)
    assert val[0].prompt[0]["role"] == "user" and str(val[0].ground_truth).isdigit()
    model = out / "model"
    index = json.loads((model / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == len(list(Path(source).glob("*.safetensors"))) > 1
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (model / name).read_bytes() == (Path(source) / name).read_bytes()
    tokenizer = load_tokenizer(str(model))
    ids = prompt_ids(train[0].prompt, tokenizer)
    assert ids.count(tokenizer.bos_token_id) == 1
    # the warm start changed the weights (3 AdamW steps at lr 1e-3 move every trained element)
    from safetensors.torch import load_file

    before = {k: v for f in Path(source).glob("*.safetensors") for k, v in load_file(f).items()}
    after = {k: v for f in model.glob("*.safetensors") for k, v in load_file(f).items()}
    assert before.keys() == after.keys() and after["model.norm.weight"].dtype == before["model.norm.weight"].dtype
    assert not torch.equal(before["model.layers.0.mlp.up_proj.weight"], after["model.layers.0.mlp.up_proj.weight"])
