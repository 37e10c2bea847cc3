"""The transformer's parameters, their layout: the shape, logical axes and initialiser of every
parameter (``param_specs``), as a nested dict whose tree is the params' own, and random
parameters made from it (``init_params``). ``rlx.models.transformer`` runs them.

    specs = param_specs(arch)          # {"embed": ParamSpec(...), "layers": {...}, ...}
    params = init_params(arch, key)    # the same tree, arrays
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp

from rlx.config import ArchConfig

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ParamSpec:
  """Shape, logical axes and initialiser of one parameter."""

  shape: tuple[int, ...]
  axes: tuple[str | None, ...]
  init: Literal["normal", "ones", "zeros"]


def param_specs(arch: ArchConfig) -> dict[str, Any]:
  """Shape, logical axes and initialiser of every parameter, as a nested dict."""
  L, D, H, K, E, F, V = (arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads,
                         arch.head_dim, arch.intermediate_size, arch.vocab_size)
  layers = {
      "attn_norm": ParamSpec((L, D), ("layers", "norm"), "ones"),
      "q": ParamSpec((L, D, H, E), ("layers", "embed", "heads", "head_dim"), "normal"),
      "k": ParamSpec((L, D, K, E), ("layers", "embed", "kv_heads", "head_dim"), "normal"),
      "v": ParamSpec((L, D, K, E), ("layers", "embed", "kv_heads", "head_dim"), "normal"),
      "o": ParamSpec((L, H, E, D), ("layers", "heads", "head_dim", "embed"), "normal"),
      "mlp_norm": ParamSpec((L, D), ("layers", "norm"), "ones"),
      "gate": ParamSpec((L, D, F), ("layers", "embed", "mlp"), "normal"),
      "up": ParamSpec((L, D, F), ("layers", "embed", "mlp"), "normal"),
      "down": ParamSpec((L, F, D), ("layers", "mlp", "embed"), "normal"),
  }
  if arch.qkv_bias:
    layers["q_bias"] = ParamSpec((L, H, E), ("layers", "heads", "head_dim"), "zeros")
    layers["k_bias"] = ParamSpec((L, K, E), ("layers", "kv_heads", "head_dim"), "zeros")
    layers["v_bias"] = ParamSpec((L, K, E), ("layers", "kv_heads", "head_dim"), "zeros")
  if arch.o_bias:
    layers["o_bias"] = ParamSpec((L, D), ("layers", "norm"), "zeros")
  if arch.qk_norm:
    layers["q_norm"] = ParamSpec((L, E), ("layers", "head_dim"), "ones")
    layers["k_norm"] = ParamSpec((L, E), ("layers", "head_dim"), "ones")
  specs = {
      "embed": ParamSpec((V, D), ("vocab", "embed"), "normal"),
      "layers": layers,
      "final_norm": ParamSpec((D,), ("norm",), "ones"),
  }
  if not arch.tie_word_embeddings:
    specs["unembed"] = ParamSpec((D, V), ("embed", "vocab"), "normal")
  return specs


def _is_spec(x) -> bool:
  return isinstance(x, ParamSpec)


def logical_axes(arch: ArchConfig) -> dict[str, Any]:
  """The logical axis names of every parameter (same tree as the params)."""
  return jax.tree.map(lambda s: s.axes, param_specs(arch), is_leaf=_is_spec)


def param_shapes(arch: ArchConfig) -> dict[str, Any]:
  """The shape of every parameter (same tree as the params)."""
  return jax.tree.map(lambda s: s.shape, param_specs(arch), is_leaf=_is_spec)


def init_params(arch: ArchConfig, key: jax.Array, param_dtype: Any = jnp.float32) -> Params:
  """Random parameters: N(0, 0.02) matrices, unit norms, zero biases.

  Jit it with ``out_shardings`` to create the params already sharded.
  """
  specs = param_specs(arch)
  leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
  keys = jax.random.split(key, len(leaves))

  def make(spec: ParamSpec, k):
    if spec.init == "normal":
      return (0.02 * jax.random.normal(k, spec.shape, jnp.float32)).astype(param_dtype)
    return (jnp.ones if spec.init == "ones" else jnp.zeros)(spec.shape, param_dtype)

  return jax.tree.unflatten(treedef, [make(s, k) for s, k in zip(leaves, keys)])
