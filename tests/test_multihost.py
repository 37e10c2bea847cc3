"""rlx.main as two processes joined by jax.distributed (CPU collectives over gloo), colocated:
each process samples its share of the prompts on its own device, one SPMD update follows, and
the run equals one process with both devices."""

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from tests.trainer import tiny

# several processes with their own ports and cores: one such test at a time (pytest -n)
pytestmark = pytest.mark.xdist_group("processes")

ROOT = pathlib.Path(__file__).parent.parent
# entropy_coef: gradients (and so metrics that move) even before the tiny model earns rewards
COMMON = (*tiny.OVERRIDES, "--config.trainer.steps=2", "--config.trainer.warmup_sft_steps=0",
          "--config.algorithm.entropy_coef=0.05", "--config.trainer.mini_batches=2",
          "--config.reward.num_workers=1")


def _run(command: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
  """Runs ``command`` in its own process group, killed whole if it outlives ``timeout``: a
  failing multi-process run fails the test, never hangs it."""
  process = subprocess.Popen(command, cwd=ROOT, env=tiny.this_python_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
  try:
    out, err = process.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(process.pid, signal.SIGKILL)
    out, err = process.communicate()
    pytest.fail(f"{' '.join(command[:4])} ran past {timeout}s:\n{out[-3000:]}\n{err[-3000:]}")
  return subprocess.CompletedProcess(command, process.returncode, out, err)


def test_two_processes_train_like_one_process_with_two_devices(tmp_path):
  two = _run(["bash", "launch/local.sh", "--processes", "2", "--config", "configs/grpo_colocated.py",
              "--workdir", str(tmp_path / "two"), *COMMON, "--config.mesh.cpu_devices=1",
              "--config.mesh.check_agreement=true"])
  assert two.returncode == 0, two.stdout + two.stderr
  assert "2 cpu devices in 2 process(es)" in two.stdout
  assert two.stdout.count("held-out accuracy: before RL") == 1  # only process 0 reports
  one = _run([sys.executable, "-m", "rlx.main", "--config", "configs/grpo_colocated.py",
              "--workdir", str(tmp_path / "one"), *COMMON, "--config.mesh.cpu_devices=2"])
  assert one.returncode == 0, one.stdout + one.stderr
  assert json.loads((tmp_path / "two" / "config.json").read_text())["mesh"]["multihost"] is True
  rows = {name: tiny.metrics(tmp_path / name) for name in ("one", "two")}
  assert [row["step"] for row in rows["two"]] == [1, 2]
  assert rows["two"][-1]["policy/kl"] > 0 and rows["two"][-1]["policy/ratio_max"] != 1
  for ours, theirs in zip(rows["two"], rows["one"]):
    for name, value in theirs.items():
      if not name.startswith(("time/", "throughput/")):
        assert ours[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    # throughput counts both processes' samples (rate x seconds = the whole batch's rows)
    samples = [row["throughput/samples_per_s"] * row["time/step_s"] for row in (ours, theirs)]
    assert samples[0] == pytest.approx(samples[1]) == pytest.approx(2 * 2), samples
  assert (tmp_path / "two" / "checkpoints" / "2").is_dir()


def test_split_across_processes_is_refused_clearly(tmp_path):
  result = _run(["bash", "launch/local.sh", "--processes", "2", "--config", "configs/dapo_split.py",
                 "--workdir", str(tmp_path), *COMMON, "--config.mesh.cpu_devices=2"], timeout=120)
  assert result.returncode == 2, result.stdout + result.stderr
  assert result.stderr.count("a split run spans one process for now") == 2
  assert "Traceback" not in result.stderr
