"""The built-in tool environments.

- ``calc``: the task's question as the user message, a ``calculator`` tool; the first turn
  without a call is the answer, scored by the run's reward (the task's verifier).
- ``code``: the code task, with a ``run_tests`` tool that runs a program against the row's
  first two tests in the sandbox and reports which fail; the answer is scored on every test
  by the ``code`` reward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from rlx.envs.contract import Observation


def calculator(expression: str) -> str:
  """Evaluates an arithmetic expression exactly.

  Args:
    expression: integers, + - * / and parentheses, e.g. "123*4567".
  """
  from rlx.rewards.verifiers import evaluate_expression  # noqa: PLC0415 - in the worker

  value, _ = evaluate_expression(expression)
  if value.denominator == 1:
    return str(value.numerator)
  return f"{float(value):.6g}"


def run_tests(code: str, tests: list) -> str:
  """Runs a Python program against the visible tests and says which fail.

  Args:
    code: the whole program, e.g. "def f(x):\\n return x+1".
  """
  from rlx.rewards.sandbox import extract_program, normalize_tests  # noqa: PLC0415
  from rlx.rewards.sandbox import run_tests as sandboxed  # noqa: PLC0415

  program = extract_program(code) or code
  cases = normalize_tests(tests)
  result = sandboxed(program, cases, timeout_s=3.0, memory_mb=512)
  if result.timed_out:
    return "timed out"
  failed = [case.get("assert", case.get("input", "")) for case, ok in zip(cases, result.passed)
            if not ok]
  return "all passed" if not failed else "failed: " + "; ".join(map(str, failed))


class TaskEnv:
  """A row's prompt as the user message and ``tools`` to call; the first turn without a tool
  call is the answer. It gives no reward itself: the run's reward function scores the answer."""

  def __init__(self, row: dict, tools: tuple[Callable, ...]):
    self.row, self.tools = row, tools

  def reset(self) -> list[dict]:
    return [{"role": "user", "content": self.row["prompt"]}]

  def step(self, text: str) -> Observation:
    del text
    return Observation(done=True)


def make_calc(row: dict) -> TaskEnv:
  return TaskEnv(row, (calculator,))


def make_code(row: dict) -> TaskEnv:
  visible = list(row.get("tests", []))[:2]
  return TaskEnv(row, (functools.partial(run_tests, tests=visible),))


FACTORIES: dict[str, Callable[[dict], object]] = {"calc": make_calc, "code": make_code}
