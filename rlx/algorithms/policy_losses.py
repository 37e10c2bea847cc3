"""Per-token policy losses. Each returns ``(loss [B, T], diagnostics)``; the loss is reduced
by ``rlx.algorithms.aggregation.aggregate``. Diagnostics are per-token float arrays
(under ``stop_gradient``) that the caller averages over the response mask.

Notation: ``r = exp(logprobs - old_logprobs)`` is the ratio to the old (proximal)
policy, ``A`` the advantage, ``eps_low`` / ``eps_high`` the clip range.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

OffPolicy = Literal["none", "tis", "decoupled"]


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
  log_ratio = logprobs - old_logprobs
  ratio = jnp.exp(log_ratio)
  clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
  loss = jnp.maximum(-ratio * advantages, -clipped * advantages)
  if dual_clip is not None:
    loss = jnp.where(advantages < 0, jnp.minimum(loss, -dual_clip * advantages), loss)
  return loss, _ratio_diagnostics(ratio, log_ratio, advantages, eps_low, eps_high)


def gspo(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array,
         response_mask: jax.Array, eps_low: float, eps_high: float | jax.Array):
  """GSPO (Zheng et al. 2025, arXiv 2507.18071): a sequence-level, length-normalised ratio.

      s_i = exp(mean_t (logprobs - old_logprobs))   over the response tokens of sequence i
      loss_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)

  Written in the paper's GSPO-token form, ``s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)]``:
  every token carries the value ``s_i`` and the gradient of GSPO. With
  sequence-constant advantages and ``seq-mean-token-mean`` aggregation it is
  exactly the sequence-level objective.

  Args:
    logprobs, old_logprobs, advantages, response_mask: [B, T].
  """
  mask = response_mask.astype(bool)
  log_ratio = jnp.where(mask, logprobs - old_logprobs, 0.0)
  seq_log_ratio = log_ratio.sum(-1, keepdims=True) / jnp.maximum(mask.sum(-1, keepdims=True), 1)
  token_log_ratio = jax.lax.stop_gradient(seq_log_ratio) + logprobs - jax.lax.stop_gradient(logprobs)
  ratio = jnp.exp(token_log_ratio)
  clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
  loss = jnp.maximum(-ratio * advantages, -clipped * advantages)
  return loss, _ratio_diagnostics(ratio, token_log_ratio, advantages, eps_low, eps_high)


def cispo(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array,
          eps_low: float, eps_high: float | jax.Array):
  """CISPO (MiniMax-M1, arXiv 2506.13585): REINFORCE weighted by a clipped, stop-gradient
  importance ratio, so that no token's gradient is dropped.

      loss = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logprobs

  Args:
    logprobs, old_logprobs, advantages: [B, T].
  """
  log_ratio = logprobs - old_logprobs
  ratio = jnp.exp(log_ratio)
  weight = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high))
  loss = -weight * advantages * logprobs
  return loss, _ratio_diagnostics(ratio, log_ratio, advantages, eps_low, eps_high)


def _ratio_diagnostics(ratio, log_ratio, advantages, eps_low, eps_high):
  ratio, log_ratio = jax.lax.stop_gradient(ratio), jax.lax.stop_gradient(log_ratio)
  return {
      "ratio": ratio,
      # The bound binds (its gradient is cut) where the ratio is past it in the advantage's direction.
      "clip_high": ((ratio > 1.0 + eps_high) & (advantages > 0)).astype(jnp.float32),
      "clip_low": ((ratio < 1.0 - eps_low) & (advantages < 0)).astype(jnp.float32),
      "approx_kl": ratio - 1.0 - log_ratio,  # k3 estimate of KL(old || new)
  }


def off_policy_weights(old_logprobs: jax.Array, behaviour_logprobs: jax.Array, kind: OffPolicy,
                       cap: float = 2.0) -> jax.Array:
  """Per-token importance weights that correct for data sampled by a stale (behaviour) policy.

  The surrogate's ratio is always taken to ``old_logprobs``, the proximal
  policy recomputed by the learner; the weight corrects from the behaviour
  policy that actually sampled the tokens to that proximal policy:

  - ``none``: 1.
  - ``tis``: truncated importance sampling, ``min(pi_old / pi_behav, cap)``
    (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training").
  - ``decoupled``: AReaL's decoupled PPO objective (Fu et al. 2025, arXiv
    2505.24298), ``pi_prox / pi_behav`` untruncated, with the clip around the
    proximal policy.

  Args:
    old_logprobs, behaviour_logprobs: [B, T].
  Returns:
    [B, T] weights, no gradient.
  """
  if kind == "none":
    return jnp.ones_like(old_logprobs)
  weight = jnp.exp(jax.lax.stop_gradient(old_logprobs - behaviour_logprobs))
  if kind == "tis":
    return jnp.minimum(weight, cap)
  if kind == "decoupled":
    return weight
  raise ValueError(f"unknown off-policy correction {kind!r}; choose none, tis or decoupled")


def value_loss(values: jax.Array, old_values: jax.Array, returns: jax.Array,
               clip: float | None) -> jax.Array:
  """PPO's clipped value loss, per token:
  ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -clip, clip) - R)^2)``; unclipped when None."""
  unclipped = jnp.square(values - returns)
  if clip is None:
    return 0.5 * unclipped
  clipped_values = old_values + jnp.clip(values - old_values, -clip, clip)
  return 0.5 * jnp.maximum(unclipped, jnp.square(clipped_values - returns))
