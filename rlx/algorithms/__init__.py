"""RL algorithms as pure functions of arrays: advantages, KL, policy and value losses,
loss aggregation, DAPO's filters and shaping."""

from rlx.algorithms.advantages import (gae, group_relative, per_token, reinforce_plus_plus,
                                       rloo)
from rlx.algorithms.aggregation import aggregate, mean_of
from rlx.algorithms.choices import ADVANTAGES, POLICY_LOSSES
from rlx.algorithms.dapo import dynamic_sampling_keep, overlong_filter, overlong_penalty
from rlx.algorithms.kl import adaptive_kl_coef, kl_estimate, kl_reward_penalty
from rlx.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from rlx.algorithms.policy_losses import cispo, gspo, off_policy_weights, ppo_clip, value_loss

__all__ = [
    "ADVANTAGES", "POLICY_LOSSES", "adaptive_kl_coef", "aggregate", "cispo", "dynamic_sampling_keep", "gae", "group_relative",
    "gspo", "kl_estimate", "kl_reward_penalty", "masked_mean", "masked_sum", "masked_var",
    "masked_whiten", "mean_of", "off_policy_weights", "overlong_filter", "overlong_penalty",
    "per_token", "ppo_clip", "reinforce_plus_plus", "rloo", "value_loss",
]
