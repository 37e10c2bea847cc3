"""Built-in synthetic tasks with verifiable answers, generated deterministically from a seed.

Each row is ``{"prompt": str, "answer": str, "sft_target": str, ...}``: the answer is what
the task's verifier in ``rlx.rewards`` checks against; the SFT target is a full response
that earns full reward (the supervised warm-up of the built-in model trains on it). Train
and eval rows never share a problem: a problem belongs to the eval split when a hash of
its text falls in ``eval_fraction``.

- ``arithmetic``: ``What is 37 + 58?`` -> ``95`` (+, - and *).
- ``countdown``: reach a target from 3-4 numbers with + - * (each number at most
  once); every target is built from the numbers, so each problem has a solution.
  The answer is ``"target|n1,n2,..."``.
- ``sort``: write 4-6 digits in ascending order: ``Sort 7 3 9 1 in ascending
  order.`` -> ``1379``.
- ``calc``: ``What is 347*582?`` -> ``201954``: products too large
  for the built-in model to compute, for the ``calc`` environment's calculator tool. A share
  of the rows' warm-up targets (``sft_turns``) call the tool, in the run's tool-call format;
  the environment's part of them (the result) is not trained on.
- ``word_sums``: two-number addition and subtraction as one-sentence word problems
  (``Mia has 7 pens and buys 5 more. How many pens does Mia have now?`` -> ``12``), numbers
  1-10, asking for a ``\\boxed{}`` answer: for small pretrained instruct models with no
  warm-up (SmolLM2-135M-Instruct, Q4_1: ~28 % greedy, ~20 % sampled at temperature 0.7 at first;
  with numbers up to 20, 16 % and 12 %).
- ``word_groups``: ``word_sums``' sibling over products and equal shares, numbers 2-6
  (``Zoe has 3 jars with 4 shells in each. How many shells does Zoe have?`` -> ``12``;
  ``Tom has 24 pens and shares them equally between 4 friends, Mia among them. How many pens
  does Mia get?`` -> ``6``), the same ``\\boxed{}`` answer and reward: a second task for a
  small instruct model that no rlx setting was tuned on.
- ``code``: write a one-line Python function ``f(b)`` from its description
  (``returns the larger of b and 37``; 8 operations, 8 argument names, constants 2-99); the
  row's ``tests`` are assert statements that the ``code`` reward runs in its sandbox. The
  answer is the reference program.
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
  return _answered(f"What is {a} {op} {b}? {INSTRUCTION}", str(value))


def _answered(prompt: str, answer: str, shown: str | None = None) -> dict[str, str]:
  """A row whose SFT target puts ``shown`` (default: the answer) in the answer tags."""
  return {"prompt": prompt, "answer": answer,
          "sft_target": f"<answer>{answer if shown is None else shown}</answer>"}


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
  return _answered(prompt, f"{value}|{','.join(map(str, numbers))}", expression)


def _sort(rng: random.Random) -> dict[str, str]:
  digits = [str(rng.randint(0, 9)) for _ in range(rng.randint(4, 6))]
  return _answered(f"Sort {' '.join(digits)} in ascending order. {INSTRUCTION}",
                   "".join(sorted(digits)))


_CODE = (("{v} plus {n}", "{v}+{n}"), ("{v} minus {n}", "{v}-{n}"), ("{v} times {n}", "{v}*{n}"),
         ("{n} minus {v}", "{n}-{v}"), ("{v} squared plus {n}", "{v}*{v}+{n}"),
         ("the larger of {v} and {n}", "max({v},{n})"),
         ("the smaller of {v} and {n}", "min({v},{n})"), ("{v} modulo {n}", "{v}%{n}"))
_CODE_NAMES = "abcdnxyz"


def _code(rng: random.Random) -> dict:
  # 8 templates x 8 argument names x 98 constants: too many problems to memorise in a short
  # warm-up, so a model must copy the name and the constant from the prompt; held-out
  # problems test that skill, which RL on the training problems can improve
  description, body = rng.choice(_CODE)
  n, name = rng.randint(2, 99), rng.choice(_CODE_NAMES)
  expression = body.format(n=n, v=name)
  program = f"def f({name}):\n return {expression}"
  tests = []  # four inputs over a range wide enough that a wrong constant fails some
  for x in rng.sample(range(-60, 61), 4):
    tests.append(f"assert f({x}) == {eval(expression, {name: x})}")  # noqa: S307 - our own text
  answer = f"```python\n{program}\n```"
  return {"prompt": f"Write f({name}) that returns {description.format(n=n, v=name)}. "
                    "Reply in ```python.",
          "answer": program, "sft_target": answer, "tests": tests,
          # with the code environment: try the program against the visible tests, then answer
          "sft_turns": [
              {"role": "assistant", "tool_calls": [{"name": "run_tests",
                                                    "arguments": {"code": program}}]},
              {"role": "tool", "name": "run_tests", "content": "all passed"},
              {"role": "assistant", "content": answer}]}


_NAMES = ("Tom", "Mia", "Sam", "Ana", "Leo", "Zoe", "Ben", "Eva")
_THINGS = ("apples", "pens", "books", "coins", "cards", "stickers", "marbles", "shells")
BOXED_INSTRUCTION = "Put the final answer within \\boxed{}."


def _word_sums(rng: random.Random) -> dict[str, str]:
  name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
  a, b = rng.randint(1, 10), rng.randint(1, 10)
  if rng.random() < 0.5:
    verb = rng.choice(("buys", "finds", "gets"))
    story, value = f"{name} has {a} {thing} and {verb} {b} more.", a + b
  else:
    a, b = max(a, b), min(a, b)
    verb = rng.choice(("gives away", "loses", "sells"))
    story, value = f"{name} has {a} {thing} and {verb} {b} of them.", a - b
  prompt = f"{story} How many {thing} does {name} have now? {BOXED_INSTRUCTION}"
  return {"prompt": prompt, "answer": str(value), "sft_target": f"\\boxed{{{value}}}"}


def _word_groups(rng: random.Random) -> dict[str, str]:
  """``word_sums``' sibling over products and equal shares (numbers 2-6): a second task of
  one-line word problems that nothing in rlx was tuned on."""
  name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
  groups, each = rng.randint(2, 6), rng.randint(2, 6)
  if rng.random() < 0.5:
    box = rng.choice(("bags", "boxes", "jars"))
    story = f"{name} has {groups} {box} with {each} {thing} in each."
    question, value = f"How many {thing} does {name} have?", groups * each
  else:
    friend = rng.choice([n for n in _NAMES if n != name])
    story = (f"{name} has {groups * each} {thing} and shares them equally between {groups} "
             f"friends, {friend} among them.")
    question, value = f"How many {thing} does {friend} get?", each
  prompt = f"{story} {question} {BOXED_INSTRUCTION}"
  return {"prompt": prompt, "answer": str(value), "sft_target": f"\\boxed{{{value}}}"}


CALC_TOOL_SHARE = 0.3
"""The share of ``calc`` rows whose warm-up target calls the calculator."""


def _calc(rng: random.Random) -> dict:
  # 3 x 3 digit products: beyond what the tiny model can compute in its head, exact with the
  # tool. The warm-up shows the tool on a share of the rows and a direct answer on the rest:
  # RL has to learn that calling is what pays, and to copy the result into the answer.
  a, b = rng.randint(100, 999), rng.randint(100, 999)
  value = str(a * b)
  row = {"prompt": f"What is {a}*{b}?", "answer": value}
  if rng.random() < CALC_TOOL_SHARE:
    # written in the run's tool-call format and chat template by the warm-up
    row["sft_turns"] = [
        {"role": "assistant", "tool_calls": [{"name": "calculator",
                                              "arguments": {"expression": f"{a}*{b}"}}]},
        {"role": "tool", "name": "calculator", "content": value},
        {"role": "assistant", "content": f"<answer>{value}</answer>"}]
    row["sft_target"] = f'<call>calculator("{a}*{b}")</call><result>{value}</result><answer>{value}</answer>'
  else:
    row["sft_target"] = f"<answer>{value}</answer>"
  return row


TASKS: dict[str, Callable[[random.Random], dict]] = {
    "arithmetic": _arithmetic, "countdown": _countdown, "sort": _sort, "code": _code,
    "calc": _calc, "word_sums": _word_sums, "word_groups": _word_groups}


def in_eval(prompt: str, eval_fraction: float) -> bool:
  """Whether a problem belongs to the held-out split (by a hash of its text)."""
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
    if in_eval(row["prompt"], eval_fraction) == (split == "eval"):
      return row
  raise RuntimeError(f"no {split} problem found for {task} row {index}")  # p ~ 0.9^1000


def task_rows(task: str, count: int, *, seed: int = 0, split: Split = "train",
              eval_fraction: float = 0.1) -> list[dict[str, str]]:
  """The first ``count`` rows of a built-in task: the same rows for the same arguments, and
  never a problem of the other split."""
  return [task_row(task, i, seed=seed, split=split, eval_fraction=eval_fraction)
          for i in range(count)]
