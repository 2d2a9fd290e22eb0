"""FLOP and MFU accounting (rltrain/perf.py): the peak table by device name; the parameter split against a count
from the config by hand, tied and untied; forward FLOPs against torch's own FLOP counter over a real forward; the
trainer's perf record, MFU included, computed as documented; the step timer."""

from types import SimpleNamespace

import pytest
import torch
import transformers as tf
from tensordict import TensorDict
from torch.utils.flop_counter import FlopCounterMode

from rltrain.perf import ModelShape, StepTimer, actor_step_flops, forward_flops, mfu, peak_flops
from rltrain.trainer import GRPOTrainer

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 64, 2, 4, 2, 32, 96, 101


def _model(tied: bool):
    config = tf.Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                            num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                            tie_word_embeddings=tied)
    config._attn_implementation = "eager"  # attention as plain matmuls, which the FLOP counter sees
    return tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                                        ("NVIDIA H200", 989e12), ("NVIDIA GH200 480GB", 989e12),
                                        ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100 80GB PCIe", 312e12),
                                        ("NVIDIA GeForce RTX 4090", None), ("NVIDIA L40S", None), (None, None)])
def test_peak_by_device_name(name, peak):
    assert peak_flops(name) == peak


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_parameter_split_matches_the_config(tied):
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    per_layer = HIDDEN * q + 2 * HIDDEN * kv + q * HIDDEN + 2 * HEAD_DIM + 3 * HIDDEN * FFN + 2 * HIDDEN
    model = _model(tied)
    shape = ModelShape.of(model)
    assert shape == ModelShape(body_params=LAYERS * per_layer + HIDDEN, head_params=VOCAB * HIDDEN,
                               attention_layers=LAYERS, attention_width=q)


def test_forward_flops_match_torchs_counter():
    """One sequence of T tokens whose last R are the response: torch counts the decoder's matmuls with full T×T
    attention (eager computes the masked half too) and the LM head over the R response positions; our count takes
    the causal half of attention and adds the norms' weights to the body (under 1% of it here)."""
    model = _model(tied=False)
    shape = ModelShape.of(model)
    total, response = 37, 11
    ids = torch.randint(0, VOCAB, (1, total))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        hidden = model.base_model(input_ids=ids).last_hidden_state
        model.lm_head(hidden[:, total - response:])
    counted = counter.get_total_flops()
    full_attention = 4 * LAYERS * HEADS * HEAD_DIM * total ** 2  # QKᵀ and PV over all T² pairs
    ours = forward_flops(shape, torch.tensor([total]), torch.tensor([response]))
    assert ours == pytest.approx(counted - full_attention / 2, rel=1e-2)
    assert ours != pytest.approx(counted, rel=1e-2)  # the comparison sees the attention term
    lengths, responses = torch.tensor([37, 20, 5]), torch.tensor([11, 3, 1])
    assert forward_flops(shape, lengths, responses) == pytest.approx(
        sum(forward_flops(shape, lengths[i:i + 1], responses[i:i + 1]) for i in range(3)))
    assert actor_step_flops(shape, lengths, responses) == 4 * forward_flops(shape, lengths, responses)


def test_trainer_perf_record():
    shape = ModelShape(body_params=1000, head_params=100, attention_layers=2, attention_width=8)
    batch = TensorDict({"prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
                        "response_mask": torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])}, batch_size=[2])
    timer = StepTimer()
    timer.add("rollout", 2.0)
    timer.count("rollout_tokens", 40)
    timer.add("old_logprob", 0.5)
    timer.add("update", 1.5)
    timer.add("ref", 0.0)
    trainer = SimpleNamespace(peak_flops=1e12, model_shape=shape, placement=SimpleNamespace(world_size=2))
    record = GRPOTrainer._perf(trainer, batch, timer)
    flops = actor_step_flops(shape, torch.tensor([4, 7]), torch.tensor([2, 4]))
    assert flops == 4 * (2 * 1000 * 11 + 2 * 100 * 6 + 2 * 2 * 8 * (16 + 49))
    assert record == {"time/rollout_s": 2.0, "time/old_logprob_s": 0.5, "time/update_s": 1.5, "time/ref_s": 0.0,
                      "perf/rollout_tokens_per_s": 20.0, "perf/actor_tokens_per_s": 11 / 2.0,
                      "perf/actor_mfu": pytest.approx(flops / (2.0 * 2 * 1e12))}
    assert mfu(flops, 2.0, 2, 1e12) == record["perf/actor_mfu"]
    trainer.peak_flops = None  # CPU, or a GPU not in the table: no MFU
    assert "perf/actor_mfu" not in GRPOTrainer._perf(trainer, batch, timer)


def test_step_timer_accumulates_phases():
    timer = StepTimer()
    for _ in range(2):
        with timer.phase("rollout"):
            pass
    with pytest.raises(ValueError), timer.phase("update"):
        raise ValueError("a failed phase is still timed")
    assert set(timer.record()) == {"time/rollout_s", "time/update_s"}
    assert timer.get("rollout") >= 0 and timer.get("ref") == 0.0
