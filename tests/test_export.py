"""``python -m rlx.export``: a run's checkpoint as a Hugging Face directory, equal to what
the run itself exported; and the run's config.json read back."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from rlx import cli

ROOT = pathlib.Path(__file__).parent.parent


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "configs").glob("*.py")
                                        if not p.stem.startswith("_")))
def test_config_json_reads_back_as_the_same_config(name):
  config = cli.load_config_file(str(ROOT / "configs" / f"{name}.py"))
  assert cli.config_from_json(json.loads(cli.to_json(config))) == config


def _python(*args):
  return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=600)


def check_export(workdir: pathlib.Path, scratch: pathlib.Path) -> None:
  """``rlx.export`` on a finished run of 2 steps with a checkpoint at each (the training is
  shared with ``test_config``'s run of the default config): any step, the newest by default
  (equal to the run's own final export), clear errors."""
  first = _python("-m", "rlx.export", str(workdir), "--step", "1", "--out", str(scratch / "one"))
  assert first.returncode == 0, first.stderr[-3000:]
  newest = _python("-m", "rlx.export", str(workdir))
  assert newest.returncode == 0, newest.stderr[-3000:]
  assert f"step 2 (policy version 2) of {workdir} -> {workdir / 'hf' / 'step_2'}" in newest.stdout
  weights = lambda d: load_file(str(d / "model.safetensors"))
  final, two, one = (weights(workdir / "hf" / "final"), weights(workdir / "hf" / "step_2"),
                     weights(scratch / "one"))
  assert final.keys() == two.keys() == one.keys()
  for key in final:
    np.testing.assert_array_equal(two[key], final[key])
  assert any(not np.array_equal(one[key], two[key]) for key in final)  # step 1 is another policy
  assert (scratch / "one" / "tokenizer.json").exists()

  missing = _python("-m", "rlx.export", str(workdir), "--step", "7")
  assert missing.returncode == 2 and "no checkpoint of step 7" in missing.stderr
  assert "steps 1, 2" in missing.stderr
  nowhere = _python("-m", "rlx.export", str(scratch / "nothing"))
  assert nowhere.returncode == 2 and "config.json does not exist" in nowhere.stderr
