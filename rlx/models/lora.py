"""Low-rank adapters (LoRA) on the transformer's projections, as plain functions on pytrees.

An adapted projection ``W`` [in..., out...] computes ``x W + (alpha / r) (x A) B`` with ``A``
[in..., r] and ``B`` [r, out...]. The adapters are a params-like tree of their own,
``{"layers": {"q_lora_a": [L, D, r], "q_lora_b": [L, r, H, E], ...}}``, stacked over layers
like the base; ``combine(base, adapters)`` puts them beside the base's matrices in one params
tree, which ``Transformer`` runs unmerged (it adds the low-rank path wherever a layer holds
``NAME_lora_a``), and ``merge`` folds them into the base's matrices (what the generator
decodes with). The learner differentiates the adapters only: the base is an argument of the
loss, never of ``jax.grad`` or the optimizer.

Why plain functions rather than a LoRA library: rlx's params are a plain dict run by pure
functions, and what LoRA needs here is four of them (specs, combine, merge, the PEFT names),
each a few lines; qwix (the JAX LoRA library) rewrites a Flax module's calls by interception,
which rlx's functional transformer does not have.

Initialisation as PEFT's: ``A`` uniform in +-1/sqrt(fan_in) (Kaiming-uniform with a=sqrt(5)),
``B`` zero, so a fresh adapter leaves the model exactly the base.
"""

from __future__ import annotations

import hashlib
import json
import math
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlx import mesh as mesh_lib
from rlx.config import ArchConfig, LoraConfig
from rlx.models.safetensors_io import CheckpointError, SafetensorsReader, read_json, write_safetensors
from rlx.models.transformer import LORA_EQUATIONS as EQUATIONS
from rlx.models.transformer import ParamSpec, Params, param_specs

HF_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
              "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
              "down": "mlp.down_proj"}
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model.model.layers.{i}."


def adapter_specs(arch: ArchConfig, lora: LoraConfig) -> dict[str, Any]:
  """Shape and logical axes of every adapter: A takes its projection's input axes, B its
  output axes; the rank axis is never sharded."""
  base = param_specs(arch)["layers"]
  layers = {}
  for target in lora.targets:
    spec = base[target]
    inputs = len(EQUATIONS[target][0])
    (L, *dims), (_, *axes) = spec.shape, spec.axes
    width = min(math.prod(dims[:inputs]), math.prod(dims[inputs:]))
    if lora.rank > width:  # B A would then cost more than the projection it adapts
      raise ValueError(f"config.model.lora.rank={lora.rank} exceeds the rank of the {target} "
                       f"projection ({width}: its smaller side), which an adapter of that rank "
                       f"would only waste memory on; use a rank of at most {width}, or full "
                       "fine-tuning (rank 0)")
    layers[f"{target}_lora_a"] = ParamSpec((L, *dims[:inputs], lora.rank),
                                           ("layers", *axes[:inputs], None), "normal")
    layers[f"{target}_lora_b"] = ParamSpec((L, lora.rank, *dims[inputs:]),
                                           ("layers", None, *axes[inputs:]), "zeros")
  return {"layers": layers}


def _is_spec(x) -> bool:
  return isinstance(x, ParamSpec)


def adapter_axes(arch: ArchConfig, lora: LoraConfig) -> dict[str, Any]:
  return jax.tree.map(lambda s: s.axes, adapter_specs(arch, lora), is_leaf=_is_spec)


def adapter_shapes(arch: ArchConfig, lora: LoraConfig) -> dict[str, Any]:
  return jax.tree.map(lambda s: s.shape, adapter_specs(arch, lora), is_leaf=_is_spec)


def adapter_shardings(arch: ArchConfig, lora: LoraConfig, mesh, rules) -> dict[str, Any]:
  """The ``NamedSharding`` of every adapter on ``mesh``."""
  return mesh_lib.logical_shardings(adapter_axes(arch, lora), adapter_shapes(arch, lora), mesh,
                                    rules)


def init_adapters(arch: ArchConfig, lora: LoraConfig, key: jax.Array,
                  dtype: Any = jnp.float32) -> Params:
  """Fresh adapters: A uniform in +-1/sqrt(fan_in) (per layer), B zero."""
  specs = adapter_specs(arch, lora)["layers"]
  keys = jax.random.split(key, len(specs))
  layers = {}
  for (name, spec), k in zip(sorted(specs.items()), keys):
    if spec.init == "zeros":
      layers[name] = jnp.zeros(spec.shape, dtype)
    else:
      bound = 1.0 / math.sqrt(math.prod(spec.shape[1:-1]))
      layers[name] = jax.random.uniform(k, spec.shape, dtype, -bound, bound)
  return {"layers": layers}


def combine(base: Params, adapters: Params | None) -> Params:
  """One params tree: the base's, with the adapters beside its layers' matrices (no copy)."""
  if adapters is None:
    return base
  return dict(base, layers=dict(base["layers"], **adapters["layers"]))


def targets_of(params: Params) -> tuple[str, ...]:
  """The projections that carry an adapter in a (combined or adapters') params tree."""
  layers = params["layers"]
  keys = layers.keys() if isinstance(layers, dict) else layers[0].keys()
  return tuple(t for t in EQUATIONS if f"{t}_lora_a" in keys)


def delta(target: str, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
  """``scale * A B`` in the projection's own layout [(L,) in..., out...] (float32)."""
  inputs, _, outputs = EQUATIONS[target]
  lead = "l" if a.ndim == len(inputs) + 2 else ""
  return scale * jnp.einsum(f"{lead}{inputs}r,{lead}r{outputs}->{lead}{inputs}{outputs}",
                            a.astype(jnp.float32), b.astype(jnp.float32))


def merge(base: Params, adapters: Params, scale: float) -> Params:
  """The base with every adapter folded into its matrix (in the base's dtype): the model the
  adapters make, at the cost of the plain one."""
  layers = dict(base["layers"])
  for target in targets_of(adapters):
    w = layers[target]
    d = delta(target, adapters["layers"][f"{target}_lora_a"],
              adapters["layers"][f"{target}_lora_b"], scale)
    layers[target] = (w.astype(jnp.float32) + d).astype(w.dtype)
  return dict(base, layers=layers)


def bank(base: Params, adapters: list[tuple[Params, float]], size: int = 0) -> Params:
  """The base with a bank of ``adapters`` ((adapters tree, scale) each) beside its layers'
  matrices, for an engine whose slots each decode with one of them (``Engine(...,
  slot_adapters=True)``, the adapter of a prompt given at prefill; ``Transformer``'s
  ``bank_adapted``): per target, ``{target}_bank_a`` [L, N, in..., r] and ``{target}_bank_b``
  [L, N, r, out...] with each B times its scale. Adapters of smaller ranks are padded with
  zeros to the largest, and a target an adapter lacks is zeros for it (no path). ``size``:
  N at least this, with empty adapters after the given ones (so that banks of a few sizes
  serve any count, each size one compiled program)."""
  if not adapters:
    raise ValueError("an adapter bank needs at least one adapter")
  empty = jax.tree.map(jnp.zeros_like, adapters[0][0])
  adapters = list(adapters) + [(empty, 0.0)] * (size - len(adapters))
  rank = max(a["layers"][f"{t}_lora_a"].shape[-1] for a, _ in adapters for t in targets_of(a))
  layers = dict(base["layers"])
  for target in dict.fromkeys(t for a, _ in adapters for t in targets_of(a)):
    w = layers[target]  # [L, in..., out...]
    inputs, _, outputs = EQUATIONS[target]
    dims_in, dims_out = w.shape[1:1 + len(inputs)], w.shape[1 + len(inputs):]
    banks_a, banks_b = [], []
    for tree, scale in adapters:
      a = tree["layers"].get(f"{target}_lora_a")
      b = tree["layers"].get(f"{target}_lora_b")
      if a is None:
        a = jnp.zeros((w.shape[0], *dims_in, rank), jnp.float32)
        b = jnp.zeros((w.shape[0], rank, *dims_out), jnp.float32)
      pad = rank - a.shape[-1]
      banks_a.append(jnp.pad(a.astype(jnp.float32), [(0, 0)] * (a.ndim - 1) + [(0, pad)]))
      banks_b.append(jnp.pad(scale * b.astype(jnp.float32), [(0, 0), (0, pad)] +
                             [(0, 0)] * (b.ndim - 2)))
    layers[f"{target}_bank_a"] = jnp.stack(banks_a, axis=1).astype(w.dtype)
    layers[f"{target}_bank_b"] = jnp.stack(banks_b, axis=1).astype(w.dtype)
  return dict(base, layers=layers)


def with_dropout_key(params: Params, key: jax.Array | None) -> Params:
  """``params`` with one dropout key per layer (``lora_key``), for the learner's loss forward."""
  if key is None:
    return params
  count = jax.tree.leaves(params["layers"])[0].shape[0]
  return dict(params, layers=dict(params["layers"], lora_key=jax.random.split(key, count)))


def nbytes(tree) -> int:
  """Bytes of every array of ``tree`` (what a weight sync ships)."""
  return int(sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


# --- the PEFT format: adapter_config.json + adapter_model.safetensors, Hugging Face names ---


def peft_config(lora: LoraConfig, base_path: str | None) -> dict:
  """The ``adapter_config.json`` that ``peft`` reads as these adapters."""
  return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
          "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "bias": "none",
          "target_modules": sorted(HF_MODULES[t].split(".")[1] for t in lora.targets),
          "base_model_name_or_path": base_path, "fan_in_fan_out": False, "use_rslora": False,
          "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
          "rank_pattern": {}, "alpha_pattern": {}}


def _peft_names(target: str, layer: int) -> tuple[str, str]:
  module = _PEFT_PREFIX.format(i=layer) + HF_MODULES[target]
  return f"{module}.lora_A.weight", f"{module}.lora_B.weight"


def save_peft(adapters: Params, arch: ArchConfig, lora: LoraConfig,
              directory: str | pathlib.Path, base_path: str | None = None) -> pathlib.Path:
  """Writes the adapters in the PEFT format (float32, torch's [out, in] layouts). With several
  processes every process calls it (the arrays are gathered) and process 0 writes."""
  from jax.experimental import multihost_utils  # noqa: PLC0415

  directory = pathlib.Path(directory)
  writer = jax.process_index() == 0
  if writer:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / PEFT_CONFIG).write_text(json.dumps(peft_config(lora, base_path), indent=2))

  def host(array):
    if not array.is_fully_addressable:
      array = multihost_utils.process_allgather(array, tiled=True)
    return np.asarray(jax.device_get(array), np.float32)

  tensors = []
  for target in lora.targets:
    a = host(adapters["layers"][f"{target}_lora_a"])  # [L, in..., r]
    b = host(adapters["layers"][f"{target}_lora_b"])  # [L, r, out...]
    for i in range(arch.num_layers):
      name_a, name_b = _peft_names(target, i)
      hf_a = a[i].reshape(-1, lora.rank).T  # [r, in]
      hf_b = b[i].reshape(lora.rank, -1).T  # [out, r]
      tensors += [(name_a, lambda t=hf_a: t, hf_a.nbytes), (name_b, lambda t=hf_b: t, hf_b.nbytes)]
  # the whole adapter in one file, as PEFT writes it
  written = write_safetensors(directory, tensors, max_shard_bytes=1 << 62, write=writer)
  if writer and written != [PEFT_WEIGHTS]:
    (directory / written[0]).rename(directory / PEFT_WEIGHTS)
  return directory


def read_peft_config(directory: str | pathlib.Path) -> dict:
  directory = pathlib.Path(directory)
  file = directory / PEFT_CONFIG
  if not file.is_file():
    raise CheckpointError(f"{directory} has no {PEFT_CONFIG}; is it a PEFT adapter directory?")
  return read_json(file)


def check_peft_config(found: dict, lora: LoraConfig, where: str) -> None:
  """Refuses a PEFT adapter whose kind, rank, scale or targets differ from ``lora``'s."""
  problems = []
  if found.get("peft_type", "LORA") != "LORA":
    problems.append(f"peft_type {found.get('peft_type')!r} is not LORA")
  if found.get("use_rslora") or found.get("use_dora"):
    problems.append("rsLoRA / DoRA adapters are not supported")
  if found.get("rank_pattern") or found.get("alpha_pattern"):
    problems.append("per-module rank_pattern / alpha_pattern are not supported")
  if found.get("r") != lora.rank:
    problems.append(f"rank r={found.get('r')} (model.lora.rank={lora.rank})")
  if found.get("lora_alpha") is not None and float(found["lora_alpha"]) != float(lora.alpha):
    problems.append(f"lora_alpha={found['lora_alpha']} (model.lora.alpha={lora.alpha})")
  modules = found.get("target_modules") or []
  modules = [modules] if isinstance(modules, str) else modules
  wanted = sorted(HF_MODULES[t].split(".")[1] for t in lora.targets)
  if sorted(modules) != wanted:
    problems.append(f"target_modules {sorted(modules)} (model.lora.targets gives {wanted})")
  if problems:
    raise CheckpointError(f"{where}: the adapter differs from the config: {'; '.join(problems)}; "
                          "set model.lora to the adapter's values")


def record(lora: LoraConfig) -> dict | None:
  """The adapters' shape and scale as a checkpoint records them (None: full fine-tuning)."""
  if not lora.enabled:
    return None
  return {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets)}


def resume_problem(saved: dict | None, lora: LoraConfig) -> str | None:
  """What keeps a checkpoint's adapters (``record`` when saved) from resuming under ``lora``:
  another alpha would silently rescale them, another shape would not read back; None: they
  fit."""
  now = record(lora)
  if saved == now:
    return None
  if saved is None or now is None:
    then = "full fine-tuning" if saved is None else f"LoRA rank {saved['rank']}"
    return f"it was trained with {then}, this run uses " + (
        "full fine-tuning (model.lora.rank=0)" if now is None else f"LoRA rank {now['rank']}")
  return "; ".join(f"model.lora.{key}={saved[key]!r} then, {now[key]!r} now"
                   for key in now if saved.get(key) != now[key])


def load_peft(directory: str | pathlib.Path, arch: ArchConfig, lora: LoraConfig,
              shardings: Any = None, dtype: Any = jnp.float32) -> Params:
  """Adapters from a PEFT directory (checked against ``lora``), in ``shardings``."""
  directory = pathlib.Path(directory)
  check_peft_config(read_peft_config(directory), lora, str(directory))
  reader = SafetensorsReader(directory, weights=PEFT_WEIGHTS)
  shapes = adapter_shapes(arch, lora)["layers"]
  layers = {}
  for target in lora.targets:
    stacked_a, stacked_b = [], []
    for i in range(arch.num_layers):
      name_a, name_b = _peft_names(target, i)
      missing = [n for n in (name_a, name_b) if n not in reader.names()]
      if missing:
        raise CheckpointError(f"{directory}: missing adapter tensor {missing[0]} (the adapter was "
                              f"made for another model, or with other targets)")
      a, b = np.asarray(reader.get(name_a)), np.asarray(reader.get(name_b))
      shape_a, shape_b = shapes[f"{target}_lora_a"][1:], shapes[f"{target}_lora_b"][1:]
      if a.size != math.prod(shape_a) or b.size != math.prod(shape_b):
        raise CheckpointError(f"{directory}: {name_a} / {name_b} have shapes {a.shape} / "
                              f"{b.shape}, which do not fit this model's {target} projection")
      stacked_a.append(a.T.reshape(shape_a))
      stacked_b.append(b.T.reshape(shape_b))
    layers[f"{target}_lora_a"] = np.stack(stacked_a)
    layers[f"{target}_lora_b"] = np.stack(stacked_b)
  adapters = jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)), {"layers": layers})
  return jax.device_put(adapters, shardings) if shardings is not None else jax.tree.map(
      jnp.asarray, adapters)


# --- the base an adapter belongs to ---


def model_fingerprint(path: str | None, arch: ArchConfig, seed: int,
                      warmup: dict | None = None) -> str:
  """A fingerprint of the base model: of a model directory, its config and every weight file's
  name, size and header (tensor names, shapes, offsets) and first and last MiB; of a built-in
  model, its architecture and seed; plus the warm-up's settings when the base was warmed up."""
  digest = hashlib.sha256()
  if path is None:
    digest.update(json.dumps({"arch": repr(arch), "seed": seed}, sort_keys=True).encode())
  else:
    directory = pathlib.Path(path)
    for file in sorted(directory.glob("*.json")) + sorted(directory.glob("*.safetensors")):
      if file.name.startswith(("tokenizer", "rlx_")) or file.name in ("vocab.json",):
        continue
      size = file.stat().st_size
      digest.update(f"{file.name}:{size}".encode())
      with file.open("rb") as handle:
        digest.update(handle.read(1 << 20))
        if size > 2 << 20:
          handle.seek(size - (1 << 20))
          digest.update(handle.read())
  if warmup is not None:
    digest.update(json.dumps(warmup, sort_keys=True).encode())
  return digest.hexdigest()[:16]
