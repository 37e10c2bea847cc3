"""Faults a real run meets: a stop signal sent to the whole process group, an unreadable newest
checkpoint, a run killed before its first checkpoint, finite data, non-finite updates."""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
import types

import pytest

from rlx.checkpoint import CheckpointError
from rlx.trainer import NonFiniteError, train
from tests.trainer import tiny

QUIET = {"say": lambda message: None}


def _command(name, workdir, *overrides):
  return [sys.executable, "-m", "rlx.main", "--config", f"configs/{name}.py",
          "--workdir", str(workdir), *tiny.OVERRIDES,
          "--config.algorithm.dynamic_sampling=false", *overrides]


def _steps(workdir) -> list[int]:
  path = pathlib.Path(workdir) / "metrics.jsonl"
  if not path.exists():
    return []
  return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("name, sig", [("grpo_colocated", signal.SIGTERM),
                                       ("dapo_split", signal.SIGINT)])
def test_a_stop_signal_to_the_process_group_saves_exits_75_and_the_rerun_finishes(
    tmp_path, name, sig):
  steps = 50  # a tiny step takes about 0.1 s: the signal lands mid-run
  command = _command(name, tmp_path, f"--config.trainer.steps={steps}",
                     "--config.checkpoint.every_steps=0", "--config.reward.num_workers=2")
  process = subprocess.Popen(command, cwd=tiny.ROOT, start_new_session=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    deadline = time.monotonic() + 300
    while len(_steps(tmp_path)) < 2 and process.poll() is None and time.monotonic() < deadline:
      time.sleep(0.2)
    assert process.poll() is None, process.communicate()[0]
    os.killpg(process.pid, sig)  # as a terminal's Ctrl-C or a scheduler does: every process
    signalled = time.monotonic()
    output, _ = process.communicate(timeout=120)
  finally:
    if process.poll() is None:
      os.killpg(process.pid, signal.SIGKILL)
  assert process.returncode == 75, output  # stopped and saved: a scheduler requeues on it
  assert time.monotonic() - signalled < 60, "a stop must take seconds, not minutes"
  assert f"stopped by {sig.name}" in output and "Traceback" not in output, output
  stopped_at = _steps(tmp_path)[-1]
  assert stopped_at < steps, output
  assert f"checkpoint saved at step {stopped_at}" in output, output
  assert (tmp_path / "checkpoints" / str(stopped_at)).is_dir()
  rerun = subprocess.run(command, cwd=tiny.ROOT, capture_output=True, text=True, timeout=600)
  assert rerun.returncode == 0, rerun.stdout + rerun.stderr
  assert f"resumed from {tmp_path / 'checkpoints'} at step {stopped_at}" in rerun.stdout
  assert _steps(tmp_path) == list(range(1, steps + 1))  # every step exactly once
  # the summary counts this process's steps, and the baseline the first start measured
  assert (f"steps {stopped_at + 1}..{steps} ({steps - stopped_at} after resuming at step "
          f"{stopped_at}) in") in rerun.stdout, rerun.stdout
  assert "held-out accuracy: before RL" in rerun.stdout and "n/a" not in rerun.stdout


def test_sigterm_during_start_up_exits_75_with_one_line(tmp_path):
  # it exited -15 in silence: a scheduler could not tell a preemption from a crash
  command = _command("grpo_colocated", tmp_path, "--config.trainer.warmup_sft_steps=200")
  process = subprocess.Popen(command, cwd=tiny.ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
  try:
    assert "resolved config written" in process.stdout.readline()
    time.sleep(1.0)  # starting JAX, building the run
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
  finally:
    if process.poll() is None:
      process.kill()
  assert process.returncode == 75, (out, err)
  # the start-up's exception ends it, or, swallowed where it landed (a garbage-collector
  # callback), the recorded signal stops the loop before it trains: one line either way
  assert ("SIGTERM before training started" in err
          or "SIGTERM during start-up: stopping before training" in out), (out, err)
  assert "Traceback" not in err, err


def test_a_start_up_stop_swallowed_by_a_callback_prints_no_traceback(monkeypatch):
  from rlx import cli
  from rlx import main as entry

  seen = []
  monkeypatch.setattr(entry, "_unraisable_before", seen.append)
  swallowed = types.SimpleNamespace(exc_value=cli.StoppedAtStart())
  entry._quiet_unraisable(swallowed)
  assert seen == [swallowed]  # not recorded: not ours to drop
  cli.stop_at_start("SIGTERM")
  try:
    entry._quiet_unraisable(swallowed)
    entry._quiet_unraisable(types.SimpleNamespace(exc_value=KeyboardInterrupt()))
    assert seen == [swallowed]
    other = types.SimpleNamespace(exc_value=ValueError("a real one"))
    entry._quiet_unraisable(other)
    assert seen == [swallowed, other]
  finally:
    assert cli.take_stop_at_start() == "SIGTERM"


def test_the_newest_checkpoint_unreadable_resumes_from_the_previous_one(tmp_path):
  config = tiny.config("grpo_colocated", "--config.trainer.steps=3",
                       "--config.checkpoint.every_steps=1")
  train(config, tmp_path, **QUIET)
  checkpoints = tmp_path / "checkpoints"
  assert sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()) == [1, 2, 3]
  # truncate every file of the newest checkpoint's state
  for file in (checkpoints / "3" / "state").rglob("*"):
    if file.is_file():
      file.write_bytes(file.read_bytes()[: file.stat().st_size // 3])
  (checkpoints / "2" / "data").mkdir(exist_ok=True)
  shutil.rmtree(checkpoints / "2")
  (checkpoints / "2").mkdir()  # an empty step directory
  said = []
  config = tiny.config("grpo_colocated", "--config.trainer.steps=4",
                       "--config.checkpoint.every_steps=1")
  summary = train(config, tmp_path, say=said.append)
  assert summary.steps == 4
  assert any("resumed from" in line and "at step 1" in line for line in said), said
  moved = [line for line in said if "does not read back" in line]
  assert len(moved) == 2, said
  assert len(list((tmp_path / "checkpoints.unreadable").iterdir())) == 2  # kept, not deleted
  assert _steps(tmp_path) == [1, 2, 3, 4]


def test_no_readable_checkpoint_is_refused_naming_the_directory(tmp_path):
  config = tiny.config("grpo_colocated", "--config.trainer.steps=1")
  train(config, tmp_path, **QUIET)
  for file in (tmp_path / "checkpoints" / "1" / "state").rglob("*"):
    if file.is_file():
      file.unlink()
  with pytest.raises(CheckpointError, match=f"no checkpoint in {tmp_path / 'checkpoints'}"):
    train(tiny.config("grpo_colocated", "--config.trainer.steps=2"), tmp_path, **QUIET)


def test_finite_data_ends_cleanly_with_a_final_checkpoint(tmp_path):
  rows = [{"prompt": f"Sort the digits: {i}{i + 1}", "answer": f"{i}{i + 1}"} for i in range(6)]
  data = tmp_path / "rows.jsonl"
  data.write_text("".join(json.dumps(row) + "\n" for row in rows))
  config = tiny.config("grpo_colocated", "--config.trainer.steps=50",
                       f"--config.data.source={data}", "--config.data.num_epochs=1",
                       "--config.reward.name=sort", "--config.checkpoint.export_hf_every=2",
                       # every row is trained on; the built-in model warms up on a data file
                       # only when asked
                       "--config.trainer.eval_prompts=0", "--config.trainer.warmup_sft=always")
  # a warm-up save that a kill cut short is never loaded: it is redone
  (tmp_path / "run" / "warmup.partial").mkdir(parents=True)
  (tmp_path / "run" / "warmup.partial" / "config.json").write_text("{")
  said = []
  summary = train(config, tmp_path / "run", say=said.append)
  assert summary.steps == 3  # 6 rows, 2 prompts a step
  assert any("the data ran out after 1 epoch(s), at step 3" in line for line in said), said
  assert (tmp_path / "run" / "checkpoints" / "3").is_dir()
  assert (tmp_path / "run" / "hf" / "step_2" / "model.safetensors").is_file()
  assert (tmp_path / "run" / "warmup" / "config.json").is_file()
  assert not (tmp_path / "run" / "warmup.partial").exists()


def _poison_rewards(monkeypatch) -> None:
  """Every sampled reward NaN: every update is skipped as non-finite."""
  from rlx.trainer.learn import learner

  real = learner.sample_arrays

  def poisoned(*args, **kwargs):
    sampled, stats = real(*args, **kwargs)
    return sampled.replace(rewards=sampled.rewards * float("nan")), stats

  monkeypatch.setattr(learner, "sample_arrays", poisoned)


def test_non_finite_updates_are_skipped_then_stop_the_run(tmp_path, monkeypatch):
  _poison_rewards(monkeypatch)
  config = tiny.config("grpo_colocated", "--config.trainer.steps=10",
                       "--config.trainer.max_skipped_steps=3")
  with pytest.raises(NonFiniteError, match="3 updates in a row were skipped, non-finite .*the advantages are not finite"):
    train(config, tmp_path, **QUIET)
  rows = tiny.metrics(tmp_path)
  assert [row["train/skipped_steps"] for row in rows] == [1, 2]


def test_a_resume_continues_the_count_of_skipped_updates(tmp_path, monkeypatch):
  """A rerun of a run whose updates were being skipped does not start a fresh streak: its
  checkpoints carry the count, so two skips before the stop and one after make three."""
  _poison_rewards(monkeypatch)
  first = tiny.config("grpo_colocated", "--config.trainer.steps=2",
                      "--config.trainer.max_skipped_steps=3", "--config.checkpoint.every_steps=1")
  train(first, tmp_path, **QUIET)
  rerun = tiny.config("grpo_colocated", "--config.trainer.steps=6",
                      "--config.trainer.max_skipped_steps=3", "--config.checkpoint.every_steps=1")
  with pytest.raises(NonFiniteError, match="3 updates in a row were skipped"):
    train(rerun, tmp_path, **QUIET)
  # the rerun's first step is the third skip in a row: it stops there, before its metrics row
  rows = tiny.metrics(tmp_path)
  assert [(row["step"], row["train/skipped_steps"]) for row in rows] == [(1, 1), (2, 2)]


def test_a_stop_signal_swallowed_during_start_up_stops_the_run_before_it_trains(tmp_path):
  # a Ctrl-C one second into start-up raised its KeyboardInterrupt inside JAX's garbage-collector
  # callback, which only printed it: the run trained on as if nothing had come
  from rlx import cli

  cli.stop_at_start("SIGINT")  # what main's start-up handler records before raising
  # (no warm-up: a warm-up ends at its next step, tests/trainer/test_warmup_until.py)
  summary = train(tiny.config("grpo_colocated", "--config.trainer.steps=20",
                              "--config.trainer.warmup_sft=never"), tmp_path, **QUIET)
  assert summary.stopped
  assert _steps(tmp_path) == []  # the loop's first agreement on stopping comes before a step
  assert cli.take_stop_at_start() is None  # taken once


def test_a_checkpoint_write_that_fails_stops_the_run_before_it_trains_again(tmp_path,
                                                                           monkeypatch):
  # on a full disk an agent run trained one more step after its save had failed (the async
  # write's error surfaced only at the next save)
  import errno

  import orbax.checkpoint as ocp

  written = []
  real_save = ocp.CheckpointManager.save

  def save(self, step, *args, **kwargs):
    written.append(step)
    return real_save(self, step, *args, **kwargs)

  def check_for_errors(self):
    if written and written[-1] >= 2:  # the write of step 2 failed in the background
      raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(ocp.CheckpointManager, "save", save)
  monkeypatch.setattr(ocp.CheckpointManager, "check_for_errors", check_for_errors)
  config = tiny.config("grpo_colocated", "--config.trainer.steps=6",
                       "--config.checkpoint.every_steps=1")
  with pytest.raises(CheckpointError, match="No space left on device"):
    train(config, tmp_path, **QUIET)
  assert _steps(tmp_path) == [1, 2]  # nothing trained after the failed save of step 2
