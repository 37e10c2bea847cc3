"""Content digests of params that do not depend on where or how the arrays lie.

A policy version crosses from the learner to the generator resharded, restored from storage,
unstacked into per-layer arrays or merged with LoRA adapters; a sync that lands partly, lands
the wrong array or lands nothing would go unseen, since every metric still looks fine. Each
side therefore computes a digest of the version it holds, and the two must be equal.

The digest of an array is two 32-bit integers over the bits of its elements ``b_i`` (float32
as its 32 bits, 16-bit floats widened), ``i`` the element's index in the array's logical
(row-major) order::

    plain    = sum_i b_i                       (mod 2**32)
    weighted = sum_i b_i * (i * 2654435761 + 1)  (mod 2**32)

Integer sums modulo 2**32 are exact and associative, so the digest is the same whatever the
sharding, the summation order, the device or the process that computes it: bitwise, not
approximately. A changed element changes ``plain`` (unless its bits change by a multiple of
2**32, impossible) and two swapped elements or arrays change ``weighted``.

A stacked array ``[L, ...]`` (the layers on a leading axis) and the list of its L slices (the
generator's per-layer weights) have the same digest: slice ``l`` counts its elements from
``l * size`` on. ``tree_digest`` gives one digest per parameter path, in the stacked naming,
for either form.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

GOLDEN = 2654435761
"""Knuth's multiplicative hash constant: the index weights (odd, so no index is lost)."""

Digest = dict[str, tuple[int, int]]


def _bits(x: jax.Array) -> jax.Array:
  """The bits of each element of ``x``, as uint32."""
  if x.dtype.itemsize == 4:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  if x.dtype.itemsize == 2:
    return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
  if x.dtype.itemsize == 1:
    return jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
  raise ValueError(f"no digest for {x.dtype} arrays")


def array_digest(x: jax.Array, start: jax.Array | int = 0) -> jax.Array:
  """uint32 [2]: ``(plain, weighted)`` of ``x``, its elements counted from ``start`` on."""
  bits = _bits(x).reshape(-1)
  index = jnp.arange(bits.shape[0], dtype=jnp.uint32) + jnp.asarray(start, jnp.uint32)
  weights = index * jnp.uint32(GOLDEN) + jnp.uint32(1)
  return jnp.stack([jnp.sum(bits, dtype=jnp.uint32),
                    jnp.sum(bits * weights, dtype=jnp.uint32)])


def _path(keys) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keys)


def _digests(params: Any) -> dict[str, jax.Array]:
  """Per path (per-layer slices folded into their stacked path), uint32 [2]."""
  out: dict[str, jax.Array] = {}
  layers = params.get("layers") if isinstance(params, dict) else None
  if isinstance(layers, (list, tuple)):  # per-layer weights: each slice at its stacked offset
    for l, layer in enumerate(layers):
      for keys, x in jax.tree_util.tree_leaves_with_path(layer):
        name = "layers/" + _path(keys)
        part = array_digest(x, (l * x.size) % 2**32)
        out[name] = part if name not in out else out[name] + part
    params = {k: v for k, v in params.items() if k != "layers"}
  for keys, x in jax.tree_util.tree_leaves_with_path(params):
    out[_path(keys)] = array_digest(x)
  return out


_jitted = jax.jit(_digests)


def tree_digest(params: Any) -> Digest:
  """The digest of every array of ``params`` (stacked or per-layer), on the host: one
  jitted program over the arrays where they lie, then a few integers copied out."""
  got = jax.device_get(_jitted(params))
  return {name: (int(value[0]), int(value[1])) for name, value in sorted(got.items())}


def differences(expected: Digest, got: Digest) -> list[str]:
  """The paths whose digests differ (or that one side lacks), in order."""
  return [name for name in sorted(set(expected) | set(got))
          if expected.get(name) != got.get(name)]


def to_json(digest: Digest) -> dict[str, list[int]]:
  return {name: list(value) for name, value in digest.items()}


def from_json(data: dict[str, list[int]]) -> Digest:
  return {name: (int(value[0]), int(value[1])) for name, value in data.items()}
