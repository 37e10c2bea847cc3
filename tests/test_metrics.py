"""The metrics sink: JSONL lines, TensorBoard events, resume truncation, scalar checks."""

import json
import time

import jax.numpy as jnp
import numpy as np
import pytest

from rlx.config import LoggingConfig
from rlx.metrics import MetricsSink


def _lines(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_and_tensorboard(tmp_path, capsys):
  config = LoggingConfig(progress_bar=False)
  with MetricsSink(tmp_path, config, total_steps=3) as sink:
    for step in (1, 2, 3):
      values = sink.write(step, {"reward/mean": jnp.float32(step / 10), "policy/kl": np.float64(0.5),
                                 "response/tokens": 7, "bad": float("nan")})
  assert values["reward/mean"] == pytest.approx(0.3) and isinstance(values["reward/mean"], float)
  lines = _lines(tmp_path / "metrics.jsonl")
  assert [line["step"] for line in lines] == [1, 2, 3]
  assert lines[0]["response/tokens"] == 7 and lines[0]["bad"] is None  # NaN is written as null
  assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())
  assert "rlx: step 3: reward/mean 0.3  policy/kl 0.5" in capsys.readouterr().out


def test_resume_drops_steps_after_the_checkpoint(tmp_path):
  config = LoggingConfig(progress_bar=False, tensorboard=False)
  with MetricsSink(tmp_path, config) as sink:
    for step in range(1, 6):
      sink.write(step, {"loss": step})
  with MetricsSink(tmp_path, config, resume_step=3) as sink:
    sink.write(4, {"loss": 40})
  assert [(line["step"], line["loss"]) for line in _lines(tmp_path / "metrics.jsonl")] == [
      (1, 1), (2, 2), (3, 3), (4, 40)]


def test_a_fresh_start_drops_what_a_run_without_checkpoint_wrote(tmp_path):
  config = LoggingConfig(progress_bar=False, tensorboard=False)
  with MetricsSink(tmp_path, config) as sink:
    for step in range(1, 5):
      sink.write(step, {"loss": step})
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 5, "lo')  # torn by a kill mid-write
  with MetricsSink(tmp_path, config, resume_step=3) as sink:
    sink.write(4, {"loss": 40})
  assert [line["step"] for line in _lines(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
  with MetricsSink(tmp_path, config) as sink:  # killed before its first checkpoint: start over
    sink.write(1, {"loss": 10})
  assert [(line["step"], line["loss"]) for line in _lines(tmp_path / "metrics.jsonl")] == [(1, 10)]


def test_every_steps_and_quiet_processes(tmp_path):
  with MetricsSink(tmp_path / "a", LoggingConfig(progress_bar=False, tensorboard=False,
                                                 every_steps=2)) as sink:
    for step in range(1, 6):
      sink.write(step, {"loss": 1.0})
  assert [line["step"] for line in _lines(tmp_path / "a" / "metrics.jsonl")] == [2, 4]
  with MetricsSink(tmp_path / "b", LoggingConfig(), write=False) as sink:
    sink.write(1, {"loss": 1.0})
  assert not (tmp_path / "b").exists()


def test_progress_bar_runs(tmp_path):
  with MetricsSink(tmp_path, LoggingConfig(tensorboard=False), total_steps=2) as sink:
    sink.write(1, {"reward/mean": 0.5})
  (line,) = _lines(tmp_path / "metrics.jsonl")
  assert abs(line.pop("time/timestamp") - time.time()) < 60  # when it was written, for plots
  assert line == {"step": 1, "reward/mean": 0.5}


def test_non_scalars_are_refused(tmp_path):
  with MetricsSink(tmp_path, LoggingConfig(progress_bar=False, tensorboard=False)) as sink:
    with pytest.raises(TypeError, match="metrics must be scalars"):
      sink.write(1, {"loss": "high"})


def test_busy_window_follows_the_recent_steps():
  from rlx.metrics import BusyWindow
  window = BusyWindow(window=2)
  # busy all the time for 10 s, then idle: the cumulative fraction drifts, the window drops
  assert window.update(5.0, {"gen": 5.0}) == {"gen": 1.0}
  assert window.update(10.0, {"gen": 10.0}) == {"gen": 1.0}
  assert window.update(15.0, {"gen": 10.0}) == {"gen": pytest.approx(0.5)}
  assert window.update(20.0, {"gen": 10.0}) == {"gen": 0.0}
  assert window.update(25.0, {"gen": 12.5}) == {"gen": pytest.approx(0.25)}


@pytest.mark.parametrize("width", [60, 120])
def test_the_progress_bar_keeps_step_rate_and_eta_and_puts_metrics_below(width):
  import io

  from rich.console import Console

  from rlx.metrics import progress_bar

  bar = progress_bar(Console(file=io.StringIO(), width=width))
  task = bar.add_task("", total=600, completed=0)
  metrics = "  ".join(f"reward/metric_{i} 0.{i}" for i in range(20))  # far wider than a line
  for step in range(1, 4):
    bar.update(task, completed=step, description=metrics)
  screen = Console(file=io.StringIO(), width=width, color_system=None)
  screen.print(bar.get_renderable())  # what the live display draws
  lines = [line for line in screen.file.getvalue().splitlines() if line.strip()]
  assert len(lines) == 2
  assert "3/600" in lines[0] and "s/step" in lines[0] and len(lines[0]) <= width
  assert lines[1].lstrip().startswith("reward/metric_0") and len(lines[1]) <= width


class _FakeWandb:
  """The part of the wandb module rlx uses, recording calls; ``fail`` makes init raise."""

  def __init__(self, fail=None):
    self.fail, self.inits, self.logged, self.finished = fail, [], [], 0

  def init(self, **kwargs):
    if self.fail:
      raise self.fail
    self.inits.append(kwargs)
    return self

  def log(self, values, step):
    self.logged.append((step, values))

  def finish(self):
    self.finished += 1


def test_wandb_gets_every_step_and_a_resumed_run_continues_the_same_one(tmp_path, monkeypatch):
  import sys

  fake = _FakeWandb()
  monkeypatch.setitem(sys.modules, "wandb", fake)
  config = LoggingConfig(progress_bar=False, tensorboard=False, wandb_project="rl")
  with MetricsSink(tmp_path, config, run_name="dapo", run_config={"a": 1}) as sink:
    sink.write(1, {"reward/mean": 0.5})
    sink.write(2, {"reward/mean": 0.75})
  with MetricsSink(tmp_path, config, run_name="dapo", resume_step=2):
    pass
  assert [(s, v["reward/mean"]) for s, v in fake.logged] == [(1, 0.5), (2, 0.75)]
  assert fake.inits[0]["project"] == "rl" and fake.inits[0]["config"] == {"a": 1}
  assert fake.inits[0]["id"] == fake.inits[1]["id"] and fake.inits[0]["resume"] == "allow"
  assert fake.finished == 2


def test_wandb_that_cannot_start_or_is_missing_never_stops_the_run(tmp_path, monkeypatch, capsys):
  import sys

  config = LoggingConfig(progress_bar=False, tensorboard=False, wandb_project="rl")
  monkeypatch.setitem(sys.modules, "wandb", _FakeWandb(fail=RuntimeError("no API key")))
  with MetricsSink(tmp_path, config) as sink:
    sink.write(1, {"reward/mean": 0.5})
  assert "Weights & Biases did not start (RuntimeError: no API key)" in capsys.readouterr().out
  monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
  with MetricsSink(tmp_path / "b", config) as sink:
    sink.write(1, {"reward/mean": 0.5})
  assert "pip install 'rlx[wandb]'" in capsys.readouterr().out
  assert (tmp_path / "b" / "metrics.jsonl").read_text().count("reward/mean") == 1


TENSORBOARD_WITHOUT_TORCH = """
import importlib.util, sys, tempfile
from rlx.config import LoggingConfig
from rlx.metrics import MetricsSink
with MetricsSink(tempfile.mkdtemp(), LoggingConfig(progress_bar=False), total_steps=1) as sink:
  sink.write(1, {"reward/mean": 0.5})
print("found", importlib.util.find_spec("torch") is not None, "torch" in sys.modules)
import tensorboardX  # noqa: F401 - imported already: a later torch import is the user's own
print("found", "torch" in sys.modules)
"""


def test_tensorboard_events_do_not_load_torch(tmp_path):
  """tensorboardX imports torch when it is installed (190 MB of memory for the whole run, for
  tensors rlx never passes): the sink writes its events without it."""
  import subprocess
  import sys
  out = subprocess.run([sys.executable, "-c", TENSORBOARD_WITHOUT_TORCH], capture_output=True,
                       text=True, check=True).stdout
  installed, loaded, after = [word for line in out.splitlines() if line.startswith("found")
                              for word in line.split()[1:]]
  if installed != "True":
    pytest.skip("torch is not installed: nothing to keep out")
  assert loaded == after == "False"
