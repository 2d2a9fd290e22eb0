"""The built-in `calculator` tool: evaluates an arithmetic expression by walking its `ast`, never with eval().

Accepted: integer and decimal literals, + - * / // % **, unary minus/plus, parentheses. Integer arithmetic is
exact (Python ints; `/` of integers is an exact fraction, shown as an integer when it is one, else as a float), any
decimal literal makes the result a float. Names, calls, attributes, subscripts, strings and comparisons are refused.
Sizes are bounded so a model cannot make a worker spin: expressions of at most MAX_CHARS characters, integers of at
most MAX_BITS bits (checked before each multiplication or power is computed), exponents of at most MAX_EXPONENT.
"""

from __future__ import annotations

import ast
import math
from fractions import Fraction

from rltrain.tools.base import tool

MAX_CHARS = 500
MAX_BITS = 4096        # ~1,233 decimal digits: far past any arithmetic task, and each op stays < 1 ms
MAX_EXPONENT = 4096

_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**"}


class CalculatorError(ValueError):
    pass


def evaluate(expression: str) -> int | float | Fraction:
    if not isinstance(expression, str) or not expression.strip():
        raise CalculatorError("expression must be a non-empty string")
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"expression is longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise CalculatorError(f"not an arithmetic expression: {exc.__class__.__name__}") from None
    return _eval(tree.body)


def _eval(node):
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalculatorError(f"only numbers are allowed, got {node.value!r}")
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _binary(type(node.op), _eval(node.left), _eval(node.right))
    raise CalculatorError(f"{type(node).__name__} is not allowed (only numbers, + - * / // % ** and parentheses)")


def _bits(value) -> int:
    if isinstance(value, Fraction):
        return max(abs(value.numerator).bit_length(), value.denominator.bit_length())
    return abs(value).bit_length() if isinstance(value, int) else 0


def _binary(op, left, right):
    exact = not isinstance(left, float) and not isinstance(right, float)
    try:
        if op is ast.Pow:
            return _power(left, right, exact)
        if op is ast.Mult and exact and _bits(left) + _bits(right) > MAX_BITS + 1:  # a product has sum-1 or sum bits
            raise CalculatorError(f"result would exceed {MAX_BITS} bits")
        if op is ast.Div:
            result = Fraction(left) / Fraction(right) if exact else left / right
        else:
            result = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
                      ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b}[op](left, right)
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except OverflowError:
        raise CalculatorError("result too large for a float") from None
    if exact and _bits(result) > MAX_BITS:
        raise CalculatorError(f"result would exceed {MAX_BITS} bits")
    return result


def _power(base, exponent, exact):
    if exact and (not isinstance(exponent, Fraction) or exponent.denominator == 1):
        exponent = int(exponent)
        if abs(exponent) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {exponent} is beyond ±{MAX_EXPONENT}")
        largest = max(abs(Fraction(base).numerator), Fraction(base).denominator, 1)
        if abs(exponent) * math.log2(largest) > MAX_BITS:  # the result's bit count, before computing it
            raise CalculatorError(f"result would exceed {MAX_BITS} bits")
        return Fraction(base) ** exponent if exponent < 0 or isinstance(base, Fraction) else base ** exponent
    if float(base) < 0 and float(exponent) != int(float(exponent)):
        raise CalculatorError("a negative number to a fractional power is not a real number")
    if abs(float(exponent)) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {float(exponent):g} is beyond ±{MAX_EXPONENT}")
    return float(base) ** float(exponent)


def format_number(value) -> str:
    if isinstance(value, Fraction):
        value = value.numerator if value.denominator == 1 else float(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not a finite number")
    return str(value)


@tool(description="Evaluate an arithmetic expression exactly: numbers, + - * / // % ** and parentheses "
                  "(for example '(12 + 30) * 7 // 4'). Returns the result as text.",
      parameters={"type": "object", "required": ["expression"],
                  "properties": {"expression": {"type": "string", "description": "the arithmetic expression"}}})
def calculator(expression: str) -> str:
    return format_number(evaluate(expression))
