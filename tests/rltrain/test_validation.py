"""Validation metrics (rltrain/validation.py) against hand-computed cases: the unbiased pass@k estimator, the k
reported, and mean@n / pass@k overall and per data source."""

import math

import pytest
import torch

from rltrain.validation import pass_at_k, pass_ks, validation_metrics


@pytest.mark.parametrize("n, c, k, expected", [
    (4, 1, 2, 1 - 3 / 6),            # 1 − C(3, 2) / C(4, 2)
    (5, 1, 4, 1 - 1 / 5),            # 1 − C(4, 4) / C(5, 4)
    (5, 2, 4, 1.0),                  # C(3, 4) = 0: any 4 of 5 hold a pass
    (10, 3, 1, 0.3),                 # pass@1 = c / n
    (10, 3, 5, 1 - math.comb(7, 5) / math.comb(10, 5)),
    (8, 0, 8, 0.0),
    (1, 1, 1, 1.0),
])
def test_pass_at_k(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_pass_at_k_rejects_k_above_n():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(2, 1, 3)


def test_ks_are_powers_of_two_and_n():
    assert [pass_ks(n) for n in (1, 2, 4, 5, 16)] == [[1], [1, 2], [1, 2, 4], [1, 2, 4, 5], [1, 2, 4, 8, 16]]


def test_metrics_overall_and_per_data_source():
    """3 prompts × 4 samples; a sample passes at reward >= 1 (1.1: correct with a format bonus; 0.1: format only)."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0,     # gsm8k: 1 of 4
                            1.1, 1.0, 0.1, 0.0,     # math:  2 of 4
                            0.0, 0.0, 0.0, 0.0])    # gsm8k: 0 of 4
    metrics = validation_metrics(rewards, 4, ["gsm8k", "math", "gsm8k"])
    gsm8k = {"mean@4": 0.125, "pass@1": (0.25 + 0) / 2, "pass@2": (0.5 + 0) / 2, "pass@4": 0.5, "count": 2}
    math_ = {"mean@4": 2.2 / 4, "pass@1": 0.5, "pass@2": 1 - 1 / 6, "pass@4": 1.0, "count": 1}
    overall = {"mean@4": 3.2 / 12, "pass@1": 0.75 / 3, "pass@2": (0.5 + 5 / 6) / 3, "pass@4": 2 / 3, "count": 3}
    expected = {**{f"val/{k}": v for k, v in overall.items()}, **{f"val/gsm8k/{k}": v for k, v in gsm8k.items()},
                **{f"val/math/{k}": v for k, v in math_.items()}}
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-6), key


def test_greedy_single_sample_is_accuracy():
    metrics = validation_metrics(torch.tensor([1.0, 0.0, 1.0, 1.0]), 1, ["a"] * 4)
    assert metrics["val/mean@1"] == metrics["val/pass@1"] == 0.75 and metrics["val/a/count"] == 4
