"""The ``word_sums`` reward and task: the marked answer first, the last number only when none
is marked; problems whose answers are their own sums and differences."""

import re

from rlx.data.tasks import task_rows
from rlx.rewards.extract import last_number
from rlx.rewards.verifiers import word_sums_reward


def test_the_marked_answer_wins_and_the_last_number_stands_in_for_none():
  assert word_sums_reward("Tom has 3 + 4 = 7 apples.", "7") == 1.0
  assert word_sums_reward("3 + 4 = 7, so \\boxed{8}", "7") == 0.0  # marked, wrong
  assert word_sums_reward("\\boxed{7} and then 9", "7") == 1.0
  assert word_sums_reward("seven apples", "7") == 0.0
  assert word_sums_reward("1,234 coins", "1234") == 1.0
  assert last_number("from 5 down to -3.") == "-3"
  assert last_number("no digits") is None


def test_word_sums_rows_are_answered_by_their_own_numbers():
  for row in task_rows("word_sums", 50):
    a, b = map(int, re.findall(r"\d+", row["prompt"])[:2])
    assert 1 <= b <= a + 10 and int(row["answer"]) in (a + b, a - b)
    assert "\\boxed{}" in row["prompt"] and word_sums_reward(row["sft_target"], row["answer"]) == 1.0
  assert task_rows("word_sums", 5, split="eval") != task_rows("word_sums", 5)
