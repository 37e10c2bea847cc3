"""Pallas kernels of the fused log-prob/entropy loss for TPUs (Mosaic).

On TPU a grid runs in order on each core, so reductions go over an
``"arbitrary"`` grid dimension while the other is ``"parallel"`` (split across
cores), and BlockSpecs stream tiles from HBM into VMEM:

- forward, grid (T / bt, V / bv): the vocab axis folds tiles into VMEM scratch
  statistics (online log-sum-exp), written out at the last vocab block;
- d hidden, grid (T / bt, V / bv): accumulates ``dz @ unembed_block.T`` in a
  float32 VMEM accumulator;
- d unembed, grid (V / bv, T / bt): accumulates ``hidden_block.T @ dz``.

Tiles of tokens whose response mask is all False are skipped. Per-token arrays
are [T, 1] columns. The tokens are padded to whole blocks by the caller
(``rlx.kernels.pallas_logprobs``); the vocabulary is not (a padded copy of the
unembedding would live from forward to backward): its last block is ragged, its
columns past the vocabulary are zeroed in VMEM before any matmul, and their part of
d unembed is never written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from rlx.kernels import pallas_common as tiles


def _forward_kernel(h_ref, w_ref, t_ref, m_ref, lp_ref, ent_ref, lse_ref, m_s, s_s, w_s, tl_s, *,
                    vocab_size, temperature):
  j = pl.program_id(1)
  rows, block_v = h_ref.shape[0], w_ref.shape[1]

  @pl.when(j == 0)
  def _():
    for ref, value in zip((m_s, s_s, w_s, tl_s), tiles.init_stats(rows)):
      ref[...] = value

  @pl.when(jnp.any(m_ref[...] != 0))
  def _():
    z, cols = tiles.masked_tile(h_ref[...], _unembed(w_ref, j, vocab_size), j * block_v,
                                vocab_size, temperature)
    stats = tiles.fold_tile((m_s[...], s_s[...], w_s[...], tl_s[...]), z, cols, t_ref[...])
    for ref, value in zip((m_s, s_s, w_s, tl_s), stats):
      ref[...] = value

  @pl.when(j == pl.num_programs(1) - 1)
  def _():
    active = m_ref[...] != 0
    logprob, entropy, lse = tiles.finish_stats((m_s[...], s_s[...], w_s[...], tl_s[...]))
    lp_ref[...] = jnp.where(active, logprob, 0.0)
    ent_ref[...] = jnp.where(active, entropy, 0.0)
    lse_ref[...] = jnp.where(active, lse, 0.0)


def _reduce_into(out_ref, acc, axis: int, active, contribution) -> None:
  """Sums ``contribution()`` over grid axis ``axis`` (an "arbitrary" one) in the float32
  scratch ``acc`` and writes the total to ``out_ref`` at the last step; skips inactive tiles."""
  k = pl.program_id(axis)

  @pl.when(k == 0)
  def _():
    acc[...] = jnp.zeros(acc.shape, jnp.float32)

  @pl.when(active)
  def _():
    acc[...] += contribution()

  @pl.when(k == pl.num_programs(axis) - 1)
  def _():
    out_ref[...] = acc[...].astype(out_ref.dtype)


def _unembed(w_ref, vocab_block, vocab_size):
  """The unembedding tile, zeroed past the vocabulary when the last block is ragged."""
  block_v = w_ref.shape[1]
  if vocab_size % block_v == 0:
    return w_ref[...]
  return tiles.valid_unembed(w_ref[...], vocab_block * block_v, vocab_size)


def _tile_dz(h_ref, unembed, t_ref, m_ref, lse_ref, ent_ref, glp_ref, gent_ref, vocab_block,
             vocab_size, temperature):
  """dz of one tile, from the unembedding tile as ``_unembed`` gives it."""
  return tiles.recompute_dz(h_ref[...], unembed, vocab_block * unembed.shape[1], t_ref[...],
                            m_ref[...], lse_ref[...], ent_ref[...], glp_ref[...], gent_ref[...],
                            vocab_size=vocab_size, temperature=temperature)


def _d_hidden_kernel(h_ref, w_ref, t_ref, m_ref, lse_ref, ent_ref, glp_ref, gent_ref, dh_ref, acc, *,
                     vocab_size, temperature):
  def contribution():  # dz @ unembed_block.T
    unembed = _unembed(w_ref, pl.program_id(1), vocab_size)  # read and masked once
    dz = _tile_dz(h_ref, unembed, t_ref, m_ref, lse_ref, ent_ref, glp_ref, gent_ref,
                  pl.program_id(1), vocab_size, temperature)
    return jax.lax.dot_general(dz.astype(unembed.dtype), unembed, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)

  _reduce_into(dh_ref, acc, 1, jnp.any(m_ref[...] != 0), contribution)


def _d_unembed_kernel(h_ref, w_ref, t_ref, m_ref, lse_ref, ent_ref, glp_ref, gent_ref, dw_ref, acc, *,
                      vocab_size, temperature):
  def contribution():  # hidden_block.T @ dz
    dz = _tile_dz(h_ref, _unembed(w_ref, pl.program_id(0), vocab_size), t_ref, m_ref, lse_ref,
                  ent_ref, glp_ref, gent_ref, pl.program_id(0), vocab_size, temperature)
    return jax.lax.dot_general(h_ref[...], dz.astype(h_ref.dtype), (((0,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32)

  _reduce_into(dw_ref, acc, 1, jnp.any(m_ref[...] != 0), contribution)


def _params(semantics):
  return pltpu.CompilerParams(dimension_semantics=semantics)


def _interpret(interpret: bool):
  # reads past an array's end (the ragged vocabulary block) give NaN, as garbage would on a TPU
  return pltpu.InterpretParams(out_of_bounds_reads="uninitialized") if interpret else False


def vmem_bytes(block_t: int, block_v: int, width: int, itemsize: int) -> int:
  """The most VMEM any of the three kernels needs (double-buffered input and output blocks,
  float32 accumulators and logit tiles): the bound that block sizes are chosen under."""
  hidden, unembed = 2 * block_t * width * itemsize, 2 * width * block_v * itemsize
  tiles_f32 = 4 * block_t * block_v * 4
  forward = hidden + unembed + tiles_f32
  d_hidden = hidden + unembed + block_t * width * 4 + 2 * block_t * width * itemsize + tiles_f32
  d_unembed = hidden + unembed + width * block_v * 4 + 2 * width * block_v * itemsize + tiles_f32
  return max(forward, d_hidden, d_unembed)


def forward(hidden, unembed, targets, mask, *, vocab_size, block_t, block_v, temperature, interpret):
  """(logprob, entropy, lse), each [Tp, 1], for hidden [Tp, D] (tokens padded to whole blocks)
  and unembed [D, V]."""
  T, D = hidden.shape
  V = unembed.shape[1]
  column = pl.BlockSpec((block_t, 1), lambda i, j: (i, 0))
  out = jax.ShapeDtypeStruct((T, 1), jnp.float32)
  return pl.pallas_call(
      functools.partial(_forward_kernel, vocab_size=vocab_size, temperature=temperature),
      grid=(T // block_t, pl.cdiv(V, block_v)), out_shape=(out, out, out),
      in_specs=[pl.BlockSpec((block_t, D), lambda i, j: (i, 0)),
                pl.BlockSpec((D, block_v), lambda i, j: (0, j)), column, column],
      out_specs=(column, column, column),
      scratch_shapes=[pltpu.VMEM((block_t, 1), jnp.float32)] * 4,
      compiler_params=_params(("parallel", "arbitrary")),
      interpret=_interpret(interpret), name="rlx_logprobs_fwd",
  )(hidden, unembed, targets, mask)


def backward(hidden, unembed, targets, mask, lse, entropy, g_logprob, g_entropy, *, vocab_size,
             block_t, block_v, temperature, interpret):
  """(d hidden [Tp, D], d unembed [D, V]) (per-token arrays [Tp, 1])."""
  T, D = hidden.shape
  V = unembed.shape[1]
  interpret = _interpret(interpret)
  per_token = (targets, mask, lse, entropy, g_logprob, g_entropy)
  column = pl.BlockSpec((block_t, 1), lambda i, j: (i, 0))
  d_hidden = pl.pallas_call(
      functools.partial(_d_hidden_kernel, vocab_size=vocab_size, temperature=temperature),
      grid=(T // block_t, pl.cdiv(V, block_v)),
      out_shape=jax.ShapeDtypeStruct(hidden.shape, hidden.dtype),
      in_specs=[pl.BlockSpec((block_t, D), lambda i, j: (i, 0)),
                pl.BlockSpec((D, block_v), lambda i, j: (0, j))] + [column] * 6,
      out_specs=pl.BlockSpec((block_t, D), lambda i, j: (i, 0)),
      scratch_shapes=[pltpu.VMEM((block_t, D), jnp.float32)],
      compiler_params=_params(("parallel", "arbitrary")), interpret=interpret,
      name="rlx_logprobs_d_hidden",
  )(hidden, unembed, *per_token)
  column = pl.BlockSpec((block_t, 1), lambda j, i: (i, 0))
  d_unembed = pl.pallas_call(
      functools.partial(_d_unembed_kernel, vocab_size=vocab_size, temperature=temperature),
      grid=(pl.cdiv(V, block_v), T // block_t),
      out_shape=jax.ShapeDtypeStruct(unembed.shape, unembed.dtype),
      in_specs=[pl.BlockSpec((block_t, D), lambda j, i: (i, 0)),
                pl.BlockSpec((D, block_v), lambda j, i: (0, j))] + [column] * 6,
      out_specs=pl.BlockSpec((D, block_v), lambda j, i: (0, j)),
      scratch_shapes=[pltpu.VMEM((D, block_v), jnp.float32)],
      compiler_params=_params(("parallel", "arbitrary")), interpret=interpret,
      name="rlx_logprobs_d_unembed",
  )(hidden, unembed, *per_token)
  return d_hidden, d_unembed
