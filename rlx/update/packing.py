"""Sequence packing: the learner's forward passes run on rows that hold several sequences.

A batch's rows are laid out one sequence per row, ``[pad | prompt | response | pad]`` (see
``rlx.trainer.experience``), so a batch of short answers beside one long one spends most of
its compute on padding. Packing places the sequences of each micro-batch end to end in fewer
rows of the same length ``T``, first-fit over the lengths sorted longest first::

    row 0: [seq 3 ........ | seq 0 .... | pad]
    row 1: [seq 1 ..... | seq 2 .... | seq 5 ..]
    row 2: [seq 4 ...... | pad ...............]

Each token attends only to the earlier tokens of its own sequence (a *segment*), and the
rotary positions restart at 0 with each one (``Transformer.hidden_states(segment_ids=,
positions=)``): every hidden state is the unpacked one. Only the transformer and the fused
log-prob kernel see the packed rows; their per-token log-probs and entropies are gathered back
to the unpacked ``[B, T]`` layout, where the policy losses, the per-sequence aggregations and
the metrics run unchanged. Packed and unpacked results are equal up to float summation order
(tests).

The host decides the placement from the sequences' lengths (``plan``), identically on every
process (the lengths and the mini-batch order are the same global arrays everywhere); the
jitted programs scatter the rows into place (``pack``) and gather the results back
(``unpack``). The number of packed rows is rounded up (``rows_for``), so that the programs
see few shapes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

ROW_BUCKETS = 8
"""Packed row counts are multiples of ``ceil(rows / ROW_BUCKETS)`` (and of the devices the
rows split over): at most this many shapes per unpacked shape, each compiled once."""


@struct.dataclass
class Packing:
  """Where each sequence of a micro-batch goes: row ``row[b]`` from slot ``offset[b]`` on.

  Leading axes (the updates, the micro-batches) are scanned over with the batch's. ``order``:
  for the update step, the row indices int [updates, mini-batch] of each mini-batch (the
  schedule the plan was made for), which the step then uses instead of drawing its own."""

  row: jax.Array
  """int32 [..., b]: the packed row of each sequence."""
  offset: jax.Array
  """int32 [..., b]: the slot of that row where the sequence's first token goes."""
  rows: int = struct.field(pytree_node=False)
  """R: packed rows per micro-batch (static: a shape of the compiled programs)."""
  order: jax.Array | None = None
  """int32 [updates, mini-batch] or None."""


def first_fit(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray, int]:
  """First-fit decreasing: ``(row, offset, rows used)`` placing sequences of ``lengths`` in
  rows of ``capacity`` slots, longest first, each in the first row it fits in."""
  lengths = np.asarray(lengths, np.int64)
  if lengths.size and lengths.max() > capacity:
    raise ValueError(f"a sequence of {lengths.max()} tokens does not fit a packed row of "
                     f"{capacity}")
  row = np.zeros(lengths.shape, np.int32)
  offset = np.zeros(lengths.shape, np.int32)
  fill: list[int] = []
  for i in np.argsort(-lengths, kind="stable"):
    n = int(lengths[i])
    r = next((r for r, used in enumerate(fill) if used + n <= capacity), len(fill))
    if r == len(fill):
      fill.append(0)
    row[i], offset[i] = r, fill[r]
    fill[r] += n
  return row, offset, max(len(fill), 1)


def rows_for(needed: int, sequences: int, ways: int = 1) -> int:
  """The packed row count for ``needed`` rows of a micro-batch of ``sequences``: rounded up
  to a multiple of ``ceil(sequences / ROW_BUCKETS)`` and of ``ways`` (the devices the rows
  split over, when the unpacked rows split over them), never more than the unpacked row
  count."""
  if sequences % ways:  # the unpacked rows do not split either: every device has every row
    ways = 1
  step = math.lcm(max(1, -(-sequences // ROW_BUCKETS)), ways)
  return min(-(-needed // step) * step, sequences)


def plan(lengths: np.ndarray, groups: np.ndarray, capacity: int, ways: int = 1,
         order: np.ndarray | None = None) -> Packing | None:
  """The packing of every micro-batch: ``groups`` int [..., b] are the row indices (into
  ``lengths``, the real tokens of each row) of each micro-batch, packed into rows of
  ``capacity`` slots. None when packing saves no row (every micro-batch would keep its
  unpacked row count): the unpacked programs are then as fast and already compiled."""
  groups = np.asarray(groups)
  placed = [first_fit(np.asarray(lengths)[g], capacity) for g in groups.reshape(-1, groups.shape[-1])]
  sequences = groups.shape[-1]
  rows = rows_for(max(used for _, _, used in placed), sequences, ways)
  if rows >= sequences:
    return None
  shape = groups.shape
  row = np.stack([r for r, _, _ in placed]).reshape(shape)
  offset = np.stack([o for _, o, _ in placed]).reshape(shape)
  return Packing(row=row, offset=offset, rows=rows, order=order)


def pad_fraction(lengths: np.ndarray, slots: int) -> float:
  """The share of ``slots`` token slots that hold no token of ``lengths``."""
  return 1.0 - float(np.sum(lengths)) / max(slots, 1)


def destinations(packing: Packing, attention_mask: jax.Array) -> jax.Array:
  """int [b, T]: each real token's index in the flattened packed rows [R * T]; padding gets
  R * T (out of range: dropped by ``pack``). One micro-batch (``packing`` without leading
  axes)."""
  b, T = attention_mask.shape
  real = attention_mask.astype(bool)
  position = jnp.cumsum(real, axis=1) - 1
  dest = packing.row[:, None] * T + packing.offset[:, None] + position
  return jnp.where(real, dest, packing.rows * T)


def pack(values: jax.Array, dest: jax.Array, rows: int, fill=0) -> jax.Array:
  """[b, T] values placed at ``dest`` in [rows, T] packed rows (``fill`` elsewhere)."""
  b, T = values.shape
  flat = jnp.full((rows * T,), fill, values.dtype)
  flat = flat.at[dest.reshape(-1)].set(values.reshape(-1), mode="drop", unique_indices=True)
  return flat.reshape(rows, T)


def unpack(packed: jax.Array, dest: jax.Array) -> jax.Array:
  """[rows, T] packed values gathered back to [b, T] (0 on padding)."""
  flat = packed.reshape(-1)
  return jnp.where(dest < flat.shape[0], flat[jnp.minimum(dest, flat.shape[0] - 1)], 0)


def segments(packing: Packing, attention_mask: jax.Array, dest: jax.Array
             ) -> tuple[jax.Array, jax.Array]:
  """The packed rows' segment ids (the sequence's index in the micro-batch; -1 on padding)
  and positions (in the sequence), [R, T] each."""
  b, T = attention_mask.shape
  index = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, T))
  position = jnp.maximum(jnp.cumsum(attention_mask.astype(bool), axis=1) - 1, 0)
  return (pack(index, dest, packing.rows, fill=-1),
          pack(position.astype(jnp.int32), dest, packing.rows))


def schedule_plan(lengths: np.ndarray, order: np.ndarray, micro_batches: int, capacity: int,
                  ways: int = 1) -> Packing | None:
  """The packing of an update step's schedule: ``order`` int [updates, mini-batch] (its
  ``schedule_order``), each mini-batch cut into ``micro_batches`` micro-batches."""
  order = np.asarray(order)
  updates, size = order.shape
  if size % micro_batches:
    raise ValueError(f"mini-batch of {size} sequences does not split into {micro_batches} "
                     "micro-batches (config.optimizer.micro_batches)")
  groups = order.reshape(updates, micro_batches, size // micro_batches)
  return plan(lengths, groups, capacity, ways, order=order.astype(np.int32))


def chunk_plan(lengths: np.ndarray, chunks: int, capacity: int, ways: int = 1) -> Packing | None:
  """The packing of a whole batch's rows in ``chunks`` consecutive chunks (``prepare``'s)."""
  size = len(lengths)
  if size % chunks:
    raise ValueError(f"batch of {size} sequences does not split into {chunks} chunks")
  return plan(lengths, np.arange(size).reshape(chunks, size // chunks), capacity, ways)
