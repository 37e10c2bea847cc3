"""Reward functions ``(response, reference_answer) -> float in [0, 1]``, run on the host.

- ``math``: the final answer (see ``extract.final_answer``) is mathematically
  equal to the reference, by ``math-verify`` (LaTeX and plain expressions).
- ``arithmetic``: the final answer is the reference integer.
- ``countdown``: the final answer is an expression over the given numbers (each
  used at most once; + - * / and parentheses) whose value is the target; the
  reference is ``"target|n1,n2,..."``.
- ``sort``: the final answer, spaces and commas aside, is the reference string
  of digits.
- ``word_sums``: the final answer is the reference integer; a response that marks no final
  answer is judged by its last number instead (``extract.last_number``). This is for small
  pretrained models, which mark their answer in a tenth of their replies at first but often
  end on the right number ("7 + 5 = 12"): a single number still has to equal the answer.
- ``format``: 1 when the response ends with its answer in ``<answer>...</answer>``.
"""

from __future__ import annotations

import ast
import logging
import collections
import operator
import re
import threading
from fractions import Fraction

from rlx.rewards.extract import final_answer, last_number

_FORMAT = re.compile(r"<answer>[^<]+</answer>\s*$")


def format_reward(response: str, reference: str = "") -> float:
  del reference
  return 1.0 if _FORMAT.search(response) else 0.0


def arithmetic_reward(response: str, reference: str) -> float:
  return _integer_reward(final_answer(response), reference)


def _integer_reward(answer: str | None, reference: str) -> float:
  """1 when ``answer`` is the reference integer (thousands commas allowed)."""
  if answer is None:
    return 0.0
  try:
    return 1.0 if int(answer.replace(",", "").strip()) == int(reference) else 0.0
  except ValueError:
    return 0.0


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv}


def evaluate_expression(expression: str) -> tuple[Fraction, list[int]]:
  """Exact value and the integer literals of an arithmetic expression (no ``eval``).

  Raises ValueError for anything but integers, + - * /, unary minus and parentheses.
  """
  tree = ast.parse(expression.replace("×", "*").replace("÷", "/"), mode="eval")
  numbers: list[int] = []

  def walk(node) -> Fraction:
    if isinstance(node, ast.Expression):
      return walk(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
      numbers.append(node.value)
      return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
      left, right = walk(node.left), walk(node.right)
      if isinstance(node.op, ast.Div) and right == 0:
        raise ValueError("division by zero")
      return _OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
      return -walk(node.operand)
    raise ValueError(f"not allowed in an answer: {ast.dump(node)[:40]}")

  return walk(tree), numbers


def countdown_reward(response: str, reference: str) -> float:
  target, numbers = reference.split("|")
  answer = final_answer(response)
  if answer is None:
    return 0.0
  expression = answer.split("=")[0]
  try:
    value, used = evaluate_expression(expression)
  except (ValueError, SyntaxError, RecursionError):
    return 0.0
  available = collections.Counter(int(n) for n in numbers.split(","))
  if collections.Counter(used) - available:  # a number not given, or used too often
    return 0.0
  return 1.0 if value == int(target) else 0.0


def math_reward(response: str, reference: str) -> float:
  answer = final_answer(response)
  if answer is None:
    return 0.0
  import math_verify  # imported in the worker that scores, not by every user of rlx

  # math-verify's own timeouts use signal.alarm, which works in a main thread only: a reward
  # worker (whose call the pool times out) has one; scoring in a thread of the trainer
  # (reward.num_workers=0) runs without them, as num_workers=0 runs without timeouts anyway
  timeout = 5 if threading.current_thread() is threading.main_thread() else None
  if timeout is None:
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its warning for each call
  gold = math_verify.parse(f"${reference}$" if "$" not in reference else reference,
                           parsing_timeout=timeout)
  predicted = math_verify.parse(f"${answer}$", parsing_timeout=timeout)
  if not gold or not predicted:
    return 0.0
  return 1.0 if math_verify.verify(gold, predicted, timeout_seconds=timeout) else 0.0


def sort_reward(response: str, reference: str) -> float:
  answer = final_answer(response)
  if answer is None:
    return 0.0
  return 1.0 if re.sub(r"[\s,]", "", answer) == reference else 0.0


def word_sums_reward(response: str, reference: str) -> float:
  answer = final_answer(response)
  return _integer_reward(last_number(response) if answer is None else answer, reference)


VERIFIERS = {"math": math_reward, "arithmetic": arithmetic_reward, "countdown": countdown_reward,
             "sort": sort_reward, "calc": arithmetic_reward,
             "word_sums": word_sums_reward, "word_groups": word_sums_reward}
