"""Corrections for data the learner's policy did not sample: a stale policy's (split mode)
or the engine's own numerics (any mode). Each is a function of the proximal (old)
log-probs the learner recomputes and the behaviour log-probs the engine recorded, and
returns per-token weights ``[B, T]`` (0 where a token or a whole sequence is rejected) that
multiply the policy loss. No gradient flows through them.

With ``w_t = pi_old(y_t) / pi_behav(y_t)`` (its log clamped to +-20 like every ratio):

==============  ===========================================================================
``none``        1.
``tis``         ``min(w_t, cap)``: truncated importance sampling (Yao et al. 2025, "Your
                efficient RL framework secretly brings you off-policy RL training").
``decoupled``   ``w_t`` untruncated: AReaL's decoupled PPO (Fu et al. 2025, arXiv 2505.24298).
``token_mask``  ``w_t``, and 0 for tokens with ``w_t > cap`` (AReaL's
                ``behav_imp_weight_cap``; TRL's token-level mask).
``seq_tis``     the sequence's ``min(prod_t w_t, cap)`` on each of its tokens (verl's
                sequence-level rollout correction).
``geo_tis``     the sequence's geometric mean ``min(exp(mean_t log w_t), cap)`` (verl's
                geometric mode: length-independent).
``seq_reject``  1, and 0 for whole sequences whose geometric-mean weight lies outside
                ``[1 / cap, cap]`` (verl's rejection sampling).
``opsm``        1, and 0 for whole sequences with a negative advantage whose mean
                ``log(pi_behav / pi_old)`` exceeds ``opsm_delta``: off-policy sequence
                masking (DeepSeek-V3.2, arXiv 2512.02556).
``icepop``      1, and 0 for tokens with ``w_t`` outside ``[1 / cap, cap]`` (IcePop, Ling
                team 2025, arXiv 2510.18855).
==============  ===========================================================================
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from rlx.algorithms.policy_losses import clamped_log_ratio

Correction = Callable[..., jax.Array]


def _sequence_sum(x, mask):
  return jnp.where(mask, x, 0.0).sum(-1, keepdims=True)


def _sequence_mean(x, mask):
  return _sequence_sum(x, mask) / jnp.maximum(mask.sum(-1, keepdims=True), 1)


def _none(log_w, mask, advantages, cap, opsm_delta):
  return jnp.ones_like(log_w)


def _tis(log_w, mask, advantages, cap, opsm_delta):
  return jnp.minimum(jnp.exp(log_w), cap)


def _decoupled(log_w, mask, advantages, cap, opsm_delta):
  return jnp.exp(log_w)


def _token_mask(log_w, mask, advantages, cap, opsm_delta):
  w = jnp.exp(log_w)
  return jnp.where(w > cap, 0.0, w)


def _seq_tis(log_w, mask, advantages, cap, opsm_delta):
  log_cap = jnp.log(cap)
  return jnp.broadcast_to(jnp.exp(jnp.minimum(_sequence_sum(log_w, mask), log_cap)), log_w.shape)


def _geo_tis(log_w, mask, advantages, cap, opsm_delta):
  return jnp.broadcast_to(jnp.minimum(jnp.exp(_sequence_mean(log_w, mask)), cap), log_w.shape)


def _seq_reject(log_w, mask, advantages, cap, opsm_delta):
  geometric = _sequence_mean(log_w, mask)
  inside = jnp.abs(geometric) <= jnp.log(cap)
  return jnp.broadcast_to(inside.astype(jnp.float32), log_w.shape)


def _opsm(log_w, mask, advantages, cap, opsm_delta):
  drift = _sequence_mean(-log_w, mask)  # mean log(pi_behav / pi_old): a KL(behav || old) estimate
  negative = _sequence_sum(advantages, mask) < 0
  return jnp.broadcast_to(jnp.where(negative & (drift > opsm_delta), 0.0, 1.0), log_w.shape)


def _icepop(log_w, mask, advantages, cap, opsm_delta):
  return jnp.where(jnp.abs(log_w) > jnp.log(cap), 0.0, 1.0)


OFF_POLICY: dict[str, Correction] = {
    "none": _none, "tis": _tis, "decoupled": _decoupled, "token_mask": _token_mask,
    "seq_tis": _seq_tis, "geo_tis": _geo_tis, "seq_reject": _seq_reject, "opsm": _opsm,
    "icepop": _icepop}
"""algorithm.off_policy -> correction."""
MASKING = ("token_mask", "seq_reject", "opsm", "icepop")
"""The corrections that can zero a token or a whole sequence."""


def off_policy_weights(old_logprobs: jax.Array, behaviour_logprobs: jax.Array, kind: str, *,
                       cap: float = 2.0, response_mask: jax.Array | None = None,
                       advantages: jax.Array | None = None,
                       opsm_delta: float = 0.01) -> jax.Array:
  """Per-token weights [B, T] (no gradient) of the correction ``kind`` (see the module's
  table). ``response_mask`` (for the sequence-level kinds) defaults to every token,
  ``advantages`` (for ``opsm``) to 0."""
  if kind not in OFF_POLICY:
    raise ValueError(f"unknown off-policy correction {kind!r}; choose one of "
                     f"{', '.join(OFF_POLICY)}")
  log_w = jax.lax.stop_gradient(clamped_log_ratio(old_logprobs, behaviour_logprobs))
  mask = (jnp.ones(log_w.shape, bool) if response_mask is None else response_mask.astype(bool))
  advantages = jnp.zeros_like(log_w) if advantages is None else advantages
  return jax.lax.stop_gradient(
      OFF_POLICY[kind](log_w, mask, jax.lax.stop_gradient(advantages), cap, opsm_delta))
