"""Reductions over the valid entries of an array (``mask`` True / 1 where valid)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def masked_sum(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
  return jnp.sum(jnp.where(mask, x, 0.0), axis=axis)


def masked_mean(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
  """Mean over valid entries; 0 where there are none."""
  count = jnp.sum(mask, axis=axis)
  return masked_sum(x, mask, axis) / jnp.maximum(count, 1)


def masked_var(x: jax.Array, mask: jax.Array, unbiased: bool = True) -> jax.Array:
  """Variance over all valid entries (Bessel-corrected when ``unbiased``)."""
  mean = masked_mean(x, mask)
  count = jnp.sum(mask)
  sum_sq = masked_sum(jnp.square(x - mean), mask)
  return sum_sq / jnp.maximum(count - 1 if unbiased else count, 1)


def masked_whiten(x: jax.Array, mask: jax.Array, shift_mean: bool = True,
                  eps: float = 1e-8) -> jax.Array:
  """(x - mean) / std over valid entries; invalid entries become 0."""
  mean = masked_mean(x, mask)
  whitened = (x - mean) * jax.lax.rsqrt(masked_var(x, mask) + eps)
  if not shift_mean:
    whitened = whitened + mean
  return jnp.where(mask, whitened, 0.0)
