"""The reward model (reward.model): a tiny Qwen2.5-Instruct-shaped sequence classifier built from config, with the
release's tokenizer and chat template (tests/fixtures/releases.py):

- its scores, packed into rows by a token budget (the default) and right-padded in micro-batches of rows, equal the
  model's own score of each conversation alone (its chat template over the prompt and response), in micro-batches
  smaller than the batch; chat-message prompts and multi-turn episodes' messages render through the same template;
- sharded with FSDP2 over 2 gloo ranks (the trainer's actor.strategy=fsdp2), packed and padded: the scores equal the
  single process's, rank 0 returning them all, the ranks running different numbers of micro-batches;
- a conversation over max_length is cut from the left: the score is the one of its last max_length tokens;
- a bad reward.model.path, a model with two labels, bad weights: errors naming the key;
- end to end: two GRPO steps with the embedded policy (its own tokenizer) and the reward model log reward/model_mean
  and reward/rule_mean, and the trained reward is their weighted sum; with actor.strategy=fsdp2 on 2 CPU ranks the
  reward model is sharded too.
"""

import socket
from pathlib import Path

import pytest
import ray
import torch
import torch.multiprocessing as mp
import transformers as tf

from rltrain.config import ConfigError, from_mapping
from rltrain.main_grpo import run
from rltrain.workers.reward import RewardConfig
from rltrain.workers.fsdp import FSDPConfig
from rltrain.workers.packing import balanced_groups
from rltrain.workers.reward_model import FSDPRewardModelWorker, RewardModelConfig, RewardModelWorker
from tests.fixtures.releases import build_release
from tests.rltrain.tiny_job import metric_records, record_started_roles, tiny_job


def _classifier(path: Path, num_labels: int = 1) -> str:
    build_release("qwen2.5-instruct", path)
    for weights in list(path.glob("*.safetensors")) + list(path.glob("*.index.json")):
        weights.unlink()
    config = tf.AutoConfig.from_pretrained(path)
    config.num_labels = num_labels
    torch.manual_seed(0)
    tf.AutoModelForSequenceClassification.from_config(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> str:
    return _classifier(tmp_path_factory.mktemp("reward_model"))


@pytest.fixture(scope="module")
def alone(classifier):
    """The model's own score of one conversation (its text), loaded apart: the worker's packed model takes only
    packed rows."""
    model = tf.AutoModelForSequenceClassification.from_pretrained(classifier, dtype=torch.float32).eval()
    tokenizer = tf.AutoTokenizer.from_pretrained(classifier)

    def score(text: str, max_length: int | None = None) -> float:
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        if max_length is not None:
            ids = ids[:, -max_length:]
        with torch.no_grad():
            return model(input_ids=ids).logits[0, 0].item()
    return score


@pytest.mark.parametrize("batching", [dict(max_tokens_per_micro_batch=150), dict(use_remove_padding=False,
                                                                                 micro_batch_size=3)],
                         ids=["packed", "padded"])
def test_batched_scores_equal_each_conversation_scored_alone(classifier, alone, batching):
    worker = RewardModelWorker(RewardModelConfig(path=classifier, **batching), "float32")
    assert worker.packed == batching.get("use_remove_padding", True)
    prompts = ["What is 2 + 3?", "Name a prime.", [{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": "7 * 6?"}], "Hi", "Say yes"]
    responses = ["5", "Seven is a prime number, and so is eleven.", "42", "Hello there, how are you today?", "yes"]
    scores = worker.score(prompts, responses)
    assert scores.shape == (5,) and scores.dtype == torch.float32
    lengths = [len(worker.tokenizer(worker.render(p, r), add_special_tokens=False)["input_ids"])
               for p, r in zip(prompts, responses)]
    assert max(map(len, worker._micro_batches(lengths))) >= 2   # conversations share a row (or a padded batch)
    for prompt, response, score in zip(prompts, responses, scores.tolist()):
        text = worker.render(prompt, response)
        assert "<|im_start|>assistant\n" + response in text   # the release's chat template
        assert score == pytest.approx(alone(text), abs=1e-5)
    assert len(set(scores.tolist())) == 5
    episode = [{"role": "user", "content": "12+7="}, {"role": "assistant", "content": "calc(12+7)"},
               {"role": "tool", "content": "19"}, {"role": "assistant", "content": "19"}]
    [episode_score] = worker.score(["12+7="], ["ignored"], [episode]).tolist()
    assert episode_score == pytest.approx(alone(worker.tokenizer.apply_chat_template(episode, tokenize=False)),
                                          abs=1e-5)


PROMPTS = ["What is 2 + 3?", "Name a prime.", "Hi", "Say yes", "7 * 6?"]
RESPONSES = ["5", "Seven is a prime number, and so is eleven.", "Hello there, how are you today?", "yes", "42"]
BATCHINGS = {"packed": dict(max_tokens_per_micro_batch=140), "padded": dict(use_remove_padding=False,
                                                                              micro_batch_size=2)}


def _sharded_rank(rank: int, port: int, classifier: str, out: str) -> None:
    for name, batching in BATCHINGS.items():
        worker = FSDPRewardModelWorker(rank, 2, "127.0.0.1", port, RewardModelConfig(path=classifier, **batching),
                                       "float32", FSDPConfig())
        scores = worker.score(PROMPTS, RESPONSES)
        assert (scores is None) == (rank != 0)
        if rank == 0:
            torch.save(scores, f"{out}/{name}.pt")


def test_sharded_scores_equal_the_single_process(classifier, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_sharded_rank, args=(port, classifier, str(tmp_path)), nprocs=2, join=True)
    for name, batching in BATCHINGS.items():
        single = RewardModelWorker(RewardModelConfig(path=classifier, **batching), "float32")
        lengths = [len(row) for row in single.encode(PROMPTS, RESPONSES)]
        shares = [len(single._micro_batches([lengths[i] for i in share])) for share in balanced_groups(lengths, 2)]
        assert shares[0] != shares[1], f"{name}: the ranks should run different numbers of micro-batches"
        torch.testing.assert_close(torch.load(tmp_path / f"{name}.pt"), single.score(PROMPTS, RESPONSES), rtol=0,
                                   atol=1e-5)


def test_packed_micro_batches_keep_to_the_token_budget(classifier, monkeypatch):
    worker = RewardModelWorker(RewardModelConfig(path=classifier, max_tokens_per_micro_batch=150), "float32")
    rows = []
    monkeypatch.setattr(worker, "_packed_scores", lambda model, group: rows.append(group) or torch.zeros(len(group)))
    worker.score(["Hi", "What is 2 + 3?", "Name a prime.", "Say yes"], ["yes", "5", "Seven and eleven.", "yes"])
    assert len(rows) > 1 and sum(len(group) for group in rows) == 4
    assert all(sum(map(len, group)) <= 150 or len(group) == 1 for group in rows)


def test_a_long_conversation_is_cut_from_the_left(classifier, alone):
    worker = RewardModelWorker(RewardModelConfig(path=classifier, max_length=12), "float32")
    prompt, response = "Tell me a long story about a number " * 4, "Once upon a time there was seven."
    [score] = worker.score([prompt], [response]).tolist()
    assert score == pytest.approx(alone(worker.render(prompt, response), max_length=12), abs=1e-5)


def test_bad_settings_name_their_key(tmp_path, classifier):
    with pytest.raises(ConfigError, match=r"^reward.model.path: must be a model directory holding config.json"):
        from_mapping(RewardConfig, {"model": {"path": str(tmp_path)}}, "reward")
    with pytest.raises(ConfigError, match=r"^reward.model.weight: must be a finite number"):
        from_mapping(RewardConfig, {"model": {"path": classifier, "weight": float("nan")}}, "reward")
    with pytest.raises(ConfigError, match=r"^reward.model.max_tokens_per_micro_batch: must be >= 0"):
        from_mapping(RewardConfig, {"model": {"path": classifier, "max_tokens_per_micro_batch": -1}}, "reward")
    with pytest.raises(ConfigError, match=r"^reward.model.placement: must be one of colocated, separate"):
        from_mapping(RewardConfig, {"model": {"path": classifier, "placement": "elsewhere"}}, "reward")
    with pytest.raises(ConfigError, match=r"^reward.model.n_gpus: needs reward.model.placement=separate"):
        from_mapping(RewardConfig, {"model": {"path": classifier, "n_gpus": 2}}, "reward")
    with pytest.raises(ConfigError, match=r"^reward.model.path: .* with 2 labels; a reward model has one label"):
        RewardModelWorker(RewardModelConfig(path=_classifier(tmp_path / "two", num_labels=2)), "float32")


@pytest.fixture(scope="module")
def ray_session():
    ray.init(address="local", num_cpus=3, include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize("strategy,placement", [("single", "colocated"), ("fsdp2", "colocated"),
                                                ("single", "separate")])
def test_two_steps_with_a_reward_model_log_both_parts(tmp_path, classifier, ray_session, monkeypatch, strategy,
                                                      placement):
    """Colocated, the reward model takes the actor's strategy and bundles; separate, two CPUs of its own (FSDP2 over
    them), released at the end."""
    placements = {}
    started = record_started_roles(monkeypatch, placements)
    own = dict(placement="separate", n_gpus=2) if placement == "separate" else {}
    job = tiny_job(tmp_path / "run", reward={"model": {"path": classifier, "weight": 0.5, "rule_weight": 2.0, **own}},
                   actor={"strategy": strategy}, trainer={"n_gpus_per_node": 2 if strategy == "fsdp2" else 1})
    assert run(job)["step"] == 2
    name = started[-1]
    assert name == ("FSDPRewardModelWorker" if strategy == "fsdp2" or own else "RewardModelWorker")
    actor_placement, reward_placement = placements[started[0]], placements[name]
    if own:
        assert reward_placement is not actor_placement and reward_placement.ranks_per_node == 2
        assert reward_placement.groups == []   # removed by the trainer's close
    else:
        assert reward_placement is actor_placement
    train = [r for r in metric_records(tmp_path / "run") if "train/reward_mean" in r]
    assert len(train) == 2
    for record in train:
        combined = 2.0 * record["reward/rule_mean"] + 0.5 * record["reward/model_mean"]
        assert record["train/reward_mean"] == pytest.approx(combined, abs=1e-5), record
        assert record["reward/model_mean"] != 0
