"""Pallas kernels of the fused log-prob/entropy loss for GPUs (Triton lowering).

Why Triton rather than Mosaic GPU: these kernels are matmul tiles plus
row reductions with an online log-sum-exp, which Pallas' Triton lowering
expresses directly (``jnp.dot`` on blocks, ``fori_loop`` over the vocabulary,
masked loads), on every NVIDIA generation from Ampere on; Mosaic GPU targets
Hopper+ warpgroup programming and would pin the kernels to H100/H200-class
parts for no gain at these arithmetic intensities.

GPU program instances run in any order, so no reduction crosses the grid: each
program owns a block of tokens (forward, d hidden) or a block of the
vocabulary (d unembed) and loops over the other dimension inside the kernel.

- forward, grid (T / bt,): per token, logprob, entropy, lse;
- d hidden, grid (T / bt,): loops over vocab blocks, recomputing each tile;
- d unembed, grid (V / bv,): loops over token blocks, recomputing each tile.

Blocks of tokens whose response mask is all False are skipped (their outputs
and gradients are 0). Triton lowering needs every array in a kernel to have
power-of-two sides: blocks are powers of two, and the caller
(``rlx.kernels.pallas_logprobs``) pads the model width to one and the tokens
and vocabulary to whole blocks. Whole-array refs (the unembedding in the
forward pass, the tokens in d unembed) are only ever read in such blocks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from rlx.kernels import pallas_common as tiles


def _forward_kernel(h_ref, w_ref, t_ref, m_ref, lp_ref, ent_ref, lse_ref, *, vocab_size, block_v,
                    temperature):
  rows = h_ref.shape[0]
  active = jnp.max(m_ref[...]) != 0

  @pl.when(active)
  def _():
    hidden, targets = h_ref[...], t_ref[...]

    def body(j, stats):
      first = j * block_v
      z, cols = tiles.masked_tile(hidden, w_ref[:, pl.ds(first, block_v)], first, vocab_size,
                                  temperature)
      return tiles.fold_tile(stats, z, cols, targets)

    stats = jax.lax.fori_loop(0, w_ref.shape[1] // block_v, body, tiles.init_stats(rows))
    logprob, entropy, lse = tiles.finish_stats(stats)
    wanted = m_ref[...] != 0
    lp_ref[...] = jnp.where(wanted, logprob, 0.0)
    ent_ref[...] = jnp.where(wanted, entropy, 0.0)
    lse_ref[...] = jnp.where(wanted, lse, 0.0)

  @pl.when(jnp.logical_not(active))
  def _():
    zeros = jnp.zeros((rows, 1), jnp.float32)
    lp_ref[...], ent_ref[...], lse_ref[...] = zeros, zeros, zeros


def _d_hidden_kernel(h_ref, w_ref, t_ref, m_ref, lse_ref, ent_ref, glp_ref, gent_ref, dh_ref, *,
                     vocab_size, block_v, temperature):
  active = jnp.max(m_ref[...]) != 0

  @pl.when(active)
  def _():
    hidden, targets, mask = h_ref[...], t_ref[...], m_ref[...]
    lse, entropy, g_lp, g_ent = lse_ref[...], ent_ref[...], glp_ref[...], gent_ref[...]

    def body(j, acc):
      first = j * block_v
      w_block = w_ref[:, pl.ds(first, block_v)]
      dz = tiles.recompute_dz(hidden, w_block, first, targets, mask, lse, entropy, g_lp, g_ent,
                              vocab_size=vocab_size, temperature=temperature)
      return acc + jnp.dot(dz.astype(w_block.dtype), w_block.T, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, w_ref.shape[1] // block_v, body,
                            jnp.zeros(dh_ref.shape, jnp.float32))
    dh_ref[...] = acc.astype(dh_ref.dtype)

  @pl.when(jnp.logical_not(active))
  def _():
    dh_ref[...] = jnp.zeros(dh_ref.shape, dh_ref.dtype)


def _d_unembed_kernel(h_ref, w_ref, t_ref, m_ref, lse_ref, ent_ref, glp_ref, gent_ref, dw_ref, *,
                      vocab_size, block_t, temperature):
  first = pl.program_id(0) * w_ref.shape[1]
  w_block = w_ref[...]

  def body(i, acc):
    rows = (pl.ds(i * block_t, block_t), slice(None))

    def add(acc):
      hidden = h_ref[pl.ds(i * block_t, block_t), :]
      dz = tiles.recompute_dz(hidden, w_block, first, t_ref[rows], m_ref[rows], lse_ref[rows],
                              ent_ref[rows], glp_ref[rows], gent_ref[rows], vocab_size=vocab_size,
                              temperature=temperature)
      return acc + jnp.dot(hidden.T, dz.astype(hidden.dtype), preferred_element_type=jnp.float32)

    return jax.lax.cond(jnp.max(m_ref[rows]) != 0, add, lambda acc: acc, acc)

  acc = jax.lax.fori_loop(0, h_ref.shape[0] // block_t, body, jnp.zeros(dw_ref.shape, jnp.float32))
  dw_ref[...] = acc.astype(dw_ref.dtype)


def forward(hidden, unembed, targets, mask, *, vocab_size, block_t, block_v, temperature, interpret):
  """(logprob, entropy, lse), each [Tp, 1], for padded inputs hidden [Tp, D], unembed [D, Vp]
  and per-token targets, mask [Tp, 1]."""
  T, D = hidden.shape
  token_block = pl.BlockSpec((block_t, 1), lambda i: (i, 0))
  kernel = functools.partial(_forward_kernel, vocab_size=vocab_size, block_v=block_v,
                             temperature=temperature)
  out = jax.ShapeDtypeStruct((T, 1), jnp.float32)
  return pl.pallas_call(
      kernel, grid=(T // block_t,), out_shape=(out, out, out),
      in_specs=[pl.BlockSpec((block_t, D), lambda i: (i, 0)),
                pl.BlockSpec(unembed.shape, lambda i: (0, 0)), token_block, token_block],
      out_specs=(token_block, token_block, token_block),
      interpret=interpret, name="rlx_logprobs_fwd")(hidden, unembed, targets, mask)


def backward(hidden, unembed, targets, mask, lse, entropy, g_logprob, g_entropy, *, vocab_size,
             block_t, block_v, temperature, interpret):
  """(d hidden [Tp, D], d unembed [D, Vp]) for padded inputs (per-token arrays [Tp, 1])."""
  T, D = hidden.shape
  V = unembed.shape[1]
  token_block = pl.BlockSpec((block_t, 1), lambda i: (i, 0))
  d_hidden = pl.pallas_call(
      functools.partial(_d_hidden_kernel, vocab_size=vocab_size, block_v=block_v,
                        temperature=temperature),
      grid=(T // block_t,), out_shape=jax.ShapeDtypeStruct(hidden.shape, hidden.dtype),
      in_specs=[pl.BlockSpec((block_t, D), lambda i: (i, 0)),
                pl.BlockSpec(unembed.shape, lambda i: (0, 0))] + [token_block] * 6,
      out_specs=pl.BlockSpec((block_t, D), lambda i: (i, 0)),
      interpret=interpret, name="rlx_logprobs_d_hidden",
  )(hidden, unembed, targets, mask, lse, entropy, g_logprob, g_entropy)
  whole_tokens = pl.BlockSpec((T, 1), lambda j: (0, 0))
  d_unembed = pl.pallas_call(
      functools.partial(_d_unembed_kernel, vocab_size=vocab_size, block_t=block_t,
                        temperature=temperature),
      grid=(V // block_v,), out_shape=jax.ShapeDtypeStruct(unembed.shape, unembed.dtype),
      in_specs=[pl.BlockSpec(hidden.shape, lambda j: (0, 0)),
                pl.BlockSpec((D, block_v), lambda j: (0, j))] + [whole_tokens] * 6,
      out_specs=pl.BlockSpec((D, block_v), lambda j: (0, j)),
      interpret=interpret, name="rlx_logprobs_d_unembed",
  )(hidden, unembed, targets, mask, lse, entropy, g_logprob, g_entropy)
  return d_hidden, d_unembed
