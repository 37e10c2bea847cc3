"""Per-device memory of a deployment compiled for an accelerator that is not here: where the
target's compiler is installed (the aot-cuda / aot-tpu extras); elsewhere, the clear refusal."""

import dataclasses
import importlib.util

import pytest

from rlx import aot
from rlx.config import ArchConfig
from tests.trainer import tiny

HAS_CUDA = importlib.util.find_spec("jax_cuda12_plugin") is not None
HAS_TPU = importlib.util.find_spec("libtpu") is not None


def _wide(config):
  """``config`` on a model whose state dwarfs the tiny batch, with dots wide enough for
  XLA:GPU's tilings (it finds none for the tiny test model's 32-wide dots)."""
  arch = ArchConfig(hidden_size=512, intermediate_size=1024, num_heads=8, num_kv_heads=4,
                    head_dim=64, vocab_size=1024, num_layers=2)
  return dataclasses.replace(config, model=dataclasses.replace(config.model, arch=arch))


@pytest.mark.skipif(HAS_CUDA and HAS_TPU, reason="both compilers are installed")
def test_a_missing_compiler_is_named_with_the_extra_that_installs_it():
  target, extra = ("v5e", "aot-tpu") if not HAS_TPU else ("h100", "aot-cuda")
  with pytest.raises(aot.TargetUnavailable, match=extra):
    aot.devices(target, 1)


@pytest.mark.skipif(not (HAS_CUDA or HAS_TPU), reason="needs jax's cuda12 plugin or libtpu")
def test_each_deployment_of_the_default_config_compiles_and_reports_memory():
  target = "h100" if HAS_CUDA else "v5e"
  memory = aot.deployment_memory(_wide(tiny.config("dapo_split")), target, 2, [1])
  assert set(memory) == {"colocated", "split 1+1"}
  assert all(m["status"] == "ok" and m["fits"] for m in memory.values()), memory
  split = memory["split 1+1"]
  assert split["peak_gib"] == max(split["learning_gib"], split["generation_gib"]) > 0


@pytest.mark.skipif(not (HAS_CUDA or HAS_TPU), reason="needs jax's cuda12 plugin or libtpu")
def test_the_lora_learner_step_compiles_without_the_base_s_state():
  import jax
  import numpy as np

  from rlx.mesh import MESH_AXES
  target = "h100" if HAS_CUDA else "v5e"
  mesh = jax.sharding.Mesh(np.array(aot.devices(target, 1)).reshape(1, 1, 1), MESH_AXES)
  config = _wide(tiny.config("dapo_split"))
  low = dataclasses.replace(config, model=dataclasses.replace(
      config.model, lora=dataclasses.replace(config.model.lora, rank=16)))
  full, adapted = (aot.compile_one(*aot.learner_program(c, mesh), None, aot.PLATFORM[target])
                   for c in (config, low))
  assert full["status"] == adapted["status"] == "ok", (full, adapted)
  # the state (params and Adam's moments) is the step's output: the adapters' is a fraction
  assert adapted["output_mib"] < full["output_mib"] / 3, (full, adapted)


@pytest.mark.skipif(not (HAS_CUDA or HAS_TPU), reason="needs jax's cuda12 plugin or libtpu")
def test_the_packed_learner_step_compiles_smaller():
  import jax
  import numpy as np

  from rlx.mesh import MESH_AXES
  target = "h100" if HAS_CUDA else "v5e"
  mesh = jax.sharding.Mesh(np.array(aot.devices(target, 1)).reshape(1, 1, 1), MESH_AXES)
  config = _wide(tiny.config("dapo_split", "--config.data.prompts_per_step=8",
                             "--config.rollout.max_new_tokens=256"))
  per_micro = config.samples_per_step // config.trainer.mini_batches
  unpacked, packed = (aot.compile_one(*aot.learner_program(config, mesh, rows), None,
                                      aot.PLATFORM[target]) for rows in (None, per_micro // 4))
  assert unpacked["status"] == packed["status"] == "ok", (unpacked, packed)
  # a quarter of the rows: the activations the step holds shrink with them
  assert packed["temp_mib"] < unpacked["temp_mib"] / 2, (unpacked, packed)


def test_fsdp_learner_activations_stay_split_over_the_rows():
  """Over 8 FSDP devices each device computes its own rows, not the whole batch: XLA's
  propagation from the FSDP-sharded weights replicated the activations (SmolLM2-135M, 8 CPU
  devices: 7.5 GB of temporaries per device with remat off; 1.3 GB with the rows kept)."""
  import re

  import jax

  from rlx.mesh import make_meshes
  config = tiny.config("grpo_colocated")
  arch = ArchConfig(hidden_size=96, intermediate_size=160, num_heads=4, num_kv_heads=2,
                    head_dim=24, vocab_size=256, num_layers=2)
  config = dataclasses.replace(
      config, model=dataclasses.replace(config.model, arch=arch, remat="none"),
      mesh=dataclasses.replace(config.mesh, mode="colocated", cpu_devices=8, data=1, fsdp=-1),
      data=dataclasses.replace(config.data, prompts_per_step=4),
      rollout=dataclasses.replace(config.rollout, group_size=4))
  mesh = make_meshes(config.mesh, jax.devices()[:8]).learning
  assert mesh.size == 8
  fn, args = aot.learner_program(config, mesh)
  text = fn.trace(*args).lower().compile().as_text()
  rows, length = config.samples_per_step, config.rollout.max_prompt_len + config.rollout.max_new_tokens
  # activations [rows, T, width]: the MLP's (160 wide) and the residual stream's (96)
  whole = re.findall(rf"f32\[(?:\d+,)?{rows},{length},(?:160|96)\]", text)
  own = re.findall(rf"f32\[(?:\d+,)?{rows // 8},{length},(?:160|96)\]", text)
  assert own and not whole, (len(own), len(whole))


def test_the_update_step_holds_one_new_copy_of_the_state_at_most():
  """The skip of a non-finite step must not keep the new params and moments beside the old
  ones, and its checks must not hold whole trees: compiled for SmolLM2-135M's shapes on the
  CPU (the real recipe's batch, full remat), a select between them took 2.08 GB of
  temporaries (4.0x the params); the step computed again under a conditional 1.52 GB (2.95x);
  with the checks read from one reduction per leaf and the clip a multiplication 1.28 GB
  (2.5x); without reading Adam's new moments (a predicate per element of each) 1.08 GB
  (2.1x: the gradient, the saved layer inputs and the backward pass's own)."""
  import jax

  from rlx.mesh import make_meshes
  arch = ArchConfig(hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3,
                    head_dim=64, vocab_size=49152, num_layers=30, tie_word_embeddings=True)
  config = tiny.config("grpo_colocated", "--config.mesh.cpu_devices=1")
  config = dataclasses.replace(
      config, model=dataclasses.replace(config.model, arch=arch, remat="full"),
      data=dataclasses.replace(config.data, prompts_per_step=4),
      rollout=dataclasses.replace(config.rollout, group_size=8, max_prompt_len=96,
                                  max_new_tokens=32))
  mesh = make_meshes(config.mesh, jax.devices()[:1]).learning
  fn, args = aot.learner_program(config, mesh)
  params_mib = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(args[0].params)) / 2**20
  memory = aot.compile_one(fn, args)
  assert memory["status"] == "ok", memory
  assert memory["temp_mib"] < 2.3 * params_mib, (memory, params_mib)
