"""Advantage estimators.

Shapes: B sequences (N prompts x G samples each, the G samples of a prompt
contiguous), T token positions. Per-token arrays are aligned with the target
tokens; ``response_mask`` [B, T] marks the response tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlx.algorithms.masked import masked_whiten


def gae(rewards: jax.Array, values: jax.Array, response_mask: jax.Array, gamma: float,
        lam: float) -> tuple[jax.Array, jax.Array]:
  """Generalised advantage estimation (Schulman et al. 2016), a reverse ``lax.scan`` over time.

      delta_t = r_t + gamma * V_{t'} - V_t      (t' the next response token; V = 0 past the end)
      A_t     = delta_t + gamma * lam * A_{t'}

  Positions outside ``response_mask`` are skipped (they neither receive nor pass
  on anything) and get advantage 0.

  Args:
    rewards: [B, T] per-token rewards.
    values: [B, T] critic values V_t of the state before token t.
    response_mask: [B, T].
  Returns:
    (advantages [B, T], returns [B, T] = advantages + values), zero outside the mask.
  """
  mask = response_mask.astype(bool)

  def step(carry, xs):
    next_value, next_advantage = carry
    reward, value, valid = xs
    delta = reward + gamma * next_value - value
    advantage = delta + gamma * lam * next_advantage
    carry = (jnp.where(valid, value, next_value), jnp.where(valid, advantage, next_advantage))
    return carry, jnp.where(valid, advantage, 0.0)

  zeros = jnp.zeros(rewards.shape[0], jnp.float32)
  xs = (rewards.T.astype(jnp.float32), values.T.astype(jnp.float32), mask.T)
  _, advantages = jax.lax.scan(step, (zeros, zeros), xs, reverse=True)
  advantages = advantages.T
  return advantages, jnp.where(mask, advantages + values, 0.0)


def _groups(rewards: jax.Array, group_size: int) -> jax.Array:
  if rewards.ndim != 1 or rewards.shape[0] % group_size:
    raise ValueError(f"rewards must be [B] with B a multiple of group_size={group_size}, "
                     f"got shape {rewards.shape}")
  return rewards.reshape(-1, group_size).astype(jnp.float32)


def group_relative(rewards: jax.Array, group_size: int, scale_by_std: bool = True,
                   eps: float = 1e-6) -> jax.Array:
  """GRPO (Shao et al. 2024, DeepSeekMath): ``(r_i - mean_g) / (std_g + eps)`` within each group.

  ``std_g`` is the Bessel-corrected sample standard deviation (as TRL and verl
  compute it). ``scale_by_std=False`` is Dr.GRPO (Liu et al. 2025, arXiv
  2503.20783): ``r_i - mean_g``, removing the question-level difficulty bias.

  Args:
    rewards: [B] sequence rewards, B = N * group_size, groups contiguous.
  Returns:
    [B] advantages.
  """
  groups = _groups(rewards, group_size)
  centred = groups - groups.mean(axis=1, keepdims=True)
  if scale_by_std:
    centred = centred / (groups.std(axis=1, ddof=1, keepdims=True) + eps)
  return centred.reshape(-1)


def rloo(rewards: jax.Array, group_size: int) -> jax.Array:
  """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024):
  ``A_i = r_i - mean_{j != i} r_j`` within each group of G >= 2 samples.

  Args:
    rewards: [B] sequence rewards, groups contiguous.
  Returns:
    [B] advantages.
  """
  if group_size < 2:
    raise ValueError("RLOO needs group_size >= 2")
  groups = _groups(rewards, group_size)
  baseline = (groups.sum(axis=1, keepdims=True) - groups) / (group_size - 1)
  return (groups - baseline).reshape(-1)


def reinforce_plus_plus(token_rewards: jax.Array, response_mask: jax.Array,
                        gamma: float = 1.0) -> jax.Array:
  """REINFORCE++ (Hu 2025): discounted return-to-go of each token, whitened over the batch.

  Args:
    token_rewards: [B, T] per-token rewards (outcome reward on the last token,
      minus any per-token KL penalty).
    response_mask: [B, T].
  Returns:
    [B, T] advantages, zero outside the mask.
  """
  mask = response_mask.astype(bool)

  def step(running, xs):
    reward, valid = xs
    running = jnp.where(valid, reward + gamma * running, running)
    return running, jnp.where(valid, running, 0.0)

  _, returns = jax.lax.scan(step, jnp.zeros(token_rewards.shape[0], jnp.float32),
                            (token_rewards.T.astype(jnp.float32), mask.T), reverse=True)
  return masked_whiten(returns.T, mask)


def per_token(sequence_advantages: jax.Array, response_mask: jax.Array) -> jax.Array:
  """Broadcasts [B] sequence advantages to [B, T] response tokens (0 elsewhere)."""
  return jnp.where(response_mask.astype(bool), sequence_advantages[:, None], 0.0)


def group_mean_batch_std(rewards: jax.Array, group_size: int, eps: float = 1e-6) -> jax.Array:
  """Group mean, batch standard deviation: ``(r_i - mean_g) / (std_batch + eps)``, with
  ``std_batch`` the standard deviation of all the batch's rewards (Lite PPO, Liu et al. 2025,
  arXiv 2508.08221; TRL's ``scale_rewards="batch"``). It keeps GRPO's per-prompt baseline
  without blowing up the advantages of groups that are nearly all equal.

  Args:
    rewards: [B] sequence rewards, groups contiguous.
  Returns:
    [B] advantages.
  """
  groups = _groups(rewards, group_size)
  centred = groups - groups.mean(axis=1, keepdims=True)
  return (centred / (groups.std(ddof=1) + eps)).reshape(-1)


def reinforce_pp_baseline(rewards: jax.Array, group_size: int, eps: float = 1e-8) -> jax.Array:
  """REINFORCE++-baseline (Hu et al. 2025, arXiv 2501.03262): subtract the group's mean
  reward, then whiten the result over the whole batch (global normalisation instead of
  GRPO's per-group standard deviation).

  Args:
    rewards: [B] sequence rewards, groups contiguous.
  Returns:
    [B] advantages.
  """
  groups = _groups(rewards, group_size)
  centred = (groups - groups.mean(axis=1, keepdims=True)).reshape(-1)
  return (centred - centred.mean()) / (centred.std(ddof=1) + eps)


def pass_at_k(rewards: jax.Array, group_size: int) -> jax.Array:
  """The pass@k objective's advantage (Walder & Karkhanis 2025, arXiv 2503.19595; verl's
  ``grpo_passk``): within each group only the best sample moves, by how much it beats the
  runner-up, ``r_max - r_second``; every other sample gets 0. Ties go to the first best.

  Args:
    rewards: [B] sequence rewards, groups contiguous, group_size >= 2.
  Returns:
    [B] advantages.
  """
  if group_size < 2:
    raise ValueError("the pass@k advantage needs group_size >= 2")
  groups = _groups(rewards, group_size)
  best = jnp.argmax(groups, axis=1)
  top2 = jax.lax.top_k(groups, 2)[0]
  margin = top2[:, 0] - top2[:, 1]
  winner = jnp.arange(group_size)[None, :] == best[:, None]
  return jnp.where(winner, margin[:, None], 0.0).reshape(-1)
