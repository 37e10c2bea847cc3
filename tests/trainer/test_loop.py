"""The one learner loop, driven by a fake source and a fake learner (no model is built):
train / drop / expire verdicts, controller retunes reaching the source and the learner, a
stop signal, the data running out, and a checkpoint-resume that continues the source's and
the controller's state."""

import json
import os
import signal
import time
import types

import pytest

from rlx.rollout import Completion
from rlx.trainer import control
from rlx.trainer.draw import Draw
from rlx.trainer.learn.loop import Batch, learn_loop
from tests.trainer import tiny

QUIET = {"say": lambda message: None}


class FakeSource:
  """Hands out batches from a script of (lag, age_s) pairs, relative to the learner's version
  when asked; records every settle and retune."""

  def __init__(self, script, first=0, counts=None):
    self.script, self.index, self.counts = list(script), first, counts or {}
    self.settled, self.retuned = [], []

  def next(self, version, wait=True):
    if self.index >= len(self.script):
      raise StopIteration
    lag, age = self.script[self.index]
    completions = [Completion(prompt_tokens=[1], response_tokens=[2, 3], logprobs=[0.0, 0.0],
                              policy_logprobs=[0.0, 0.0], finish_reason="stop",
                              policy_version=version - lag, prompt_index=i, sample_index=0)
                   for i in range(2)]
    draw = Draw(completions=completions, rewards=None, correct=None, counts=dict(self.counts),
                generate_seconds=0.01, data_state={"next_index": self.index + 1},
                born=time.time() - age)
    return Batch(draw, draw.data_state, metrics={"fake/index": self.index})

  def settle(self, batch, verdict, version):
    self.settled.append(verdict)
    self.index += 1

  def retune(self, controller):
    self.retuned.append((controller.k, controller.temperature))

  def metrics(self, learn_seconds):
    return {"fake/learn_s": learn_seconds}

  def state(self):
    return {"fake_index": self.index}

  def close(self):
    pass


class FakeLearner:
  """Counts versions, records the knobs it was given and what it saved."""

  def __init__(self, directory, config, version=0, entropy=0.5, stop_at=None):
    self.version, self.entropy, self.stop_at, self.config = version, entropy, stop_at, config
    self.clip_eps_highs, self.saves = [], {}
    self.saved_step, self.restored_meta = None, {}
    self.released = False  # the generator's copy, until the next publish
    self.checkpointer = types.SimpleNamespace(directory=directory, latest_step=self._latest,
                                              wait=lambda: None, failed_save=lambda: None)

  def _latest(self):
    return max(self.saves, default=None)

  def learn(self, draw, *, clip_eps_high):
    self.clip_eps_highs.append(clip_eps_high)
    self.version += 1
    if self.version == self.stop_at:
      os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler would, mid-step
    return {"loss": 1.0 / self.version, "policy/entropy": self.entropy,
            "policy/is_clip_frac": 0.0}

  sync_bytes = 1024
  sync_verified = 3

  def publish(self):
    self.released = False
    return 0.001

  def release_generation_copy(self):
    self.released = True

  def save(self, step, data_state, **meta):
    self.saved_step = step
    self.saves[step] = {"data_state": data_state, **meta}

  def generation_params(self):
    assert not self.released, "sampling from a released copy"
    return None

  def close(self):
    pass


def _run(config, workdir):
  stream = types.SimpleNamespace(get_state=lambda: {"next_index": 0}, skipped=0)
  return types.SimpleNamespace(
      config=config, workdir=workdir, stream=stream, eval_rows=[], close=lambda: None,
      model=None,  # nothing to export at the end
      pool=types.SimpleNamespace(first_error="KeyError: 'anwser'"),
      source=types.SimpleNamespace(skipped=0, fingerprint=lambda: "fake-data"))


def _no_eval(run, params):
  return {}


def _loop(tmp_path, script, *overrides, learner=None, source=None, start=None, controller=None,
          evaluate=_no_eval):
  config = tiny.config("dapo_split", "--config.checkpoint.every_steps=0", *overrides)
  learner = learner or FakeLearner(tmp_path / "checkpoints", config)
  source = source or FakeSource(script)
  controller = controller or control.Controller.from_config(config)
  summary = learn_loop(_run(config, tmp_path), learner, source, controller, start=start,
                       accuracy_before=None, evaluate=evaluate, **QUIET)
  return summary, learner, source, controller


def test_each_batch_gets_the_controllers_verdict_and_the_source_hears_it(tmp_path):
  script = [(0, 0), (3, 0), (2, 0), (0, 100), (-1, 0), (1, 0)]  # (lag, age in seconds)
  summary, learner, source, _ = _loop(
      tmp_path, script, "--config.trainer.steps=2", "--config.mesh.max_staleness=2",
      "--config.mesh.lag_threshold=1", "--config.data.max_age_s=30")
  assert source.settled == [control.TRAIN, control.DROP, control.EXPIRE, control.EXPIRE,
                            control.DROP, control.TRAIN]
  assert (summary.steps, summary.dropped_batches, summary.expired_batches) == (2, 2, 2)
  rows = tiny.metrics(tmp_path)
  assert [row["step"] for row in rows] == [1, 2] and [row["fake/index"] for row in rows] == [0, 5]
  assert rows[-1]["rollout/dropped_batches"] == 2 and rows[-1]["rollout/expired_batches"] == 2
  assert learner.version == 2 and not summary.stopped
  # the final step is saved with the source's state, the data position and the controller's
  assert learner.saves[2]["fake_index"] == 6 and learner.saves[2]["data_state"] == {"next_index": 6}
  assert learner.saves[2]["control"] == {"k": 2, "entropy_level": 0}


def test_the_loops_metrics_keys_are_the_same_whatever_the_source(tmp_path):
  _loop(tmp_path, [(0, 0)] * 2, "--config.trainer.steps=2")
  row = tiny.metrics(tmp_path)[-1]
  for key in ("time/step_s", "time/wait_for_data_s", "time/generate_s", "time/learn_s",
              "time/sync_s", "throughput/tokens_per_s", "throughput/samples_per_s",
              "throughput/learning_tokens_per_s", "rollout/dropped_batches",
              "data/skipped_rows", "fake/learn_s"):
    assert key in row, key
  assert row["throughput/samples_per_s"] > 0 and row["fake/learn_s"] >= 0
  assert "rollout/expired_batches" not in row  # nothing can expire: no constant 0


def test_expired_batches_lower_k_and_the_source_is_retuned(tmp_path):
  # lag 2 > threshold 1: expired; two in a window lower k, two more lower it again; two fresh
  # batches in a window are healthy (mean lag 0 + 1 <= 1): k goes back up
  script = [(2, 0)] * 4 + [(0, 0)] * 2
  summary, _, source, controller = _loop(
      tmp_path, script, "--config.trainer.steps=2", "--config.mesh.max_staleness=3",
      "--config.mesh.lag_threshold=1", "--config.mesh.control_window=2")
  assert [k for k, _ in source.retuned] == [2, 1, 2] and controller.k == 2
  assert summary.expired_batches == 4 and summary.steps == 2
  assert [e.split(": ", 1)[1][:16] for e in summary.control_events] == [
      "control/k 3 -> 2", "control/k 2 -> 1", "control/k 1 -> 2"]


def test_an_entropy_floor_retunes_the_temperature_and_the_learners_clip_high(tmp_path):
  summary, _, source, _ = _loop(tmp_path, [(0, 0)] * 3, "--config.trainer.steps=3",
                                "--config.algorithm.entropy_floor=100",
                                "--config.mesh.control_window=1")
  assert [t for _, t in source.retuned] == [1.125, 1.25, 1.375]
  summary, learner, _, _ = _loop(tmp_path / "clip", [(0, 0)] * 3, "--config.trainer.steps=3",
                                 "--config.algorithm.entropy_floor=100",
                                 "--config.mesh.control_window=1",
                                 "--config.algorithm.entropy_control=clip_eps_high")
  # each step trains with the setting made after the one before
  assert learner.clip_eps_highs == pytest.approx([0.28, 0.31, 0.34])


def test_a_stop_signal_ends_the_loop_after_the_step_saved_and_stopped(tmp_path):
  config = tiny.config("dapo_split", "--config.trainer.steps=10")
  learner = FakeLearner(tmp_path / "checkpoints", config, stop_at=2)
  summary, _, _, _ = _loop(tmp_path, [(0, 0)] * 10, "--config.trainer.steps=10", learner=learner)
  assert summary.stopped and summary.steps == 2 and max(learner.saves) == 2
  assert summary.eval_accuracy_after is None  # a stop skips the final evaluation


def test_the_data_running_out_ends_the_loop_with_a_save(tmp_path):
  summary, learner, _, _ = _loop(tmp_path, [(0, 0)] * 3, "--config.trainer.steps=10")
  assert summary.steps == 3 and not summary.stopped and max(learner.saves) == 3


def test_a_resumed_loop_continues_the_sources_and_the_controllers_state(tmp_path):
  overrides = ("--config.algorithm.entropy_floor=100", "--config.mesh.control_window=1",
               "--config.checkpoint.every_steps=2")
  script = [(0, 0)] * 5
  config = tiny.config("dapo_split", "--config.trainer.steps=2", *overrides)
  _, first, _, _ = _loop(tmp_path, script, "--config.trainer.steps=2", *overrides)
  saved = first.saves[2]
  # a new process: the checkpoint's meta restores the controller, and the source resumes
  controller = control.Controller.from_config(config)
  controller.restore(saved["control"])
  assert controller.temperature == 1.25
  learner = FakeLearner(tmp_path / "checkpoints", config, version=2)
  source = FakeSource(script, first=saved["fake_index"])
  summary, _, _, _ = _loop(tmp_path, script, "--config.trainer.steps=4", *overrides,
                           learner=learner, source=source, start=2, controller=controller)
  rows = tiny.metrics(tmp_path)
  assert [row["step"] for row in rows] == [1, 2, 3, 4]
  assert [row["fake/index"] for row in rows] == [0, 1, 2, 3]
  assert [row["control/temperature"] for row in rows] == [1.125, 1.25, 1.375, 1.5]
  assert summary.steps == 4 and learner.saves[4]["fake_index"] == 4


def test_the_profile_window_traces_the_steps_asked_for(tmp_path):
  said = []
  config = tiny.config("dapo_split", "--config.trainer.steps=3", "--config.logging.profile_steps=1:2")
  learner = FakeLearner(tmp_path / "checkpoints", config)
  learn_loop(_run(config, tmp_path), learner, FakeSource([(0, 0)] * 3),
             control.Controller.from_config(config), start=None, accuracy_before=None,
             say=said.append, evaluate=_no_eval)
  traces = list((tmp_path / "profile" / "process_0").rglob("*.xplane.pb"))
  assert len(traces) == 1
  assert any("profile of steps 1..1" in line for line in said)
  with pytest.raises(Exception, match="profile_steps"):
    tiny.config("dapo_split", "--config.logging.profile_steps=3:1")


def test_the_inline_source_samples_with_the_published_weights_at_the_retuned_temperature(
    tmp_path, monkeypatch):
  from rlx.trainer.deploy import colocated

  calls = []

  def fake_collect(run, params_fn, seed, temperature=None):
    calls.append((params_fn(), seed, temperature))
    return Draw(completions=[], rewards=None, correct=None, counts={}, generate_seconds=0.0,
                data_state={"next_index": len(calls)})

  monkeypatch.setattr(colocated, "collect", fake_collect)
  config = tiny.config("grpo_colocated", "--config.algorithm.entropy_floor=100",
                       "--config.mesh.control_window=1")
  sync = types.SimpleNamespace(latest=lambda: ("params-v3", 3))
  source = colocated.InlineSource(types.SimpleNamespace(config=config, sync=sync), 5, 1.0)
  assert source.next(version=3, wait=False) is None  # nothing is ready without sampling
  batch = source.next(version=3)
  controller = control.Controller.from_config(config)
  controller.observe(1, lag_mean=None, entropy=0.0)  # under the floor: the temperature rises
  source.retune(controller)
  source.next(version=4)
  seed = config.trainer.seed * 1_000_003
  assert calls == [(("params-v3", 3), seed + 5, 1.0), (("params-v3", 3), seed + 6, 1.125)]
  assert batch.data_state == {"next_index": 1}


def test_a_reward_that_never_works_stops_the_run_with_its_first_error(tmp_path):
  from rlx.trainer import RewardFailedError

  source = FakeSource([(0, 0)] * 10, counts={"reward/error_frac": 1.0})
  learner = FakeLearner(tmp_path / "checkpoints", tiny.config("dapo_split"))
  with pytest.raises(RewardFailedError, match="every reward call of 3 steps in a row failed .*"
                     "the first error: KeyError: 'anwser'"):
    _loop(tmp_path, [], "--config.trainer.steps=10", source=source, learner=learner)
  assert [row["step"] for row in tiny.metrics(tmp_path)] == [1, 2]
  assert list(learner.saves) == [2]  # the steps done are saved before it stops
  # a step with one working call resets the count
  source = FakeSource([(0, 0)] * 4, counts={"reward/error_frac": 0.5})
  summary, _, _, _ = _loop(tmp_path / "some", [], "--config.trainer.steps=4", source=source)
  assert summary.steps == 4


class FailingSource(FakeSource):
  """Raises a data error when it reaches batch ``at``."""

  def __init__(self, script, at):
    super().__init__(script)
    self.at = at

  def next(self, version, wait=True):
    if self.index == self.at:
      from rlx.data import DataError
      raise DataError("d.jsonl:7: the file changed while the run was reading it")
    return super().next(version, wait)


def test_a_data_error_mid_run_saves_the_last_completed_step_first(tmp_path):
  from rlx.data import DataError

  config = tiny.config("dapo_split", "--config.checkpoint.every_steps=0")
  learner = FakeLearner(tmp_path / "checkpoints", config)
  with pytest.raises(DataError, match="d.jsonl:7"):
    _loop(tmp_path, [], "--config.trainer.steps=10", learner=learner,
          source=FailingSource([(0, 0)] * 10, at=4))
  assert list(learner.saves) == [4] and learner.saves[4]["data_state"] == {"next_index": 4}
  # before the first step there is nothing to save
  learner = FakeLearner(tmp_path / "other", config)
  with pytest.raises(DataError):
    _loop(tmp_path / "other", [], "--config.trainer.steps=10", learner=learner,
          source=FailingSource([(0, 0)] * 10, at=0))
  assert not learner.saves


@pytest.mark.parametrize("steps, script, logged", [
    (4, [(0, 0)] * 4, [2, 4]),  # the last step is on the schedule: its evaluation is the final one
    (3, [(0, 0)] * 3, [2, 3]),  # off it: the last step evaluates anyway, and once
    (6, [(0, 0)] * 3, [2, 3]),  # the data ran out at step 3: the final evaluation is logged
])
def test_the_final_evaluation_is_a_step_metric_run_once(tmp_path, monkeypatch, steps, script,
                                                        logged):
  calls = []

  def evaluate(run, params):
    calls.append(len(calls))
    return {"eval/accuracy": 0.1 * len(calls)}

  summary, learner, *_ = _loop(tmp_path, script, f"--config.trainer.steps={steps}",
                               "--config.trainer.eval_every=2", evaluate=evaluate)
  # once the final evaluation ran, the save and the export have the generator's memory (the
  # fake refuses to sample from a released copy: the data running out evaluates after it)
  assert learner.released == (steps == len(script))
  rows = [row for row in tiny.metrics(tmp_path) if "eval/accuracy" in row]
  assert [row["step"] for row in rows] == logged and len(calls) == len(logged)
  assert summary.eval_accuracy_after == rows[-1]["eval/accuracy"] == 0.1 * len(calls)
  assert json.loads((tmp_path / "eval_final.json").read_text())["eval/accuracy"] == 0.1 * len(calls)
