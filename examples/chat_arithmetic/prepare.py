"""Data for a first run on a real checkpoint: two-operand arithmetic as chat-message prompts in verl's row format
(train.jsonl, val.jsonl), and optionally a supervised warm start of the checkpoint on them, for models that cannot
add yet (a randomly initialised checkpoint with a release's files, e.g. `python -m tests.fixtures.releases`).

    python examples/chat_arithmetic/prepare.py --out /tmp/arith                        # data only (Qwen3-0.6B adds)
    python examples/chat_arithmetic/prepare.py --out /tmp/arith --model DIR --warm-start-steps 400
    python -m rltrain.main_grpo model.path=/tmp/arith/model data.train_files=/tmp/arith/train.jsonl \
        data.val_files=/tmp/arith/val.jsonl reward.path=examples/chat_arithmetic/reward.py reward.name=compute_score

The warm start trains the answer and the tokenizer's end-of-sequence token after each prompt, rendered exactly as
the trainer renders it (the chat template; rltrain.data.rows.prompt_ids), until greedy decoding answers
--target-accuracy of 128 training problems; the result, saved in the source's layout (sharded safetensors, its
generation_config.json and tokenizer files), goes to OUT/model.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path

import torch

from rltrain.data.rows import PromptRow, prompt_ids
from rltrain.rewards.plugin import load_reward_fn
from rltrain.workers.batch import left_pad
from rltrain.workers.policy import load_tokenizer

DATA_SOURCE = "chat_arithmetic"
REWARD = load_reward_fn(str(Path(__file__).with_name("reward.py")), "compute_score")


def make_rows(max_operand: int, num_val: int, seed: int) -> tuple[list[PromptRow], list[PromptRow]]:
    problems = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    random.Random(seed).shuffle(problems)
    rows = [PromptRow([{"role": "user", "content": f"{a}+{b}="}], DATA_SOURCE, str(a + b), {"index": i})
            for i, (a, b) in enumerate(problems)]
    return rows[num_val:], rows[:num_val]


def write_jsonl(rows: list[PromptRow], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({"prompt": row.prompt, "data_source": row.data_source,
                                "reward_model": {"ground_truth": row.ground_truth},
                                "extra_info": row.extra_info}) + "\n")


def sft_batch(rows: list[PromptRow], tokenizer):
    """Prompt + answer + <eos> rows (right-padded), labels on the answer and <eos> only."""
    sequences, starts = [], []
    for row in rows:
        prompt = prompt_ids(row.prompt, tokenizer)
        answer = tokenizer(str(row.ground_truth), add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        sequences.append(prompt + answer)
        starts.append(len(prompt))
    width = max(map(len, sequences))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    for i, (seq, start) in enumerate(zip(sequences, starts)):
        ids[i, :len(seq)] = torch.tensor(seq)
        labels[i, start:len(seq)] = torch.tensor(seq[start:])
    return ids, (labels != -100) | (torch.arange(width) < torch.tensor(starts)[:, None]), labels


@torch.no_grad()
def greedy_accuracy(model, tokenizer, rows: list[PromptRow], device) -> float:
    ids, mask = left_pad([prompt_ids(row.prompt, tokenizer) for row in rows], tokenizer.pad_token_id)
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                         max_new_tokens=8, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
    return sum(REWARD(r.data_source, t, r.ground_truth) for t, r in zip(texts, rows)) / len(rows)


def warm_start(source: str, target: Path, rows: list[PromptRow], steps: int, target_accuracy: float, lr: float,
               batch_size: int, seed: int) -> float:
    import transformers as tf

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = load_tokenizer(source, padding_side="left")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = tf.AutoModelForCausalLM.from_pretrained(source, dtype="auto")
    saved_dtype = model.dtype   # trained in fp32, saved back in the checkpoint's dtype
    model = model.float().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rng, accuracy = random.Random(seed), 0.0
    probe = rng.sample(rows, min(128, len(rows)))
    for step in range(1, steps + 1):
        model.train()
        ids, mask, labels = sft_batch(rng.sample(rows, batch_size), tokenizer)
        loss = model(input_ids=ids.to(device), attention_mask=mask.long().to(device), labels=labels.to(device)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == steps:
            model.eval()
            accuracy = greedy_accuracy(model, tokenizer, probe, device)
            print(f"warm start step {step}: loss {loss.item():.3f}, greedy accuracy {accuracy:.2f}", flush=True)
            if accuracy >= target_accuracy:
                break
    shards = sorted(Path(source).glob("*.safetensors"))   # as many shards as the source (a sharded index stays one)
    size = sum(f.stat().st_size for f in shards)
    model.to(saved_dtype).save_pretrained(target, max_shard_size=size // len(shards) + 2**16 if shards else "5GB")
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja"):
        if Path(source, name).is_file():
            shutil.copy(Path(source, name), target / name)   # the release's own files, not re-serialised
    return accuracy


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for train.jsonl, val.jsonl (and model/)")
    parser.add_argument("--model", help="a model directory to warm-start (with --warm-start-steps)")
    parser.add_argument("--warm-start-steps", type=int, default=0)
    parser.add_argument("--target-accuracy", type=float, default=0.15)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-operand", type=int, default=49)
    parser.add_argument("--num-val", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.warm_start_steps and not args.model:
        parser.error("--warm-start-steps needs --model")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train, val = make_rows(args.max_operand, args.num_val, args.seed)
    write_jsonl(train, out / "train.jsonl")
    write_jsonl(val, out / "val.jsonl")
    print(f"wrote {len(train)} training and {len(val)} held-out rows to {out}")
    if args.warm_start_steps:
        accuracy = warm_start(args.model, out / "model", train, args.warm_start_steps, args.target_accuracy,
                              args.lr, args.batch_size, args.seed)
        print(f"warm-started {args.model} -> {out / 'model'} (greedy accuracy {accuracy:.2f})")


if __name__ == "__main__":
    main()
