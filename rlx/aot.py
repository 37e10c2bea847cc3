"""Compiling rlx's programs for a GPU or TPU that is not here: compile-only devices of a target,
and the per-device memory of a deployment's programs as the target's real compiler lays them out.

    devices("h100", 4)                            # compile-only devices (needs the target's plugin)
    deployment_memory(config, "h100", devices=4)  # {"colocated": {...}, "split 2+2": {...}, ...}

The target's jaxlib plugin must be installed at jax's version (``pip install -e ".[aot-cuda]"``
or ``".[aot-tpu]"``), and the process must run with ``JAX_PLATFORMS=cpu``. A compile proves
that a program lowers and what memory it needs per device; it says nothing about speed.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import os
import pathlib

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec

from rlx import hlo_traffic, update
from rlx.config import RunConfig
from rlx.kernels import compiling_for
from rlx.mesh import make_meshes
from rlx.models import Transformer, lora, param_shardings
from rlx.rollout.engine import Engine, _generate_chunk, _generate_one
from rlx.types import RolloutBatch

PLATFORM = {"v5e": "tpu", "v6e": "tpu", "h100": "cuda", "a100": "cuda"}
MEMORY_GIB = {"v5e": 16, "v6e": 32, "h100": 80, "a100": 80}
"""Device memory of each target (HBM)."""
TPU_SHAPES = {1: "1x1", 2: "1x2", 4: "2x2", 8: "2x4"}
PLUGIN = {"tpu": "libtpu", "cuda": "jax_cuda12_plugin"}


class TargetUnavailable(RuntimeError):
  """The target's compiler is not installed in this environment."""


def environment() -> None:
  """Sets what libtpu needs to compile with no TPU and no metadata server (before JAX starts)."""
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("TPU_WORKER_ID", "0")


def devices(target: str, count: int = 1) -> list:
  """Compile-only devices of ``target``; raises TargetUnavailable without its plugin."""
  platform = PLATFORM[target]
  try:
    if platform == "tpu":
      if count not in TPU_SHAPES:
        raise ValueError(f"{target}: compile-only TPU slices of {sorted(TPU_SHAPES)} chips, "
                         f"not {count}")
      shape = TPU_SHAPES[count]
      bounds = (1, 1, 1) if count == 1 else (2, 2, 1) if count >= 4 else (1, 2, 1)
      return list(topologies.get_topology_desc(
          platform="tpu", topology_name=f"{target}:{shape}", chip_config_name="default",
          chips_per_host_bounds=bounds, num_slices=1, wrap=(False, False, False)).devices)
    spec = importlib.resources.files("rlx").joinpath(f"targets/{target}.txtpb").read_text()
    return list(topologies.get_topology_desc(platform="cuda", target_config=spec,
                                             topology=f"1x1x{count}").devices)
  except (RuntimeError, NotImplementedError) as error:
    # what jax says without the plugin: "topology not implemented for cuda", "JAX TPU support
    # not installed"
    if isinstance(error, NotImplementedError) or "not installed" in str(error):
      raise TargetUnavailable(
          f"compiling for {target} needs {PLUGIN[platform]} at jax's version: pip install -e "
          f"'.[aot-{'tpu' if platform == 'tpu' else 'cuda'}]' (and run with JAX_PLATFORMS=cpu)"
      ) from error
    raise


def placed(tree, sharding):
  """Abstract values of ``tree`` with ``sharding`` (one, or a matching tree of them)."""
  if isinstance(sharding, jax.sharding.Sharding):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree,
                      sharding)


def _mib(value) -> float:
  return round(value / 2**20, 1)


def peaks(target: str) -> dict:
  """The target's published peak bf16 FLOP/s, HBM bytes/s and memory, with their source
  (``rlx/targets/peaks.json``)."""
  return json.loads(importlib.resources.files("rlx").joinpath("targets/peaks.json")
                    .read_text())[target]


def cost(compiled) -> dict:
  """What a compiled program moves and computes, per device: XLA's cost analysis (``flops``,
  ``bytes``: what the compiler's model reads and writes, None where the target gives none, as
  XLA:GPU without a GPU), and the memory traffic read from its optimized HLO
  (``rlx.hlo_traffic``): ``hlo_bytes`` with each conditional's costliest branch (as XLA
  counts), ``hlo_bytes_cheapest`` with its cheapest, ``hlo_loop_bytes[_cheapest]`` the part
  inside loops, and the ``top_ops`` that move the most. Without XLA's flops, XLA's generic
  count on the same HLO."""
  analysis = compiled.cost_analysis()
  if isinstance(analysis, (list, tuple)):  # older jax: one dict per program
    analysis = analysis[0] if analysis else {}
  analysis = analysis or {}
  text = compiled.as_text()
  xla_bytes = analysis.get("bytes accessed")
  result = {"flops": float(analysis.get("flops") or hlo_traffic.flops(text) or 0.0),
            "bytes": None if xla_bytes is None else float(xla_bytes),
            "loops": text.count(" while(")}
  module = hlo_traffic.Module(text)  # parsed once, read with either branch
  for branch, suffix in (("costliest", ""), ("cheapest", "_cheapest")):
    ops = module.traffic(branch)
    result["hlo_bytes" + suffix] = float(sum(op.bytes for op in ops))
    result["hlo_loop_bytes" + suffix] = float(sum(op.bytes for op in ops if op.in_loop))
    if branch == "costliest":
      result["top_ops"] = hlo_traffic.largest(ops, 4)
  return result


def compile_one(fn, args, device=None, platform: str | None = None, *,
                with_cost: bool = False) -> dict:
  """Compiles ``fn`` (jitted, or jitted here) on abstract ``args`` (placed on ``device`` when
  given, else already placed); returns the status and per-device memory in MiB (and XLA's
  flops and bytes accessed with ``with_cost``)."""
  if device is not None:
    args = placed(list(args), jax.sharding.SingleDeviceSharding(device))
  jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
  try:
    with compiling_for(platform or "cpu"):
      compiled = jitted.trace(*args).lower().compile()
  except Exception as error:  # noqa: BLE001 - the compiler's verdict is the result
    first = next((line for line in str(error).splitlines() if line.strip()), repr(error))
    return {"status": "failed", "error": first[:300]}
  memory = compiled.memory_analysis()
  result = {"status": "ok", "argument_mib": _mib(memory.argument_size_in_bytes),
            "output_mib": _mib(memory.output_size_in_bytes),
            "temp_mib": _mib(memory.temp_size_in_bytes)}
  if with_cost:
    result.update(cost(compiled))
  return result


def model_arch(config: RunConfig):
  """The architecture a run trains: the checkpoint's (``model.path``), else ``model.arch``."""
  if config.model.path is None:
    return config.model.arch
  from rlx.models import hf

  path = pathlib.Path(config.model.path) / "config.json"
  return hf.arch_from_hf(json.loads(path.read_text()))


def _transformer(config: RunConfig, remat: str) -> Transformer:
  model = config.model
  return Transformer(model_arch(config), jnp.dtype(model.dtype),
                     "reference" if model.attention == "reference" else "fused", remat,
                     lora_scale=model.lora.scale, lora_dropout=model.lora.dropout)


def learner_program(config: RunConfig, mesh, packed_rows: int | None = None):
  """The learner's update step for ``config`` on ``mesh``, at the config's batch and lengths:
  (jitted step, abstract args). The critic's step (PPO) is not included. With LoRA the state
  holds the float32 adapters and the frozen base (``model.param_dtype``) is an argument.
  ``packed_rows``: the step with sequence packing (``trainer.pack_sequences``), each
  micro-batch's sequences in that many rows; None: unpacked (the largest the step gets)."""
  rules = config.mesh.logical_axis_rules
  rows = config.samples_per_step
  rows_sharding = update.batch_sharding(mesh, rules, rows)
  transformer = dataclasses.replace(_transformer(config, config.model.remat),
                                    row_sharding=rows_sharding)
  arch = transformer.arch
  params = placed(jax.eval_shape(lambda: transformer.init(jax.random.key(0),
                                                          jnp.dtype(config.model.param_dtype))),
                  param_shardings(arch, mesh, rules))
  frozen, frozen_shardings = None, None
  lora_config = config.model.lora
  if lora_config.enabled:
    frozen, frozen_shardings = params, jax.tree.map(lambda x: x.sharding, params)
    params = placed(jax.eval_shape(lambda: lora.init_adapters(arch, lora_config,
                                                              jax.random.key(0))),
                    lora.adapter_shardings(arch, lora_config, mesh, rules))
  updates = config.trainer.steps * config.trainer.ppo_epochs * config.trainer.mini_batches
  optimizer, schedule = update.make_optimizer(config.optimizer, total_steps=updates)
  shardings = update.train_state_shardings(params, optimizer)
  state = placed(jax.eval_shape(lambda p: update.TrainState(
      step=jnp.zeros((), jnp.int32), params=p, opt_state=optimizer.init(p),
      key=jax.random.key(0), policy_version=jnp.zeros((), jnp.int32)), params), shardings)
  shape = (rows, config.rollout.max_prompt_len + config.rollout.max_new_tokens)
  floats = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=rows_sharding)
  one_update = (config.trainer.ppo_epochs * config.trainer.mini_batches == 1
                and not config.algorithm.uses_critic)
  batch = RolloutBatch(
      tokens=jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rows_sharding),
      attention_mask=jax.ShapeDtypeStruct(shape, bool, sharding=rows_sharding),
      response_mask=jax.ShapeDtypeStruct(shape, bool, sharding=rows_sharding),
      advantages=floats, old_logprobs=None if one_update else floats,
      behaviour_logprobs=floats,
      policy_version=jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=rows_sharding),
      ref_logprobs=floats if config.algorithm.uses_reference else None,
      temperature=jax.ShapeDtypeStruct((rows,), jnp.float32, sharding=rows_sharding))
  step = update.make_update_step(config, transformer, optimizer, schedule,
                                 state_shardings=shardings, batch_shardings=rows_sharding,
                                 frozen_shardings=frozen_shardings)
  scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))
  packing = None
  if packed_rows is not None:
    updates, micro = config.trainer.ppo_epochs * config.trainer.mini_batches, \
        config.optimizer.micro_batches
    size = rows // config.trainer.mini_batches
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=scalar.sharding)
    packing = update.Packing(row=ints(updates, micro, size // micro),
                             offset=ints(updates, micro, size // micro), rows=packed_rows,
                             order=ints(updates, size))
  # the KL coefficient, the upper clip range, the entropy coefficient, the LoRA base, packing
  return step.jitted, (state, batch, scalar, scalar, scalar, frozen, packing)


def decode_program(config: RunConfig, mesh):
  """The engine's decode chunk for ``config`` on ``mesh`` (every slot, the whole cache):
  (jitted function, abstract args)."""
  r = config.rollout
  transformer = _transformer(config, "none")
  engine = Engine(transformer, max_slots=r.max_slots, max_len=r.max_prompt_len + r.max_new_tokens,
                  max_prompt_len=r.max_prompt_len, mesh=mesh, decode_steps=r.decode_steps,
                  layout=None if r.cache_layout == "auto" else r.cache_layout)
  params = placed(jax.eval_shape(lambda: transformer.init(jax.random.key(0),
                                                          jnp.dtype(config.model.dtype))),
                  param_shardings(transformer.arch, mesh, config.mesh.logical_axis_rules))
  if engine.cache_layout == "per_layer":  # as the weight sync keeps them (decode_params)
    layers = params["layers"]
    count = jax.tree.leaves(layers)[0].shape[0]
    layer = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape[1:], x.dtype, sharding=NamedSharding(mesh, PartitionSpec(*x.sharding.spec[1:]))),
        layers)
    params = dict(params, layers=[layer] * count)
  state = engine.abstract_decode_state()
  if r.decode_steps == 1:
    return _generate_one, (transformer, params, state, engine.max_len, None)
  return _generate_chunk, (transformer, params, state, r.decode_steps, engine.max_len, None)


def deployment_memory(config: RunConfig, target: str, devices_total: int,
                      generation_devices: list[int]) -> dict[str, dict]:
  """Per-device memory (GiB) on ``target`` of colocated and of each split ``g`` +
  ``devices_total - g``, from the learner step and decode chunk compiled for it.

  Colocated devices hold the learner's state throughout, and in turn the learner's temporaries
  or the generation params, cache and temporaries; a split's devices hold one side's.
  """
  platform = PLATFORM[target]
  target_devices = devices(target, devices_total)
  results: dict[str, dict] = {}
  cache: dict[tuple, dict] = {}

  def compiled(kind: str, count: int) -> dict:
    if (kind, count) not in cache:
      mode = dict(mode="colocated") if count == devices_total else dict(
          mode="split", generation_devices=count if kind == "decode" else devices_total - count)
      meshes = make_meshes(dataclasses.replace(config.mesh, **mode), target_devices)
      mesh = meshes.generation if kind == "decode" else meshes.learning
      fn, args = (decode_program if kind == "decode" else learner_program)(config, mesh)
      cache[kind, count] = compile_one(fn, args, platform=platform)
    return cache[kind, count]

  def gib(program: dict, *parts: str) -> float:
    return sum(program[f"{part}_mib"] for part in parts) / 1024

  def entry(name, learn: dict, decode: dict, colocated: bool) -> None:
    failed = [p for p in (learn, decode) if p["status"] != "ok"]
    if failed:
      results[name] = {"status": "failed", "error": failed[0]["error"]}
      return
    if colocated:  # the train state stays while generation runs
      peak = gib(learn, "argument") + max(gib(learn, "temp"), gib(decode, "argument", "temp"))
      per = {"peak_gib": peak}
    else:
      per = {"learning_gib": gib(learn, "argument", "temp"),
             "generation_gib": gib(decode, "argument", "temp")}
      peak = max(per.values())
      per["peak_gib"] = peak
    results[name] = dict(per, status="ok", fits=peak <= 0.9 * MEMORY_GIB[target],
                         memory_gib=MEMORY_GIB[target])

  entry("colocated", compiled("learn", devices_total), compiled("decode", devices_total), True)
  for g in generation_devices:
    entry(f"split {g}+{devices_total - g}", compiled("learn", devices_total - g),
          compiled("decode", g), False)
  return results
