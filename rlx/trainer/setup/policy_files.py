"""A policy's files: a model in Hugging Face format or LoRA adapters in the PEFT format, each
written whole or not at all, and the adapters a LoRA run starts from.

    write_policy(config, model, trainable, tokenizer, directory, base=base, merged=True)
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import shutil

import jax

from rlx.config import RunConfig
from rlx.models import Model, Tokenizer, lora, save_pretrained


def save_hf(model: Model, tokenizer: Tokenizer, directory: pathlib.Path) -> pathlib.Path:
  """Writes ``model`` and ``tokenizer`` in Hugging Face format under a temporary name and
  renames it to ``directory`` when complete, so that a kill mid-write never leaves a
  half-written model where a later start would load it."""
  return _written_whole(directory, tokenizer, functools.partial(save_pretrained, model))


def save_adapter(adapters, arch, lora_config, tokenizer: Tokenizer, directory: pathlib.Path,
                 base_path: str | None = None) -> pathlib.Path:
  """Writes LoRA ``adapters`` in the PEFT format, with the tokenizer, as ``save_hf`` writes a
  model (whole or not at all)."""
  return _written_whole(directory, tokenizer, functools.partial(
      lora.save_peft, adapters, arch, lora_config, base_path=base_path))


def _written_whole(directory: pathlib.Path, tokenizer: Tokenizer, write) -> pathlib.Path:
  """``write(path)`` and the tokenizer into a temporary directory, renamed to ``directory``."""
  partial = directory.with_name(directory.name + ".partial")
  if jax.process_index() == 0 and partial.exists():
    shutil.rmtree(partial)
  write(partial)
  if jax.process_index() == 0:
    tokenizer.save_pretrained(partial)
    if directory.exists():
      shutil.rmtree(directory)
    partial.rename(directory)
  return directory


def write_policy(config: RunConfig, model: Model, trainable, tokenizer, directory: pathlib.Path,
                 *, base=None, merged: bool = False) -> list[pathlib.Path]:
  """Writes a policy in Hugging Face format: ``trainable`` as ``model``'s params, or with LoRA
  (``base`` given) the adapters ``trainable`` as a PEFT adapter in ``directory`` and, when
  ``merged``, merged into ``base`` as a whole model in ``directory`` + ``_merged``."""
  if base is None:
    return [save_hf(dataclasses.replace(model, params=trainable), tokenizer, directory)]
  lora_config = config.model.lora
  written = [save_adapter(trainable, model.arch, lora_config, tokenizer, directory,
                          base_path=config.model.path)]
  if merged:
    params = jax.jit(functools.partial(lora.merge, scale=lora_config.scale))(base, trainable)
    written.append(save_hf(dataclasses.replace(model, params=params), tokenizer,
                           directory.with_name(directory.name + "_merged")))
  return written


def initial_adapters(config: RunConfig, model: Model, mesh):
  """The LoRA adapters a run starts from, on the learning ``mesh``: read from the PEFT
  directory ``model.lora.path``, or fresh (A random, B zero: the policy starts as the base)."""
  lora_config, rules = config.model.lora, config.mesh.logical_axis_rules
  shardings = lora.adapter_shardings(model.arch, lora_config, mesh, rules)
  if lora_config.path:
    return lora.load_peft(lora_config.path, model.arch, lora_config, shardings)
  init = functools.partial(lora.init_adapters, model.arch, lora_config)
  return jax.jit(init, out_shardings=shardings)(
      jax.random.fold_in(jax.random.key(config.trainer.seed), 0x10a))
