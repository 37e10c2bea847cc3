"""Pallas kernels of the fused log-prob/entropy loss for GPUs (Triton lowering, pinned with
``pallas.triton.CompilerParams``).

Why Triton rather than Mosaic GPU: these kernels are matmul tiles plus row reductions with an
online log-sum-exp, which Pallas' Triton lowering expresses directly (``jnp.dot`` on blocks,
``fori_loop`` over the vocabulary and the model width), on every NVIDIA generation from
Ampere on; Mosaic GPU targets Hopper+ warpgroup programming and would pin the kernels to
H100/H200-class parts.

Shared memory is what a GPU program has least of (227 KiB on H100, 163 KiB on A100), so no
program ever holds a whole row of the model width: a logit tile ``z [bt, bv]`` is
accumulated in float32 over chunks of ``bd`` of the width, and the gradients are written
chunk by chunk. A program needs O(bt*bd + bd*bv + bt*bv) of it, whatever the model's width.

GPU program instances run in any order, so no reduction crosses the grid: each program owns
a block of tokens (forward, d hidden) or a block of the vocabulary (d unembed) and loops
over the other dimension inside the kernel:

- forward, grid (T / bt,): per token, logprob, entropy, lse;
- d hidden, grid (T / bt,): over vocab blocks, recompute each tile's ``dz`` and add
  ``dz @ unembed_block.T`` into its rows of a float32 output, chunk by chunk of the width;
- d unembed, grid (V / bv,): over token blocks, add ``hidden_block.T @ dz`` into its
  columns of a float32 output.

Blocks of tokens whose response mask is all False are skipped (their outputs and gradients
are 0). Triton needs power-of-two tiles: bt, bv and bd are powers of two; the caller
(``rlx.kernels.pallas_logprobs``) pads the tokens and the vocabulary to whole blocks, and the
width to a multiple of bd only when it is not one already (real models' widths are).
Matmuls take the inputs' dtype and accumulate in float32; float32 inputs multiply at full
float32 precision (``precision=HIGHEST``: no TF32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from rlx.kernels import pallas_common as tiles

WARPS, STAGES = 4, 2  # untuned: no GPU was at hand to tune them on; they compile on A100 and H100


def _params():
  return plgpu.CompilerParams(num_warps=WARPS, num_stages=STAGES)


def _dot(a, b):
  """a @ b accumulated in float32. Triton multiplies like dtypes only: bf16 activations against
  float32 weights multiply in bf16, as the model's own matmuls do."""
  if a.dtype != b.dtype:
    narrow = min((a.dtype, b.dtype), key=lambda dtype: jnp.finfo(dtype).bits)
    a, b = a.astype(narrow), b.astype(narrow)
  precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=precision)


def _logit_tile(h_ref, w_ref, rows, first_col, *, block_v, block_d, vocab_size, temperature):
  """z [bt, bv] = hidden[rows] @ unembed[:, first_col:+bv] / temperature (``rows`` a ``pl.ds``
  of bt), accumulated over chunks of the width; columns past the vocabulary set to NEG_INF."""
  def width_chunk(k, acc):
    d = pl.ds(k * block_d, block_d)
    return acc + _dot(h_ref[rows, d], w_ref[d, pl.ds(first_col, block_v)])

  z = jax.lax.fori_loop(0, h_ref.shape[1] // block_d, width_chunk,
                        jnp.zeros((rows.size, block_v), jnp.float32)) / temperature
  cols = first_col + jax.lax.broadcasted_iota(jnp.int32, z.shape, 1)
  return jnp.where(cols < vocab_size, z, tiles.NEG_INF), cols


def _forward_kernel(h_ref, w_ref, t_ref, m_ref, lp_ref, ent_ref, lse_ref, *, vocab_size, block_v,
                    block_d, temperature):
  rows = h_ref.shape[0]
  active = jnp.max(m_ref[...]) != 0

  @pl.when(active)
  def _():
    targets = t_ref[...]

    def vocab_block(j, stats):
      z, cols = _logit_tile(h_ref, w_ref, pl.ds(0, rows), j * block_v, block_v=block_v,
                            block_d=block_d, vocab_size=vocab_size, temperature=temperature)
      return tiles.fold_tile(stats, z, cols, targets)

    stats = jax.lax.fori_loop(0, w_ref.shape[1] // block_v, vocab_block, tiles.init_stats(rows))
    logprob, entropy, lse = tiles.finish_stats(stats)
    wanted = m_ref[...] != 0
    lp_ref[...] = jnp.where(wanted, logprob, 0.0)
    ent_ref[...] = jnp.where(wanted, entropy, 0.0)
    lse_ref[...] = jnp.where(wanted, lse, 0.0)

  @pl.when(jnp.logical_not(active))
  def _():
    zeros = jnp.zeros((rows, 1), jnp.float32)
    lp_ref[...], ent_ref[...], lse_ref[...] = zeros, zeros, zeros


def _tile_dz(h_ref, w_ref, rows, first_col, targets, mask, lse, entropy, g_lp, g_ent, *, block_v,
             block_d, vocab_size, temperature):
  z, cols = _logit_tile(h_ref, w_ref, rows, first_col, block_v=block_v, block_d=block_d,
                        vocab_size=vocab_size, temperature=temperature)
  return tiles.tile_grad(z, cols, targets, lse, entropy, g_lp, g_ent, mask != 0, temperature)


def _zero(out_ref, chunks: int, block_d: int, axis: int) -> None:
  def clear(k, carry):
    d = pl.ds(k * block_d, block_d)
    index = (slice(None), d) if axis == 1 else (d, slice(None))
    shape = list(out_ref.shape)
    shape[axis] = block_d
    out_ref[index] = jnp.zeros(shape, out_ref.dtype)
    return carry

  jax.lax.fori_loop(0, chunks, clear, 0)


def _d_hidden_kernel(h_ref, w_ref, t_ref, m_ref, lse_ref, ent_ref, glp_ref, gent_ref, dh_ref, *,
                     vocab_size, block_v, block_d, temperature):
  chunks = h_ref.shape[1] // block_d
  _zero(dh_ref, chunks, block_d, axis=1)

  @pl.when(jnp.max(m_ref[...]) != 0)
  def _():
    per_token = (t_ref[...], m_ref[...], lse_ref[...], ent_ref[...], glp_ref[...], gent_ref[...])

    def vocab_block(j, carry):
      first = j * block_v
      dz = _tile_dz(h_ref, w_ref, pl.ds(0, h_ref.shape[0]), first, *per_token, block_v=block_v,
                    block_d=block_d, vocab_size=vocab_size, temperature=temperature)

      def width_chunk(k, carry):  # dh[:, chunk] += dz @ unembed[chunk, block].T
        d = pl.ds(k * block_d, block_d)
        w = w_ref[d, pl.ds(first, block_v)]
        dh_ref[:, d] += _dot(dz.astype(w.dtype), w.T)
        return carry

      return jax.lax.fori_loop(0, chunks, width_chunk, carry)

    jax.lax.fori_loop(0, w_ref.shape[1] // block_v, vocab_block, 0)


def _d_unembed_kernel(h_ref, w_ref, t_ref, m_ref, lse_ref, ent_ref, glp_ref, gent_ref, dw_ref, *,
                      vocab_size, block_t, block_v, block_d, temperature):
  first = pl.program_id(0) * block_v
  chunks = h_ref.shape[1] // block_d
  _zero(dw_ref, chunks, block_d, axis=0)

  def token_block(i, carry):
    rows = pl.ds(i * block_t, block_t)

    def add(carry):
      per_token = tuple(ref[rows, :] for ref in (t_ref, m_ref, lse_ref, ent_ref, glp_ref,
                                                   gent_ref))
      dz = _tile_dz(h_ref, w_ref, rows, first, *per_token, block_v=block_v, block_d=block_d,
                    vocab_size=vocab_size, temperature=temperature)

      def width_chunk(k, carry):  # dW[chunk, :] += hidden[rows, chunk].T @ dz
        d = pl.ds(k * block_d, block_d)
        hidden = h_ref[rows, d]
        dw_ref[d, :] += _dot(hidden.T, dz.astype(hidden.dtype))
        return carry

      return jax.lax.fori_loop(0, chunks, width_chunk, carry)

    return jax.lax.cond(jnp.max(m_ref[rows, :]) != 0, add, lambda carry: carry, carry)

  jax.lax.fori_loop(0, h_ref.shape[0] // block_t, token_block, 0)


def forward(hidden, unembed, targets, mask, *, vocab_size, block_t, block_v, block_d, temperature,
            interpret):
  """(logprob, entropy, lse), each [Tp, 1], for padded inputs hidden [Tp, D], unembed [D, Vp]
  and per-token targets, mask [Tp, 1]."""
  T, D = hidden.shape
  token_block = pl.BlockSpec((block_t, 1), lambda i: (i, 0))
  kernel = functools.partial(_forward_kernel, vocab_size=vocab_size, block_v=block_v,
                             block_d=block_d, temperature=temperature)
  out = jax.ShapeDtypeStruct((T, 1), jnp.float32)
  return pl.pallas_call(
      kernel, grid=(T // block_t,), out_shape=(out, out, out),
      in_specs=[pl.BlockSpec((block_t, D), lambda i: (i, 0)),
                pl.BlockSpec(unembed.shape, lambda i: (0, 0)), token_block, token_block],
      out_specs=(token_block, token_block, token_block), compiler_params=_params(),
      interpret=interpret, name="rlx_logprobs_fwd")(hidden, unembed, targets, mask)


def backward(hidden, unembed, targets, mask, lse, entropy, g_logprob, g_entropy, *, vocab_size,
             block_t, block_v, block_d, temperature, interpret):
  """(d hidden [Tp, D], d unembed [D, Vp]) for padded inputs (per-token arrays [Tp, 1]),
  accumulated in float32 and returned in the inputs' dtypes."""
  T, D = hidden.shape
  V = unembed.shape[1]
  per_token = (targets, mask, lse, entropy, g_logprob, g_entropy)
  token_block = pl.BlockSpec((block_t, 1), lambda i: (i, 0))
  d_hidden = pl.pallas_call(
      functools.partial(_d_hidden_kernel, vocab_size=vocab_size, block_v=block_v,
                        block_d=block_d, temperature=temperature),
      grid=(T // block_t,), out_shape=jax.ShapeDtypeStruct(hidden.shape, jnp.float32),
      in_specs=[pl.BlockSpec((block_t, D), lambda i: (i, 0)),
                pl.BlockSpec(unembed.shape, lambda i: (0, 0))] + [token_block] * 6,
      out_specs=pl.BlockSpec((block_t, D), lambda i: (i, 0)), compiler_params=_params(),
      interpret=interpret, name="rlx_logprobs_d_hidden",
  )(hidden, unembed, *per_token)
  whole_tokens = pl.BlockSpec((T, 1), lambda j: (0, 0))
  d_unembed = pl.pallas_call(
      functools.partial(_d_unembed_kernel, vocab_size=vocab_size, block_t=block_t,
                        block_v=block_v, block_d=block_d, temperature=temperature),
      grid=(V // block_v,), out_shape=jax.ShapeDtypeStruct(unembed.shape, jnp.float32),
      in_specs=[pl.BlockSpec(hidden.shape, lambda j: (0, 0)),
                pl.BlockSpec(unembed.shape, lambda j: (0, 0))] + [whole_tokens] * 6,
      out_specs=pl.BlockSpec((D, block_v), lambda j: (0, j)), compiler_params=_params(),
      interpret=interpret, name="rlx_logprobs_d_unembed",
  )(hidden, unembed, *per_token)
  return d_hidden.astype(hidden.dtype), d_unembed.astype(unembed.dtype)
