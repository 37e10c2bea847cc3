"""A split run as two jobs (mesh.role=learner / generator) sharing only the workdir: rollout
files round-trip exactly, staleness stays bounded, and a generator killed mid-run and
restarted resumes without duplicating or losing a batch."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from rlx.models import lora
from rlx.rollout import Completion
from rlx.trainer.draw import Draw
from rlx.trainer.deploy.exchange import RolloutFiles
from rlx.trainer.draw import decode, encode
from tests.trainer import tiny

# several processes with their own ports and cores: one such test at a time (pytest -n)
pytestmark = pytest.mark.xdist_group("processes")

ROOT = pathlib.Path(__file__).parents[2]


def _draw(rng, n=4):
  completions = [Completion(prompt_tokens=rng.integers(0, 99, rng.integers(1, 6)).tolist(),
                            response_tokens=rng.integers(0, 99, rng.integers(0, 5)).tolist(),
                            logprobs=[], policy_logprobs=[], finish_reason=rng.choice(["stop", "length"]),
                            policy_version=int(rng.integers(0, 9)), prompt_index=i // 2,
                            sample_index=i % 2) for i in range(n)]
  for c in completions:
    c.logprobs[:] = rng.normal(size=len(c.response_tokens)).astype(np.float32).tolist()
    c.policy_logprobs[:] = rng.normal(size=len(c.response_tokens)).astype(np.float32).tolist()
  return Draw(completions=completions, rewards=rng.random(n).astype(np.float32),
              correct=rng.random(n) > 0.5, counts={"reward/mean": 0.25, "rollout/draws": 2},
              generate_seconds=1.5, data_state={"epoch": 1, "position": [3, 4]})


def test_rollout_files_round_trip_and_are_written_whole(tmp_path):
  rng = np.random.default_rng(0)
  draw = _draw(rng)
  back, extra = decode(encode(draw, {"index": 7}))
  assert extra == {"index": 7}
  assert back.completions == draw.completions
  np.testing.assert_array_equal(back.rewards, draw.rewards)
  np.testing.assert_array_equal(back.correct, draw.correct)
  assert (back.counts, back.generate_seconds, back.data_state) == (draw.counts, 1.5, draw.data_state)
  # multi-turn episodes keep their sampled-token masks and turn counts
  for c in draw.completions:
    c.sampled_mask = (rng.random(len(c.response_tokens)) > 0.3).tolist()
    c.turns = int(rng.integers(1, 4))
  assert decode(encode(draw))[0].completions == draw.completions

  files = RolloutFiles(tmp_path)
  (tmp_path / ".00000002.rollout.123.partial").write_bytes(b"half")  # a killed writer's
  files.write(0, draw)
  files.write(1, _draw(rng))
  assert files.pending() == [0, 1]  # hidden names are never read
  assert files.remove_partial() == 1
  files.finish(0, draw.data_state)
  assert files.pending() == [1] and files.progress() == {"done": 1, "data_state": draw.data_state,
                                                         "data_states": {}}
  assert files.resume_state(0) == draw.data_state
  assert files.expire_below(2) == 1 and files.pending() == []


def test_several_generator_jobs_resume_from_their_own_batches(tmp_path):
  rng = np.random.default_rng(1)
  files = RolloutFiles(tmp_path, generators=2)
  assert [i for i in range(6) if files.mine(i, 1)] == [1, 3, 5]
  draws = [_draw(rng) for _ in range(3)]
  for i, draw in enumerate(draws):
    draw.data_state = {"next_index": 10 * i}
    files.write(i, draw)
  # a killed writer of job 1 left batch 3 half-written: only job 1 removes it
  (tmp_path / ".00000003.rollout.99.partial").write_bytes(b"half")
  assert files.remove_partial(0) == 0 and files.remove_partial(1) == 1
  files.finish(0, draws[0].data_state)
  files.finish(1, draws[1].data_state)
  assert files.resume_state(0) == {"next_index": 0} and files.resume_state(1) == {"next_index": 10}
  assert files.progress()["done"] == 2 and files.pending() == [2]


def _start(role: str, workdir: pathlib.Path, *overrides: str) -> subprocess.Popen:
  return subprocess.Popen(
      [sys.executable, "-m", "rlx.main", "--config", "configs/dapo_split.py", "--workdir",
       str(workdir), *tiny.OVERRIDES, "--config.mesh.cpu_devices=1", f"--config.mesh.role={role}",
       "--config.mesh.weight_sync=orbax", "--config.algorithm.dynamic_sampling=false",
       "--config.trainer.warmup_sft_steps=0", "--config.mesh.max_staleness=1", *overrides],
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      start_new_session=True)


def _steps(workdir: pathlib.Path) -> int:
  path = workdir / "metrics.jsonl"
  return len(path.read_text().splitlines()) if path.is_file() else 0


def _wait_for_steps(learner: subprocess.Popen, workdir: pathlib.Path, count: int, *,
                    timeout_s: float) -> None:
  """Until the learner job has logged ``count`` steps; fails with its output if it ends first
  or the time runs out."""
  deadline = time.monotonic() + timeout_s
  while _steps(workdir) < count:
    assert time.monotonic() < deadline and learner.poll() is None, learner.stdout.read()
    time.sleep(0.2)


def test_a_learner_job_and_two_generator_jobs_with_a_generator_restart(tmp_path):
  steps = 8
  # an entropy floor no policy reaches: the learner's controller raises the sampling
  # temperature every 2 steps, and the generator jobs follow it through control.json
  control = ("--config.algorithm.entropy_floor=100", "--config.mesh.control_window=2",
             "--config.mesh.generators=2")
  learner = _start("learner", tmp_path, f"--config.trainer.steps={steps}", *control)
  generators = [_start("generator", tmp_path, *control, f"--config.mesh.generator_id={g}")
                for g in (0, 1)]
  processes = [learner, *generators]
  try:
    _wait_for_steps(learner, tmp_path, 3, timeout_s=180)
    os.killpg(generators[1].pid, signal.SIGKILL)  # mid-run, maybe mid-write
    generators[1].wait(timeout=30)
    generators[1] = _start("generator", tmp_path, *control, "--config.mesh.generator_id=1")
    processes.append(generators[1])
    learner_out, _ = learner.communicate(timeout=240)
    # each exits when the learner is done
    outputs = [generator.communicate(timeout=60)[0] for generator in generators]
  finally:
    for p in processes:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
  assert learner.returncode == 0, learner_out
  assert [generator.returncode for generator in generators] == [0, 0], outputs
  assert "rlx: generator 1: resuming at rollout" in outputs[1]
  rows = tiny.metrics(tmp_path)
  assert [row["step"] for row in rows] == list(range(1, steps + 1))
  # every batch trained exactly once, in order, job g writing batches g, g + 2, ...: none
  # generated twice or lost
  assert [row["rollout/index"] for row in rows] == list(range(steps))
  assert [row["rollout/generator"] for row in rows] == [0, 1] * (steps // 2)
  # each job's prompts in order, none repeated or skipped, across the restart too
  for g in (0, 1):
    drawn = [row["data/prompts_drawn"] for row in rows if row["rollout/generator"] == g]
    assert drawn == [2 * (i + 1) for i in range(steps // 2)], (g, drawn)
  assert max(row["rollout/policy_lag_max"] for row in rows) <= 1
  assert any(row["rollout/policy_lag_max"] == 1 for row in rows)  # the jobs did overlap
  assert rows[-1]["time/sync_s"] > 0 and rows[-1]["time/generator_sync_s"] > 0
  settings = [row["control/temperature"] for row in rows]
  assert settings == sorted(settings) and settings[-1] == 1.5, settings
  sampled = [row["rollout/temperature"] for row in rows]
  assert sampled[0] == 1.0 and max(sampled) > 1.0, sampled  # the generator job followed
  # a batch is sampled at a setting the learner had already made (it lags by the queue)
  assert all(s <= t for s, t in zip(sampled, settings)), (sampled, settings)
  rollouts = tmp_path / "rollouts"
  assert not list(rollouts.glob(".*")) and (rollouts / "DONE").is_file()
  assert json.loads((rollouts / "progress.json").read_text())["done"] == steps
  versions = sorted(int(p.name) for p in (tmp_path / "policy_versions").iterdir() if p.name.isdigit())
  assert versions == [steps - 3, steps - 2, steps - 1, steps]  # k + 3 kept


def test_a_streaming_generator_job_killed_mid_stream_resumes(tmp_path):
  """A generator job with continuous admission (its gate the learner's progress on disk, its
  weights the newest Orbax version between decode chunks), killed mid-run and restarted: the
  learner trains every batch once, in order, within the bound, and the batches carry the
  stream's own measures."""
  steps, stream = 6, ("--config.mesh.admission=continuous", "--config.mesh.max_staleness=2")
  learner = _start("learner", tmp_path, f"--config.trainer.steps={steps}", *stream)
  generator = _start("generator", tmp_path, *stream)
  processes = [learner, generator]
  try:
    _wait_for_steps(learner, tmp_path, 2, timeout_s=180)
    os.killpg(generator.pid, signal.SIGKILL)
    generator.wait(timeout=30)
    generator = _start("generator", tmp_path, *stream)
    processes.append(generator)
    learner_out, _ = learner.communicate(timeout=240)
    output, _ = generator.communicate(timeout=60)
  finally:
    for p in processes:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
  assert learner.returncode == 0, learner_out
  assert generator.returncode == 0, output
  assert "rlx: generator: resuming at rollout" in output
  rows = tiny.metrics(tmp_path)
  assert [row["step"] for row in rows] == list(range(1, steps + 1))
  assert [row["rollout/index"] for row in rows] == list(range(steps))
  assert max(row["rollout/policy_lag_max"] for row in rows) <= 2
  assert all("rollout/slot_occupancy" in row and "rollout/groups_in_flight" in row
             for row in rows)


# with delta versions, the launch scripts' sync; Orbax versions' discard is
# tests/test_sync.py's, and the other job tests kill and resume with Orbax versions
@pytest.mark.parametrize("weight_sync", ["delta"])
def test_two_jobs_killed_after_step_5_resume_from_3_without_the_dead_runs_versions(
    tmp_path, weight_sync):
  steps, overrides = 8, ("--config.trainer.steps=8", "--config.checkpoint.every_steps=3",
                         f"--config.mesh.weight_sync={weight_sync}")
  processes = [_start("learner", tmp_path, *overrides), _start("generator", tmp_path, *overrides)]
  try:
    deadline = time.monotonic() + 240
    while _steps(tmp_path) < 5:
      assert time.monotonic() < deadline and processes[0].poll() is None
      time.sleep(0.1)
    for p in processes:  # both at once, as a lost node would
      os.killpg(p.pid, signal.SIGKILL)
    for p in processes:
      p.wait(timeout=30)
    dead = sorted(int(p.name) for p in (tmp_path / "policy_versions").iterdir()
                  if p.name.isdigit())
    # the dead run published past its checkpoint (step 3); a learner job writes each version
    # in the background, so version 5 may not have reached storage when it was killed
    assert max(dead) >= 4
    processes += [_start("learner", tmp_path, *overrides), _start("generator", tmp_path,
                                                                    *overrides)]
    learner_out, _ = processes[2].communicate(timeout=300)
    generator_out, _ = processes[3].communicate(timeout=60)
  finally:
    for p in processes:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
  assert processes[2].returncode == 0 and processes[3].returncode == 0, learner_out
  assert "resumed from" in learner_out and "at step 3" in learner_out, learner_out
  assert "policy version(s) from 3 on aside" in learner_out, learner_out
  rows = tiny.metrics(tmp_path)
  assert [row["step"] for row in rows] == list(range(1, steps + 1))
  # no trained batch was sampled with a version newer than the learner's (a dead run's)
  assert all(row["rollout/policy_lag_mean"] >= 0 for row in rows), rows
  assert all(0 <= row["rollout/policy_lag_max"] <= 1 for row in rows), rows  # max_staleness


def test_roles_need_split_and_orbax():
  from rlx.config import ConfigError, check

  with pytest.raises(ConfigError, match="config.mesh.weight_sync: must be 'delta' or 'orbax'"):
    check(tiny.config("dapo_split", "--config.mesh.role=learner"))
  with pytest.raises(ConfigError, match="config.mesh.role: 'generator' is one side of a split"):
    check(tiny.config("grpo_colocated", "--config.mesh.role=generator",
                      "--config.mesh.weight_sync=orbax"))
  with pytest.raises(ConfigError, match="config.mesh.generators: counts generator jobs"):
    check(tiny.config("dapo_split", "--config.mesh.generators=2"))
  with pytest.raises(ConfigError, match="config.mesh.generator_id: must be in 0 .. "):
    tiny.config("dapo_split", "--config.mesh.generators=2", "--config.mesh.generator_id=2")


def test_a_generator_killed_without_a_word_stops_the_learner_naming_it(tmp_path):
  learner = _start("learner", tmp_path, "--config.trainer.steps=50")
  generator = _start("generator", tmp_path)
  try:
    _wait_for_steps(learner, tmp_path, 1, timeout_s=240)
    os.killpg(generator.pid, signal.SIGKILL)
    killed = time.monotonic()
    out, _ = learner.communicate(timeout=90)
    assert time.monotonic() - killed < 60, out
  finally:
    for p in (learner, generator):
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
  assert learner.returncode == 1, out
  assert "the generator job died without a word" in out, out
  status = json.loads((tmp_path / "jobs" / "learner-0.json").read_text())
  assert status["state"] == "failed" and "generator job died" in status["error"]


def test_a_generator_whose_reward_never_returns_stops_the_learner_naming_the_hang(tmp_path):
  """Its heartbeat thread keeps beating; its progress (decode chunks, rewards scored) stops."""
  hang = ("--config.reward.num_workers=0", "--config.reward.name=tests.trainer.toy_rewards:"
          "hangs_after_a_batch", "--config.mesh.job_timeout_s=8")
  learner = _start("learner", tmp_path, "--config.trainer.steps=20", *hang)
  generator = _start("generator", tmp_path, *hang)
  try:
    out, _ = learner.communicate(timeout=240)
  finally:
    for p in (learner, generator):
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
  assert learner.returncode == 1, out
  assert "the generator job hangs: it has got nothing done for" in out, out
  # each of its threads' stage: the generating thread's, and the scorer's in the reward call
  assert "while the main thread: sampling and scoring rollout 2" in out, out
  assert "rlx-scorer: scoring the rewards of" in out and "kill -USR1" in out, out
  assert _steps(tmp_path) == 2, out  # the two batches it delivered were trained on


def test_a_failing_generator_job_stops_the_launcher_with_its_status(tmp_path):
  """The generator raises (dynamic sampling finds no usable group: every reward is alike);
  the learner stops naming its error, and launch/local.sh returns with a failing status."""
  started = time.monotonic()
  launcher = subprocess.run(
      ["bash", "launch/local.sh", "--learner", "1", "--generator", "1", "--config",
       "configs/dapo_split.py", "--workdir", str(tmp_path), *tiny.OVERRIDES,
       "--config.mesh.cpu_devices=1", "--config.trainer.warmup_sft_steps=0",
       "--config.trainer.eval_prompts=0", "--config.reward.name=tests.trainer.toy_rewards:constant",
       "--config.algorithm.dynamic_sampling_max_draws=1", "--config.trainer.steps=5"],
      cwd=ROOT, capture_output=True, text=True, timeout=300, env=tiny.this_python_env())
  out = launcher.stdout + launcher.stderr
  assert launcher.returncode != 0, out
  assert "dynamic sampling kept 0 of 2 groups" in out, out
  failed = json.loads((tmp_path / "jobs" / "generator-0.json").read_text())
  assert failed["state"] == "failed" and "DynamicSamplingError" in failed["error"]
  assert time.monotonic() - started < 240, out


def _status(state="running", host="here", pid=1, beat=100.0, error=None):
  return {"state": state, "host": host, "pid": pid, "heartbeat": beat, "error": error}


def test_a_peer_counts_as_gone_when_failed_killed_silent_or_never_started():
  from rlx.trainer.deploy.jobstatus import DEAD_GRACE_S, silent_or_failed

  def verdict(status, now=100.0, since=0.0, alive=True):
    return silent_or_failed("the generator job", status, now=now, since=since, timeout_s=60,
                            host="here", alive=lambda pid: alive)

  assert verdict(_status()) is None
  assert "failed: DynamicSamplingError: no group" in verdict(
      _status("failed", error="DynamicSamplingError: no group"))
  # killed on this host: its process is gone; a restart gets DEAD_GRACE_S to take its place
  assert verdict(_status(), now=100 + DEAD_GRACE_S - 1, alive=False) is None
  assert "died without a word" in verdict(_status(), now=100 + DEAD_GRACE_S + 1, alive=False)
  # on another host only the heartbeat tells
  assert verdict(_status(host="elsewhere"), now=150, alive=False) is None
  assert "silent for 61s" in verdict(_status(host="elsewhere"), now=161)
  assert verdict(None, now=59) is None and "has not started" in verdict(None, now=61)
  assert verdict(_status("finished"), now=1000) is None
  assert verdict(_status("stopped"), now=150) is None
  assert "stopped 100s ago" in verdict(_status("stopped"), now=200)
  # beating, but nothing done past the timeout: hung, unless it waits on its peer
  stuck = dict(_status(beat=100.0), doing="sampling and scoring rollout 3", progress_at=39.0,
               waiting_on=None)
  assert "hangs: it has got nothing done for 61s while sampling and scoring rollout 3" in (
      verdict(stuck))
  assert verdict(dict(stuck, progress_at=41.0)) is None
  assert verdict(dict(stuck, waiting_on="the learner job")) is None


def test_a_job_status_file_says_running_then_how_the_job_ended(tmp_path):
  from rlx.trainer.deploy.jobstatus import JobStatus, read_status

  with JobStatus(tmp_path, "generator", 1):
    assert read_status(tmp_path, "generator", 1)["state"] == "running"
    assert read_status(tmp_path, "generator", 0) is None
  assert read_status(tmp_path, "generator", 1)["state"] == "finished"
  with pytest.raises(ValueError):
    with JobStatus(tmp_path, "learner"):
      raise ValueError("config.x: bad\nmore detail")
  ended = read_status(tmp_path, "learner", 0)
  assert ended["state"] == "failed" and ended["error"] == "ValueError: config.x: bad"
  with JobStatus(tmp_path, "learner") as status:
    status.stopped = True
  assert read_status(tmp_path, "learner", 0)["state"] == "stopped"


def test_a_job_status_file_carries_the_job_s_progress(tmp_path, monkeypatch):
  from rlx import compilation, progress
  from rlx.trainer.deploy import jobstatus

  monkeypatch.setattr(jobstatus, "HEARTBEAT_S", 0.05)
  with jobstatus.JobStatus(tmp_path, "generator"):
    progress.doing("sampling rollout 7")
    time.sleep(0.3)
    status = jobstatus.read_status(tmp_path, "generator")
    assert status["doing"] == "sampling rollout 7" and status["waiting_on"] is None
    assert status["heartbeat"] - status["progress_at"] > 0.1  # beats on, no progress
    ticks = status["ticks"]
    progress.tick()
    progress.waiting("the learner job")
    time.sleep(0.2)
    status = jobstatus.read_status(tmp_path, "generator")
    assert status["ticks"] == ticks + 1 and status["waiting_on"] == "the learner job"
    monkeypatch.setattr(compilation, "compiling", lambda: "jit_update_step")
    time.sleep(0.2)
    status = jobstatus.read_status(tmp_path, "generator")  # a compile in flight is progress
    assert status["heartbeat"] - status["progress_at"] < 0.1
    assert status["doing"] == "sampling rollout 7 (compiling jit_update_step)"


def test_lora_jobs_ship_adapter_versions_onto_the_learner_s_warmed_up_base(tmp_path):
  """A generator job of a warmed-up LoRA run merges the adapters into the learner's warm-up
  (it loads it once the first version is out): the engine and the learner agree at step 1."""
  overrides = ("--config.trainer.steps=3", "--config.model.lora.rank=4",
               "--config.trainer.warmup_sft_steps=3", "--config.algorithm.entropy_coef=0.05")
  processes = [_start("learner", tmp_path, *overrides), _start("generator", tmp_path, *overrides)]
  try:
    outputs = [p.communicate(timeout=300)[0] for p in processes]
  finally:
    for p in processes:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
  assert [p.returncode for p in processes] == [0, 0], outputs
  rows = tiny.metrics(tmp_path)
  assert rows[0]["rollout/mismatch_kl"] < 1e-6  # sampled with the learner's very weights
  # a version is the adapters: their tree alone, and the bytes they hold
  version = next(p for p in (tmp_path / "policy_versions").iterdir() if p.name.isdigit())
  stored = json.loads((version / "default" / "_METADATA").read_text())["tree_metadata"]
  assert stored and all("_lora_" in name for name in stored), sorted(stored)
  config = tiny.config("dapo_split", *overrides)
  adapters = jax.eval_shape(lambda: lora.init_adapters(config.model.arch, config.model.lora,
                                                       jax.random.key(0)))
  assert rows[0]["sync/bytes"] == lora.nbytes(adapters)
  assert json.loads((tmp_path / "lora_base.json").read_text())["path"] == str(tmp_path / "warmup")


def test_the_launcher_names_the_role_and_the_signal_of_a_dead_process():
  # it said only "process 26218 exited with status 137"
  script = ('source launch/wait_all.sh; (sleep 0.2; kill -9 $BASHPID) & p=$!; '
            'RLX_ROLES[$p]="the generator 0"; sleep 30 & q=$!; wait_all $p $q')
  result = subprocess.run(["bash", "-c", script], cwd=tiny.ROOT, capture_output=True, text=True,
                          timeout=60)
  assert result.returncode == 137
  assert "rlx launch: the generator 0 (pid " in result.stderr
  assert "was killed: SIGKILL; stopping the others" in result.stderr
