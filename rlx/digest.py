"""Content digests of params that do not depend on where or how the arrays lie.

A policy version crosses from the learner to the generator resharded, restored from storage,
unstacked into per-layer arrays or merged with LoRA adapters; a sync that lands partly, lands
the wrong array or lands nothing would go unseen, since every metric still looks fine. Each
side therefore computes a digest of the version it holds, and the two must be equal.

An array is seen as a matrix ``b[r, c]`` of the bits of its elements (float32 as its 32
bits, 16-bit floats widened), ``c`` the index along its last axis and ``r`` the row-major
index over the others. Its digest is three 32-bit integers::

    plain   = sum_{r,c} b[r, c]                         (mod 2**32)
    columns = sum_c w(c) * sum_r b[r, c]                (mod 2**32)
    rows    = sum_r v(r) * sum_c b[r, c]                (mod 2**32)

with odd multiplicative-hash weights ``w(c) = c * 2654435761 + 1`` and ``v(r) = r * 2246822519
+ 1``. Integer sums modulo 2**32 are exact and associative, so the digest is the same whatever
the sharding, the summation order, the device or the process that computes it: bitwise, not
approximately. A changed element changes ``plain``; two swapped elements change ``rows``
(different rows) or ``columns`` (one row); two swapped arrays change both arrays' digests.

A stacked array ``[L, ...]`` (the layers on a leading axis) and the list of its L slices (the
generator's per-layer weights) have the same digest: slice ``l`` counts its rows from ``l *
rows per slice`` on. ``tree_digest`` gives one digest per parameter path, in the stacked naming,
for either form.

Two implementations, equal (tests): numpy where every array is on one CPU device or in host
memory (read in place, no copy; XLA:CPU runs a float-to-bits conversion ten times slower than
the sums), and otherwise one jitted program per tree (``jitted_tree_digest``), so that an
accelerator's or a sharded tree's arrays never cross to the host.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


COLUMN_WEIGHT, ROW_WEIGHT = 2654435761, 2246822519
"""Odd multiplicative-hash constants (Knuth's; xxHash's second prime): no index is lost."""
MOD = 2**32

Digest = dict[str, tuple[int, int, int]]


def _np_bits(data: np.ndarray) -> np.ndarray:
  size = data.dtype.itemsize
  if size not in (1, 2, 4):
    raise ValueError(f"no digest for {data.dtype} arrays")
  view = np.ascontiguousarray(data).view({1: np.uint8, 2: np.uint16, 4: np.uint32}[size])
  return view if size == 4 else view.astype(np.uint32)


def array_digest(x, row_offset: int = 0) -> np.ndarray:
  """uint64 [3]: the digest of ``x`` (host memory or one device, read in place), its rows
  counted from ``row_offset`` on (see the module docstring)."""
  shape = tuple(x.shape) or (1,)
  bits = _np_bits(np.asarray(x)).reshape(-1, shape[-1])
  w = np.arange(shape[-1], dtype=np.uint32) * np.uint32(COLUMN_WEIGHT) + np.uint32(1)
  v = ((np.arange(bits.shape[0], dtype=np.uint32) + np.uint32(row_offset % MOD))
       * np.uint32(ROW_WEIGHT) + np.uint32(1))
  return np.array([int(bits.sum(dtype=np.uint32)),
                   int((bits.sum(axis=0, dtype=np.uint32) * w).sum(dtype=np.uint32)),
                   int((bits.sum(axis=1, dtype=np.uint32) * v).sum(dtype=np.uint32))],
                  np.uint64)


def _jnp_digest(x: jax.Array, row_offset: int = 0) -> jax.Array:
  """uint32 [3]: ``array_digest`` as a traced computation (the whole array)."""
  if x.dtype.itemsize == 4:
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  else:
    narrow = {2: jnp.uint16, 1: jnp.uint8}[x.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(x, narrow).astype(jnp.uint32)
  shape = tuple(x.shape) or (1,)
  bits = bits.reshape(-1, shape[-1])
  w = jnp.arange(shape[-1], dtype=jnp.uint32) * jnp.uint32(COLUMN_WEIGHT) + jnp.uint32(1)
  v = ((jnp.arange(bits.shape[0], dtype=jnp.uint32) + jnp.uint32(row_offset % MOD))
       * jnp.uint32(ROW_WEIGHT) + jnp.uint32(1))
  return jnp.stack([jnp.sum(bits, dtype=jnp.uint32),
                    jnp.sum(jnp.sum(bits, axis=0, dtype=jnp.uint32) * w, dtype=jnp.uint32),
                    jnp.sum(jnp.sum(bits, axis=1, dtype=jnp.uint32) * v, dtype=jnp.uint32)])


def _path(keys) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keys)


def _pieces(params: Any) -> list[tuple[str, Any, int]]:
  """``(path, array, row offset)`` of every array: per-layer slices under their stacked path,
  their rows after the earlier layers'."""
  out = []
  layers = params.get("layers") if isinstance(params, dict) else None
  if isinstance(layers, (list, tuple)):
    for l, layer in enumerate(layers):
      for keys, x in jax.tree_util.tree_leaves_with_path(layer):
        shape = tuple(x.shape) or (1,)
        out.append(("layers/" + _path(keys), x, l * int(np.prod(shape[:-1]))))
    params = {k: v for k, v in params.items() if k != "layers"}
  out += [(_path(keys), x, 0) for keys, x in jax.tree_util.tree_leaves_with_path(params)]
  return out


def _combined(parts: list[tuple[str, np.ndarray]]) -> Digest:
  totals: dict[str, np.ndarray] = {}
  for name, part in parts:
    totals[name] = (totals.get(name, np.zeros(3, np.uint64)) + part) % MOD
  return {n: tuple(int(v) for v in totals[n]) for n in sorted(totals)}


def _on_cpu(x) -> bool:
  """Whether numpy reads ``x`` where it lies: host memory, or one CPU device (zero-copy). The
  shards of an array over several devices would each get a cached single-device array of their
  own (``addressable_shards``), live as long as the array: those take the jitted program."""
  if not isinstance(x, jax.Array):
    return True
  devices = x.devices()
  return len(devices) == 1 and next(iter(devices)).platform == "cpu"


def tree_digest(params: Any) -> Digest:
  """The digest of every array of ``params`` (stacked or per-layer): numpy where every array is
  in host memory or on one CPU device (each process then digests its own copy), else the
  jitted program (global arrays: the same on every process)."""
  pieces = _pieces(params)
  if all(_on_cpu(x) for _, x, _ in pieces):
    return _combined([(name, array_digest(x, offset)) for name, x, offset in pieces])
  return jitted_tree_digest(params)


@functools.partial(jax.jit, static_argnums=1)
def _jitted_digests(arrays: list, offsets: tuple[int, ...]) -> list[jax.Array]:
  return [_jnp_digest(x, offset) for x, offset in zip(arrays, offsets)]


def jitted_tree_digest(params: Any) -> Digest:
  """``tree_digest`` by one jitted program over the arrays where they lie (compiled once per
  tree structure and layout)."""
  pieces = _pieces(params)
  values = jax.device_get(_jitted_digests([x for _, x, _ in pieces],
                                          tuple(offset for _, _, offset in pieces)))
  return _combined([(name, np.asarray(v, np.uint64)) for (name, _, _), v in zip(pieces, values)])


def differences(expected: Digest, got: Digest) -> list[str]:
  """The paths whose digests differ (or that one side lacks), in order."""
  return [name for name in sorted(set(expected) | set(got))
          if expected.get(name) != got.get(name)]


def to_json(digest: Digest) -> dict[str, list[int]]:
  return {name: list(value) for name, value in digest.items()}


def from_json(data: dict[str, list[int]]) -> Digest:
  return {name: tuple(int(v) for v in value) for name, value in data.items()}
