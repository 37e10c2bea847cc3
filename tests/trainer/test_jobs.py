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

import numpy as np
import pytest

from rlx.rollout import Completion
from rlx.trainer.common import Draw
from rlx.trainer.exchange import RolloutFiles, decode, encode
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
  return Draw(completions, rng.random(n).astype(np.float32), rng.random(n) > 0.5,
              {"reward/mean": 0.25, "rollout/draws": 2}, 1.5, {"epoch": 1, "position": [3, 4]})


def test_rollout_files_round_trip_and_are_written_whole(tmp_path):
  rng = np.random.default_rng(0)
  draw = _draw(rng)
  back, extra = decode(encode(draw, {"index": 7}))
  assert extra == {"index": 7}
  assert back.completions == draw.completions
  np.testing.assert_array_equal(back.rewards, draw.rewards)
  np.testing.assert_array_equal(back.correct, draw.correct)
  assert (back.counts, back.generate_seconds, back.data_state) == (draw.counts, 1.5, draw.data_state)

  files = RolloutFiles(tmp_path)
  (tmp_path / ".00000002.rollout.123.partial").write_bytes(b"half")  # a killed writer's
  files.write(0, draw)
  files.write(1, _draw(rng))
  assert files.pending() == [0, 1]  # hidden names are never read
  assert files.remove_partial() == 1
  files.finish(0, draw.data_state)
  assert files.pending() == [1] and files.progress() == {"done": 1, "data_state": draw.data_state}
  assert files.expire_below(2) == 1 and files.pending() == []


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


def test_learner_and_generator_jobs_with_a_generator_restart(tmp_path):
  steps = 8
  # an entropy floor no policy reaches: the learner's controller raises the sampling
  # temperature every 2 steps, and the generator job follows it through control.json
  control = ("--config.algorithm.entropy_floor=100", "--config.mesh.control_window=2")
  learner = _start("learner", tmp_path, f"--config.trainer.steps={steps}", *control)
  generator = _start("generator", tmp_path, *control)
  processes = [learner, generator]
  try:
    deadline = time.monotonic() + 180
    while _steps(tmp_path) < 3:
      assert time.monotonic() < deadline and learner.poll() is None, learner.stdout.read()
      time.sleep(0.2)
    os.killpg(generator.pid, signal.SIGKILL)  # mid-run, maybe mid-write
    generator.wait(timeout=30)
    generator = _start("generator", tmp_path, *control)
    processes.append(generator)
    learner_out, _ = learner.communicate(timeout=240)
    generator_out, _ = generator.communicate(timeout=60)  # exits when the learner is done
  finally:
    for p in processes:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
  assert learner.returncode == 0, learner_out
  assert generator.returncode == 0, generator_out
  assert "rlx: generator: resuming at rollout" in generator_out
  rows = tiny.metrics(tmp_path)
  assert [row["step"] for row in rows] == list(range(1, steps + 1))
  # every batch trained exactly once, in order: none generated twice or lost
  assert [row["rollout/index"] for row in rows] == list(range(steps))
  assert [row["data/prompts_drawn"] for row in rows] == [2 * (i + 1) for i in range(steps)]
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
  assert versions == [steps - 2, steps - 1, steps]  # k + 2 kept


def test_roles_need_split_and_orbax():
  from rlx.config import ConfigError, check

  with pytest.raises(ConfigError, match="config.mesh.weight_sync: must be 'orbax'"):
    check(tiny.config("dapo_split", "--config.mesh.role=learner"))
  with pytest.raises(ConfigError, match="config.mesh.role: 'generator' is one side of a split"):
    check(tiny.config("grpo_colocated", "--config.mesh.role=generator",
                      "--config.mesh.weight_sync=orbax"))
