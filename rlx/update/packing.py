"""Sequence packing: the learner's forward passes run on rows that hold several sequences.

A batch's rows are laid out one sequence per row, ``[pad | prompt | response | pad]`` (see
``rlx.trainer.learn.experience``), so a batch of short answers beside one long one spends most of
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

**Shared prefixes.** A GRPO group's samples share their prompt: forwarded once per sample, it
is most of the learner's compute when prompts are long beside the answers. Where consecutive
rows of a batch begin with the same tokens (``shared_prefixes``), the plan places a group's
sequences in one row behind a single copy of the prefix: the first (its *lead*) whole, the others
from the first token after the prefix::

    row 0: [prompt A | answer A0 | answer A1 | answer A2 | prompt B | answer B0 | ... ]

An answer attends to its group's prefix and to itself (``Transformer.hidden_states(group_ids=,
shared=)``) with the positions it has unpacked, so every hidden state is the unpacked one; each
target token's log-prob is taken from the hidden state of the token before it in its own
sequence (for an answer's first token, the prefix's last), so a gradient through the prefix is
the sum of its samples' gradients, as unpacked. The packed rows may then be longer than the
unpacked ones (``Packing.width``, a power-of-two multiple of them) so that a whole group fits.

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
  """int32 [..., b]: the slot of that row where the first token the sequence places goes."""
  rows: int = struct.field(pytree_node=False)
  """R: packed rows per micro-batch (static: a shape of the compiled programs)."""
  order: jax.Array | None = None
  """int32 [updates, mini-batch] or None."""
  lead: jax.Array | None = None
  """int32 [..., b] or None (nothing shared): the sequence (its index in the micro-batch) that
  places the prefix this one shares; itself where it places its own tokens from the first."""
  prefix: jax.Array | None = None
  """int32 [..., b] or None: how many leading real tokens of each sequence are its group's
  shared prefix in its row (0: none); the lead places them, the others skip them."""
  width: int | None = struct.field(pytree_node=False, default=None)
  """W: the packed rows' length (static); None: the unpacked rows' length T."""


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


def units(lengths: np.ndarray, links: np.ndarray | None, capacity: int
          ) -> list[tuple[list[int], int]]:
  """The sequences of one micro-batch (``lengths``, in the order given) cut into *units* that
  go into a row together, each ``(members, prefix)``: the members of one group share their
  first ``prefix`` tokens (the first member places them), the unit fits ``capacity`` slots, and
  a lone sequence is a unit with prefix 0. ``links[i]``: how many leading tokens member i shares
  with member i - 1 of the same group (0: it starts a new group; see ``shared_prefixes``)."""
  lengths = np.asarray(lengths, np.int64)
  if links is None:
    return [([i], 0) for i in range(len(lengths))]
  size = lambda members, prefix: int(lengths[members].sum()) - prefix * (len(members) - 1)
  out: list[tuple[list[int], int]] = []
  members, prefix = [0], 0
  for i in range(1, len(lengths)):
    shared = int(links[i]) if len(members) == 1 else min(prefix, int(links[i]))
    if links[i] > 0 and size(members + [i], shared) <= capacity:
      members, prefix = members + [i], shared
    else:
      out.append((members, prefix))
      members, prefix = [i], 0
  if len(lengths):
    out.append((members, prefix))
  return out


def place(lengths: np.ndarray, capacity: int, links: np.ndarray | None = None
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
  """``(row, offset, lead, prefix, rows used)`` of one micro-batch's sequences in rows of
  ``capacity`` slots: its ``units`` first-fit decreasing, each unit's members one after the
  other behind their lead (``Packing``'s fields)."""
  lengths = np.asarray(lengths, np.int64)
  grouped = units(lengths, links, capacity)
  sizes = np.array([sum(int(lengths[m]) - (prefix if k else 0) for k, m in enumerate(members))
                    for members, prefix in grouped], np.int64)
  unit_row, unit_offset, used = first_fit(sizes, capacity)
  row = np.zeros(lengths.shape, np.int32)
  offset = np.zeros(lengths.shape, np.int32)
  lead = np.arange(len(lengths), dtype=np.int32)
  prefix = np.zeros(lengths.shape, np.int32)
  for (members, shared), r, o in zip(grouped, unit_row, unit_offset):
    for k, m in enumerate(members):
      row[m], offset[m], lead[m], prefix[m] = r, o, members[0], shared
      o += int(lengths[m]) - (shared if k else 0)
  return row, offset, lead, prefix, used


def rows_for(needed: int, sequences: int, ways: int = 1) -> int:
  """The packed row count for ``needed`` rows of a micro-batch of ``sequences``: rounded up
  to a multiple of ``ceil(sequences / ROW_BUCKETS)`` and of ``ways`` (the devices the rows
  split over, when the unpacked rows split over them), never more than the unpacked row
  count."""
  if sequences % ways:  # the unpacked rows do not split either: every device has every row
    ways = 1
  step = math.lcm(max(1, -(-sequences // ROW_BUCKETS)), ways)
  return min(-(-needed // step) * step, sequences)


WIDTHS = (1, 2, 4, 8)
"""With shared prefixes, the packed rows' lengths tried: these multiples of the unpacked one."""


def plan(lengths: np.ndarray, groups: np.ndarray, capacity: int, ways: int = 1,
         order: np.ndarray | None = None, links: np.ndarray | None = None) -> Packing | None:
  """The packing of every micro-batch: ``groups`` int [..., b] are the row indices (into
  ``lengths``, the real tokens of each row) of each micro-batch, packed into rows of
  ``capacity`` slots. None when packing saves no token slot: the unpacked programs are then as
  fast and already compiled.

  ``links`` (``shared_prefixes``, over the same rows as ``lengths``): the groups' shared
  prefixes are placed once per row; the rows may then be a few times ``capacity`` long, the
  width that needs the fewest token slots (the shortest of equals)."""
  groups = np.asarray(groups)
  lengths = np.asarray(lengths)
  flat = groups.reshape(-1, groups.shape[-1])
  sequences = groups.shape[-1]
  best = None
  for factor in (WIDTHS if links is not None else (1,)):
    width = capacity * factor
    placed = [_place_members(lengths, g, width, links) for g in flat]
    rows = rows_for(max(p[-1] for p in placed), sequences, ways)
    if best is None or rows * width < best[0] * best[1]:
      best = (rows, width, placed)
  rows, width, placed = best
  if rows * width >= sequences * capacity:
    return None
  shape = groups.shape
  row, offset, lead, prefix = (np.stack([p[i] for p in placed]).reshape(shape) for i in range(4))
  if links is None or not prefix.any():
    return Packing(row=row, offset=offset, rows=rows, order=order,
                   width=None if width == capacity else width)
  return Packing(row=row, offset=offset, rows=rows, order=order, lead=lead, prefix=prefix,
                 width=None if width == capacity else width)


def _place_members(lengths: np.ndarray, members: np.ndarray, capacity: int,
                   links: np.ndarray | None):
  """``place`` for the batch rows ``members`` of one micro-batch, in their order there; with
  ``links``, a group's members are placed in the batch's order (wherever the schedule put them
  in the micro-batch), so that they meet."""
  if links is None:
    return place(lengths[members], capacity)
  by_row = np.argsort(members, kind="stable")
  row, offset, lead, prefix, used = place(lengths[members[by_row]], capacity,
                                          _member_links(links, members[by_row]))
  back = np.empty_like(by_row)
  back[by_row] = np.arange(len(by_row))
  lead = by_row[lead].astype(np.int32)  # as indices into the micro-batch's own order
  return row[back], offset[back], lead[back], prefix[back], used


def _member_links(links: np.ndarray, members: np.ndarray) -> np.ndarray:
  """``links`` of the rows ``members`` (of one micro-batch, in its order) to the member before:
  what row ``m`` shares with the previous member ``p`` is the least link between them (the
  batch's rows in between share at least that with both), 0 unless ``p < m``."""
  links = np.asarray(links)
  out = np.zeros(len(members), np.int64)
  for k in range(1, len(members)):
    p, m = int(members[k - 1]), int(members[k])
    out[k] = links[p + 1:m + 1].min() if p < m else 0
  return out


def shared_prefixes(tokens: jax.Array, attention_mask: jax.Array, response_mask: jax.Array
                    ) -> jax.Array:
  """int32 [B]: how many leading real tokens each row shares with the row before it (0 for the
  first), never past either row's first response token (only context is shared: every target
  stays its own sequence's). Rows laid out as the learner's (``[pad | prompt | response |
  pad]``, the prompts ending at one column) share exactly when their prompts are equal."""
  B, T = tokens.shape
  real = attention_mask.astype(bool)
  differs = (tokens[1:] != tokens[:-1]) | (real[1:] != real[:-1])  # [B - 1, T]
  first_diff = jnp.where(differs.any(1), jnp.argmax(differs, axis=1), T)
  response = response_mask.astype(bool)
  first_target = jnp.where(response.any(1), jnp.argmax(response, axis=1), T)
  end = jnp.minimum(first_diff, jnp.minimum(first_target[1:], first_target[:-1]))
  shared = jnp.sum(real[1:] & (jnp.arange(T)[None] < end[:, None]), axis=1, dtype=jnp.int32)
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), shared])


def pad_fraction(lengths: np.ndarray, slots: int) -> float:
  """The share of ``slots`` token slots that hold no token of ``lengths``."""
  return 1.0 - float(np.sum(lengths)) / max(slots, 1)


def width(packing: Packing, attention_mask: jax.Array) -> int:
  """W, the packed rows' length."""
  return attention_mask.shape[1] if packing.width is None else packing.width


def destinations(packing: Packing, attention_mask: jax.Array) -> jax.Array:
  """int [b, T]: each real token's index in the flattened packed rows [R * W] (a token of a
  shared prefix: where its lead placed it); padding gets R * W (out of range: dropped by
  ``pack``). One micro-batch (``packing`` without leading axes)."""
  W = width(packing, attention_mask)
  real = attention_mask.astype(bool)
  position = jnp.cumsum(real, axis=1) - 1
  start = packing.row[:, None] * W
  if packing.lead is None:
    dest = start + packing.offset[:, None] + position
  else:
    prefix = packing.prefix[:, None]
    skipped = jnp.where(packing.lead == jnp.arange(packing.lead.shape[0]), 0, packing.prefix)
    dest = start + jnp.where(position < prefix, packing.offset[packing.lead][:, None] + position,
                             packing.offset[:, None] + position - skipped[:, None])
  return jnp.where(real, dest, packing.rows * W)


def placements(packing: Packing, attention_mask: jax.Array, dest: jax.Array) -> jax.Array:
  """``dest`` where each row places its own tokens: a shared prefix's tokens only in its lead's
  row of the batch (out of range in the others')."""
  if packing.lead is None:
    return dest
  position = jnp.cumsum(attention_mask.astype(bool), axis=1) - 1
  follower = packing.lead != jnp.arange(packing.lead.shape[0])
  skipped = follower[:, None] & (position < packing.prefix[:, None])
  return jnp.where(skipped, packing.rows * width(packing, attention_mask), dest)


def pack(values: jax.Array, dest: jax.Array, rows: int, fill=0, width: int | None = None
         ) -> jax.Array:
  """[b, T] values placed at ``dest`` (each index at most once: ``placements``) in [rows, W]
  packed rows (``fill`` elsewhere; W is ``width``, or T)."""
  b, T = values.shape
  W = T if width is None else width
  flat = jnp.full((rows * W,), fill, values.dtype)
  flat = flat.at[dest.reshape(-1)].set(values.reshape(-1), mode="drop", unique_indices=True)
  return flat.reshape(rows, W)


def unpack(packed: jax.Array, dest: jax.Array) -> jax.Array:
  """[rows, T] packed values gathered back to [b, T] (0 on padding)."""
  flat = packed.reshape(-1)
  return jnp.where(dest < flat.shape[0], flat[jnp.minimum(dest, flat.shape[0] - 1)], 0)


def segments(packing: Packing, attention_mask: jax.Array, place: jax.Array
             ) -> tuple[jax.Array, jax.Array]:
  """The packed rows' segment ids (the sequence's index in the micro-batch; -1 on padding)
  and positions (in the sequence), [R, W] each. ``place``: ``placements``."""
  b, T = attention_mask.shape
  W = width(packing, attention_mask)
  index = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, T))
  position = jnp.maximum(jnp.cumsum(attention_mask.astype(bool), axis=1) - 1, 0)
  return (pack(index, place, packing.rows, fill=-1, width=W),
          pack(position.astype(jnp.int32), place, packing.rows, width=W))


def groups(packing: Packing, attention_mask: jax.Array, place: jax.Array
           ) -> tuple[jax.Array, jax.Array] | tuple[None, None]:
  """The packed rows' group ids (the lead's index; -1 on padding) and whether each token is
  its group's shared prefix, [R, W] each; (None, None) when nothing is shared."""
  if packing.lead is None:
    return None, None
  b, T = attention_mask.shape
  W = width(packing, attention_mask)
  position = jnp.cumsum(attention_mask.astype(bool), axis=1) - 1
  lead = jnp.broadcast_to(packing.lead[:, None], (b, T)).astype(jnp.int32)
  return (pack(lead, place, packing.rows, fill=-1, width=W),
          pack(position < packing.prefix[:, None], place, packing.rows, fill=False, width=W))


def sources(packing: Packing, attention_mask: jax.Array, dest: jax.Array, place: jax.Array
            ) -> jax.Array:
  """int [R * W]: for each packed slot, the slot of the token before it in its own sequence
  (the hidden state its log-prob is taken from): the slot before it, except where a sequence's
  first own token follows its group's shared prefix; itself where it has none."""
  W = width(packing, attention_mask)
  before = jnp.concatenate([dest[:, :1], dest[:, :-1]], axis=1)  # the predecessor's slot
  first = jnp.cumsum(attention_mask.astype(bool), axis=1) <= 1  # no predecessor: itself
  before = jnp.where(first, dest, before)
  slots = jnp.arange(packing.rows * W, dtype=jnp.int32)
  return slots.at[place.reshape(-1)].set(before.reshape(-1).astype(jnp.int32), mode="drop",
                                         unique_indices=True)


def schedule_plan(lengths: np.ndarray, order: np.ndarray, micro_batches: int, capacity: int,
                  ways: int = 1, links: np.ndarray | None = None) -> Packing | None:
  """The packing of an update step's schedule: ``order`` int [updates, mini-batch] (its
  ``schedule_order``), each mini-batch cut into ``micro_batches`` micro-batches; ``links``:
  ``plan``'s."""
  order = np.asarray(order)
  updates, size = order.shape
  if size % micro_batches:
    raise ValueError(f"mini-batch of {size} sequences does not split into {micro_batches} "
                     "micro-batches (config.optimizer.micro_batches)")
  groups = order.reshape(updates, micro_batches, size // micro_batches)
  return plan(lengths, groups, capacity, ways, order=order.astype(np.int32), links=links)


def chunk_plan(lengths: np.ndarray, chunks: int, capacity: int, ways: int = 1,
               links: np.ndarray | None = None) -> Packing | None:
  """The packing of a whole batch's rows in ``chunks`` consecutive chunks (``prepare``'s)."""
  size = len(lengths)
  if size % chunks:
    raise ValueError(f"batch of {size} sequences does not split into {chunks} chunks")
  return plan(lengths, np.arange(size).reshape(chunks, size // chunks), capacity, ways,
              links=links)
