"""``Model``: params plus how to run them, with Hugging Face loading and saving.

    model = rlx.models.from_pretrained("path/to/Qwen2.5-0.5B", dtype="bfloat16", mesh=mesh)
    logits = model(tokens)                     # int [B, T] -> float32 [B, T, V]
    rlx.models.save_pretrained(model, "out/")  # transformers loads it back unchanged
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh

from rlx import mesh as mesh_lib
from rlx.config import ArchConfig, MeshConfig, ModelConfig
from rlx.models import hf
from rlx.models.safetensors_io import CheckpointError, read_json, write_safetensors
from rlx.models.transformer import Params, Transformer, logical_axes, param_shapes

DEFAULT_RULES = MeshConfig().logical_axis_rules


@struct.dataclass
class Model:
  """A transformer's parameters with the (static) description of how to run them.

  A pytree: ``params`` are its leaves, so a ``Model`` passes through ``jit``.
  """

  params: Params
  transformer: Transformer = struct.field(pytree_node=False)

  @property
  def arch(self) -> ArchConfig:
    return self.transformer.arch

  def __call__(self, tokens: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Float32 logits [B, T, V] of int tokens [B, T] (mask: True on real tokens)."""
    return _logits(self, jnp.asarray(tokens), None if mask is None else jnp.asarray(mask))

  def hidden_states(self, tokens: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Final hidden states [B, T, D]."""
    return self.transformer.hidden_states(self.params, tokens, mask)[0]


@jax.jit
def _logits(model: Model, tokens, mask):
  return model.transformer(model.params, tokens, mask)[0]


def param_shardings(arch: ArchConfig, mesh: Mesh | None, rules=DEFAULT_RULES) -> Any:
  """The ``NamedSharding`` of every parameter on ``mesh`` (one device when None)."""
  mesh = mesh_lib.single_device_mesh() if mesh is None else mesh
  return mesh_lib.logical_shardings(logical_axes(arch), param_shapes(arch), mesh, rules)


def _transformer(arch: ArchConfig, dtype: Any, attention: str = "fused", remat: str = "none"):
  return Transformer(arch, jnp.dtype(dtype), "reference" if attention == "reference" else "fused",
                     remat)


def init_model(arch: ArchConfig, key: jax.Array, *, dtype: Any = "float32", param_dtype: Any = None,
               mesh: Mesh | None = None, rules=DEFAULT_RULES, attention: str = "fused",
               remat: str = "none") -> Model:
  """A model with random weights, created directly in its sharding on ``mesh``."""
  param_dtype = jnp.dtype(dtype if param_dtype is None else param_dtype)
  params = _initializer(arch, param_dtype, mesh, tuple(map(tuple, rules)))(key)
  return Model(params, _transformer(arch, dtype, attention, remat))


@functools.lru_cache(maxsize=32)
def _initializer(arch: ArchConfig, param_dtype, mesh: Mesh | None, rules):
  """The jitted initializer of one architecture and layout (compiled once, not per model)."""
  shardings = param_shardings(arch, mesh, rules)
  return jax.jit(lambda k: Transformer(arch).init(k, param_dtype), out_shardings=shardings)


def from_pretrained(path: str | pathlib.Path, *, dtype: Any = "float32", param_dtype: Any = None,
                    mesh: Mesh | None = None, rules=DEFAULT_RULES, attention: str = "fused",
                    remat: str = "none") -> Model:
  """Loads a Hugging Face model directory (config.json + safetensors, single or sharded).

  Every tensor goes straight from the memory-mapped file into its sharding on
  ``mesh`` (one device when None). Raises ``CheckpointError`` for an unknown
  architecture, a missing tensor or a shape that disagrees with config.json.
  """
  directory = pathlib.Path(path)
  config_file = directory / "config.json"
  if not config_file.is_file():
    if not directory.exists() and len(directory.parts) == 2 and not str(path).startswith(("/", ".")):
      raise CheckpointError(
          f"{path} is not a directory here; rlx reads models from disk only. If it is a Hugging "
          f"Face hub id, download it first (`huggingface-cli download {path} --local-dir "
          f"models/{directory.name}`) and pass that directory")
    raise CheckpointError(f"{directory} has no config.json; is it a Hugging Face model directory?")
  config = read_json(config_file)
  try:
    arch = hf.arch_from_hf(config)
  except (KeyError, TypeError, AttributeError) as error:
    raise CheckpointError(f"{config_file} lacks or garbles a field rlx needs ({type(error).__name__}"
                          f": {error}); the download is incomplete or the file was damaged: "
                          "fetch the model again") from None
  param_dtype = jnp.dtype(dtype if param_dtype is None else param_dtype)
  params = hf.load_params(directory, arch, param_dtype, param_shardings(arch, mesh, rules))
  return Model(params, _transformer(arch, dtype, attention, remat))


def save_pretrained(model: Model, path: str | pathlib.Path, *, dtype: Any = None,
                    max_shard_bytes: int = 4 << 30) -> pathlib.Path:
  """Writes ``config.json`` and safetensors that ``transformers`` loads as the same model.

  ``dtype`` defaults to the dtype of the parameters. Files above
  ``max_shard_bytes`` are split, with a ``model.safetensors.index.json``. With
  several processes, every process calls it (the tensors are gathered) and
  process 0 writes.
  """
  directory = pathlib.Path(path)
  writer = jax.process_index() == 0
  dtype = jnp.dtype(jax.tree.leaves(model.params)[0].dtype if dtype is None else dtype)
  config = json.dumps(hf.arch_to_hf(model.arch, dtype.name), indent=2)
  if writer:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(config)
  write_safetensors(directory, hf.hf_tensors(model.params, model.arch, dtype), max_shard_bytes,
                    write=writer)
  return directory


def build_model(config: ModelConfig, mesh: Mesh | None = None, rules=DEFAULT_RULES) -> Model:
  """The policy model a ``ModelConfig`` asks for: loaded from ``path`` or built from ``arch``
  (with LoRA: the base, its transformer set to run adapters at ``lora``'s scale)."""
  options = dict(dtype=config.dtype, param_dtype=config.param_dtype, mesh=mesh, rules=rules,
                 attention=config.attention, remat=config.remat)
  if config.path:
    model = from_pretrained(config.path, **options)
  else:
    model = init_model(config.arch, jax.random.key(config.seed), **options)
  if not config.lora.enabled:
    return model
  return model.replace(transformer=dataclasses.replace(
      model.transformer, lora_scale=config.lora.scale, lora_dropout=config.lora.dropout))
