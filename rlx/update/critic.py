"""The PPO critic: a value head on a copy of the policy's transformer, and its jitted step on
the policy's ``ppo_epochs x mini_batches`` schedule."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from rlx import algorithms
from rlx.config import RunConfig
from rlx.models.transformer import Params, Transformer
from rlx.types import RolloutBatch, TrainState
from rlx.update.optimizer import replicated_like
from rlx.update.steps import accumulate, apply_if_finite, over_schedule


def init_critic_params(policy_params: Params, key: jax.Array) -> Params:
  """A critic initialised from the policy: the transformer's params plus a zero scalar head."""
  del key  # the head starts at zero, so the first values are 0 for every state
  hidden_size = policy_params["final_norm"].shape[0]
  head = lambda: {"kernel": jnp.zeros((hidden_size,), jnp.float32),
                  "bias": jnp.zeros((), jnp.float32)}
  # the head replicated on the policy's mesh, created there (never via a default device)
  return {"model": policy_params, "value_head": jax.jit(
      head, out_shardings=replicated_like(policy_params))()}


def critic_values(transformer: Transformer, critic_params: Params, tokens: jax.Array,
                  attention_mask: jax.Array) -> jax.Array:
  """Values [B, T]: entry t is V of the state before target token t (position 0 gets 0)."""
  hidden, _ = transformer.hidden_states(critic_params["model"], tokens, attention_mask)
  head = critic_params["value_head"]
  values = jnp.einsum("btd,d->bt", hidden.astype(jnp.float32), head["kernel"]) + head["bias"]
  return jnp.pad(values[:, :-1], ((0, 0), (1, 0)))


def make_critic_step(config: RunConfig, transformer: Transformer,
                     optimizer: optax.GradientTransformation, *, state_shardings: Any = None,
                     batch_shardings: Any = None):
  """The jitted PPO critic step ``(critic_state, batch) -> (critic_state, metrics)``: clipped
  value loss, token-mean over response tokens, accumulated over micro-batches, on the same
  ``ppo_epochs x mini_batches`` schedule as the policy (permutations from the critic's key),
  skipped like the policy's step when anything it produced is not finite."""
  clip = config.algorithm.value_clip
  epochs, mini_batches = config.trainer.ppo_epochs, config.trainer.mini_batches

  def microbatch(params, micro: RolloutBatch, denominator):
    values = critic_values(transformer, params, micro.tokens, micro.attention_mask)
    loss = algorithms.value_loss(values, micro.old_values, micro.returns, clip)
    mask = micro.response_mask.astype(bool)
    error = algorithms.masked_sum(jnp.square(values - micro.returns), mask)
    return algorithms.masked_sum(loss, mask) / denominator, {"error": error}

  grad_fn = jax.value_and_grad(microbatch, has_aux=True)

  def minibatch_step(state: TrainState, scheduled: tuple[RolloutBatch, None]):
    batch, _ = scheduled  # the critic runs unpacked
    denominator = jnp.maximum(batch.response_mask.sum().astype(jnp.float32), 1.0)
    loss, grads, sums = accumulate(lambda p, micro, *_: grad_fn(p, micro, denominator),
                                   state.params, batch, config.optimizer.micro_batches)
    state, applied = apply_if_finite(optimizer, state, loss, grads,
                                     max_update_ratio=config.optimizer.max_update_ratio)
    return state, {"critic/loss": loss, "critic/value_mse": sums["error"] / denominator,
                   "critic/grad_norm": applied["grad_norm"], "critic/skipped": applied["skipped"]}

  def critic_step(state: TrainState, batch: RolloutBatch):
    if batch.returns is None or batch.old_values is None:
      raise ValueError("the critic step needs batch.returns and batch.old_values")
    state, metrics = over_schedule(minibatch_step, state, batch, epochs=epochs,
                                   mini_batches=mini_batches)
    return state, {name: values.sum() if name == "critic/skipped" else values.mean()
                   for name, values in metrics.items()}

  if state_shardings is None:
    return jax.jit(critic_step, donate_argnums=0)
  return jax.jit(critic_step, donate_argnums=0, in_shardings=(state_shardings, batch_shardings),
                 out_shardings=(state_shardings, state_shardings.step))
