"""The not-learning warnings: each once its symptom held for logging.warn_after_steps steps in
a row, again only after it cleared, never when turned off."""

import dataclasses

from rlx.config import RunConfig
from rlx.trainer.learn.health import Health

HEALTHY = {"advantage/zero_groups_frac": 0.4, "reward/mean": 0.3, "policy/entropy": 0.8,
           "response/truncated_frac": 0.1}


def _config(after):
  config = RunConfig()
  return dataclasses.replace(config, logging=dataclasses.replace(config.logging,
                                                                 warn_after_steps=after))


def test_each_symptom_warns_once_after_its_streak_and_again_after_it_clears():
  health = Health(_config(3))
  stuck = dict(HEALTHY, **{"advantage/zero_groups_frac": 1.0})
  said = [health.check(stuck) for _ in range(5)]
  assert [len(lines) for lines in said] == [0, 0, 1, 0, 0]
  assert "every group's samples got the same reward" in said[2][0]
  assert "rollout.group_size" in said[2][0] and "3 steps in a row" in said[2][0]
  assert health.check(HEALTHY) == []
  assert [len(health.check(stuck)) for _ in range(3)] == [0, 0, 1]  # back: said again


def test_every_symptom_is_recognised_and_a_healthy_run_says_nothing():
  cases = {"reward/mean": (0.0, "no sample earned any reward"),
           "policy/entropy": (0.001, "exploration is over"),
           "response/truncated_frac": (0.9, "rollout.max_new_tokens")}
  for key, (value, words) in cases.items():
    health = Health(_config(2))
    lines = [line for _ in range(2) for line in health.check(dict(HEALTHY, **{key: value}))]
    assert len(lines) == 1 and words in lines[0], (key, lines)
  health = Health(_config(2))
  assert all(health.check(HEALTHY) == [] for _ in range(20))
  assert all(health.check({}) == [] for _ in range(20))  # metrics absent: no symptom
  off = Health(_config(0))
  assert all(off.check({"reward/mean": 0.0}) == [] for _ in range(20))


def test_a_sample_reads_on_the_console():
  from rlx.trainer.learn.health import describe_sample

  row = {"step": 7, "prompt": "x" * 1000 + "Sort 3 1 2", "response": "<answer>1 2 3</answer>",
         "reward": 1.0, "correct": True, "finish_reason": "stop"}
  text = describe_sample(row)
  assert text.startswith("rlx: sample at step 7 (reward 1, correct, stop)")
  assert "Sort 3 1 2" in text and "<answer>1 2 3</answer>" in text and len(text) < 800
