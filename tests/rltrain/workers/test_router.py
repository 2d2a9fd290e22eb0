"""An MoE policy's routers in the actor (rltrain/workers/router.py): actor.router_aux_loss_coef adds exactly coef × the
load-balancing loss's gradient (against transformers' recorded router logits of each sequence, packed and padded,
with gradient checkpointing's recomputation), and the metrics report that loss and the load imbalance."""

import pytest
import torch

from rltrain.algorithms.advantages import compute_advantages
from rltrain.algorithms.config import LossConfig
from rltrain.data.sampler import encode_prompts
from rltrain.embedded.model import embedded_policy_dir
from rltrain.embedded.task import make_rows
from rltrain.workers.actor import ActorWorker
from rltrain.workers.actor_config import ActorConfig, RouterReplayConfig
from rltrain.workers.rollout import RolloutConfig, RolloutWorker
from rltrain.workers.router import ROUTING, router_classes
from tests.helpers import rel_error
from tests.rltrain.tiny_job import tiny_job

COEF = 0.5


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(the embedded qwen3_moe model's directory, a scored batch of 3 prompts × 4 responses)."""
    from transformers import AutoTokenizer

    job = tiny_job(tmp_path_factory.mktemp("moe"), model={"embedded": {"arch": "qwen3_moe", "num_layers": 2}})
    model_dir = str(embedded_policy_dir(job.trainer.output_dir, job.model.embedded, job.data.task, 0))
    ids, mask = encode_prompts(make_rows(job.data.task)[0][:3], AutoTokenizer.from_pretrained(model_dir))
    rollout = RolloutWorker(RolloutConfig(n=4, max_new_tokens=5, torch_threads=1), model_dir, "float32", None)
    batch = rollout.generate(ids, mask, 4, 1.0, seed=0)
    batch["response_mask"][1] = 0   # a response with no tokens: its sequence is not run
    batch["rewards"] = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    batch["advantages"] = compute_advantages("grpo", batch["rewards"], batch["response_mask"], batch["group_ids"])
    return model_dir, batch


def reference_aux(model, batch) -> torch.Tensor:
    """Mean over the routers of E·Σ_e f_e·P_e over every token of the sequences with response tokens, from the router
    logits transformers records running each sequence alone."""
    per_layer = None
    for row in range(batch.batch_size[0]):
        kept = int(batch["response_mask"][row].nonzero().max()) + 1 if batch["response_mask"][row].any() else 0
        if not kept:
            continue
        ids = torch.cat([batch["prompt_ids"][row][batch["prompt_mask"][row].bool()], batch["response_ids"][row][:kept]])
        logits = model(ids[None], output_router_logits=True).router_logits
        per_layer = list(logits) if per_layer is None else [torch.cat([a, b]) for a, b in zip(per_layer, logits)]
    k = model.config.num_experts_per_tok
    losses = []
    for logits in per_layer:
        probs = torch.softmax(logits.float(), -1)
        chosen = probs.topk(k, -1).indices
        share = torch.zeros(probs.shape[1]).scatter_add_(0, chosen.reshape(-1), torch.ones(chosen.numel()))
        losses.append(probs.shape[1] * (share / (len(probs) * k) * probs.mean(0)).sum())
    return torch.stack(losses).mean()


def _actor(model_dir, coef, packed, checkpointing=False):
    config = ActorConfig(torch_threads=1, grad_clip=1e9, micro_batch_size=64, use_remove_padding=packed,
                         max_tokens_per_micro_batch=0, gradient_checkpointing=checkpointing,
                         router_aux_loss_coef=coef)
    return ActorWorker(config, LossConfig(), model_dir, "float32", None, temperature=1.0)


@pytest.mark.parametrize("packed, checkpointing", [(True, False), (False, False), (True, True)],
                         ids=["packed", "padded", "packed-checkpointing"])
def test_the_aux_loss_adds_coef_times_its_gradient(setup, packed, checkpointing):
    from transformers import AutoModelForCausalLM

    model_dir, batch = setup
    batch = batch.clone()
    plain, balanced = _actor(model_dir, 0.0, packed, checkpointing), _actor(model_dir, COEF, packed, checkpointing)
    assert plain.routers is not None and len([m for m in plain.model.modules()
                                              if isinstance(m, router_classes(plain.model))]) == 2
    batch["old_logprobs"] = plain.compute_logprobs(batch)
    metrics = plain.update(batch), balanced.update(batch)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    aux = reference_aux(reference, batch)
    aux.backward()
    for record in metrics:
        assert record["actor/router_aux_loss"] == pytest.approx(aux.item(), rel=1e-5), metrics
        assert 1.0 <= record["actor/router_load_imbalance"] <= 2.0   # 4 experts, 2 a token: at most twice a share
    expected = dict(reference.named_parameters())
    routers = 0
    for (name, with_aux), without in zip(balanced.model.named_parameters(), plain.model.parameters()):
        want = expected[name].grad
        if want is None or want.norm() == 0:   # no path from the routers' loss (the last norm, the LM head)
            assert torch.allclose(with_aux.grad, without.grad, atol=1e-7), name
            continue
        routers += "gate.weight" in name
        assert rel_error(with_aux.grad - without.grad, COEF * want) < 1e-4, name
    assert routers == 2


def test_a_dense_policy_has_no_routers(tmp_path):
    job = tiny_job(tmp_path)
    model_dir = str(embedded_policy_dir(job.trainer.output_dir, job.model.embedded, job.data.task, 0))
    assert _actor(model_dir, COEF, True).routers is None


def second_choices(module, args, output):
    """A router that sends every token to its 2nd and 3rd likeliest experts: routing other than the actor's own."""
    logits, weights, _ = output
    probs = torch.softmax(logits, -1, dtype=torch.float)
    experts = probs.topk(3, -1).indices[:, 1:]
    top = probs.gather(1, experts)
    return logits, (top / top.sum(-1, keepdim=True)).to(weights.dtype), experts


def second_choice_rollouts(model_dir, ids, mask):
    """4 responses a prompt from an hf engine whose routers take every token's 2nd and 3rd likeliest experts (routing
    other than the policy's own), with their log-probs and that routing recorded."""
    engine = RolloutWorker(RolloutConfig(n=4, max_new_tokens=5, torch_threads=1, micro_batch_size=5), model_dir,
                           "float32", None, logprobs=True, routing=True)
    for router in engine.engine.routing.routers:
        router.register_forward_hook(second_choices, prepend=True)
    return engine.generate(ids, mask, 4, 1.0, seed=3)


def _actor_r3(model_dir, mode, packed=True):
    config = ActorConfig(torch_threads=1, grad_clip=1e9, micro_batch_size=5, use_remove_padding=packed,
                         max_tokens_per_micro_batch=40 if packed else 0, router_replay=RouterReplayConfig(mode))
    return ActorWorker(config, LossConfig(), model_dir, "float32", None, temperature=1.0)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_r3_replays_the_rollouts_routing(setup, packed):
    """The engine routes every token otherwise than the actor would (its routers take the 2nd and 3rd likeliest
    experts) and records it; with R3 the actor's old log-probs and the on-policy update's equal the engine's
    log-probs of its samples at fp32, and the mismatch metric reports that every choice was replayed; without
    replay they differ."""
    model_dir, scored = setup
    ids, mask = scored["prompt_ids"][::4], scored["prompt_mask"][::4]
    batch = second_choice_rollouts(model_dir, ids, mask)
    prompt, response = batch[ROUTING[0]], batch[ROUTING[1]]
    assert prompt.shape[:3] == (12, ids.shape[1], 2) and response.shape[:3] == (12, batch["response_ids"].shape[1], 2)
    assert (prompt[mask.repeat_interleave(4, 0).bool()] >= 0).all()
    batch["advantages"] = torch.randn(12, 1).expand_as(batch["response_mask"]).contiguous()
    engine_logprobs = batch["rollout_logprobs"]
    replayed, own = _actor_r3(model_dir, "R3", packed), _actor_r3(model_dir, "disabled", packed)
    old = replayed.compute_logprobs(batch)
    mask_r = batch["response_mask"].bool()
    assert (old - engine_logprobs)[mask_r].abs().max() < 1e-5
    assert (own.compute_logprobs(batch) - engine_logprobs)[mask_r].abs().max() > 1e-3
    update = replayed.update(batch.exclude("rollout_logprobs"))   # on-policy: the update's own log-probs
    assert (update["old_logprobs"] - engine_logprobs)[mask_r].abs().max() < 1e-5
    assert update["actor/router_replay_mismatch"] == pytest.approx(1.0)


def test_r3_config_checks():
    from rltrain.config import ConfigError
    from rltrain.job import load_job_config
    from tests.rltrain.tiny_job import compose

    load_job_config(compose("actor.router_replay.mode=R3", "model.embedded.arch=qwen3_moe"))
    for overrides, message in [
            (["actor.router_replay.mode=R3"], "R3 replays a mixture-of-experts policy's routing"),
            (["actor.router_replay.mode=R2"], "actor.router_replay.mode: must be one of disabled, R3"),
            (["actor.router_replay.mode=R3", "model.embedded.arch=qwen3_moe", "rollout.multi_turn.enabled=true",
              "rollout.multi_turn.tools=[{builtin: calculator}]"], "R3 replays single-turn responses")]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            load_job_config(compose(*overrides))


def _tiny_mixtral():
    import transformers as tf

    config = tf.MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                              num_experts_per_tok=2)
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_next"])
def test_other_moe_families_have_their_routers_found(family):
    """Mixtral's and Qwen3-Next's routers (the classes their models record router_logits from) take the loss and
    the metrics too: a forward in a micro-batch context records them, and the loss's gradient alone reaches every
    router's weight."""
    from rltrain.workers.router import RouterBalance
    from tests.model_factory import tiny_qwen3_next

    model = _tiny_mixtral() if family == "mixtral" else tiny_qwen3_next()
    balance = RouterBalance.of(model, coef=1.0)
    sparse = 2   # Mixtral: both layers; the tiny Qwen3-Next: layers 2-3 (0-1 dense)
    assert balance is not None and balance.count == sparse
    with balance.micro_batch(1.0, None) as metrics:
        logits = model(torch.randint(0, 96, (2, 9))).logits
    assert metrics["router_aux_loss"] > 0 and metrics["router_load_imbalance"] >= 1
    (logits * 0).sum().backward()   # no gradient from the outputs: only the routers' loss moves the routers
    routers = [m for m in model.modules() if isinstance(m, router_classes(model))]
    assert len(routers) == sparse and all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0
                                          for r in routers)
