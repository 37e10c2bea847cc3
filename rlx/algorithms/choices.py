"""The closed tables that turn the config's typed choices into functions: one advantage
estimator table, one policy-loss table. Adding an algorithm is one function and one entry.

    advantages = ADVANTAGES[config.algorithm.advantage_estimator](rewards, mask, algo, group)
    loss, diagnostics = POLICY_LOSSES[config.algorithm.loss](logprobs, old, advantages, mask, algo,
                                                             eps_high)

``gae`` is not in the advantage table: its advantages need the critic's values, which the
learner computes (``rlx.algorithms.gae``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from rlx.algorithms.advantages import (group_mean_batch_std, group_relative, pass_at_k, per_token,
                                       reinforce_plus_plus, reinforce_pp_baseline, rloo)
from rlx.algorithms.policy_losses import clip_cov, cispo, gmpo, gspo, kl_cov, ppo_clip, sapo
from rlx.config import AlgorithmConfig

AdvantageFn = Callable[[jax.Array, jax.Array, AlgorithmConfig, int], jax.Array]
"""(rewards [B], response_mask bool [B, T], algorithm config, group size) -> advantages [B, T]."""

PolicyLossFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, AlgorithmConfig,
                         float | jax.Array], tuple[jax.Array, dict[str, jax.Array]]]
"""(logprobs, old_logprobs, advantages, response_mask [B, T], algorithm config, upper clip range)
-> (per-token loss [B, T], per-token diagnostics). The upper clip range is passed apart from the
config: a controller moves it, as a traced value (``algo.clip_eps_high`` is its start)."""


def _grpo(rewards, response_mask, algo, group):
  return per_token(group_relative(rewards, group, scale_by_std=True), response_mask)


def _dr_grpo(rewards, response_mask, algo, group):
  return per_token(group_relative(rewards, group, scale_by_std=False), response_mask)


def _rloo(rewards, response_mask, algo, group):
  return per_token(rloo(rewards, group), response_mask)


def _reinforce_pp(rewards, response_mask, algo, group):
  del group
  mask = response_mask.astype(bool)
  last = jnp.cumsum(mask, axis=1) == mask.sum(1, keepdims=True)  # the last response token
  token_rewards = jnp.where(mask & last, rewards[:, None], 0.0)
  return reinforce_plus_plus(token_rewards, mask, algo.gamma)


def _sequence_level(estimator):
  def advantages(rewards, response_mask, algo, group):
    return per_token(estimator(rewards, group), response_mask)
  return advantages


ADVANTAGES: dict[str, AdvantageFn] = {
    "grpo": _grpo, "dr_grpo": _dr_grpo, "grpo_batch_std": _sequence_level(group_mean_batch_std),
    "rloo": _rloo, "reinforce_pp": _reinforce_pp,
    "reinforce_pp_baseline": _sequence_level(reinforce_pp_baseline),
    "passk": _sequence_level(pass_at_k)}


def _ppo_clip(logprobs, old_logprobs, advantages, response_mask, algo, eps_high):
  return ppo_clip(logprobs, old_logprobs, advantages, algo.eps_low, eps_high, algo.dual_clip)


def _gspo(logprobs, old_logprobs, advantages, response_mask, algo, eps_high):
  return gspo(logprobs, old_logprobs, advantages, response_mask, algo.eps_low, eps_high)


def _cispo(logprobs, old_logprobs, advantages, response_mask, algo, eps_high):
  return cispo(logprobs, old_logprobs, advantages, algo.eps_low, eps_high)


def _gmpo(logprobs, old_logprobs, advantages, response_mask, algo, eps_high):
  return gmpo(logprobs, old_logprobs, advantages, response_mask, algo.eps_low, eps_high)


def _sapo(logprobs, old_logprobs, advantages, response_mask, algo, eps_high):
  return sapo(logprobs, old_logprobs, advantages, algo.sapo_tau_pos, algo.sapo_tau_neg)


def _clip_cov(logprobs, old_logprobs, advantages, response_mask, algo, eps_high):
  return clip_cov(logprobs, old_logprobs, advantages, response_mask, algo.eps_low, eps_high,
                  algo.dual_clip, algo.cov_ratio, algo.cov_bounds)


def _kl_cov(logprobs, old_logprobs, advantages, response_mask, algo, eps_high):
  return kl_cov(logprobs, old_logprobs, advantages, response_mask, algo.cov_ratio,
                algo.kl_cov_coef)


POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "ppo_clip": _ppo_clip, "gspo": _gspo, "cispo": _cispo, "gmpo": _gmpo, "sapo": _sapo,
    "clip_cov": _clip_cov, "kl_cov": _kl_cov}
