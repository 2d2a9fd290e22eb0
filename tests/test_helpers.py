"""The helpers themselves must be able to fail: a wrong answer, a NaN or a shape mismatch raises."""

import pytest
import torch

from tests.helpers import assert_rel_close, case_id, poisoned, rel_error


def test_rel_error_is_scale_free():
    x = torch.randn(100, dtype=torch.float64)
    assert rel_error(x * 1.001, x) == pytest.approx(1e-3, rel=1e-6)
    assert rel_error(1e6 * x * 1.001, 1e6 * x) == pytest.approx(1e-3, rel=1e-6)


def test_assert_rel_close_rejects_wrong_nan_and_shape():
    x = torch.randn(64)
    assert_rel_close(x, x.double(), dtype=torch.float32)
    with pytest.raises(AssertionError, match="relative error"):
        assert_rel_close(x + 1e-2 * torch.randn(64), x.double(), dtype=torch.float32)
    with pytest.raises(AssertionError, match="non-finite"):
        assert_rel_close(poisoned((64,), torch.float32, "cpu"), x.double())
    with pytest.raises(AssertionError, match="shape"):
        assert_rel_close(x[:10], x.double())


def test_case_id():
    assert case_id(B=2, T=75, H=4, D=64) == "B2-T75-H4-D64"
