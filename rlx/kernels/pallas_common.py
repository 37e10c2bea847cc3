"""Tile arithmetic shared by the Pallas kernels of the fused log-prob/entropy loss.

A tile is the float32 logits ``z`` [bt, bv] of a block of tokens against a block
of the vocabulary. The forward pass folds tiles into running per-token
statistics (an online log-sum-exp that also carries what the entropy needs);
the backward pass turns a recomputed tile into ``dz``.

Per-token values are column vectors [bt, 1] (a layout both Triton and Mosaic
accept for blocks). Running statistics, relative to the running max ``m``:

    s = sum_v exp(z_v - m)
    w = sum_v exp(z_v - m) (z_v - m)
    lse = m + log s,   entropy = log s - w / s

(entropy = lse - E_p[z], written relative to m so that nothing large cancels).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite, so that exp(NEG_INF - m) is 0 without inf - inf


def masked_tile(hidden, unembed, first_col, vocab_size: int, temperature: float):
  """z = hidden @ unembed / temperature (float32), columns past the vocabulary set to NEG_INF."""
  z = jnp.dot(hidden, unembed, preferred_element_type=jnp.float32) / temperature
  cols = first_col + jax.lax.broadcasted_iota(jnp.int32, z.shape, 1)
  return jnp.where(cols < vocab_size, z, NEG_INF), cols


def valid_unembed(unembed_block, first_col, vocab_size: int):
  """The unembedding tile [D, bv] with the columns past the vocabulary set to 0: the last
  block of an unpadded vocabulary reads past the array, and whatever it finds there (NaN
  included) must not reach a matmul."""
  cols = first_col + jax.lax.broadcasted_iota(jnp.int32, (1, unembed_block.shape[1]), 1)
  return jnp.where(cols < vocab_size, unembed_block, jnp.zeros_like(unembed_block))


def init_stats(rows: int):
  """(m, s, w, target_logit), each [rows, 1], before any tile."""
  zeros = jnp.zeros((rows, 1), jnp.float32)
  return jnp.full((rows, 1), NEG_INF, jnp.float32), zeros, zeros, zeros


def fold_tile(stats, z, cols, targets):
  """Folds one tile z [bt, bv] (columns ``cols``) into the statistics; targets [bt, 1]."""
  m, s, w, target_logit = stats
  m_new = jnp.maximum(m, jnp.max(z, axis=1, keepdims=True))
  scale = jnp.exp(m - m_new)
  shifted = z - m_new
  e = jnp.exp(shifted)
  s_new = s * scale + jnp.sum(e, axis=1, keepdims=True)
  w_new = scale * (w + (m - m_new) * s) + jnp.sum(e * shifted, axis=1, keepdims=True)
  target_logit = target_logit + jnp.sum(jnp.where(cols == targets, z, 0.0), axis=1, keepdims=True)
  return m_new, s_new, w_new, target_logit


def finish_stats(stats):
  """(logprob, entropy, lse), each [bt, 1], from the final statistics."""
  m, s, w, target_logit = stats
  log_s = jnp.log(s)
  lse = m + log_s
  return target_logit - lse, log_s - w / s, lse


def tile_grad(z, cols, targets, lse, entropy, g_logprob, g_entropy, active, temperature: float):
  """dL/d(hidden @ unembed) of one tile (per-token arguments [bt, 1]):
  ``dz = (g_lp (onehot - p) - g_H p (log p + H)) / temperature``, and exactly 0 for tokens
  that are not ``active`` (masked out: the forward pass stored no lse for them, so
  ``exp(z - lse)`` could overflow and 0 * inf would poison the whole matmul with NaN)."""
  log_p = jnp.where(active, z - lse, NEG_INF)
  p = jnp.exp(log_p)
  onehot = (cols == targets).astype(jnp.float32)
  dz = g_logprob * (onehot - p) - g_entropy * p * (log_p + entropy)
  return jnp.where(active, dz / temperature, 0.0)


def recompute_dz(hidden, unembed_block, first_col, targets, mask, lse, entropy, g_logprob,
                 g_entropy, *, vocab_size: int, temperature: float):
  """The backward kernels' common core: recompute one logit tile and return its ``dz`` (0 on
  the rows whose ``mask`` [bt, 1] is 0)."""
  z, cols = masked_tile(hidden, unembed_block, first_col, vocab_size, temperature)
  return tile_grad(z, cols, targets, lse, entropy, g_logprob, g_entropy, mask != 0, temperature)
