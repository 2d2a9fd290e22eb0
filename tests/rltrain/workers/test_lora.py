"""LoRA RL (actor.lora, rltrain/workers/lora.py) in process, without Ray, on a small Qwen3 built from its config:

- the actor trains the adapters only: over several updates every base weight stays bit-identical, the adapters
  move, the optimizer holds exactly the adapters, and the weight push's buckets hold adapter tensors only;
- the reference log-probs (compute_ref_logprobs: adapters disabled) equal a plain copy of the base model's;
- after a push through export_weights / load_bucket (the CPU route) the hf rollout engine's log-probs equal the
  actor's (and did not before), its greedy responses the actor's policy's (not the base's), its base unchanged;
- the actor's checkpoint holds the adapters alone (and with trainer.save_hf their PEFT format, which
  PeftModel.from_pretrained on the base loads as the actor), a fresh actor resumed from it (adapters + optimizer) makes
  the same next update as the original, and `python -m rltrain.export` merges them into a full HF model with the
  actor's log-probs (a base that moved: exit 2 asking for --base);
- log-probs are computed without LoRA dropout and the update's dropout draws are seeded by the step;
- bad target_modules fail naming actor.lora.target_modules;
- save_peft_adapter (the directory the vLLM engine loads the pushed adapters from) writes PEFT's own tensor names
  and config, and PeftModel.from_pretrained on it reproduces the actor; adapter_modules_of finds the modules PEFT
  wraps without reading weights.

Run: `pytest tests/rltrain/workers/test_lora.py` (CPU, about a minute).
"""

import json

import pytest
import torch
from tensordict import TensorDict

from rltrain.algorithms.advantages import compute_advantages
from rltrain.algorithms.config import LossConfig
from rltrain.checkpoint import save_checkpoint
from rltrain.config import ConfigError
from rltrain.distributed_checkpoint import read_state
from rltrain.export import main as export_main
from rltrain.workers.actor import ActorWorker
from rltrain.workers.actor_config import ActorConfig
from rltrain.workers.lora import (LoraConfig, adapter_modules_of, adapter_weights, check_target_modules,
                                  check_target_modules_of, is_adapter_weight, peft_checkpoint_name,
                                  save_peft_adapter)
from rltrain.workers.packing import MicroBatching
from rltrain.workers.policy import load_policy, load_tokenizer, response_logprobs
from rltrain.workers.rollout import RolloutConfig, RolloutWorker
from tests.rltrain.tiny_job import save_tiny_policy

LORA = LoraConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    save_tiny_policy(path)
    return str(path)


def _actor(model_dir, lora=LORA, seed=0, **config) -> ActorWorker:
    return ActorWorker(ActorConfig(torch_threads=1, lr=1e-2, lora=lora, **config), LossConfig(), model_dir,
                       "float32", None, temperature=1.0, seed=seed)


def _batch(vocab: int, seed: int = 0) -> TensorDict:
    """3 prompts × 4 responses of random tokens (a few masked), rewarded so that GRPO's advantages are non-zero."""
    generator = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(4, vocab, (12, 5), generator=generator)
    response_ids = torch.randint(4, vocab, (12, 6), generator=generator)
    response_mask = torch.ones(12, 6, dtype=torch.long)
    response_mask[1, 4:] = 0
    response_mask[7, 2:] = 0
    batch = TensorDict({"prompt_ids": prompt_ids, "prompt_mask": torch.ones(12, 5, dtype=torch.long),
                        "response_ids": response_ids, "response_mask": response_mask,
                        "group_ids": torch.arange(3).repeat_interleave(4)}, batch_size=[12])
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    batch["advantages"] = compute_advantages("grpo", rewards, response_mask, batch["group_ids"])
    return batch


def _train(actor: ActorWorker, steps: int, first_step: int = 1) -> list[dict]:
    metrics = []
    for step in range(first_step, first_step + steps):
        batch = _batch(actor.model.config.vocab_size, seed=step)
        batch["old_logprobs"] = actor.compute_logprobs(batch)
        metrics.append(actor.update(batch, step))
    return metrics


def _base_weights(model) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in model.state_dict().items() if not is_adapter_weight(name)}


def _plain_logprobs(model_dir, batch) -> torch.Tensor:
    model = load_policy(model_dir, "float32", None, "cpu")
    return response_logprobs(model.eval(), batch, 1.0, MicroBatching(rows=64, packed=False))


def test_only_adapters_train_and_travel(model_dir):
    actor = _actor(model_dir)
    adapters = {name for name, _ in actor.model.named_parameters() if is_adapter_weight(name)}
    assert adapters and all(".lora_A." in name or ".lora_B." in name for name in adapters)
    assert not any("lm_head" in name for name in adapters)  # all-linear leaves the head out
    assert {id(p) for group in actor.optimizer.param_groups for p in group["params"]} == \
           {id(p) for name, p in actor.model.named_parameters() if name in adapters}
    base = _base_weights(actor.model)
    before = {name: p.detach().clone() for name, p in actor.model.named_parameters() if name in adapters}
    metrics = _train(actor, 3)
    assert all(m["actor/grad_norm"] > 0 for m in metrics)
    after = _base_weights(actor.model)
    assert after.keys() == base.keys() and all(torch.equal(after[name], base[name]) for name in base)
    moved = [name for name, p in actor.model.named_parameters() if name in adapters
             and not torch.equal(p.detach(), before[name])]
    assert len(moved) == len(adapters)  # lora_B starts at 0 and every A gets a gradient once B is non-zero

    names = [name for bucket in actor.bucket_names(1) for name in bucket]
    assert set(names) == adapters and len(names) == len(adapters)
    exported = actor.export_weights(names, ipc_ranks=[], host=True).host.tensors()
    assert set(exported) == adapters and all(is_adapter_weight(name) for name in exported)
    live = dict(actor.model.named_parameters())
    assert all(torch.equal(exported[name], live[name].detach()) for name in names)
    full = _actor(model_dir, lora=LoraConfig())  # rank 0: the whole state_dict travels, as before
    assert [n for bucket in full.bucket_names(256) for n in bucket] == list(full.model.state_dict())


def test_adapters_take_the_models_dtype(model_dir):
    """bf16 policy, bf16 adapters (PEFT's default would make them fp32 and keep an fp32 copy of every adapted
    layer's input for the backward); the adapted layers' outputs stay bf16."""
    actor = ActorWorker(ActorConfig(torch_threads=1, lora=LORA), LossConfig(), model_dir, "bfloat16", None,
                        temperature=1.0)
    adapters = {name: p for name, p in actor.model.named_parameters() if is_adapter_weight(name)}
    assert adapters and {p.dtype for p in adapters.values()} == {torch.bfloat16}
    layer = actor.model.model.layers[0].mlp.down_proj
    assert layer(torch.randn(3, layer.in_features, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_reference_is_the_base_with_adapters_disabled(model_dir):
    actor = _actor(model_dir)
    _train(actor, 2)
    batch = _batch(actor.model.config.vocab_size, seed=9)
    valid = batch["response_mask"].bool()
    reference, policy = actor.compute_ref_logprobs(batch), actor.compute_logprobs(batch)
    plain = _plain_logprobs(model_dir, batch)
    assert (reference - plain).abs()[valid].max() < 1e-6
    assert (policy - plain).abs()[valid].mean() > 1e-2  # the adapters have moved the policy
    assert torch.equal(actor.compute_logprobs(batch), policy)  # adapters are back on after the reference
    with pytest.raises(RuntimeError, match="needs actor.lora.rank > 0"):
        _actor(model_dir, lora=LoraConfig()).compute_ref_logprobs(batch)


def _greedy(model, batch) -> torch.Tensor:
    with torch.no_grad():
        out = model.generate(input_ids=batch["prompt_ids"], attention_mask=batch["prompt_mask"], do_sample=False,
                             max_new_tokens=6, pad_token_id=0, eos_token_id=model.config.eos_token_id)
    return out[:, batch["prompt_ids"].shape[1]:]


def test_push_makes_the_rollout_engine_equal_the_actor(model_dir, tmp_path):
    actor = _actor(model_dir)
    rollout = RolloutWorker(RolloutConfig(torch_threads=1), model_dir, "float32", None, lora=LORA)
    engine_model = rollout.engine.model
    base = _base_weights(engine_model)
    _train(actor, 2)
    batch = _batch(actor.model.config.vocab_size, seed=5)
    valid = batch["response_mask"].bool()
    batching = MicroBatching(rows=64, packed=False)
    actor_logprobs = actor.compute_logprobs(batch)
    stale = response_logprobs(engine_model, batch, 1.0, batching)
    assert (stale - actor_logprobs).abs()[valid].mean() > 1e-2  # the check discriminates

    rollout.begin_weight_update()
    for names in actor.bucket_names(1):
        assert rollout.load_bucket(actor.export_weights(names, ipc_ranks=[], host=True)) == "host"
    rollout.finish_weight_update()
    pushed = response_logprobs(engine_model, batch, 1.0, batching)
    assert (pushed - actor_logprobs).abs()[valid].max() < 1e-6
    after = _base_weights(engine_model)
    assert all(torch.equal(after[name], base[name]) for name in base)  # the engine's base is untouched too
    # greedy responses: the actor's model runs packed rows only, so its policy generates as PEFT loads it
    import peft
    from transformers import AutoModelForCausalLM

    actor.save_pretrained(str(tmp_path))
    policy = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), str(tmp_path)).eval()
    greedy = _greedy(engine_model, batch)
    assert torch.equal(greedy, _greedy(policy, batch))
    assert not torch.equal(greedy, _greedy(AutoModelForCausalLM.from_pretrained(model_dir).eval(), batch))


def test_checkpoint_holds_the_adapters_resumes_and_exports(model_dir, tmp_path, capsys):
    import peft
    from transformers import AutoModelForCausalLM

    actor = _actor(model_dir)
    _train(actor, 2)
    checkpoint = save_checkpoint(str(tmp_path), 2, lambda p: actor.save_checkpoint(str(p), save_hf=True), model_dir,
                                 load_tokenizer(model_dir), {}, LORA)
    saved = read_state(checkpoint / "model")   # the adapters alone: the base is model.path's
    assert saved.keys() == set(adapter_weights(actor.model))
    files = {p.name for p in (checkpoint / "hf").iterdir()}   # trainer.save_hf: PEFT's format too
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files and "model.safetensors" not in files
    config = json.loads((checkpoint / "hf" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == model_dir and config["r"] == 4 and config["lora_alpha"] == 8
    batch = _batch(actor.model.config.vocab_size, seed=7)
    valid = batch["response_mask"].bool()
    expected = actor.compute_logprobs(batch)

    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), str(checkpoint / "hf"))
    got = response_logprobs(loaded.get_base_model().eval(), batch, 1.0, MicroBatching(rows=64, packed=False))
    assert (got - expected).abs()[valid].max() < 1e-6

    resumed = _actor(model_dir, seed=1)  # other initial adapters: everything must come from the checkpoint
    resumed.load_checkpoint(str(checkpoint))
    assert torch.equal(resumed.compute_logprobs(batch), expected)
    _train(actor, 1, first_step=3)
    _train(resumed, 1, first_step=3)
    state, again = dict(actor.model.named_parameters()), dict(resumed.model.named_parameters())
    assert all(torch.equal(state[name], again[name]) for name in state)

    for out, base in ((tmp_path / "merged", None), (tmp_path / "merged_base", model_dir)):
        assert export_main([str(checkpoint), str(out), *(["--base", base] if base else [])]) == 0
        merged = AutoModelForCausalLM.from_pretrained(out)
        assert not any(is_adapter_weight(name) or "base_layer" in name for name in merged.state_dict())
        assert merged.state_dict().keys() == AutoModelForCausalLM.from_pretrained(model_dir).state_dict().keys()
        merged_logprobs = response_logprobs(merged.eval(), batch, 1.0, MicroBatching(rows=64, packed=False))
        assert (merged_logprobs - expected).abs()[valid].max() < 1e-4
        assert (merged_logprobs - _plain_logprobs(model_dir, batch)).abs()[valid].mean() > 1e-2
    capsys.readouterr()

    config["base_model_name_or_path"] = str(tmp_path / "gone")   # the base moved since the run
    (checkpoint / "hf" / "adapter_config.json").write_text(json.dumps(config))
    assert export_main([str(checkpoint), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (f"error: base model {str(tmp_path / 'gone')!r} is not a transformers model "
                                       "directory (no config.json); pass --base with the model the adapters were "
                                       "trained on\n")
    assert not (tmp_path / "out").exists()


def test_dropout_stays_out_of_log_probs_and_is_seeded_in_the_update(model_dir):
    lora = LoraConfig(rank=4, alpha=8.0, dropout=0.5)
    first, second = _actor(model_dir, lora=lora), _actor(model_dir, lora=lora)
    _train(first, 1)
    batch = _batch(first.model.config.vocab_size, seed=3)
    assert torch.equal(first.compute_logprobs(batch), first.compute_logprobs(batch))  # eval mode: no dropout
    torch.manual_seed(123)  # the global stream differs between the two runs; the update seeds its own
    _train(second, 1)
    state, again = dict(first.model.named_parameters()), dict(second.model.named_parameters())
    assert all(torch.equal(state[name], again[name]) for name in state)


def test_target_modules_are_checked_against_the_model(model_dir):
    model = load_policy(model_dir, "float32", None, "cpu")
    check_target_modules(model, LoraConfig(rank=4, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(ConfigError, match=r"actor.lora.target_modules: 'qkv_proj' matches no module of "
                                          r"Qwen3ForCausalLM; its linear layers: down_proj, gate_proj, k_proj"):
        check_target_modules(model, LoraConfig(rank=4, target_modules=["q_proj", "qkv_proj"]))
    with pytest.raises(ConfigError, match=r"actor.lora.target_modules: 'lm_head' matches the LM head 'lm_head'"):
        check_target_modules(model, LoraConfig(rank=4, target_modules=["lm_head"]))
    with pytest.raises(ConfigError, match=r"'o' matches no module"):  # on the meta device, from the directory
        check_target_modules_of(model_dir, LoraConfig(rank=4, target_modules=["o"]))
    check_target_modules_of(model_dir, LoraConfig(rank=0, target_modules=["o"]))  # LoRA off: not checked
    with pytest.raises(ConfigError, match=r"^critic.lora.target_modules: 'o' matches no module"):
        check_target_modules_of(model_dir, LoraConfig(rank=4, target_modules=["o"]), "critic.lora")
    actor = _actor(model_dir, lora=LoraConfig(rank=4, target_modules=["q_proj", "v_proj"]))
    assert {name.split(".")[-4] for name in dict(actor.model.named_parameters()) if is_adapter_weight(name)} == \
           {"q_proj", "v_proj"}


def test_peft_checkpoint_names():
    assert peft_checkpoint_name("model.layers.0.mlp.up_proj.lora_A.default.weight") == \
        "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"
    assert peft_checkpoint_name("model.embed_tokens.lora_embedding_B.default") == \
        "base_model.model.model.embed_tokens.lora_embedding_B"
    # only the segment right after a lora_ module is the adapter's name
    assert peft_checkpoint_name("model.default.q_proj.lora_B.default.weight") == \
        "base_model.model.model.default.q_proj.lora_B.weight"


def test_saved_adapters_are_peft_format(model_dir, tmp_path):
    """What the vLLM engine loads: save_peft_adapter's file has exactly the tensors PEFT's save_pretrained writes (same
    names), its config the same LoRA settings, and PeftModel.from_pretrained on it computes the actor's log-probs.
    Embedding adapters (lora_embedding_A/B, no .weight) included."""
    import peft
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    lora = LoraConfig(rank=4, alpha=8.0, target_modules=["embed_tokens", "q_proj", "v_proj", "down_proj"])
    actor = _actor(model_dir, lora=lora)
    _train(actor, 2)
    save_peft_adapter(str(tmp_path / "ours"), actor.pushed_weights(), lora, model_dir)
    actor.save_pretrained(str(tmp_path / "peft"))
    ours = load_file(tmp_path / "ours" / "adapter_model.safetensors")
    theirs = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    # with embed_tokens targeted PEFT also saves that layer's base weight (save_embedding_layers); the push sends
    # adapters only, the engine has the base
    assert [name for name in theirs if name not in ours] == ["base_model.model.model.embed_tokens.base_layer.weight"]
    theirs.pop("base_model.model.model.embed_tokens.base_layer.weight")
    assert ours.keys() == theirs.keys() and any("lora_embedding_A" in name for name in ours)
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    assert {p.name for p in (tmp_path / "ours").iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    config, expected = (json.loads((tmp_path / d / "adapter_config.json").read_text()) for d in ("ours", "peft"))
    for key in ("peft_type", "r", "lora_alpha", "lora_dropout", "bias", "base_model_name_or_path", "use_rslora",
                "use_dora", "modules_to_save"):
        assert config[key] == expected[key], key
    assert sorted(config["target_modules"]) == sorted(expected["target_modules"])

    batch = _batch(actor.model.config.vocab_size, seed=4)
    valid = batch["response_mask"].bool()
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), str(tmp_path / "ours"))
    got = response_logprobs(loaded.get_base_model().eval(), batch, 1.0, MicroBatching(rows=64, packed=False))
    expected_logprobs = actor.compute_logprobs(batch)
    assert (got - expected_logprobs).abs()[valid].max() < 1e-6
    assert (got - _plain_logprobs(model_dir, batch)).abs()[valid].mean() > 1e-2  # the adapters are in it


def test_adapter_modules_are_found_on_the_meta_device(model_dir):
    assert adapter_modules_of(model_dir, LORA) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"}  # all-linear: not the LM head
    assert adapter_modules_of(model_dir, LoraConfig(rank=2, target_modules=["embed_tokens", "v_proj"])) == \
        {"embed_tokens", "v_proj"}
