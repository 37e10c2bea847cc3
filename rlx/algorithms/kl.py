"""KL estimators between the policy and the reference policy, per token, and the adaptive
KL coefficient.

With ``log_ratio = logprobs - ref_logprobs`` on tokens sampled from the policy
(Schulman, "Approximating KL divergence", 2020):

    k1 = log_ratio                                  unbiased, high variance, can be < 0
    k2 = log_ratio^2 / 2                            biased, low variance
    k3 = exp(-log_ratio) - 1 + log_ratio            unbiased, low variance, >= 0
    k3+ = k3's value with k2's gradient             (straight-through, as verl offers)

As values they estimate KL(policy || ref). As *loss terms* they differ in what their
gradient (on samples of the policy, which the loss does not differentiate through) pushes:

- k2's expected gradient is exactly the gradient of KL(policy || ref);
- k3's is the gradient of KL(ref || policy), the reverse KL: it pulls the policy towards
  covering the reference rather than staying within it;
- k1's is zero in expectation (``E[grad log pi] = 0``): pure noise, so the loss refuses it
  (``algorithm.kl_estimator=k1`` is for ``kl_in_reward``).

``k3+`` reports k3 and follows KL(policy || ref). The log-ratio is clamped to +-20 before
the exponential, and k3 to ``[-clamp, clamp]`` after it: a token far more likely under the
policy than the reference gives neither an overflow nor a NaN gradient.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

Estimator = Literal["k1", "k2", "k3", "k3+"]
LOG_RATIO_BOUND = 20.0


def _exp_minus_one_plus(u: jax.Array) -> jax.Array:
  """exp(u) - 1 - u. Near 0 it is u^2 / 2, and the float32 subtraction would cancel all of it
  (an engine and a learner that agree to 1e-5 would measure rounding noise): there, its Taylor
  series to u^6 (relative error below 1e-8 for |u| < 0.1)."""
  series = jnp.square(u) * (0.5 + u * (1 / 6 + u * (1 / 24 + u * (1 / 120 + u / 720))))
  small = jnp.abs(u) < 0.1
  return jnp.where(small, series, jnp.expm1(u) - u)


def kl_estimate(logprobs: jax.Array, ref_logprobs: jax.Array, estimator: Estimator,
                clamp: float = 10.0) -> jax.Array:
  """Per-token KL(policy || reference) estimate. logprobs, ref_logprobs: [...]."""
  log_ratio = logprobs.astype(jnp.float32) - ref_logprobs.astype(jnp.float32)
  if estimator == "k1":
    return log_ratio
  if estimator == "k2":
    return 0.5 * jnp.square(log_ratio)
  if estimator in ("k3", "k3+"):
    bounded = jnp.clip(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    k3 = jnp.clip(_exp_minus_one_plus(-bounded), -clamp, clamp)
    if estimator == "k3":
      return k3
    k2 = 0.5 * jnp.square(log_ratio)
    return k2 + jax.lax.stop_gradient(k3 - k2)
  raise ValueError(f"unknown KL estimator {estimator!r}; choose k1, k2, k3 or k3+")

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


def adaptive_entropy_coef(coef: float, entropy: float, target: float, step: float) -> float:
  """Skywork-OR1's adaptive entropy control (He et al. 2025, arXiv 2505.22312, sec. 3.2.4):
  ``coef + step`` while the entropy is below ``target``, ``coef - step`` (not below 0) while
  above. The learner applies the bonus only while it is below (``policy_loss`` gets 0 then)."""
  return max(0.0, coef + step if entropy < target else coef - step)
