"""The split loop: the staleness bound holds whichever side is slow, expired batches are
dropped, and the two weight syncs drive identical runs."""

import dataclasses

import pytest

from rlx.config import ConfigError
from rlx.rollout import Completion
from rlx.trainer import train_split
from rlx.trainer.common import Draw
from rlx.trainer.split import expired
from tests.trainer import tiny

QUIET = {"say": lambda message: None}


def _split(*overrides):
  return tiny.config("dapo_split", "--config.algorithm.dynamic_sampling=false",
                     "--config.checkpoint.every_steps=0", *overrides)


@pytest.mark.parametrize("k, learner_delay, generator_delay",
                         [(0, 0.0, 0.0), (1, 0.3, 0.0), (1, 0.0, 0.3), (2, 0.3, 0.0)])
def test_the_staleness_bound_holds_with_a_slow_side(tmp_path, k, learner_delay, generator_delay):
  config = _split("--config.trainer.steps=5", f"--config.mesh.max_staleness={k}")
  summary = train_split(config, tmp_path, learner_delay_s=learner_delay,
                        generator_delay_s=generator_delay, **QUIET)
  rows = tiny.metrics(tmp_path)
  assert len(rows) == 5 and summary["dropped_batches"] == 0
  lags = [row["rollout/policy_lag_max"] for row in rows]
  assert max(lags) <= k, lags
  if k and learner_delay:  # the generator works ahead while the learner is slow: lag reaches k
    assert max(lags) == k, lags
  if k == 0:
    assert all(row["rollout/policy_lag_mean"] == 0 for row in rows)


def _draw(versions):
  completions = [Completion(prompt_tokens=[1], response_tokens=[2], logprobs=[0.0],
                            policy_logprobs=[0.0], finish_reason="stop", policy_version=v,
                            prompt_index=i, sample_index=0) for i, v in enumerate(versions)]
  return Draw(completions, None, {}, 0.0, {})


def test_a_batch_with_a_rollout_past_the_bound_is_expired():
  assert not expired(_draw([3, 4]), version=4, max_staleness=1)
  assert expired(_draw([2, 4]), version=4, max_staleness=1)
  assert expired(_draw([3]), version=4, max_staleness=0)


def test_orbax_and_reshard_syncs_drive_identical_runs(tmp_path):
  # with max_staleness 0 the split loop is synchronous, so two runs see the same weights
  runs = {}
  for sync in ("reshard", "orbax"):
    config = _split("--config.trainer.steps=3", "--config.mesh.max_staleness=0",
                    f"--config.mesh.weight_sync={sync}")
    train_split(config, tmp_path / sync, **QUIET)
    runs[sync] = tiny.metrics(tmp_path / sync)
  for a, b in zip(runs["reshard"], runs["orbax"]):
    for key in ("loss", "reward/mean", "policy/entropy", "response/length_mean"):
      assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-8), key
  assert (tmp_path / "orbax" / "policy_versions").is_dir()


def test_split_needs_split_mode_and_one_controller(tmp_path):
  with pytest.raises(ConfigError, match="mode=split"):
    train_split(tiny.config("grpo_colocated"), tmp_path, **QUIET)
  config = _split()
  config = dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, multihost=True))
  with pytest.raises(ConfigError, match="does not "):
    train_split(config, tmp_path, **QUIET)
