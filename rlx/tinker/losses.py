"""The Tinker API's loss functions, per token, summed over a batch's tokens as the API defines
them (a sum, not a mean: the caller scales by its own weights or advantages).

Each takes the policy's log-probs of the target tokens ``logprobs`` [B, T] (float32, with the
gradient) and the datums' ``loss_fn_inputs`` as arrays [B, T] (padding weighs 0 through
``mask``), and returns the loss per token [B, T]:

- ``cross_entropy``: ``-weights * logprobs``;
- ``importance_sampling``: ``-ratio * advantages``, ``ratio = exp(logprobs - sampler's)``;
- ``ppo``: ``-min(ratio * A, clip(ratio, low, high) * A)``, the clip thresholds on the ratio
  (``loss_fn_config``: ``clip_low_threshold`` 0.8, ``clip_high_threshold`` 1.2);
- ``cispo``: ``-stop_gradient(clip(ratio, low, high)) * A * logprobs`` (same thresholds);
- ``gspo`` (GSPO-token): every token of a datum carries its sequence ratio's value, the
  geometric mean of the ratios over the tokens ``sequence_ratio_mask`` marks (all of them when
  it is absent), with its own log-prob's gradient, ``s_t = sg(s) * exp(logprob - sg(logprob))``,
  and PPO's clipped objective on it: ``-min(s_t * A, clip(s_t, low, high) * A)`` (same
  thresholds);
- ``dro``: ``-(logprobs * A - beta / 2 * (logprobs - sampler's)^2)`` (``loss_fn_config``:
  ``beta``, 0.05 here).

The arrays are flat over a batch's tokens; ``inputs["datum"]`` numbers each token's datum
(``gspo`` reduces over it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

INPUTS = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "gspo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
}
"""The loss_fn_inputs each loss needs (every one also needs the target tokens)."""
OPTIONAL = {"gspo": {"sequence_ratio_mask": 1.0}}
"""The loss_fn_inputs a loss reads when given, and the value of each token when not."""

CONFIG = {"ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
          "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
          "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
          "dro": {"beta": 0.05}}
"""The loss_fn_config keys each loss takes, with their defaults (no other key is accepted)."""


def per_token(loss_fn: str, logprobs: jax.Array, inputs: dict[str, jax.Array],
              config: dict[str, float]) -> jax.Array:
  """The loss of each token [B, T] (unmasked)."""
  if loss_fn == "cross_entropy":
    return -inputs["weights"] * logprobs
  advantages = inputs["advantages"]
  if loss_fn == "dro":
    return -(logprobs * advantages - 0.5 * config["beta"] * (logprobs - inputs["logprobs"]) ** 2)
  if loss_fn == "gspo":
    ratio = _sequence_ratio(logprobs, inputs)
  else:
    ratio = jnp.exp(logprobs - inputs["logprobs"])
  if loss_fn == "importance_sampling":
    return -ratio * advantages
  low, high = config["clip_low_threshold"], config["clip_high_threshold"]
  clipped = jnp.clip(ratio, low, high)
  if loss_fn in ("ppo", "gspo"):
    return -jnp.minimum(ratio * advantages, clipped * advantages)
  if loss_fn == "cispo":
    return -jax.lax.stop_gradient(clipped) * advantages * logprobs
  raise ValueError(f"unknown loss_fn {loss_fn!r}")


def _sequence_ratio(logprobs: jax.Array, inputs: dict[str, jax.Array]) -> jax.Array:
  """GSPO-token's ratio of each token: its datum's geometric-mean ratio over the marked tokens
  (a datum with none marked: 1), with the gradient of the token's own log-prob."""
  fixed = jax.lax.stop_gradient(logprobs)
  mask, datum = inputs["sequence_ratio_mask"], inputs["datum"]
  segments = datum.shape[0]  # a datum's number is below the token count
  total = jax.ops.segment_sum(mask * (fixed - inputs["logprobs"]), datum, segments)
  count = jax.ops.segment_sum(mask, datum, segments)
  mean = jnp.where(count > 0, total / jnp.where(count > 0, count, 1.0), 0.0)
  return jnp.exp(mean[datum] + logprobs - fixed)


def settings(loss_fn: str, given: dict | None) -> dict[str, float]:
  """``loss_fn``'s config: its defaults, overridden by ``given``; an unknown loss or key raises
  ValueError naming it."""
  if loss_fn == "stable_reinforce":
    # tinker-cookbook's RL recipes default to it; its definition (with the stability records
    # of the sampled sequences it reads) is not published, so it is not guessed here
    raise ValueError("loss_fn 'stable_reinforce' is not served: its definition is not "
                     "public; pass one of ppo, cispo, importance_sampling or gspo (in "
                     "tinker-cookbook's RL recipes: loss_fn=ppo)")
  if loss_fn not in INPUTS:
    raise ValueError(f"loss_fn {loss_fn!r} is not served; this service serves "
                     f"{', '.join(sorted(INPUTS))}")
  allowed = CONFIG.get(loss_fn, {})
  unknown = sorted(set(given or {}) - set(allowed))
  if unknown:
    raise ValueError(f"loss_fn_config keys {unknown} are not read by {loss_fn!r}"
                     + (f" (it reads {sorted(allowed)})" if allowed else " (it takes none)"))
  return {**allowed, **{k: float(v) for k, v in (given or {}).items()}}
