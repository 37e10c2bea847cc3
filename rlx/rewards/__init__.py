"""Reward functions on decoded text (math verification, format, task verifiers), scored in a
pool of host processes, off the device path."""

from rlx.rewards.extract import final_answer, last_boxed
from rlx.rewards.pool import RewardPool, Scored
from rlx.rewards.verifiers import (VERIFIERS, arithmetic_reward, countdown_reward,
                                   evaluate_expression, format_reward, judge, math_reward, score,
                                   sort_reward)

__all__ = ["RewardPool", "Scored", "VERIFIERS", "arithmetic_reward", "countdown_reward",
           "evaluate_expression", "final_answer", "format_reward", "judge", "last_boxed", "math_reward",
           "score", "sort_reward"]
