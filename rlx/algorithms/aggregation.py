"""Reducing per-token losses to one number, as ``(numerator, denominator)``.

Both parts add up across micro-batches, so ``sum(numerators) / sum(denominators)``
over the micro-batches of a batch is exactly the full-batch loss, and so is its
gradient when each micro-batch's numerator is divided by the full batch's
denominator (``rlx.update`` does that).

Modes, for loss ``l`` [B, T] and response mask ``m`` with ``n_i = sum_t m_it``:

- ``token-mean``: ``sum_it m l / sum_it m`` (DAPO: every token weighs the same).
- ``seq-mean-token-sum``: ``sum_i (sum_t m l) / #seqs``.
- ``seq-mean-token-mean``: ``sum_i (sum_t m l / n_i) / #seqs`` (GRPO's original).
- ``seq-mean-token-sum-norm``: ``sum_it m l / (B * norm)`` with a constant
  ``norm`` such as the maximum response length (Dr.GRPO, arXiv 2503.20783).

``#seqs`` counts sequences with at least one response token.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

Mode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def aggregate(loss: jax.Array, response_mask: jax.Array, mode: Mode,
              norm: float | None = None) -> tuple[jax.Array, jax.Array]:
  """(numerator, denominator) of the aggregated loss. loss, response_mask: [B, T]."""
  mask = response_mask.astype(bool)
  token_sums = jnp.where(mask, loss, 0.0).sum(-1)  # [B]
  counts = mask.sum(-1)
  sequences = (counts > 0).sum().astype(jnp.float32)
  if mode == "token-mean":
    return token_sums.sum(), counts.sum().astype(jnp.float32)
  if mode == "seq-mean-token-sum":
    return token_sums.sum(), sequences
  if mode == "seq-mean-token-mean":
    return (token_sums / jnp.maximum(counts, 1)).sum(), sequences
  if mode == "seq-mean-token-sum-norm":
    if norm is None or norm <= 0:
      raise ValueError("seq-mean-token-sum-norm needs a positive constant norm (e.g. the max "
                       "response length)")
    return token_sums.sum(), jnp.asarray(loss.shape[0] * norm, jnp.float32)
  raise ValueError(f"unknown loss aggregation {mode!r}")


def mean_of(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
  """numerator / denominator, 0 when the denominator is 0 (an all-masked batch)."""
  return numerator / jnp.maximum(denominator, 1e-8)
