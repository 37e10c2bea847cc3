"""The training loops (colocated and split) and what they share: turning completions and
rewards into the learner's batch."""

from rlx.trainer.experience import advantages, build_batch, layout, shaped_rewards

__all__ = ["advantages", "build_batch", "layout", "shaped_rewards"]
