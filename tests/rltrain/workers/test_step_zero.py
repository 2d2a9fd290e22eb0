"""Step-0 invariants, in process (no Ray): response log-probs equal HF's log-softmax of the logits at the right
positions; actor and reference agree; the first mini-batch has ratio 1 (ppo_kl 0, no clipping)."""

import pytest
import torch
import transformers

from rltrain.algorithms.advantages import compute_advantages
from rltrain.algorithms.config import LossConfig
from rltrain.data.sampler import encode_prompts
from rltrain.embedded.model import embedded_policy_dir
from rltrain.embedded.task import make_rows
from rltrain.workers.actor import ActorWorker
from rltrain.workers.actor_config import ActorConfig
from rltrain.workers.batch import model_inputs
from rltrain.workers.packing import MicroBatching
from rltrain.workers.reference import ReferenceWorker
from rltrain.workers.rollout import RolloutConfig, RolloutWorker
from tests.rltrain.tiny_job import tiny_job


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    job = tiny_job(tmp_path_factory.mktemp("step0"))
    model_dir = str(embedded_policy_dir(job.trainer.output_dir, job.model.embedded, job.data.task, 0))
    train, _ = make_rows(job.data.task)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids, mask = encode_prompts(train[:3], tokenizer)
    rollout = RolloutWorker(RolloutConfig(n=4, max_new_tokens=5, torch_threads=1), model_dir, "float32", None)
    batch = rollout.generate(ids, mask, 4, 1.0, seed=0)
    return model_dir, batch, rollout


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_hf_logits(setup, temperature):
    model_dir, batch, _ = setup
    ref = ReferenceWorker(model_dir, "float32", None, temperature, MicroBatching(rows=5), torch_threads=1)
    logp = ref.compute_logprobs(batch)
    input_ids, attention_mask, position_ids = model_inputs(batch)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)   # plain transformers
    logits = hf(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    width = batch["prompt_ids"].shape[1]
    dense = torch.log_softmax(logits[:, width - 1:-1].double() / temperature, -1)
    expected = dense.gather(-1, batch["response_ids"].unsqueeze(-1)).squeeze(-1) * batch["response_mask"]
    assert batch["response_mask"].sum() > 0
    torch.testing.assert_close(logp.double(), expected, rtol=0, atol=1e-5)
    assert torch.all(logp[batch["response_mask"] == 0] == 0)


def test_actor_and_reference_agree_and_first_update_is_on_policy(setup):
    model_dir, batch, _ = setup
    actor = ActorWorker(ActorConfig(micro_batch_size=5, torch_threads=1), LossConfig(kl_coef=0.1), model_dir,
                        "float32", None, temperature=1.0)
    reference = ReferenceWorker(model_dir, "float32", None, 1.0, MicroBatching(rows=7, packed=False), torch_threads=1)
    old, ref = actor.compute_logprobs(batch), reference.compute_logprobs(batch)
    assert (old - ref).abs().max().item() < 1e-6
    batch = batch.clone()
    batch["rewards"] = torch.rand(batch.batch_size[0])
    batch["advantages"] = compute_advantages("grpo", batch["rewards"], batch["response_mask"], batch["group_ids"])
    batch["old_logprobs"], batch["ref_logprobs"] = old, ref
    before = {k: v.clone() for k, v in actor.state_dict().items()}
    metrics = actor.update(batch)
    assert abs(metrics["actor/ppo_kl"]) < 1e-6 and metrics["actor/clipfrac"] == 0.0
    assert abs(metrics["actor/ref_kl"]) < 1e-6 and metrics["actor/grad_norm"] > 0
    assert any(not torch.equal(before[k], v) for k, v in actor.state_dict().items())


def test_weight_push_makes_rollout_match_actor(setup):
    model_dir, batch, rollout = setup
    actor = ActorWorker(ActorConfig(torch_threads=1), LossConfig(), model_dir, "float32", None, temperature=1.0)
    with torch.no_grad():
        for p in actor.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    rollout.begin_weight_update()
    for name, tensor in actor.state_dict().items():  # one tensor per bucket
        rollout.load_weights({name: tensor})
    rollout.finish_weight_update()
    for name, value in rollout.engine.model.state_dict().items():
        assert torch.equal(value, actor.model.state_dict()[name]), name


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batching_gives_the_whole_batch_gradient(setup, loss_agg):
    """Gradient accumulation over micro-batches of padded rows equals one pass over the mini-batch, for each
    aggregation (one response fully masked, so valid-sequence counts differ from row counts). Packed micro-batches:
    tests/rltrain/workers/test_packing.py."""
    model_dir, batch, _ = setup
    batch = batch.clone()
    batch["response_mask"][2] = 0
    batch["rewards"] = torch.rand(batch.batch_size[0])
    batch["advantages"] = compute_advantages("grpo", batch["rewards"], batch["response_mask"], batch["group_ids"])
    grads = []
    for micro in (batch.batch_size[0], 5):
        actor = ActorWorker(ActorConfig(micro_batch_size=micro, grad_clip=1e9, torch_threads=1,
                                        use_remove_padding=False),
                            LossConfig(loss_agg=loss_agg), model_dir, "float32", None, temperature=1.0)
        batch["old_logprobs"] = actor.compute_logprobs(batch)
        actor.update(batch)
        grads.append(torch.cat([p.grad.flatten() for p in actor.model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-7)
