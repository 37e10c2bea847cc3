"""A run's checkpoint as a Hugging Face directory.

    python -m rlx.export WORKDIR [--step N] [--out DIR]

Reads ``WORKDIR/config.json`` (the run's resolved config) and the checkpoint of step ``N``
(default: the newest) under ``WORKDIR/checkpoints``, and writes the policy's weights, config
and tokenizer to ``DIR`` (default ``WORKDIR/hf/step_N``), which ``transformers``,
``python -m rlx.serve --model`` and ``model.path`` load. A finished run has already written
its final policy to ``WORKDIR/hf/final``; this is for any other step, and for runs that were
stopped. Runs on CPU; the checkpoint is read whole into one process. A LoRA run's checkpoint
is written as a PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``), and
with ``--merged`` also merged into its base as a whole model (``DIR_merged``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

from rlx.config import ConfigError


def export(workdir: str | pathlib.Path, step: int | None = None,
           out: str | pathlib.Path | None = None, say=print,
           merged: bool = False) -> pathlib.Path:
  """Writes checkpoint ``step`` (None: the newest) of the run in ``workdir`` as a Hugging
  Face directory; returns it (with LoRA: the PEFT adapter, and with ``merged`` the merged
  model beside it, ``DIR_merged``, which is returned). Raises ``ConfigError`` naming what is
  missing."""
  from rlx import cli  # noqa: PLC0415 - after argument checks, before JAX starts

  workdir = pathlib.Path(workdir)
  config_file = workdir / "config.json"
  if not config_file.is_file():
    raise ConfigError(f"{config_file} does not exist: WORKDIR must be the --workdir of a run")
  config = cli.config_from_json(json.loads(config_file.read_text()))
  # one process, the whole model on its devices: whatever mesh the run trained on
  config = dataclasses.replace(config, mesh=dataclasses.replace(
      config.mesh, multihost=False, mode="colocated", role="both"))
  from rlx.main import start_jax  # noqa: PLC0415

  jax = start_jax(dataclasses.replace(config, trainer=dataclasses.replace(
      config.trainer, compile_cache="")))
  from rlx import update  # noqa: PLC0415
  from rlx.checkpoint import Checkpointer  # noqa: PLC0415
  from rlx.models.tokenizer import builtin_tokenizer, load_tokenizer  # noqa: PLC0415
  from rlx.mesh import make_meshes  # noqa: PLC0415
  from rlx.models import build_model  # noqa: PLC0415
  from rlx.trainer.setup.policy_files import initial_adapters, write_policy  # noqa: PLC0415
  from rlx.trainer.setup.run import base_reference  # noqa: PLC0415
  from rlx.trainer.setup.warmup import warms_up  # noqa: PLC0415

  checkpointer = Checkpointer(workdir / "checkpoints", config.checkpoint)
  steps = checkpointer.all_steps()
  if not steps:
    raise ConfigError(f"{workdir / 'checkpoints'} holds no checkpoint")
  if step is not None and step not in steps:
    raise ConfigError(f"no checkpoint of step {step} in {workdir / 'checkpoints'}; it holds "
                      f"steps {', '.join(map(str, steps))}")
  meshes = make_meshes(config.mesh)
  lora_config = config.model.lora
  model_config = config.model
  if lora_config.enabled and warms_up(config):  # the adapters sit on the warmed-up base
    model_config = dataclasses.replace(config.model, path=str(workdir / "warmup"))
  model = build_model(model_config, meshes.learning, config.mesh.logical_axis_rules)
  tokenizer = load_tokenizer(config.model.path) if config.model.path else builtin_tokenizer()
  updates = config.trainer.steps * config.trainer.ppo_epochs * config.trainer.mini_batches
  optimizer, _ = update.make_optimizer(config.optimizer, total_steps=updates)
  trainable = (initial_adapters(dataclasses.replace(config, model=dataclasses.replace(
      config.model, lora=dataclasses.replace(lora_config, path=None))), model, meshes.learning)
               if lora_config.enabled else model.params)
  like = update.init_train_state(trainable, optimizer, jax.random.key(0))
  restored = checkpointer.restore(like, step=step if step is not None else steps[-1], say=say)
  checkpointer.close()
  target = pathlib.Path(out) if out else workdir / "hf" / f"step_{restored.step}"
  base = None
  if lora_config.enabled:
    base = model.params
    saved = restored.meta.get("lora_base") or {}
    reference = base_reference(config, workdir)
    if merged and saved.get("fingerprint") not in (None, reference["fingerprint"]):
      raise ConfigError(f"the checkpoint's adapters were trained on {saved.get('path')} "
                        f"(fingerprint {saved.get('fingerprint')}), but {reference['path']} is "
                        f"now {reference['fingerprint']}: the merged model would be wrong")
  written = write_policy(config, model, restored.state.params, tokenizer, target, base=base,
                         merged=merged)
  say(f"rlx: export: step {restored.step} (policy version "
      f"{restored.meta.get('policy_version', '?')}) of {workdir} -> "
      f"{', '.join(map(str, written))}")
  return written[-1]


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m rlx.export",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("workdir", help="the --workdir of a run")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
  parser.add_argument("--out", default=None, help="output directory (default WORKDIR/hf/step_N)")
  parser.add_argument("--merged", action="store_true",
                      help="LoRA runs: also write the adapters merged into the base (DIR_merged)")
  args = parser.parse_args(argv)
  try:
    export(args.workdir, args.step, args.out, merged=args.merged)
  except ConfigError as error:
    print(f"rlx: export: {error}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
