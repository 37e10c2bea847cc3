"""Entry point: ``python -m rlx.main --config configs/X.py --workdir DIR [--config.a.b=value ...]``.

Today it validates the config, writes ``DIR/config.json``, builds the meshes,
builds or loads the policy model on the learning mesh, checks one forward pass
and reports what is built and what is not yet (the trainer lands next).
"""

from __future__ import annotations

import os
import pathlib
import sys
import time

from rlx import cli
from rlx.config import ConfigError, RunConfig

NOT_BUILT_YET = (
    "the {mode} trainer loop that wires the rollout engine, rewards and update_step together",
    "weight sync, the data pipeline, rewards, checkpoints and the metrics sink",
)


def write_config(config: RunConfig, workdir: pathlib.Path) -> pathlib.Path:
  """Writes the resolved config to ``workdir/config.json``; keeps a different earlier one aside."""
  workdir.mkdir(parents=True, exist_ok=True)
  path = workdir / "config.json"
  text = cli.to_json(config)
  if path.is_file() and path.read_text() != text:
    previous = workdir / f"config.{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.rename(previous)
    print(f"rlx: {path} held a different config; kept it as {previous.name}")
  path.write_text(text)
  return path


def start_jax(config: RunConfig):
  """Imports and configures JAX: CPU device count, and the multi-process runtime if asked."""
  import jax

  try:
    jax.config.update("jax_num_cpu_devices", config.mesh.cpu_devices)
  except RuntimeError:  # JAX already started in this process: keep the devices it has
    print(f"rlx: JAX was already running; config.mesh.cpu_devices={config.mesh.cpu_devices} "
          "not applied")
  if config.mesh.multihost:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    env = lambda name: int(os.environ[name]) if name in os.environ else None
    jax.distributed.initialize(num_processes=env("JAX_NUM_PROCESSES"),
                               process_id=env("JAX_PROCESS_ID"))
  return jax


def run(config: RunConfig, workdir: pathlib.Path) -> int:
  """Builds what exists of a run and reports it."""
  jax = start_jax(config)  # after parsing, so that a bad command line never waits for JAX
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec

  from rlx import mesh as mesh_lib
  from rlx import models

  lead = jax.process_index() == 0
  say = print if lead else (lambda *args, **kwargs: None)
  if lead:
    say(f"rlx: run {config.name!r}: resolved config written to {write_config(config, workdir)}")
  meshes = mesh_lib.make_meshes(config.mesh)
  say(f"rlx: {jax.device_count()} {jax.default_backend()} devices in {jax.process_count()} "
      f"process(es), mode={config.mesh.mode}")
  say(f"rlx:   learning mesh   {dict(meshes.learning.shape)}")
  say(f"rlx:   generation mesh {dict(meshes.generation.shape)}"
      + (" (same devices, time-sliced)" if meshes.colocated else " (disjoint devices)"))
  started = time.perf_counter()
  model = models.build_model(config.model, meshes.learning, config.mesh.logical_axis_rules)
  arch = model.arch
  count = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(model.params))
  source = config.model.path or f"built-in {arch.family} (random init, seed {config.model.seed})"
  say(f"rlx: model {source}: {arch.num_layers} layers, hidden {arch.hidden_size}, "
      f"{arch.num_heads}/{arch.num_kv_heads} q/kv heads, vocab {arch.vocab_size}, "
      f"{count / 1e6:.2f}M params ({config.model.param_dtype}), "
      f"ready in {time.perf_counter() - started:.1f}s")
  if config.model.path and (pathlib.Path(config.model.path) / "tokenizer.json").is_file():
    tokenizer = models.load_tokenizer(config.model.path)
    if tokenizer.vocab_size > arch.vocab_size:  # JAX would clamp the extra ids silently
      raise models.CheckpointError(
          f"{config.model.path}: the tokenizer has {tokenizer.vocab_size} tokens but the model's "
          f"vocab_size is {arch.vocab_size}; the tokenizer belongs to another model")
    say(f"rlx: tokenizer: {tokenizer.vocab_size} tokens, eos ids {list(tokenizer.eos_ids)}, "
        f"chat template {'yes' if tokenizer.chat_template else 'no'}")
  batch = NamedSharding(meshes.learning, PartitionSpec(("data", "fsdp")))
  probe_shape = (meshes.learning.size, 8)
  probe = jax.make_array_from_callback(
      probe_shape, batch, lambda index: np.zeros(probe_shape, np.int32)[index])
  logits = model(probe)
  finite = jax.jit(lambda x: jnp.isfinite(x).all(),
                   out_shardings=NamedSharding(meshes.learning, PartitionSpec()))(logits)
  finite = bool(finite)
  say(f"rlx: forward pass on a probe batch {probe_shape} -> logits {logits.shape}, "
      f"{'finite' if finite else 'NOT FINITE'}")
  say("rlx: not built yet, so no training ran:")
  for item in NOT_BUILT_YET:
    say(f"rlx:   - {item.format(mode=config.mesh.mode)}")
  return 0 if finite else 1


def main(argv: list[str] | None = None) -> int:
  try:
    invocation = cli.parse_args(sys.argv[1:] if argv is None else argv)
    if invocation is None:
      return 0
    return run(invocation.config, invocation.workdir)
  except ConfigError as error:
    return cli.main_error(error)
  except ValueError as error:  # CheckpointError and other refusals with a message for the user
    print(f"rlx: error: {error}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
