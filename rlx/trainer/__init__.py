"""The training loops (colocated and split) and what they share: turning completions and
rewards into the learner's batch."""

from rlx.trainer.colocated import DynamicSamplingError, evaluate, train_colocated
from rlx.trainer.experience import advantages, build_batch, layout, shaped_rewards
from rlx.trainer.warmup import warm_up

__all__ = ["DynamicSamplingError", "advantages", "build_batch", "evaluate", "layout",
           "shaped_rewards", "train_colocated", "warm_up"]
