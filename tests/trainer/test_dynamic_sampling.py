"""DAPO's dynamic sampling in the loop: only groups of varied rewards are kept, the batch is
refilled, and a run whose groups never vary stops with an error that says what to change."""

import dataclasses

import numpy as np
import pytest

from rlx.rewards import RewardPool
from rlx.trainer import DynamicSamplingError, collect, prepare
from tests.trainer import tiny


def _odd_length(response: str, reference: str) -> float:
  del reference
  return float(len(response) % 2)


def _run(tmp_path, verifier, max_draws=16, *overrides):
  config = tiny.config("dapo_split", "--config.rollout.group_size=4",
                       f"--config.algorithm.dynamic_sampling_max_draws={max_draws}", *overrides)
  run = prepare(config, tmp_path, say=lambda message: None)
  run.pool.close()
  run = dataclasses.replace(run, pool=RewardPool(verifier, num_workers=0))
  run.sync.publish(run.model.params, 0)  # the generation layout
  return run


def test_kept_groups_have_varied_rewards_and_fill_the_batch(tmp_path):
  run = _run(tmp_path, _odd_length)
  draw = collect(run, run.sync.latest, seed=0)
  groups = draw.rewards.reshape(-1, 4)
  assert len(draw.completions) == 2 * 4
  assert np.all(groups.std(axis=1) > 0)
  assert draw.counts["rollout/draws"] >= 1
  # every draw is 2 prompts; what was not kept (beyond the batch) was dropped
  assert draw.counts["rollout/dropped_groups"] <= 2 * draw.counts["rollout/draws"] - 2
  # the zero-advantage fraction is over every group drawn, so dynamic sampling does not hide it
  drawn = 2 * draw.counts["rollout/draws"]
  assert draw.counts["advantage/zero_groups_frac"] == draw.counts["rollout/dropped_groups"] / drawn


def test_groups_that_never_vary_stop_the_run_with_a_clear_error(tmp_path):
  # (and the stacked KV cache, the TPU's, asked for in the config, on the CPU)
  run = _run(tmp_path, lambda response, reference: 0.0, 3, "--config.rollout.cache_layout=stacked")
  assert run.engine.cache_layout == "stacked"
  with pytest.raises(DynamicSamplingError, match="kept 0 of 2 groups after 3 draws"):
    collect(run, run.sync.latest, seed=0)


def _raises(response: str, reference: str) -> float:
  raise RuntimeError("a broken reward function")


def test_a_raising_reward_scores_zero_is_counted_and_the_run_goes_on(tmp_path):
  config = tiny.config("grpo_colocated", "--config.rollout.group_size=4")
  run = prepare(config, tmp_path, say=lambda message: None)
  run.pool.close()
  run = dataclasses.replace(run, pool=RewardPool(_raises, num_workers=0))
  run.sync.publish(run.model.params, 0)
  draw = collect(run, run.sync.latest, seed=0)
  assert np.all(draw.rewards == 0) and draw.counts["reward/errors"] == 2 * 4
  assert draw.counts["advantage/zero_groups_frac"] == 1.0  # kept anyway (no dynamic sampling)
