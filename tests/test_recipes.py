"""The real-model recipes: their settings are the peers' published ones, and their learner
step and decode trace at the real models' shapes on the recipe's mesh of 8 devices (here 8
CPU devices; where the CUDA or TPU compiler is installed, they compile for it too)."""

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys

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


def _target_for(name: str) -> str | None:
  """The smallest installed target with the memory the recipe's docstring asks for ("Hardware:
  8 accelerators of N GB or more"), so that the compile checks that claim; None: none here."""
  doc = importlib.import_module(f"rlx.configs.{name}").__doc__
  needed = int(re.search(r"Hardware: 8 accelerators of (\d+) GB", doc).group(1))
  installed = (["v5e", "v6e"] if importlib.util.find_spec("libtpu") else []) + (
      ["a100", "h100"] if importlib.util.find_spec("jax_cuda12_plugin") else [])
  fitting = [t for t in installed if aot.peaks(t)["hbm_gib"] >= needed]
  return min(fitting, key=lambda t: aot.peaks(t)["hbm_gib"], default=None)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_compiles_for_its_accelerator(name):
  target = _target_for(name)
  if target is None:
    pytest.skip("needs the TPU or CUDA compiler of an accelerator with the recipe's memory: "
                "pip install -e '.[aot-tpu]' / '.[aot-cuda]'")
  config = _recipe(name)
  memory = aot.deployment_memory(config, target, 8, [config.mesh.generation_devices]
                                 if config.mesh.mode == "split" else [])
  assert all(entry["status"] == "ok" for entry in memory.values()), (target, memory)


def test_a_newcomer_runs_a_recipe_on_a_local_checkpoint(tmp_path):
  """The README's path from a fresh clone: a recipe, a locally saved Qwen2-architecture model
  (the tests' tiny one) and a GSM8K-format file, with the recipe's sizes overridden to fit a
  CPU. The untrained model earns no reward, so the not-learning warning fires too."""
  for split, count in (("train", 16), ("test", 4)):
    rows = [{"question": f"What is {a} + {a}?",
             "answer": f"{a} and {a} make {2 * a}.\n#### {2 * a}"} for a in range(count)]
    (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  result = subprocess.run(
      [sys.executable, "-m", "rlx.main", "--config", "configs/qwen25_math_grpo.py", "--workdir",
       str(tmp_path / "run"), "--config.model.path=tests/fixtures/hf/qwen2",
       f"--config.data.source={tmp_path / 'train.jsonl'}",
       f"--config.data.eval_source={tmp_path / 'test.jsonl'}",
       "--config.model.dtype=float32", "--config.mesh.cpu_devices=2",
       "--config.rollout.max_new_tokens=8", "--config.rollout.max_prompt_len=128",
       "--config.rollout.max_slots=8", "--config.rollout.group_size=2",
       "--config.data.prompts_per_step=2", "--config.trainer.steps=1",
       "--config.trainer.eval_prompts=1", "--config.trainer.eval_samples=0",
       "--config.trainer.mini_batches=1", "--config.reward.num_workers=0",
       "--config.logging.warn_after_steps=1", "--config.logging.progress_bar=false",
       "--config.logging.tensorboard=false", "--config.checkpoint.async_save=false",
       f"--config.trainer.compile_cache={os.environ.get('RLX_TEST_COMPILE_CACHE', '')}"],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
  assert "held-out accuracy: before RL" in result.stdout
  assert "rlx: warning: for a step, every group's samples got the same reward" \
      in result.stdout
  final = tmp_path / "run" / "hf" / "final"
  assert (final / "config.json").is_file() and (final / "tokenizer.json").is_file()
  assert json.loads((final / "config.json").read_text())["model_type"] == "qwen2"
