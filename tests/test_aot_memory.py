"""Per-device memory of a deployment compiled for an accelerator that is not here: where the
target's compiler is installed (the aot-cuda / aot-tpu extras); elsewhere, the clear refusal."""

import importlib.util

import pytest

from rlx import aot
from tests.trainer import tiny

HAS_CUDA = importlib.util.find_spec("jax_cuda12_plugin") is not None
HAS_TPU = importlib.util.find_spec("libtpu") is not None


@pytest.mark.skipif(HAS_CUDA and HAS_TPU, reason="both compilers are installed")
def test_a_missing_compiler_is_named_with_the_extra_that_installs_it():
  target, extra = ("v5e", "aot-tpu") if not HAS_TPU else ("h100", "aot-cuda")
  with pytest.raises(aot.TargetUnavailable, match=extra):
    aot.devices(target, 1)


@pytest.mark.skipif(not (HAS_CUDA or HAS_TPU), reason="needs jax's cuda12 plugin or libtpu")
def test_each_deployment_of_a_tiny_config_compiles_and_reports_memory():
  target = "h100" if HAS_CUDA else "v5e"
  config = tiny.config("dapo_split")
  memory = aot.deployment_memory(config, target, 4, [2])
  assert set(memory) == {"colocated", "split 2+2"}
  assert all(m["status"] == "ok" and m["fits"] for m in memory.values()), memory
  assert memory["split 2+2"]["peak_gib"] == max(memory["split 2+2"]["learning_gib"],
                                                memory["split 2+2"]["generation_gib"])
