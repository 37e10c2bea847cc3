"""Hugging Face checkpoints in and out: ``config.json`` <-> ``ArchConfig``, safetensors <-> params.

Each rlx parameter is stacked over layers; each Hugging Face tensor is one
layer's matrix in torch's ``[out, in]`` layout. A ``_TensorMap`` states how one
becomes the other: ``ours = hf.reshape(split).transpose(perm)`` per layer.
Loading builds every parameter with ``jax.make_array_from_callback``, so each
device shard copies only its own block out of the memory-mapped file: a large
checkpoint never sits in host memory twice.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
import numpy as np

from rlx.config import ArchConfig
from rlx.models import transformer
from rlx.models.safetensors_io import CheckpointError, SafetensorsReader

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_ARCH_NAME = {family: name for name, family in ARCHITECTURES.items()}


def arch_from_hf(hf: dict[str, Any]) -> ArchConfig:
  """Reads a Hugging Face ``config.json`` dict; refuses what rlx cannot run exactly."""
  names = hf.get("architectures") or []
  family = next((ARCHITECTURES[n] for n in names if n in ARCHITECTURES), None)
  if family is None:
    family = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}.get(hf.get("model_type"))
  if family is None:
    raise CheckpointError(
        f"unsupported architecture {names or hf.get('model_type')!r}; rlx runs "
        f"{', '.join(ARCHITECTURES)}")
  if hf.get("mlp_bias"):
    raise CheckpointError("mlp_bias=true is not supported (no Llama / Qwen release uses it)")
  if hf.get("use_sliding_window"):
    raise CheckpointError("use_sliding_window=true is not supported; rlx attends to the full context")
  rope = dict(hf.get("rope_scaling") or {})
  # transformers >= 5 keeps theta and scaling together in `rope_parameters`.
  rope.update(hf.get("rope_parameters") or {})
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type not in ("default", "llama3", "linear"):
    raise CheckpointError(f"rope scaling {rope_type!r} is not supported (supported: llama3, linear)")
  heads = hf["num_attention_heads"]
  attention_bias = bool(hf.get("attention_bias", False))
  eos = hf.get("eos_token_id")
  eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
  return ArchConfig(
      family=family,
      vocab_size=hf["vocab_size"],
      hidden_size=hf["hidden_size"],
      intermediate_size=hf["intermediate_size"],
      num_layers=hf["num_hidden_layers"],
      num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
      rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
      rope_scaling="none" if rope_type == "default" else rope_type,
      rope_factor=float(rope.get("factor", 1.0)),
      rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
      rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
      rope_original_max_len=int(rope.get("original_max_position_embeddings", 8192)),
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      qkv_bias=True if family == "qwen2" else attention_bias,
      o_bias=False if family == "qwen2" else attention_bias,
      qk_norm=family == "qwen3",
      # transformers' Llama, Qwen2 and Qwen3 configs all default to untied.
      tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
      max_position_embeddings=hf.get("max_position_embeddings", 4096),
      bos_token_id=hf.get("bos_token_id"),
      eos_token_ids=eos_ids,
  )


def arch_to_hf(arch: ArchConfig, dtype: str) -> dict[str, Any]:
  """The ``config.json`` dict that ``transformers`` reads back as the same model."""
  if arch.family == "qwen2" and (not arch.qkv_bias or arch.o_bias):
    raise CheckpointError("a Qwen2 model has q/k/v biases and no o_proj bias; this arch does not")
  if arch.family != "qwen2" and arch.qkv_bias != arch.o_bias:
    raise CheckpointError(f"{arch.family}: attention_bias covers q, k, v and o together")
  if arch.qk_norm != (arch.family == "qwen3"):
    raise CheckpointError("q/k RMSNorm exists in Qwen3 and only there")
  hf = {
      "architectures": [_ARCH_NAME[arch.family]],
      "model_type": arch.family,
      "vocab_size": arch.vocab_size,
      "hidden_size": arch.hidden_size,
      "intermediate_size": arch.intermediate_size,
      "num_hidden_layers": arch.num_layers,
      "num_attention_heads": arch.num_heads,
      "num_key_value_heads": arch.num_kv_heads,
      "head_dim": arch.head_dim,
      "hidden_act": "silu",
      "rms_norm_eps": arch.rms_norm_eps,
      "rope_theta": arch.rope_theta,
      "tie_word_embeddings": arch.tie_word_embeddings,
      "max_position_embeddings": arch.max_position_embeddings,
      "torch_dtype": dtype,
      "use_cache": True,
  }
  if arch.family != "qwen2":
    hf["attention_bias"] = arch.qkv_bias
  if arch.family == "llama":
    hf["mlp_bias"] = False
  if arch.family in ("qwen2", "qwen3"):
    hf["use_sliding_window"] = False
  if arch.rope_scaling != "none":
    hf["rope_scaling"] = {"rope_type": arch.rope_scaling, "factor": arch.rope_factor}
    if arch.rope_scaling == "llama3":
      hf["rope_scaling"].update(
          low_freq_factor=arch.rope_low_freq_factor, high_freq_factor=arch.rope_high_freq_factor,
          original_max_position_embeddings=arch.rope_original_max_len)
  if arch.bos_token_id is not None:
    hf["bos_token_id"] = arch.bos_token_id
  if arch.eos_token_ids:
    hf["eos_token_id"] = arch.eos_token_ids[0] if len(arch.eos_token_ids) == 1 else list(arch.eos_token_ids)
  return hf


@dataclasses.dataclass(frozen=True)
class _TensorMap:
  """One rlx parameter <-> one HF tensor per layer.

  ``dims`` lists, per HF (torch ``[out, in]``) dim, the sizes it splits into;
  our layout is ``hf.reshape(split).transpose(perm)``. E.g. q_proj ``[(H E), D]``
  has dims ``((H, E), (D,))`` and perm ``(2, 0, 1)``: ours is ``[D, H, E]``.
  """

  name: str  # '{i}' stands for the layer index of stacked parameters
  dims: tuple[tuple[int, ...], ...]
  perm: tuple[int, ...]

  @property
  def stacked(self) -> bool:
    return "{i}" in self.name

  @property
  def split(self) -> tuple[int, ...]:
    return tuple(size for group in self.dims for size in group)

  @property
  def hf_shape(self) -> tuple[int, ...]:
    return tuple(int(np.prod(group)) for group in self.dims)


def tensor_maps(arch: ArchConfig) -> dict[str, Any]:
  """The ``_TensorMap`` of every parameter, in the same tree as the params."""
  D, H, K, E, F, V = (arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                      arch.intermediate_size, arch.vocab_size)
  vector = lambda name, n: _TensorMap(name, ((n,),), (0,))
  transposed = lambda name, rows, cols: _TensorMap(name, ((rows,), (cols,)), (1, 0))
  layer = "model.layers.{i}."
  maps = {
      "attn_norm": vector(layer + "input_layernorm.weight", D),
      "q": _TensorMap(layer + "self_attn.q_proj.weight", ((H, E), (D,)), (2, 0, 1)),
      "k": _TensorMap(layer + "self_attn.k_proj.weight", ((K, E), (D,)), (2, 0, 1)),
      "v": _TensorMap(layer + "self_attn.v_proj.weight", ((K, E), (D,)), (2, 0, 1)),
      "o": _TensorMap(layer + "self_attn.o_proj.weight", ((D,), (H, E)), (1, 2, 0)),
      "mlp_norm": vector(layer + "post_attention_layernorm.weight", D),
      "gate": transposed(layer + "mlp.gate_proj.weight", F, D),
      "up": transposed(layer + "mlp.up_proj.weight", F, D),
      "down": transposed(layer + "mlp.down_proj.weight", D, F),
      "q_bias": _TensorMap(layer + "self_attn.q_proj.bias", ((H, E),), (0, 1)),
      "k_bias": _TensorMap(layer + "self_attn.k_proj.bias", ((K, E),), (0, 1)),
      "v_bias": _TensorMap(layer + "self_attn.v_proj.bias", ((K, E),), (0, 1)),
      "o_bias": vector(layer + "self_attn.o_proj.bias", D),
      "q_norm": vector(layer + "self_attn.q_norm.weight", E),
      "k_norm": vector(layer + "self_attn.k_norm.weight", E),
  }
  top = {
      "embed": _TensorMap("model.embed_tokens.weight", ((V,), (D,)), (0, 1)),
      "final_norm": vector("model.norm.weight", D),
      "unembed": transposed("lm_head.weight", V, D),
  }
  shapes = transformer.param_shapes(arch)
  return {**{k: top[k] for k in shapes if k != "layers"},
          "layers": {k: maps[k] for k in shapes["layers"]}}


def _hf_block(tensor: np.ndarray, tmap: _TensorMap, index: tuple[slice, ...]) -> np.ndarray:
  """The block ``index`` (in our layout) of one layer's HF tensor, reading only what it needs.

  An HF dim made of several split dims is read as one contiguous range when all
  but its first split dim are whole (head_dim is never sharded, so a q/k/v/o
  shard reads exactly its heads); otherwise that HF dim is read whole.
  """
  split_index = [slice(None)] * len(tmap.split)
  for ours_dim, split_dim in enumerate(tmap.perm):
    split_index[split_dim] = index[ours_dim]
  hf_index, split_shape, first = [], [], 0
  for group in tmap.dims:
    rest = range(first + 1, first + len(group))
    start, stop, step = split_index[first].indices(group[0])
    inner = int(np.prod(group[1:]))
    if step == 1 and all(split_index[d].indices(tmap.split[d]) == (0, tmap.split[d], 1) for d in rest):
      hf_index.append(slice(start * inner, stop * inner))
      split_index[first] = slice(None)
      split_shape.append(stop - start)
    else:
      hf_index.append(slice(None))
      split_shape.append(group[0])
    split_shape += group[1:]
    first += len(group)
  block = np.asarray(tensor[tuple(hf_index)]).reshape(split_shape)[tuple(split_index)]
  return block.transpose(tmap.perm)


def _check_shape(reader: SafetensorsReader, name: str, tmap: _TensorMap):
  tensor = reader.get(name)
  if tuple(tensor.shape) != tmap.hf_shape:
    raise CheckpointError(
        f"tensor {name!r} has shape {tuple(tensor.shape)}, but config.json implies {tmap.hf_shape}; "
        "the checkpoint and its config.json disagree")
  return tensor


def load_params(directory: str | pathlib.Path, arch: ArchConfig, dtype: Any,
                shardings: Any) -> transformer.Params:
  """Loads every parameter straight into its sharding, one device block at a time."""
  reader = SafetensorsReader(directory)
  maps = tensor_maps(arch)
  shapes = transformer.param_shapes(arch)
  expected = {tmap.name.format(i=i) for tmap in jax.tree.leaves(maps)
              for i in (range(arch.num_layers) if tmap.stacked else [0])}
  missing = sorted(expected - reader.names())
  if missing:
    more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
    raise CheckpointError(
        f"{directory}: missing tensors {', '.join(missing[:5])}{more} for a {arch.family} model "
        f"with {arch.num_layers} layers; the checkpoint is incomplete or config.json is wrong")
  np_dtype = jnp.dtype(dtype)

  def load(tmap: _TensorMap, shape: tuple[int, ...], sharding) -> jax.Array:
    if not tmap.stacked:
      tensor = _check_shape(reader, tmap.name, tmap)
      return jax.make_array_from_callback(
          shape, sharding, lambda index: _hf_block(tensor, tmap, index).astype(np_dtype))
    layers = [_check_shape(reader, tmap.name.format(i=i), tmap) for i in range(arch.num_layers)]

    def block(index):
      return np.stack([_hf_block(layers[i], tmap, index[1:]).astype(np_dtype)
                       for i in range(*index[0].indices(arch.num_layers))])

    return jax.make_array_from_callback(shape, sharding, block)

  return jax.tree.map(load, maps, shapes, shardings,
                      is_leaf=lambda x: isinstance(x, _TensorMap))


def hf_tensors(params: transformer.Params, arch: ArchConfig, dtype: Any):
  """Yields ``(hf_name, produce, nbytes)`` for every HF tensor, for ``write_safetensors``.

  ``produce`` fetches and converts one layer's tensor only when it is called; with
  several processes it is a collective that every process must call.
  """
  maps = tensor_maps(arch)
  flat_maps = jax.tree_util.tree_flatten_with_path(maps, is_leaf=lambda x: isinstance(x, _TensorMap))[0]
  np_dtype = jnp.dtype(dtype)
  for path, tmap in flat_maps:
    array = params
    for key in path:
      array = array[key.key]
    hf_shape = tmap.hf_shape
    inverse = tuple(np.argsort(tmap.perm))
    nbytes = int(np.prod(hf_shape)) * np_dtype.itemsize

    def produce(array=array, layer=None, tmap=tmap, hf_shape=hf_shape, inverse=inverse):
      value = array if layer is None else array[layer]
      if not value.is_fully_addressable:  # multi-process: every process joins the gather
        value = multihost_utils.process_allgather(value, tiled=True)
      return np.asarray(jax.device_get(value)).astype(np_dtype).transpose(inverse).reshape(hf_shape)

    if tmap.stacked:
      for i in range(arch.num_layers):
        yield tmap.name.format(i=i), (lambda produce=produce, i=i: produce(layer=i)), nbytes
    else:
      yield tmap.name, produce, nbytes
