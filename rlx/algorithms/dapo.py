"""DAPO's data-side pieces (Yu et al. 2025, arXiv 2503.14476): dynamic sampling, soft
overlong punishment and overlong filtering."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dynamic_sampling_keep(rewards: jax.Array, group_size: int) -> jax.Array:
  """Which samples to keep: those of groups whose rewards are not all equal (std > 0).

  A group with equal rewards has zero advantage everywhere and gives no
  gradient; the trainer over-samples prompts and refills the batch.

  Args:
    rewards: [B] sequence rewards, B = N * group_size, groups contiguous.
  Returns:
    bool [B].
  """
  groups = rewards.reshape(-1, group_size)
  varied = jnp.any(groups != groups[:, :1], axis=1)
  return jnp.repeat(varied, group_size)


def overlong_penalty(response_lengths: jax.Array, max_length: int, buffer: int) -> jax.Array:
  """Soft overlong punishment (DAPO eq. 13), measured in tokens, with L_max = ``max_length``
  and L_cache = ``buffer``:

      0                                   if |y| <= L_max - L_cache
      ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max
      -1                                  if |y| > L_max

  Args:
    response_lengths: int [B] response lengths in tokens.
  Returns:
    [B] penalties to add to the rewards.
  """
  if buffer <= 0 or buffer > max_length:
    raise ValueError(f"overlong buffer must be in (0, max_length={max_length}], got {buffer}")
  lengths = response_lengths.astype(jnp.float32)
  start = max_length - buffer
  penalty = jnp.where(lengths <= start, 0.0, (start - lengths) / buffer)
  return jnp.where(lengths > max_length, -1.0, penalty)


def overlong_filter(response_mask: jax.Array, truncated: jax.Array) -> jax.Array:
  """Masks truncated responses (finish reason 'length') out of the loss.

  Args:
    response_mask: [B, T]; truncated: bool [B].
  """
  return response_mask.astype(bool) & ~truncated.astype(bool)[:, None]
