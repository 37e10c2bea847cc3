"""KL estimators between the policy and the reference policy, per token, and the adaptive
KL coefficient.

With ``log_ratio = logprobs - ref_logprobs`` on tokens sampled from the policy
(Schulman, "Approximating KL divergence", 2020):

    k1 = log_ratio                                  unbiased, high variance, can be < 0
    k2 = log_ratio^2 / 2                            biased, low variance
    k3 = exp(-log_ratio) - 1 + log_ratio            unbiased, low variance, >= 0

k3 is clamped to ``[-clamp, clamp]`` (its exponential blows up where the policy
is far more confident than the reference).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

Estimator = Literal["k1", "k2", "k3"]


def kl_estimate(logprobs: jax.Array, ref_logprobs: jax.Array, estimator: Estimator,
                clamp: float = 10.0) -> jax.Array:
  """Per-token KL(policy || reference) estimate. logprobs, ref_logprobs: [...]."""
  log_ratio = logprobs.astype(jnp.float32) - ref_logprobs.astype(jnp.float32)
  if estimator == "k1":
    return log_ratio
  if estimator == "k2":
    return 0.5 * jnp.square(log_ratio)
  if estimator == "k3":
    return jnp.clip(jnp.exp(-log_ratio) - 1.0 + log_ratio, -clamp, clamp)
  raise ValueError(f"unknown KL estimator {estimator!r}; choose k1, k2 or k3")


def kl_reward_penalty(token_rewards: jax.Array, logprobs: jax.Array, ref_logprobs: jax.Array,
                      response_mask: jax.Array, coef: jax.Array | float,
                      estimator: Estimator = "k1") -> jax.Array:
  """Per-token rewards minus ``coef * KL`` on response tokens (the KL as a reward, no gradient)."""
  penalty = jax.lax.stop_gradient(kl_estimate(logprobs, ref_logprobs, estimator))
  return token_rewards - jnp.where(response_mask.astype(bool), coef * penalty, 0.0)


def adaptive_kl_coef(coef: jax.Array | float, observed_kl: jax.Array | float, target: float,
                     horizon: int, steps: int = 1) -> jax.Array:
  """Proportional controller of Ziegler et al. 2019 (arXiv 1909.08593):

      error = clip(observed_kl / target - 1, -0.2, 0.2)
      coef <- coef * (1 + error * steps / horizon)
  """
  error = jnp.clip(jnp.asarray(observed_kl) / target - 1.0, -0.2, 0.2)
  return jnp.asarray(coef) * (1.0 + error * steps / horizon)
