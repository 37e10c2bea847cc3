"""Rewards on decoded text: built-in verifiers (math, arithmetic, countdown, sort), the
sandboxed ``code`` reward, and users' own functions, scored in a pool of host worker
processes, off the device path."""

from rlx.rewards.extract import final_answer, last_boxed
from rlx.rewards.functions import (BUILTIN, CodeOptions, Judged, RewardError, RewardFn, check,
                                   from_config, judge, judge_batch)
from rlx.rewards.pool import RewardPool, Scored
from rlx.rewards.verifiers import (VERIFIERS, arithmetic_reward, countdown_reward,
                                   evaluate_expression, format_reward, math_reward, sort_reward)

__all__ = ["BUILTIN", "CodeOptions", "Judged", "RewardError", "RewardFn", "RewardPool", "Scored",
           "VERIFIERS", "arithmetic_reward", "check", "countdown_reward", "evaluate_expression",
           "final_answer", "from_config", "format_reward", "judge", "judge_batch", "last_boxed", "math_reward",
           "sort_reward"]
