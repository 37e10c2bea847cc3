"""The ahead-of-time compile check for real hardware, at one small shape: runs where the TPU
compiler (libtpu, the ``aot-tpu`` extra) is installed, and is skipped elsewhere (CI)."""

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.trainer.tiny import ROOT


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="needs libtpu: pip install -e '.[aot-tpu]'")
def test_the_pallas_loss_compiles_for_a_v5e():
  result = subprocess.run(
      [sys.executable, "benchmarks/aot_compile.py", "--target", "v5e", "--tokens", "512",
       "--only", "qwen2.5-0.5b/T=512/pallas"], capture_output=True, text=True, timeout=900,
      cwd=ROOT)
  assert result.returncode == 0, result.stderr[-2000:]
  report = json.loads(result.stdout)
  assert report["failed"] == 0 and len(report["programs"]) == 2, report
