"""The calculator tool: exact results, refusal of anything but arithmetic, bounds on sizes."""

import time

import pytest

from rltrain.tools.builtin.calculator import MAX_BITS, CalculatorError, calculator  # MAX_BITS = 4096


@pytest.mark.parametrize("expression, result", [
    ("1 + 2 * 3", "7"), ("(1 + 2) * 3", "9"), ("-3 - -4", "1"), ("+5", "5"), ("7 / 2", "3.5"), ("6 / 3", "2"),
    ("7 // 2", "3"), ("-7 // 2", "-4"), ("7 % 3", "1"), ("2 ** 10", "1024"), ("2 ** -2", "0.25"),
    ("10 ** 20 + 1", "100000000000000000001"), ("(10 ** 30) / (10 ** 10)", "100000000000000000000"),
    ("1 / 3 * 3", "1"), ("1.5 * 2", "3.0"), ("2 ** 0.5", str(2 ** 0.5)), ("3 * 10**18 // 7", str(3 * 10**18 // 7)),
])
def test_results(expression, result):
    assert calculator(expression) == result


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('true')", "Call is not allowed"),
    ("x + 1", "Name is not allowed"),
    ("(1).real", "Attribute is not allowed"),
    ("[1][0]", "Subscript is not allowed"),
    ("'a' * 3", "only numbers"),
    ("True + 1", "only numbers"),
    ("1 < 2", "Compare is not allowed"),
    ("lambda: 1", "Lambda is not allowed"),
    ("1 +", "not an arithmetic expression"),
    ("", "non-empty"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("(-8) ** 0.5", "not a real number"),
])
def test_refusals(expression, message):
    with pytest.raises(CalculatorError, match=message):
        calculator(expression)


@pytest.mark.parametrize("expression", ["9 ** 9 ** 9", "2 ** 100000", "2 ** 4097", "3 ** 4000",
                                        "(2 ** 4000) * (2 ** 4000)", "(2 ** 4000) * 3 ** 3000 // 2", "10.0 ** 400",
                                        "1" * 600])
def test_huge_results_refused_quickly(expression):
    start = time.monotonic()
    with pytest.raises(CalculatorError):
        calculator(expression)
    assert time.monotonic() - start < 0.5


def test_largest_allowed_power_is_exact():
    assert MAX_BITS == 4096  # the cases above are sized for it
    assert calculator("2 ** 4095") == str(2 ** 4095) and calculator("-(2 ** 4094) * 2") == str(-(2 ** 4095))
