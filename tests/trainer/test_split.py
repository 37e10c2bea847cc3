"""Split in one process: the staleness bound holds with a slow side, the generator's gate never
deadlocks or lets the lag pass k, and a batch past the bound is expired."""

import dataclasses
import threading
import time
import types

import numpy as np
import pytest

from rlx.config import ConfigError
from rlx.rollout import Completion
from rlx.trainer import train_split
from rlx.trainer.draw import Draw
from rlx.trainer import control
from rlx.trainer.deploy.split import Generator, ThreadGate
from tests.trainer import tiny

QUIET = {"say": lambda message: None}


def _split(*overrides):
  return tiny.config("dapo_split", "--config.algorithm.dynamic_sampling=false",
                     "--config.checkpoint.every_steps=0", *overrides)


# end to end, one case: the loop's verdicts are tested on a fake source (test_loop.py), the
# generator's gate under random delays and drops below
@pytest.mark.parametrize("k, learner_delay, generator_delay", [(1, 0.3, 0.0)])
def test_the_staleness_bound_holds_with_a_slow_side(tmp_path, k, learner_delay, generator_delay):
  config = _split("--config.trainer.steps=5", f"--config.mesh.max_staleness={k}")
  summary = train_split(config, tmp_path, learner_delay_s=learner_delay,
                        generator_delay_s=generator_delay, **QUIET)
  rows = tiny.metrics(tmp_path)
  assert len(rows) == 5 and summary.dropped_batches == 0
  # no lag threshold or age limit: nothing can expire, and no constant 0 is reported
  assert "rollout/expired_batches" not in rows[-1] and not any("control/" in k for k in rows[-1])
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
  return Draw(completions=completions, rewards=None, correct=None, counts={},
              generate_seconds=0.0, data_state={})


def test_the_gate_rule_and_the_bound_on_the_oldest_token():
  assert control.may_start(0, finished=0, k=0) and not control.may_start(1, finished=0, k=0)
  assert control.may_start(3, finished=2, k=1) and not control.may_start(4, finished=2, k=1)
  verdict = control.Controller.from_config(_split("--config.mesh.max_staleness=1")).verdict
  assert verdict(lag_max=1, age_s=0) == control.TRAIN
  assert verdict(lag_max=2, age_s=0) == control.DROP


class _Versions:
  """A stand-in for the weight sync: the newest published version."""

  def __init__(self):
    self.version, self.lock = 0, threading.Lock()

  def publish(self, version):
    with self.lock:
      self.version = version

  def latest(self, newer_than=-1):
    with self.lock:
      return (None, self.version) if self.version > newer_than else None


def _job(k, sync):
  return types.SimpleNamespace(sync=sync, config=types.SimpleNamespace(
      mesh=types.SimpleNamespace(max_staleness=k, inflight_updates=True, admission="batch"),
      trainer=types.SimpleNamespace(seed=0)))


@pytest.mark.parametrize("k", [0, 1, 2])
def test_no_deadlock_and_no_lag_past_k_under_random_delays_and_drops(k):
  """The real generator thread, in-flight updates on, against a learner that drops batches
  at random (as an age limit would): 1,000 batches, random delays on both sides, a watchdog
  on every wait; the lag is judged by each row's oldest token."""
  rng = np.random.default_rng(k)
  sync = _Versions()
  generator_rng = np.random.default_rng(1000 + k)

  def collect_stub(job, params_fn, seed, temperature=None, inflight=None):
    _, first = params_fn()
    time.sleep(generator_rng.uniform(0, 0.001))
    _, last = inflight()  # a version published meanwhile reaches the rows in flight
    draw = _draw([first] * 2)
    for c in draw.completions:
      c.stamp(1, last)
      c.response_tokens.append(2)
    return draw

  generator = Generator(_job(k, sync), first_step=0, collect_fn=collect_stub)
  generator.start()
  version, trained, dropped, lags, token_lags = 0, 0, 0, [], []
  try:
    while trained + dropped < 1000:
      draw = generator.next(timeout=30).draw  # the watchdog: queue.Empty fails the test
      _, lag_max = control.lag([c.policy_version for c in draw.completions], version)
      if rng.random() < 0.15 or control.past_bound(lag_max, k):
        dropped += 1
        generator.gate.finish()
        continue
      lags.append(lag_max)
      token_lags.append(version - min(c.newest_version for c in draw.completions))
      time.sleep(rng.uniform(0, 0.001))
      version += 1
      sync.publish(version)
      trained += 1
      generator.gate.finish()
  finally:
    generator.stop()
    generator.join(timeout=10)
  assert not generator.is_alive()
  assert max(lags) <= k and dropped > 100
  if k:  # the generator did work ahead, and some rows took a newer version in flight
    assert max(lags) > 0 and min(t - l for t, l in zip(token_lags, lags)) < 0


def test_the_gate_counts_a_new_setting_only_when_k_changes():
  gate = ThreadGate(2)
  gate.retune(2, temperature=1.2)
  assert gate.setting == 0 and gate.wait(0).temperature == 1.2
  gate.retune(1, temperature=1.2)
  assert gate.setting == 1 and gate.wait(1).setting == 1
  gate.halt()
  assert gate.wait(5) is None  # a halted gate never blocks


def test_split_needs_split_mode_and_one_controller(tmp_path):
  with pytest.raises(ConfigError, match="mode=split"):
    train_split(tiny.config("grpo_colocated"), tmp_path, **QUIET)
  config = _split()
  config = dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, multihost=True))
  with pytest.raises(ConfigError, match="does not "):
    train_split(config, tmp_path, **QUIET)


def test_a_resume_never_samples_with_the_stopped_runs_newer_weights(tmp_path):
  """Killed after step 5 with checkpoint 3 (checkpoints 4 and 5 lost, versions 4 and 5 on
  storage): the resumed run moves those versions aside, and trains on no batch from them."""
  import shutil

  overrides = ("--config.mesh.weight_sync=orbax", "--config.mesh.max_staleness=1",
               "--config.checkpoint.every_steps=1")
  train_split(_split("--config.trainer.steps=5", *overrides), tmp_path, **QUIET)
  for step in (4, 5):
    shutil.rmtree(tmp_path / "checkpoints" / str(step))
  assert sorted(int(p.name) for p in (tmp_path / "policy_versions").iterdir()
                if p.name.isdigit())[-1] == 5
  said = []
  train_split(_split("--config.trainer.steps=7", *overrides), tmp_path, say=said.append)
  assert any("moved 3 policy version(s) from 3 on aside" in line for line in said), said
  rows = tiny.metrics(tmp_path)
  resumed = [row for row in rows if row["step"] > 3][-4:]
  assert [row["step"] for row in resumed] == [4, 5, 6, 7]
  assert all(row["rollout/policy_lag_mean"] >= 0 for row in resumed)
  assert resumed[-1]["rollout/dropped_batches"] == 0
