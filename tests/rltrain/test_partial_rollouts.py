"""Partial rollouts (rollout.partial, rltrain/async_rollout.py): a batch generated in segments, newer weights loaded
between them. With a stand-in engine: tokens before a push carry the old version, after it the new one, 0 past each
response's end, finished responses stop. With the tiny embedded model: the continued tokens are exactly what the
engine draws from prompt + prefix on the new weights (seeded), and each token's rollout log-prob is the log-prob of
the version that sampled it. The producer loads the newest snapshot between segments; the lags are per token and
checked against k; the config errors name rollout.partial. End to end: trainer.mode=async with rollout.partial
trains the embedded default with every token's lag within k.

    .venv/bin/python -m pytest tests/rltrain/test_partial_rollouts.py -x -q     # about a minute on 2 cores
"""

import json
import threading
from pathlib import Path

import pytest
import ray
import torch
from tensordict import TensorDict
from transformers import AutoTokenizer

from rltrain.algorithms.config import LossConfig
from rltrain.async_rollout import (
    ProducedBatch, RolloutProducer, check_lag, generate_in_segments, lag_metrics, oldest_versions, token_lags,
)
from rltrain.config import ConfigError
from rltrain.data.sampler import encode_prompts
from rltrain.embedded.model import embedded_policy_dir
from rltrain.embedded.task import make_rows
from rltrain.trainer import GRPOTrainer
from rltrain.workers.actor import ActorWorker
from rltrain.workers.actor_config import ActorConfig
from rltrain.workers.batch import concat_batches
from rltrain.workers.rollout import RolloutConfig, RolloutWorker
from tests.rltrain.tiny_job import record_token_versions, tiny_job

EOS, PAD = 99, 0


class StandIn:
    """generate(ids, mask, n, temperature, seed, max_new_tokens): row i of the call emits `10 × version + 1`
    tokens, ending with EOS at its total length lengths[i] (a row keeps its length through continuations: the
    length is read off the prompt's first token); records every call."""

    def __init__(self):
        self.version, self.calls = 0, []

    def generate(self, ids, mask, n, temperature, seed, max_new_tokens):
        ids, mask = ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
        self.calls.append((ids.shape[0], seed, max_new_tokens))
        lengths, so_far = ids[:, 0], ids.shape[1] - 1            # prompt = [length]
        out = torch.full((ids.shape[0], max_new_tokens), PAD)
        for row, length in enumerate(lengths.tolist()):
            left = length - so_far
            out[row, :min(left, max_new_tokens)] = 10 * self.version + 1
            if left <= max_new_tokens:
                out[row, left - 1] = EOS
        width = int(((out != PAD).sum(1)).max())
        out = out[:, :max(width, 1)]
        is_eos = out == EOS
        response_mask = ((is_eos.long().cumsum(1) - is_eos.long()) == 0).long()
        logprobs = torch.where(response_mask.bool(), -1.0 - self.version, 0.0)
        return TensorDict({"prompt_ids": ids, "prompt_mask": mask, "response_ids": out,
                           "response_mask": response_mask, "truncated": ~is_eos.any(1),
                           "group_ids": torch.arange(ids.shape[0]), "rollout_logprobs": logprobs},
                          batch_size=[ids.shape[0]])


def test_a_push_between_segments_stamps_later_tokens_with_the_new_version():
    engine, refreshes = StandIn(), []

    def refresh():  # the push lands before the second segment
        refreshes.append(engine.version)
        if len(refreshes) == 2:
            engine.version = 1
        return engine.version

    lengths = torch.tensor([[2], [3], [5], [9]])  # 9 > max_new_tokens: truncated
    batch = generate_in_segments(engine.generate, refresh, lengths, torch.ones_like(lengths), 1, 1.0, 7,
                                 max_new_tokens=8, segment_tokens=3, pad_token_id=PAD)
    mask, versions = batch["response_mask"], batch["token_versions"]
    assert mask.sum(1).tolist() == [2, 3, 5, 8] and batch["truncated"].tolist() == [False, False, False, True]
    # segment 1 (3 tokens) on version 0, the rest on version 1; 0 past each end
    assert versions.tolist() == [[0] * 8, [0] * 8, [0, 0, 0, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1, 1, 1]]
    assert batch["response_ids"][2].tolist() == [1, 1, 1, 11, EOS, PAD, PAD, PAD]
    assert batch["response_ids"][3].tolist() == [1, 1, 1, 11, 11, 11, 11, 11]
    assert batch["rollout_logprobs"][3].tolist() == [-1.0] * 3 + [-2.0] * 5        # the sampling version's
    assert batch["rollout_logprobs"][0].tolist() == [-1.0, -1.0] + [0.0] * 6
    # finished rows stop: segments of 3, 3, 2 tokens over 4, 2, 1 rows, each seeded apart
    assert [(rows, limit) for rows, _, limit in engine.calls] == [(4, 3), (2, 3), (1, 2)]
    assert len({seed for _, seed, _ in engine.calls}) == 3 and len(refreshes) == 3
    assert oldest_versions(versions, mask).tolist() == [0, 0, 0, 0]


def test_lags_are_per_token_and_checked_against_k():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    batch = TensorDict({"response_mask": mask, "token_versions": torch.tensor([[3, 4, 4, 0], [2, 2, 3, 4]]),
                        "weight_version": torch.tensor([3, 2])}, batch_size=[2])
    lags = token_lags("async", 2, 5, 0, batch)  # step 5 trains version 4: lags 4 - versions over the 7 tokens
    assert sorted(lags.tolist()) == [0, 0, 0, 1, 1, 2, 2]
    assert lag_metrics(lags) == {"rollout/version_lag_mean": 6 / 7, "rollout/version_lag_max": 2.0}
    with pytest.raises(RuntimeError, match=r"lags \[1, 2, 3\]; the mode allows lags in \[0, 2\]"):
        token_lags("async", 2, 6, 0, batch)
    # without token_versions (rollout.partial=false): one lag per response, as check_lag gives
    del batch["token_versions"]
    assert token_lags("async", 2, 5, 0, batch).tolist() == check_lag("async", 2, 5, 0, torch.tensor([3, 2])).tolist()


def test_the_producer_loads_the_newest_snapshot_between_segments():
    """Step 2's generation starts on version 0 and takes version 1 (published meanwhile) for its second segment;
    its weight_version is the oldest token's, its weight_load time counts the load."""
    loaded, started = [], threading.Event()

    def load(snapshot, version):
        loaded.append((snapshot, version))
        return 0.5

    def generate(step):
        first = producer.refresh()
        if step == 2:
            started.set()
            while producer._published < 1:
                threading.Event().wait(0.001)
        second = producer.refresh()
        batch = TensorDict({"token_versions": torch.tensor([[first, second]]),
                            "response_mask": torch.ones(1, 2, dtype=torch.long)}, batch_size=[1])
        return ProducedBatch(step, batch, [], 0, 1, {"rollout": 0.0}, {}, {})

    producer = RolloutProducer(generate, load, range(1, 3), 0, "async", 2)
    producer.start()
    one = producer.take(1)
    assert one.batch["token_versions"].tolist() == [[0, 0]] and one.seconds["weight_load"] == 0.0
    started.wait(10)
    producer.publish(1, "snapshot-1")
    two = producer.take(2)
    producer.stop()
    assert two.batch["token_versions"].tolist() == [[0, 1]] and two.batch["weight_version"].tolist() == [0]
    assert loaded == [("snapshot-1", 1)] and two.seconds["weight_load"] == 0.5 and two.version == 0


def test_dynamic_sampling_rounds_concatenate_token_versions_padded_with_zero():
    def batch(width, version):
        return TensorDict({"prompt_ids": torch.ones(1, 2, dtype=torch.long), "prompt_mask": torch.ones(1, 2),
                           "response_ids": torch.ones(1, width, dtype=torch.long),
                           "response_mask": torch.ones(1, width),
                           "token_versions": torch.full((1, width), version)}, batch_size=[1])

    both = concat_batches([batch(2, 3), batch(4, 5)])
    assert both["token_versions"].tolist() == [[3, 3, 0, 0], [5, 5, 5, 5]]


# ---------------------------------------------------------------- the hf engine, tiny embedded model
TEMPERATURE = 1.5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    job = tiny_job(tmp_path_factory.mktemp("partial"))
    model_dir = str(embedded_policy_dir(job.trainer.output_dir, job.model.embedded, job.data.task, 0))
    ids, mask = encode_prompts(make_rows(job.data.task)[0][:3], AutoTokenizer.from_pretrained(model_dir))
    return model_dir, ids, mask


def test_the_continuation_is_the_engines_draw_from_prompt_and_prefix_on_the_new_weights(tiny):
    model_dir, ids, mask = tiny
    config = RolloutConfig(n=4, max_new_tokens=6, torch_threads=1, micro_batch_size=5)
    worker = RolloutWorker(config, model_dir, "float32", None, logprobs=True)
    new = {k: v + 0.3 * torch.randn_like(v) for k, v in worker.engine.model.named_parameters()}
    calls, versions = [], []

    def generate(ids, mask, n, temperature, seed, limit):
        calls.append((ids, mask, seed, limit))
        return worker.generate(ids, mask, n, temperature, seed, 0, limit)

    def refresh():  # a push before the second segment
        if len(versions) == 1:
            worker.begin_weight_update()
            worker.load_weights(new)
            worker.finish_weight_update()
        versions.append(1 if versions else 0)
        return versions[-1]

    batch = generate_in_segments(generate, refresh, ids, mask, 4, TEMPERATURE, 11, 6, 2, worker.engine.pad_token_id)
    token_mask = batch["response_mask"].bool()
    assert len(calls) >= 2, "every response ended within the first segment"
    assert (batch["token_versions"][:, :2] == 0).all()
    assert (batch["token_versions"][~token_mask] == 0).all()
    assert (batch["token_versions"][:, 2:][token_mask[:, 2:]] == 1).all()
    # segment 2: the engine's own draw from prompt + the first 2 tokens, on the new weights, with that seed
    cont_ids, cont_mask, seed, limit = calls[1]
    active = batch["truncated"] | (batch["response_mask"].sum(1) > 2)
    assert int(active.sum()) == cont_ids.shape[0]
    redraw = worker.generate(cont_ids, cont_mask, 1, TEMPERATURE, seed, 0, limit)
    width = redraw["response_ids"].shape[1]
    assert torch.equal(batch["response_ids"][active, 2:2 + width], redraw["response_ids"])
    assert torch.equal(cont_ids[:, -2:], batch["response_ids"][active, :2])
    # each token's rollout log-prob is its sampling version's, as the actor computes it
    actor = ActorWorker(ActorConfig(torch_threads=1), LossConfig(), model_dir, "float32", None,
                        temperature=TEMPERATURE)
    lp_old = actor.compute_logprobs(batch)
    actor.model.load_state_dict(new, strict=False)
    lp_new = actor.compute_logprobs(batch)
    expected = torch.where(batch["token_versions"] == 1, lp_new, lp_old) * token_mask
    torch.testing.assert_close(batch["rollout_logprobs"], expected, rtol=0, atol=2e-5)
    assert (lp_new - lp_old)[batch["token_versions"] == 1].abs().max() > 1e-3  # the versions do differ there


def test_partial_false_generates_in_one_call_without_token_versions(tiny):
    model_dir, ids, mask = tiny
    config = RolloutConfig(n=2, max_new_tokens=6, torch_threads=1)
    worker = RolloutWorker(config, model_dir, "float32", None, logprobs=True)
    batch = worker.generate(ids, mask, 2, TEMPERATURE, 5)
    assert "token_versions" not in batch.keys()
    again = worker.generate(ids, mask, 2, TEMPERATURE, 5, 0, 6)  # an explicit limit equal to the config's: the same
    assert torch.equal(batch["response_ids"], again["response_ids"])


# ---------------------------------------------------------------- config
@pytest.mark.parametrize("trainer, rollout, key", [
    ({"mode": "sync"}, {}, "rollout.partial: needs trainer.mode=async"),
    ({"mode": "one_step_off"}, {"placement": "separate"}, "rollout.partial: needs trainer.mode=async"),
    ({"mode": "async"}, {"engine": "vllm", "mode": "async", "placement": "separate", "stop": ["\n"]},
     "rollout.partial: cannot be combined with rollout.stop"),
    ({"mode": "async"}, {"placement": "separate", "partial_segment_tokens": 0}, "rollout.partial_segment_tokens"),
], ids=["sync", "one_step_off", "stop", "segment-0"])
def test_partial_config_errors_name_the_key(tmp_path, trainer, rollout, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        tiny_job(tmp_path, trainer=trainer, rollout={"partial": True, **rollout})


def test_partial_with_multi_turn_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout\.partial: cannot be combined with rollout\.multi_turn"):
        tiny_job(tmp_path, trainer={"mode": "async"},
                 rollout={"partial": True, "placement": "separate",
                          "multi_turn": {"enabled": True, "tools": [{"builtin": "calculator"}]}})


# ---------------------------------------------------------------- end to end
def test_async_partial_trains_end_to_end_with_every_tokens_lag_within_k(tmp_path):
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    out, k = tmp_path / "run", 2
    plugin = tmp_path / "reward.py"
    plugin.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(sum(map(ord, solution_str)) % 2)\n")
    job = tiny_job(out, trainer={"total_steps": 5, "mode": "async", "max_staleness": k},
                   rollout={"placement": "separate", "temperature": 1.5, "partial": True,
                            "partial_segment_tokens": 1},
                   reward={"path": str(plugin), "name": "score"},
                   algorithm={"old_logprobs": "rollout", "rollout_correction": {"mode": "truncate", "high": 1.5}})
    try:
        trainer = GRPOTrainer(job)
        produced = record_token_versions(trainer)
        try:
            result = trainer.fit()
        finally:
            trainer.close()
    finally:
        ray.shutdown()
    assert result["step"] == 5
    records = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train/reward_mean" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5]
    for record in train:  # the trainer's check_lag passed on every token; the logged numbers agree
        assert 0 <= record["rollout/version_lag_mean"] <= record["rollout/version_lag_max"] <= k, record
        assert record["actor/grad_norm"] > 0
        assert record["time/rollout_s"] > 0 and record["time/weight_load_s"] >= 0  # loads between segments: the latter
    assert train[0]["rollout/version_lag_max"] == 0
    interrupted = 0
    for record in train:  # the logged lags are over tokens: the producer's token_versions give them back
        versions, mask = produced[record["step"]]
        lags = (record["step"] - 1 - versions[mask.bool()]).double()
        assert record["rollout/version_lag_mean"] == pytest.approx(float(lags.mean()))
        assert record["rollout/version_lag_max"] == float(lags.max())
        spread = torch.where(mask.bool(), versions, -1).amax(1) - oldest_versions(versions, mask)
        interrupted += int((spread > 0).sum())
    print(f"responses continued on newer weights: {interrupted}")
