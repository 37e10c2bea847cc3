"""The agent metrics of a step from its episodes' summed statistics."""

import pytest

from rlx.trainer.produce.tally import agent_metrics


def test_means_fractions_and_latency_percentiles():
  sums = {"episodes": 4, "turns": 10, "tool_calls": 6, "tool_errors": 1, "truncated": 1,
          "env_s": 2.5, "slot_steps": 80, "busy_steps": 60, "parked_s": 0.5}
  calls = [("calculator", 0.1), ("calculator", 0.3), ("search", 2.0)]
  got = agent_metrics(sums, calls)
  assert got["agent/turns_mean"] == 2.5 and got["agent/tool_calls_mean"] == 1.5
  assert got["agent/truncated_frac"] == 0.25 and got["rollout/slot_occupancy"] == 0.75
  assert got["agent/tool_errors"] == 1 and got["time/env_s"] == 2.5
  assert got["agent/tool_latency_p50_s"] == pytest.approx(0.3)
  assert got["agent/tool_latency_p50_s/calculator"] == pytest.approx(0.2)
  assert got["agent/tool_latency_p90_s/search"] == pytest.approx(2.0)
  assert "agent/tool_latency_p50_s" not in agent_metrics(sums, [])
  one = agent_metrics(sums, [("calculator", 0.1)])
  assert "agent/tool_latency_p50_s" in one and "agent/tool_latency_p50_s/calculator" not in one


def test_the_failed_fraction_counts_every_episode_run():
  # 4 groups of 4: two groups each lost 2 episodes to their programs (the other 2 of each were
  # dropped with them), two groups were kept whole: 4 of 16 episodes failed
  sums = {"episodes": 8, "requests": 8, "dropped_episodes": 4, "program_errors": 3,
          "program_timeouts": 1, "silent_episodes": 0}
  assert agent_metrics(sums, [])["agent/failed_frac"] == 4 / 16
  every_group_failed = {"episodes": 0, "requests": 0, "dropped_episodes": 8, "program_errors": 8}
  assert agent_metrics(every_group_failed, [])["agent/failed_frac"] == 0.5


def test_the_share_of_an_episode_s_life_in_a_slot():
  released = {"episodes": 4, "life_s": 10.0, "away_s": 7.5}
  assert agent_metrics(released, [])["agent/in_slot_frac"] == pytest.approx(0.25)
  parked = {"episodes": 4, "life_s": 10.0, "away_s": 0.0}
  assert agent_metrics(parked, [])["agent/in_slot_frac"] == 1.0
  assert agent_metrics({"episodes": 0}, [])["agent/in_slot_frac"] == 1.0  # none finished
