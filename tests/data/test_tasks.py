"""Built-in tasks: deterministic, disjoint splits, answers their verifiers accept."""

import re

import pytest

from rlx import rewards
from rlx.data import task_rows


@pytest.mark.parametrize("task", ["arithmetic", "countdown", "sort", "code"])
def test_rows_are_deterministic_and_splits_disjoint(task):
  train = task_rows(task, 300, seed=1)
  assert train == task_rows(task, 300, seed=1)
  assert train != task_rows(task, 300, seed=2)
  evaluation = task_rows(task, 100, seed=1, split="eval")
  assert not {r["prompt"] for r in train} & {r["prompt"] for r in evaluation}


def test_arithmetic_answers_are_right():
  for row in task_rows("arithmetic", 200):
    a, op, b = re.match(r"What is (\d+) ([-+*]) (\d+)\?", row["prompt"]).groups()
    assert int(row["answer"]) == eval(f"{a} {op} {b}")  # noqa: S307 - test oracle on digits
    assert rewards.arithmetic_reward(f"<answer>{row['answer']}</answer>", row["answer"]) == 1.0


def test_every_countdown_problem_is_solvable():
  """Brute force over expressions of the given numbers finds the target for each problem."""
  import itertools

  def values(numbers):
    if len(numbers) == 1:
      yield numbers[0], str(numbers[0])
      return
    for i in range(1, len(numbers)):
      for left in values(numbers[:i]):
        for right in values(numbers[i:]):
          yield left[0] + right[0], f"({left[1]} + {right[1]})"
          yield left[0] - right[0], f"({left[1]} - {right[1]})"
          yield left[0] * right[0], f"({left[1]} * {right[1]})"

  for row in task_rows("countdown", 40, seed=3):
    target, numbers = row["answer"].split("|")
    numbers = [int(n) for n in numbers.split(",")]
    found = next((expr for k in range(1, len(numbers) + 1)
                  for subset in itertools.permutations(numbers, k)
                  for value, expr in values(list(subset)) if value == int(target)), None)
    assert found is not None, row
    assert rewards.countdown_reward(f"<answer>{found}</answer>", row["answer"]) == 1.0


def test_code_references_pass_their_tests_and_name_what_the_prompt_names():
  rows = task_rows("code", 200, seed=4)
  assert len({r["prompt"] for r in rows}) > 190  # too many problems to repeat (or memorise)
  for row in rows:
    name, constant = re.match(r"Write f\((\w)\) that returns .*?(\d+)", row["prompt"]).groups()
    assert row["answer"].startswith(f"def f({name}):") and constant in row["answer"]
    namespace = {}
    exec(row["answer"], namespace)  # noqa: S102 - the task's own reference program
    for test in row["tests"]:
      exec(test, namespace)  # noqa: S102


def test_unknown_task_is_refused():
  with pytest.raises(ValueError, match="unknown built-in task 'sorting'"):
    task_rows("sorting", 3)


def test_sort_answers_are_the_prompt_digits_in_order():
  from rlx import rewards

  for row in task_rows("sort", 30, seed=5):
    digits = row["prompt"].split(" in ascending")[0].removeprefix("Sort ").split()
    assert row["answer"] == "".join(sorted(digits)) and 4 <= len(digits) <= 6
    assert rewards.sort_reward(f"<answer>{row['answer']}</answer>", row["answer"]) == 1.0
