"""Built-in synthetic tasks with verifiable answers, generated deterministically from a seed.

Each row is ``{"prompt": str, "answer": str}``; the answer is what the task's
verifier in ``rlx.rewards`` checks against. Train and eval rows never share a
problem: a problem belongs to the eval split when a hash of its text falls in
``eval_fraction``.

- ``arithmetic``: ``What is 37 + 58?`` -> ``95`` (+, - and *).
- ``countdown``: reach a target from 3-4 numbers with + - * (each number at most
  once); every target is built from the numbers, so each problem has a solution.
  The answer is ``"target|n1,n2,..."``.
- ``sort``: write 4-6 digits in ascending order: ``Sort 7 3 9 1 in ascending
  order.`` -> ``1379``.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from typing import Literal

Split = Literal["train", "eval"]
INSTRUCTION = "Put the final answer in <answer></answer>."


def _arithmetic(rng: random.Random) -> dict[str, str]:
  op = rng.choice("+-*")
  a = rng.randint(0, 99)
  b = rng.randint(0, 99) if op != "*" else rng.randint(0, 12)
  value = {"+": a + b, "-": a - b, "*": a * b}[op]
  return {"prompt": f"What is {a} {op} {b}? {INSTRUCTION}", "answer": str(value)}


def _countdown(rng: random.Random) -> dict[str, str]:
  numbers = [rng.randint(1, 12) for _ in range(rng.choice((3, 4)))]
  used = rng.sample(numbers, rng.randint(2, len(numbers)))
  expression, value = str(used[0]), used[0]
  for n in used[1:]:
    op = rng.choice("+-*")
    expression = f"({expression} {op} {n})"
    value = {"+": value + n, "-": value - n, "*": value * n}[op]
  shown = ", ".join(map(str, numbers))
  prompt = (f"Using the numbers {shown}, each at most once, and + - * /, make {value}. "
            f"{INSTRUCTION}")
  return {"prompt": prompt, "answer": f"{value}|{','.join(map(str, numbers))}"}


def _sort(rng: random.Random) -> dict[str, str]:
  digits = [str(rng.randint(0, 9)) for _ in range(rng.randint(4, 6))]
  return {"prompt": f"Sort {' '.join(digits)} in ascending order. {INSTRUCTION}",
          "answer": "".join(sorted(digits))}


TASKS: dict[str, Callable[[random.Random], dict[str, str]]] = {
    "arithmetic": _arithmetic, "countdown": _countdown, "sort": _sort}


def _in_eval(prompt: str, eval_fraction: float) -> bool:
  digest = hashlib.sha256(prompt.encode()).digest()
  return int.from_bytes(digest[:8], "big") / 2**64 < eval_fraction


def _check(task: str, eval_fraction: float) -> None:
  if task not in TASKS:
    raise ValueError(f"unknown built-in task {task!r}; choose one of {', '.join(TASKS)}")
  if not 0 < eval_fraction < 1:
    raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")


def task_row(task: str, index: int, *, seed: int = 0, split: Split = "train",
             eval_fraction: float = 0.1) -> dict[str, str]:
  """Row ``index`` of a built-in task, computed on its own (random access, deterministic)."""
  _check(task, eval_fraction)
  for attempt in range(1000):
    row = TASKS[task](random.Random(f"{task}:{seed}:{index}:{attempt}"))
    if _in_eval(row["prompt"], eval_fraction) == (split == "eval"):
      return row
  raise RuntimeError(f"no {split} problem found for {task} row {index}")  # p ~ 0.9^1000


def task_rows(task: str, count: int, *, seed: int = 0, split: Split = "train",
              eval_fraction: float = 0.1) -> list[dict[str, str]]:
  """The first ``count`` rows of a built-in task: the same rows for the same arguments, and
  never a problem of the other split."""
  return [task_row(task, i, seed=seed, split=split, eval_fraction=eval_fraction)
          for i in range(count)]
