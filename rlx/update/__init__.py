"""The learner's steps, pure and jitted once.

    optimizer, schedule = make_optimizer(config.optimizer, total_steps=config.trainer.steps)
    state = init_train_state(model.params, optimizer, jax.random.key(0))
    step = make_update_step(config, model.transformer, optimizer, schedule)
    state, metrics = step(state, batch)            # state is donated

- ``optimizer``: AdamW and its schedule; where the train state and the batches lie;
- ``logprobs``: log-probs and entropy of target tokens through the fused kernels;
- ``steps``: what the policy and critic steps share (micro-batch accumulation, the update kept
  only when finite, the epochs x mini-batches schedule);
- ``packing``: several sequences per row for the forward passes, results unchanged;
- ``policy``: the policy loss and ``make_update_step``;
- ``critic``: the PPO critic and its step.
"""

from rlx.update.critic import critic_values, init_critic_params, make_critic_step
from rlx.update.logprobs import (make_logprobs_fn, policy_logprobs, row_ways,
                                 sampling_temperature, sequence_logprobs)
from rlx.update.optimizer import (batch_is_split, batch_sharding, init_train_state,
                                  make_optimizer, make_schedule, train_state_shardings)
from rlx.update.packing import Packing
from rlx.update.policy import (loss_and_grads, loss_denominator, make_update_step,
                               microbatch_loss, policy_loss)
from rlx.update.steps import all_finite, minibatch_order, schedule_batches, schedule_order
from rlx.types import TrainState

__all__ = [
    "Packing", "TrainState", "all_finite", "batch_is_split", "batch_sharding", "critic_values",
    "init_critic_params", "init_train_state", "loss_and_grads", "loss_denominator",
    "make_critic_step", "make_logprobs_fn", "make_optimizer", "make_schedule",
    "make_update_step", "microbatch_loss", "minibatch_order", "policy_logprobs", "policy_loss",
    "row_ways", "sampling_temperature", "schedule_batches", "schedule_order", "sequence_logprobs",
    "train_state_shardings",
]
