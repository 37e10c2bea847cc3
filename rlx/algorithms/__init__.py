"""RL algorithms as pure functions of arrays: advantages, KL, policy and value losses,
loss aggregation, DAPO's filters and shaping."""

from rlx.algorithms.advantages import (gae, group_mean_batch_std, group_relative, pass_at_k,
                                       per_token, reinforce_plus_plus, reinforce_pp_baseline, rloo)
from rlx.algorithms.aggregation import aggregate, mean_of
from rlx.algorithms.choices import ADVANTAGES, POLICY_LOSSES
from rlx.algorithms.dapo import dynamic_sampling_keep, overlong_filter, overlong_penalty
from rlx.algorithms.kl import (adaptive_entropy_coef, adaptive_kl_coef, kl_estimate,
                              kl_reward_penalty)
from rlx.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from rlx.algorithms.off_policy import MASKING, OFF_POLICY, off_policy_weights
from rlx.algorithms.policy_losses import (cispo, clip_cov, gmpo, gspo, kl_cov, ppo_clip, sapo,
                                          value_loss)

__all__ = [
    "ADVANTAGES", "MASKING", "OFF_POLICY", "POLICY_LOSSES", "adaptive_entropy_coef", "adaptive_kl_coef", "aggregate", "cispo",
    "clip_cov", "dynamic_sampling_keep", "gae", "gmpo", "group_mean_batch_std", "group_relative",
    "gspo", "kl_cov", "kl_estimate", "kl_reward_penalty", "masked_mean", "masked_sum",
    "masked_var", "masked_whiten", "mean_of", "off_policy_weights", "overlong_filter",
    "overlong_penalty", "pass_at_k", "per_token", "ppo_clip", "reinforce_plus_plus",
    "reinforce_pp_baseline", "rloo", "sapo", "value_loss",
]
