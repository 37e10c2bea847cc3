"""The controllers' decisions on synthetic metric streams, the expiry rule, and a split run
with a slow learner in which the controller lowers k until the lag is back under the
threshold."""

import pytest

from rlx.config import ConfigError, check
from rlx.trainer.control import (DROP, EXPIRE, KNOB_STEPS, TRAIN, Controller, EntropyFloor,
                                Staleness)
from tests.trainer import tiny


def _feed(controller, values, **fixed):
  """Feeds one observation per value; returns [(index, event)] of the changes."""
  changes = []
  for i, value in enumerate(values):
    event = controller.observe(i, value, **fixed)
    if event is not None:
      changes.append((i, event))
  return changes


def test_k_steps_down_while_the_mean_lag_exceeds_the_threshold_and_back_up_when_healthy():
  staleness = Staleness(max_staleness=3, lag_threshold=1, max_is_clip_frac=None, window=3)
  # lag 3 for a window: k 3 -> 2; the window restarts, so two more batches change nothing
  changes = _feed(staleness, [3, 3, 3, 3, 3], is_clip_frac=None)
  assert [(i, e.old, e.new) for i, e in changes] == [(2, 3, 2)]
  _feed(staleness, [2], is_clip_frac=None)  # the window is full again: [3, 3, 2]
  assert "mean lag 3.00 > mesh.lag_threshold=1" in changes[0][1].reason
  assert staleness.k == 1
  _feed(staleness, [1, 1], is_clip_frac=None)
  # at the threshold: neither too stale nor room for one more version
  assert _feed(staleness, [1] * 9, is_clip_frac=None) == [] and staleness.k == 1
  # well under it (lag + 1 <= threshold): up one, once per window, never past max_staleness
  changes = _feed(staleness, [0] * 12, is_clip_frac=None)
  assert [(i, e.old, e.new) for i, e in changes] == [(2, 1, 2), (5, 2, 3)]
  assert staleness.k == 3


def test_k_falls_to_synchronous_while_importance_weights_clip_too_often():
  staleness = Staleness(max_staleness=2, lag_threshold=None, max_is_clip_frac=0.1, window=2)
  changes = _feed(staleness, [1.0] * 10, is_clip_frac=0.3)
  assert [(e.old, e.new) for _, e in changes] == [(2, 1), (1, 0)] and staleness.k == 0
  assert "IS clip fraction 0.300 > algorithm.max_is_clip_frac=0.1" in changes[0][1].reason
  # between half the limit and the limit: hold
  assert _feed(staleness, [0.0] * 6, is_clip_frac=0.07) == []
  changes = _feed(staleness, [0.0] * 4, is_clip_frac=0.01)
  assert [(e.old, e.new) for _, e in changes] == [(0, 1), (1, 2)]


def test_expired_batches_count_towards_the_window_without_a_clip_fraction():
  staleness = Staleness(max_staleness=2, lag_threshold=0, max_is_clip_frac=0.5, window=2)
  # two expired batches (no clip fraction) at lag 2: the lag alone lowers k
  changes = _feed(staleness, [2, 2], is_clip_frac=None)
  assert [(e.old, e.new) for _, e in changes] == [(2, 1)]


def test_no_thresholds_no_decisions():
  staleness = Staleness(max_staleness=2, lag_threshold=None, max_is_clip_frac=None, window=1)
  assert _feed(staleness, [50] * 5, is_clip_frac=0.9) == [] and staleness.k == 2


def test_the_entropy_floor_raises_the_temperature_in_steps_and_lowers_it_once_recovered():
  floor = EntropyFloor(0.5, "temperature", low=1.0, high=1.5, window=2)
  assert floor.levels == [1.0, 1.125, 1.25, 1.375, 1.5]
  changes = _feed(floor, [0.3] * 12)
  assert [e.new for _, e in changes] == [1.125, 1.25, 1.375, 1.5]  # then it stays at the top
  assert [i for i, _ in changes] == [1, 3, 5, 7] and floor.value == 1.5
  assert "entropy 0.300 < algorithm.entropy_floor=0.5" in changes[0][1].reason
  # above the floor but under 1.25 x the floor: hold (no flapping)
  assert _feed(floor, [0.6] * 6) == []
  changes = _feed(floor, [0.7] * 4)
  assert [(e.old, e.new) for _, e in changes] == [(1.5, 1.375), (1.375, 1.25)]
  assert _feed(floor, [float("nan")] * 4) == []  # a skipped update's NaN is no evidence


def test_the_controller_reports_only_the_knobs_it_moves_and_its_state_round_trips():
  config = tiny.config("dapo_split", "--config.mesh.max_staleness=2",
                       "--config.mesh.lag_threshold=1", "--config.mesh.control_window=1",
                       "--config.algorithm.entropy_floor=0.5",
                       "--config.algorithm.entropy_control=clip_eps_high")
  control = Controller.from_config(config)
  assert control.metrics() == {"control/k": 2, "control/clip_eps_high": 0.28}
  control.observe(0, lag_mean=2.0, is_clip_frac=0.0, entropy=0.1)
  assert control.k == 1 and control.clip_eps_high == pytest.approx(0.28 + 0.12 / KNOB_STEPS)
  assert control.temperature == config.rollout.temperature
  restored = Controller.from_config(config)
  restored.restore(control.state())
  assert restored.metrics() == control.metrics()
  assert len(control.events) == 2
  plain = Controller.from_config(tiny.config("dapo_split"))
  assert plain.metrics() == {}
  assert plain.observe(0, lag_mean=9.0, is_clip_frac=1.0, entropy=0.0) == []


def test_a_batch_past_the_lag_threshold_or_the_age_limit_is_expired():
  control = Controller.from_config(tiny.config(
      "dapo_split", "--config.mesh.max_staleness=3", "--config.mesh.lag_threshold=1",
      "--config.data.max_age_s=30"))
  assert control.verdict(1, 29.0) == TRAIN
  assert control.verdict(2, 0.0) == EXPIRE  # past the lag threshold
  assert control.verdict(0, 31.0) == EXPIRE  # past the age limit
  assert control.verdict(4, 0.0) == DROP  # past the bound k: the gate was bypassed
  assert control.verdict(0, 0.0, lag_min=-1) == DROP  # from a version a dead run wrote
  assert control.fresh(1, 29.0) and not control.fresh(2, 0.0)


@pytest.mark.parametrize("override, message", [
    ("--config.mesh.lag_threshold=1", "mesh.lag_threshold"),
    ("--config.data.max_age_s=10", "data.max_age_s"),
    ("--config.algorithm.max_is_clip_frac=0.1", "algorithm.max_is_clip_frac"),
])
def test_staleness_limits_need_split_mode(override, message):
  with pytest.raises(ConfigError, match=message):
    check(tiny.config("grpo_colocated", override))


def test_the_entropy_floor_cannot_raise_greedy_sampling():
  with pytest.raises(ConfigError, match="entropy_control=clip_eps_high"):
    check(tiny.config("dapo_split", "--config.algorithm.entropy_floor=0.5",
                      "--config.rollout.temperature=0"))
