"""One tally for both producer loops, one reward merge, and the learner loop's side work as
hooks with one rule for when it is due."""

import numpy as np
import pytest

from rlx.rewards import Scored
from rlx.trainer.common import due
from rlx.trainer.learn.hooks import AfterStep, Hook, run_hooks
from rlx.trainer.produce.tally import Tally, merge_rewards


def _scored(rewards, components=None, errors=0):
  rewards = np.asarray(rewards, np.float32)
  return Scored(rewards, rewards >= 1.0, {"reward/errors": errors, "reward/timeouts": 0},
                components or {})


GROUPS = [([1.0, 0.0], {"length": [0.5, np.nan]}, 0),  # varied
          ([1.0, 1.0], {"length": [0.25, 0.75]}, 1),  # alike
          ([0.0, 0.0], {}, 2)]  # alike, its reward calls failed


def test_a_batch_tallied_at_once_and_group_by_group_gives_the_same_metrics():
  """``collect`` adds whole draws, the stream one group as it completes: the metrics agree."""
  whole, each = Tally(2), Tally(2)
  rewards = sum((r for r, _, _ in GROUPS), [])
  length = np.concatenate([np.asarray(c.get("length", [np.nan] * 2), np.float32)
                           for _, c, _ in GROUPS])
  whole.count({"reward/errors": 3, "reward/timeouts": 0})
  keep = whole.add(_scored(rewards, {"length": length}), dynamic=True)
  for r, c, errors in GROUPS:
    each.count({"reward/errors": errors, "reward/timeouts": 0})
    each.add(_scored(r, {k: np.asarray(v, np.float32) for k, v in c.items()}), dynamic=True)
  assert keep.tolist() == [True, True, False, False, False, False]
  a, b = whole.metrics(whole.sums(), draws=1), each.metrics(each.sums(), draws=1)
  assert a == b
  assert a["reward/mean"] == pytest.approx(3 / 6) and a["reward/accuracy"] == pytest.approx(3 / 6)
  assert a["rollout/dropped_groups"] == 2 and a["advantage/zero_groups_frac"] == pytest.approx(2 / 3)
  assert a["reward/errors"] == 3 and a["reward/error_frac"] == pytest.approx(3 / 6)
  assert a["reward/length"] == pytest.approx((0.5 + 0.25 + 0.75) / 3)  # NaN: not given


def test_without_dynamic_sampling_every_group_is_kept_and_still_counted_alike():
  tally = Tally(2)
  keep = tally.add(_scored([1.0, 1.0, 0.0, 1.0]), dynamic=False)
  assert keep.all() and tally.dropped == 0 and tally.alike == 1


def test_episode_statistics_become_agent_metrics_and_sum_over_processes():
  tally = Tally(2)
  tally.count({"agent:episodes": 2, "agent:turns": 6, "agent:tool_calls": 2,
               "reward/errors": 0, "reward/timeouts": 0})
  tally.add(_scored([1.0, 0.0]), dynamic=True)
  tally.latencies += [("calculator", 0.1), ("calculator", 0.3)]
  # two processes' tallies summed, as collect sums them
  sums = tally.sums()
  totals = {key: 2 * value for key, value in sums.items()}
  metrics = tally.metrics(totals, draws=1)
  assert metrics["agent/turns_mean"] == 3.0 and metrics["agent/tool_calls_mean"] == 1.0
  assert metrics["agent/tool_latency_p50_s"] == pytest.approx(0.2)
  assert metrics["reward/mean"] == 0.5 and "agent:episodes" not in metrics


class _Pool:
  def __init__(self):
    self.asked = []

  def score(self, texts, rows):
    self.asked += texts
    rewards = np.full(len(texts), 0.5, np.float32)
    return Scored(rewards, np.zeros(len(texts), bool), {"reward/errors": 1, "reward/timeouts": 0},
                  {"format": np.ones(len(texts), np.float32)})


def test_the_merge_asks_the_pool_only_where_no_reward_was_given():
  pool = _Pool()
  scored = merge_rewards(pool, [(1.0, True), None, (0.0, False), None],
                         lambda i: (f"text {i}", {"row": i}))
  assert pool.asked == ["text 1", "text 3"]
  assert scored.rewards.tolist() == [1.0, 0.5, 0.0, 0.5]
  assert scored.correct.tolist() == [True, False, False, False]
  assert scored.counts["reward/errors"] == 1
  np.testing.assert_array_equal(scored.components["format"], [np.nan, 1.0, np.nan, 1.0])
  # every reward given: the pool is not asked
  assert merge_rewards(pool, [(1.0, True)], lambda i: ("x", {})).counts["reward/errors"] == 0
  assert pool.asked == ["text 1", "text 3"]


def _after(step, stopping=False, last=False):
  return AfterStep(step, None, {}, {}, stopping, last)


def test_hooks_run_when_due_in_order_and_a_stop_runs_the_checkpoint_not_the_evaluation():
  ran = []
  hooks = [Hook("evaluation", 3, lambda a: ran.append(("eval", a.step)), at_last=True,
                on_stop=False),
           Hook("metrics", 1, lambda a: ran.append(("metrics", a.step))),
           Hook("checkpoint", 2, lambda a: ran.append(("save", a.step)), on_stop=True),
           Hook("export", 0, lambda a: ran.append(("export", a.step)))]
  for step in range(1, 5):
    run_hooks(hooks, _after(step))
  assert ran == [("metrics", 1), ("metrics", 2), ("save", 2), ("eval", 3), ("metrics", 3),
                 ("metrics", 4), ("save", 4)]
  ran.clear()
  run_hooks(hooks, _after(6, stopping=True))  # due for both, but the run stops
  run_hooks(hooks, _after(5, stopping=True))
  assert ran == [("metrics", 6), ("save", 6), ("metrics", 5), ("save", 5)]
  ran.clear()
  run_hooks(hooks, _after(7, last=True))
  assert ran == [("eval", 7), ("metrics", 7)]
  assert not due(0, 4) and due(2, 4) and not due(3, 4)
