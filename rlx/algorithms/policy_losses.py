"""Per-token policy losses. Each returns ``(loss [B, T], diagnostics)``; the loss is reduced
by ``rlx.algorithms.aggregation.aggregate``. Diagnostics are per-token float arrays
(under ``stop_gradient``) that the caller averages over the response mask.

Notation: ``r = exp(logprobs - old_logprobs)`` is the ratio to the old (proximal)
policy, ``A`` the advantage, ``eps_low`` / ``eps_high`` the clip range.

Every log-ratio is clamped to ``[-LOG_RATIO_BOUND, LOG_RATIO_BOUND]`` before ``exp`` (as verl
and Tunix do): a token whose log-ratio passes ~88 would give ``r = inf``, and the clipped
branch's backward ``0 * inf`` a NaN gradient that sinks the whole step. Past the bound a
token's ratio stops moving, which the clip has already done for any ratio that large.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

LOG_RATIO_BOUND = 20.0
"""|log r| bound of every per-token ratio before ``exp``."""
SEQUENCE_LOG_RATIO_BOUND = 10.0
"""Upper bound of GSPO's sequence log-ratio (verl's)."""


def clamped_log_ratio(logprobs: jax.Array, old_logprobs: jax.Array) -> jax.Array:
  """``logprobs - old_logprobs`` within ``[-LOG_RATIO_BOUND, LOG_RATIO_BOUND]``."""
  return jnp.clip(logprobs - old_logprobs, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def ppo_clip(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array,
             eps_low: float, eps_high: float | jax.Array, dual_clip: float | None = None):
  """PPO's clipped surrogate (Schulman et al. 2017) with decoupled clip ranges.

      loss = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)

  ``eps_high > eps_low`` is DAPO's clip-higher (Yu et al. 2025, arXiv 2503.14476).
  With ``dual_clip = c > 1`` (Ye et al. 2020), the loss of tokens with ``A < 0``
  is further capped at ``-c A``.

  Args:
    logprobs, old_logprobs, advantages: [B, T].
  Returns:
    loss [B, T]; diagnostics with ratio, clip_low, clip_high (1.0 where that bound binds).
  """
  log_ratio = clamped_log_ratio(logprobs, old_logprobs)
  ratio = jnp.exp(log_ratio)
  return _clipped(ratio, advantages, eps_low, eps_high, dual_clip), _ratio_diagnostics(
      ratio, log_ratio, advantages, 1.0 - eps_low, 1.0 + eps_high)


def _clipped(ratio, advantages, eps_low, eps_high, dual_clip=None):
  clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
  loss = jnp.maximum(-ratio * advantages, -clipped * advantages)
  if dual_clip is not None:
    loss = jnp.where(advantages < 0, jnp.minimum(loss, -dual_clip * advantages), loss)
  return loss


def _sequence_mean(x: jax.Array, response_mask: jax.Array) -> jax.Array:
  """[B, 1] mean of ``x`` over each row's response tokens (0 for an empty row)."""
  mask = response_mask.astype(bool)
  return (jnp.where(mask, x, 0.0).sum(-1, keepdims=True)
          / jnp.maximum(mask.sum(-1, keepdims=True), 1))


def gspo(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array,
         response_mask: jax.Array, eps_low: float, eps_high: float | jax.Array):
  """GSPO (Zheng et al. 2025, arXiv 2507.18071): a sequence-level, length-normalised ratio.

      s_i = exp(mean_t (logprobs - old_logprobs))   over the response tokens of sequence i
      loss_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)

  Written in the paper's GSPO-token form, ``s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)]``:
  every token carries the value ``s_i`` and the gradient of GSPO. With
  sequence-constant advantages and ``seq-mean-token-mean`` aggregation it is
  exactly the sequence-level objective. ``log s_i`` is bounded above by
  ``SEQUENCE_LOG_RATIO_BOUND``.

  Args:
    logprobs, old_logprobs, advantages, response_mask: [B, T].
  """
  seq_log_ratio = jnp.minimum(_sequence_mean(clamped_log_ratio(logprobs, old_logprobs),
                                             response_mask), SEQUENCE_LOG_RATIO_BOUND)
  token_log_ratio = jax.lax.stop_gradient(seq_log_ratio) + logprobs - jax.lax.stop_gradient(logprobs)
  ratio = jnp.exp(token_log_ratio)
  return _clipped(ratio, advantages, eps_low, eps_high), _ratio_diagnostics(
      ratio, token_log_ratio, advantages, 1.0 - eps_low, 1.0 + eps_high)


def cispo(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array,
          eps_low: float, eps_high: float | jax.Array):
  """CISPO (MiniMax-M1, arXiv 2506.13585): REINFORCE weighted by a clipped, stop-gradient
  importance ratio, so that no token's gradient is dropped.

      loss = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logprobs

  The paper bounds the weight from above only: ``eps_low >= 1`` (its preset) leaves it
  unbounded below.

  Args:
    logprobs, old_logprobs, advantages: [B, T].
  """
  log_ratio = clamped_log_ratio(logprobs, old_logprobs)
  ratio = jnp.exp(log_ratio)
  weight = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high))
  loss = -weight * advantages * logprobs
  return loss, _ratio_diagnostics(ratio, log_ratio, advantages, 1.0 - eps_low, 1.0 + eps_high)


def gmpo(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array,
         response_mask: jax.Array, eps_low: float, eps_high: float | jax.Array):
  """GMPO (Zhao et al. 2025, arXiv 2507.20673): PPO's clipped objective on the geometric mean
  of the token ratios instead of their arithmetic mean.

      g_i = exp(mean_t sgn(A) min(sgn(A) log r_t, sgn(A) clip(log r_t, -eps_low, eps_high)))
      loss_i = -g_i A_i

  The clip range is in log space: a token's ratio is held within ``[e^-eps_low, e^eps_high]``
  in the advantage's direction (the paper uses 0.4 each way). Every token of sequence ``i``
  carries ``loss_i``; ``seq-mean-token-mean`` aggregation gives the paper's objective.

  Args:
    logprobs, old_logprobs, advantages, response_mask: [B, T].
  """
  log_ratio = clamped_log_ratio(logprobs, old_logprobs)
  sign = jnp.where(advantages < 0, -1.0, 1.0)
  signed = sign * log_ratio
  bounded = jnp.minimum(signed, sign * jnp.clip(log_ratio, -eps_low, eps_high))
  ratio = jnp.exp(_sequence_mean(sign * bounded, response_mask))  # [B, 1]
  loss = -ratio * advantages
  token_ratio = jnp.exp(log_ratio)
  return loss, _ratio_diagnostics(token_ratio, log_ratio, advantages, math.exp(-eps_low),
                                  jnp.exp(eps_high))


def sapo(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array,
         tau_pos: float, tau_neg: float):
  """SAPO (Gao et al. 2025, arXiv 2511.20347): a smooth gate in place of the hard clip.

      f(r) = sigmoid(tau (r - 1)) * 4 / tau,   tau = tau_pos if A > 0 else tau_neg
      loss = -f(r) A

  ``f'(1) = 1``: on policy it is REINFORCE; off policy a token's gradient fades smoothly
  (``f'(r) = 4 s (1 - s)``, ``s = sigmoid(tau (r - 1))``). ``clip_high`` / ``clip_low``
  count the tokens whose gate has damped the gradient below half in the advantage's
  direction.

  Args:
    logprobs, old_logprobs, advantages: [B, T].
  """
  log_ratio = clamped_log_ratio(logprobs, old_logprobs)
  ratio = jnp.exp(log_ratio)
  tau = jnp.where(advantages > 0, tau_pos, tau_neg)
  gate = jax.nn.sigmoid(tau * (ratio - 1.0))
  loss = -gate * 4.0 / tau * advantages
  # 4 s (1 - s) < 1/2  <=>  |tau (r - 1)| > log((1 + sqrt(1/2)) / (1 - sqrt(1/2)))
  bound = math.log((1 + math.sqrt(0.5)) / (1 - math.sqrt(0.5))) / tau
  return loss, _ratio_diagnostics(ratio, log_ratio, advantages, 1.0 - bound, 1.0 + bound)


def _covariance(logprobs: jax.Array, advantages: jax.Array, mask: jax.Array) -> jax.Array:
  """Per-token centred covariance ``(logp - mean logp)(A - mean A)`` over the response
  tokens (Cui et al. 2025, arXiv 2505.22617); -inf outside the mask. No gradient."""
  logprobs, advantages = jax.lax.stop_gradient(logprobs), jax.lax.stop_gradient(advantages)
  count = jnp.maximum(mask.sum(), 1)
  mean = lambda x: jnp.where(mask, x, 0.0).sum() / count
  cov = (logprobs - mean(logprobs)) * (advantages - mean(advantages))
  return jnp.where(mask, cov, -jnp.inf)


def _count_of(ratio: float, mask: jax.Array) -> jax.Array:
  """``max(floor(ratio * tokens), 1)`` (traced)."""
  return jnp.maximum(jnp.floor(ratio * mask.sum()), 1).astype(jnp.int32)


def _smallest(scores: jax.Array, k: jax.Array) -> jax.Array:
  """True on the ``k`` smallest finite entries of ``scores`` (``k`` traced)."""
  flat = jnp.sort(scores.reshape(-1))
  threshold = flat[jnp.clip(k - 1, 0, flat.shape[0] - 1)]
  return jnp.isfinite(scores) & (scores <= threshold) & (k > 0)


def clip_cov(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array,
             response_mask: jax.Array, eps_low: float, eps_high: float | jax.Array,
             dual_clip: float | None, ratio: float, bounds: tuple[float, float]):
  """Clip-Cov (Cui et al. 2025, arXiv 2505.22617): PPO-clip, plus the gradient of a random
  ``ratio`` fraction of the tokens whose covariance between log-prob and advantage lies in
  ``bounds`` (and that the clip has not already cut) is detached. The high-covariance tokens
  are the ones that drive entropy down.

  The random choice is seeded by the batch's old log-probs (the loss takes no key): the
  same batch always detaches the same tokens.
  """
  mask = response_mask.astype(bool)
  loss, diagnostics = ppo_clip(logprobs, old_logprobs, advantages, eps_low, eps_high, dual_clip)
  r = jax.lax.stop_gradient(diagnostics["ratio"])
  unclipped = jnp.clip(r, 1.0 - eps_low, 1.0 + eps_high) * advantages >= r * advantages
  cov = _covariance(logprobs, advantages, mask)
  candidates = mask & (cov > bounds[0]) & (cov < bounds[1]) & unclipped
  seed = jax.lax.bitcast_convert_type(jnp.sum(old_logprobs.astype(jnp.float32)), jnp.int32)
  draws = jax.random.uniform(jax.random.key(seed), cov.shape)
  detached = _smallest(jnp.where(candidates, draws, jnp.inf), _count_of(ratio, mask))
  loss = jnp.where(detached, jax.lax.stop_gradient(loss), loss)
  return loss, dict(diagnostics, cov_selected=detached.astype(jnp.float32))


def kl_cov(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array,
           response_mask: jax.Array, ratio: float, coef: float):
  """KL-Cov (Cui et al. 2025, arXiv 2505.22617): the unclipped surrogate ``-r A``, plus
  ``coef * |log r|`` on the ``ratio`` fraction of tokens with the largest covariance between
  log-prob and advantage (no clip: the KL term holds exactly those tokens back)."""
  mask = response_mask.astype(bool)
  log_ratio = clamped_log_ratio(logprobs, old_logprobs)
  r = jnp.exp(log_ratio)
  cov = _covariance(logprobs, advantages, mask)
  selected = _smallest(-cov, _count_of(ratio, mask))
  loss = -r * advantages + jnp.where(selected, coef * jnp.abs(log_ratio), 0.0)
  diagnostics = _ratio_diagnostics(r, log_ratio, advantages, 0.0, jnp.inf)
  return loss, dict(diagnostics, cov_selected=selected.astype(jnp.float32))


def _ratio_diagnostics(ratio, log_ratio, advantages, low, high):
  ratio, log_ratio = jax.lax.stop_gradient(ratio), jax.lax.stop_gradient(log_ratio)
  return {
      "ratio": ratio,
      # The bound binds (its gradient is cut) where the ratio is past it in the advantage's direction.
      "clip_high": ((ratio > high) & (advantages > 0)).astype(jnp.float32),
      "clip_low": ((ratio < low) & (advantages < 0)).astype(jnp.float32),
      "approx_kl": ratio - 1.0 - log_ratio,  # k3 estimate of KL(old || new)
  }


def value_loss(values: jax.Array, old_values: jax.Array, returns: jax.Array,
               clip: float | None) -> jax.Array:
  """PPO's clipped value loss, per token:
  ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -clip, clip) - R)^2)``; unclipped when None."""
  unclipped = jnp.square(values - returns)
  if clip is None:
    return 0.5 * unclipped
  clipped_values = old_values + jnp.clip(values - old_values, -clip, clip)
  return 0.5 * jnp.maximum(unclipped, jnp.square(clipped_values - returns))
