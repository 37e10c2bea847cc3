"""The real-model recipes: their settings are the peers' published ones, and their learner
step and decode trace at the real models' shapes on the recipe's mesh of 8 devices (here 8
CPU devices; where the CUDA or TPU compiler is installed, they compile for it too)."""

import dataclasses
import importlib.util

import jax
import pytest

from rlx import aot, cli
from rlx.mesh import make_meshes
from tests.trainer.tiny import ROOT

RECIPES = ["qwen25_math_grpo", "qwen25_math_dapo", "qwen3_math", "qwen25_code_grpo"]


def _recipe(name):
  config = cli.load_config_file(str(ROOT / "configs" / f"{name}.py"))
  # the checkpoint is not here: its architecture, as the recipe records it
  return dataclasses.replace(config, model=dataclasses.replace(config.model, path=None))


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_settings_are_a_real_model_s(name):
  config = cli.load_config_file(str(ROOT / "configs" / f"{name}.py"))
  assert config.model.path and config.model.dtype == "bfloat16"
  assert config.optimizer.learning_rate <= 2e-6
  assert 512 <= config.rollout.max_new_tokens <= 4096 and 8 <= config.rollout.group_size <= 16
  assert config.trainer.warmup_sft_steps == 0 and config.model.arch.vocab_size == 151936
  assert config.data.source.endswith(".jsonl")


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_programs_trace_at_the_real_shapes(name):
  config = _recipe(name)
  meshes = make_meshes(config.mesh, jax.devices()[:8])
  for program, mesh in ((aot.learner_program, meshes.learning),
                        (aot.decode_program, meshes.generation)):
    fn, args = program(config, mesh)
    assert fn.trace(*args).lower().as_text()  # both are jitted: shapes and shardings agree


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None
                    and importlib.util.find_spec("jax_cuda12_plugin") is None,
                    reason="needs the TPU or CUDA compiler: pip install -e '.[aot-tpu]' / '.[aot-cuda]'")
@pytest.mark.parametrize("name", RECIPES)
def test_recipe_compiles_for_its_accelerator(name):
  target = "v5e" if importlib.util.find_spec("libtpu") else "h100"
  config = _recipe(name)
  memory = aot.deployment_memory(config, target, 8, [config.mesh.generation_devices]
                                 if config.mesh.mode == "split" else [])
  assert all(entry["status"] == "ok" for entry in memory.values()), memory
