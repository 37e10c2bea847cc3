"""The policy step: ``update_step(state, batch) -> (state, metrics)``, pure and jitted once.

For each micro-batch, the policy's log-probs and entropy come from the final hidden states and
the unembedding through ``rlx.kernels.fused_logprobs``; the per-token policy loss (PPO-clip /
GSPO / CISPO by algorithm), the off-policy weight, the KL and entropy terms are aggregated as
(numerator, denominator) with the denominator of the *whole* mini-batch, so the accumulated
gradient equals the mini-batch's gradient exactly.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from rlx import algorithms
from rlx.config import RunConfig
from rlx.models.transformer import Params, Transformer
from rlx.types import RolloutBatch, TrainState
from rlx.update.logprobs import config_temperature, sequence_logprobs
from rlx.update.steps import accumulate, apply_if_finite, over_schedule


def policy_loss(config: RunConfig, logprobs: jax.Array, entropy: jax.Array, batch: RolloutBatch,
                kl_coef: jax.Array, clip_eps_high: jax.Array | None = None
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Per-token loss [B, T] of the configured algorithm, and per-token diagnostics;
  ``clip_eps_high`` (traced) replaces the config's upper clip range when given."""
  algo = config.algorithm
  old = jax.lax.stop_gradient(logprobs) if batch.old_logprobs is None else batch.old_logprobs
  eps_high = algo.clip_eps_high if clip_eps_high is None else clip_eps_high
  loss, diagnostics = algorithms.POLICY_LOSSES[algo.loss](
      logprobs, old, batch.advantages, batch.response_mask, algo, eps_high)
  weights = algorithms.off_policy_weights(old, batch.behaviour_logprobs, algo.off_policy,
                                          algo.tis_cap)
  # tokens whose behaviour importance weight pi_old / pi_behav exceeds the cap (truncated by
  # tis): how far the data's sampler has drifted from the policy, whatever the correction
  is_clip = (old - batch.behaviour_logprobs > math.log(algo.tis_cap)).astype(jnp.float32)
  diagnostics = dict(diagnostics, policy_loss=loss, is_weight=weights, is_clip=is_clip,
                     kl_behaviour=algorithms.kl_estimate(logprobs, batch.behaviour_logprobs, "k3"))
  loss = weights * loss
  if batch.ref_logprobs is not None:
    kl = algorithms.kl_estimate(logprobs, batch.ref_logprobs, algo.kl_estimator)
    diagnostics["kl"] = jax.lax.stop_gradient(kl)
    if algo.kl_coef > 0 and not algo.kl_in_reward:
      loss = loss + kl_coef * kl
  if algo.entropy_coef:
    loss = loss - algo.entropy_coef * entropy
  diagnostics["entropy"] = jax.lax.stop_gradient(entropy)
  return loss, jax.tree.map(jax.lax.stop_gradient, diagnostics)


def _loss_norm(config: RunConfig) -> float:
  return float(config.rollout.max_new_tokens)


def loss_denominator(config: RunConfig, response_mask: jax.Array) -> jax.Array:
  """The aggregation denominator of a whole batch (it depends on the mask only)."""
  return algorithms.aggregate(jnp.zeros(response_mask.shape), response_mask,
                              config.algorithm.loss_agg, _loss_norm(config))[1]


def microbatch_loss(params: Params, batch: RolloutBatch, denominator: jax.Array, kl_coef: jax.Array,
                    clip_eps_high: jax.Array | None = None, *, config: RunConfig,
                    transformer: Transformer, rows: NamedSharding | None = None):
  """(numerator / full-batch denominator, sums of diagnostics) of one micro-batch."""
  temperature = config_temperature(config) if batch.temperature is None else batch.temperature
  logprobs, entropy = sequence_logprobs(
      transformer, params, batch.tokens, batch.attention_mask, batch.response_mask,
      impl=config.model.logprob_impl, temperature=temperature,
      chunk=config.model.logprob_chunk, rows=rows)
  loss, diagnostics = policy_loss(config, logprobs, entropy, batch, kl_coef, clip_eps_high)
  numerator, _ = algorithms.aggregate(loss, batch.response_mask, config.algorithm.loss_agg,
                                      _loss_norm(config))
  mask = batch.response_mask.astype(bool)
  sums = {name: algorithms.masked_sum(value, mask) for name, value in diagnostics.items()}
  sums["ratio_max"] = jnp.max(jnp.where(mask, diagnostics["ratio"], -jnp.inf))
  sums["tokens"] = mask.sum().astype(jnp.float32)
  return numerator / denominator, sums


def loss_and_grads(params: Params, batch: RolloutBatch, kl_coef: jax.Array,
                   clip_eps_high: jax.Array | None = None, *, config: RunConfig,
                   transformer: Transformer, rows: NamedSharding | None = None
                   ) -> tuple[jax.Array, Params, dict[str, jax.Array]]:
  """Full-batch loss and gradient, accumulated over ``config.optimizer.micro_batches``."""
  denominator = loss_denominator(config, batch.response_mask)
  grad_fn = jax.value_and_grad(
      functools.partial(microbatch_loss, config=config, transformer=transformer, rows=rows),
      has_aux=True)
  return accumulate(lambda p, micro: grad_fn(p, micro, denominator, kl_coef, clip_eps_high),
                    params, batch, config.optimizer.micro_batches, maxima=("ratio_max",))


def _reduce_over_updates(metrics: dict[str, jax.Array], epochs: int) -> dict[str, jax.Array]:
  """Per-update metrics [updates] -> one value each: maxima stay maxima, counts add up, the
  tokens of one pass add up, the rest are means over the updates."""
  reduced = {}
  for name, values in metrics.items():
    if name == "policy/ratio_max":
      reduced[name] = values.max()
    elif name in ("train/skipped", "train/skipped_update"):
      reduced[name] = values.sum()
    elif name == "response/tokens":
      reduced[name] = values.sum() / epochs
    else:
      reduced[name] = values.mean()
  return reduced


def make_update_step(config: RunConfig, transformer: Transformer,
                     optimizer: optax.GradientTransformation, schedule=None, *,
                     state_shardings: Any = None, batch_shardings: Any = None):
  """The jitted ``update_step(state, batch, kl_coef=None, clip_eps_high=None) -> (state,
  metrics)``: the whole ``trainer.ppo_epochs x trainer.mini_batches`` schedule on one rollout
  batch.

  Each pass draws a fresh permutation of the sequences from ``fold_in(state.key,
  state.step)``; every mini-batch is one optimizer step (its micro-batches accumulated
  exactly, normalised by the mini-batch's own denominator), run as a ``lax.scan``. A step
  whose loss, gradient norm, new params or new optimizer state is not finite is skipped
  inside the jitted step and reported as ``train/skipped``. The policy version goes up by
  one per call (unless every update was skipped): the generator sees one new policy per
  rollout batch. Jitted once, the state donated, with explicit shardings when
  ``state_shardings`` (a ``TrainState`` of shardings) and ``batch_shardings`` (a prefix of
  the batch) are given. ``kl_coef`` and ``clip_eps_high`` (None: the config's) are traced
  scalars, like the batch's sampling temperatures: a controller that moves them never
  recompiles the step.
  ``step.minibatch`` is one optimizer step on one mini-batch (the reference the schedule is
  tested against).
  """
  epochs, mini_batches = config.trainer.ppo_epochs, config.trainer.mini_batches
  # the Pallas kernels run per device on its rows when the batch is split over the mesh
  rows = batch_shardings if isinstance(batch_shardings, NamedSharding) else None

  def minibatch_update(state: TrainState, batch: RolloutBatch, kl_coef: jax.Array,
                       clip_eps_high: jax.Array):
    loss, grads, sums = loss_and_grads(state.params, batch, kl_coef, clip_eps_high,
                                       config=config, transformer=transformer, rows=rows)
    new_state, applied = apply_if_finite(optimizer, state, loss, grads)
    tokens = jnp.maximum(sums.pop("tokens"), 1.0)
    metrics = {
        "loss": loss,
        "policy/loss": sums["policy_loss"] / tokens,
        "policy/entropy": sums["entropy"] / tokens,
        "policy/clip_frac_low": sums["clip_low"] / tokens,
        "policy/clip_frac_high": sums["clip_high"] / tokens,
        "policy/approx_kl": sums["approx_kl"] / tokens,
        "policy/kl_behaviour": sums["kl_behaviour"] / tokens,
        "policy/ratio_mean": sums["ratio"] / tokens,
        "policy/ratio_max": sums["ratio_max"],
        "policy/is_weight_mean": sums["is_weight"] / tokens,
        "policy/is_clip_frac": sums["is_clip"] / tokens,
        "optim/grad_norm": applied["grad_norm"],
        "train/skipped": applied["skipped"],
        "train/skipped_update": applied["skipped_update"],
        "optim/lr": jnp.asarray(schedule(state.step) if schedule else jnp.nan, jnp.float32),
        "response/tokens": tokens,
    }
    if "kl" in sums:
      metrics["policy/kl"] = sums["kl"] / tokens
    return new_state, metrics

  def update_step(state: TrainState, batch: RolloutBatch, kl_coef: jax.Array,
                  clip_eps_high: jax.Array):
    version = state.policy_version
    state, metrics = over_schedule(lambda s, b: minibatch_update(s, b, kl_coef, clip_eps_high),
                                   state, batch, epochs=epochs, mini_batches=mini_batches)
    metrics = _reduce_over_updates(metrics, epochs)
    mask = batch.response_mask.astype(bool)
    metrics["advantage/mean"] = algorithms.masked_mean(batch.advantages, mask)
    metrics["advantage/std"] = jnp.sqrt(algorithms.masked_var(batch.advantages, mask))
    metrics["train/updates"] = jnp.asarray(epochs * mini_batches, jnp.int32)
    if "policy/kl" in metrics:
      metrics["policy/kl_coef"] = jnp.asarray(kl_coef, jnp.float32)
    changed = metrics["train/skipped"] < epochs * mini_batches  # not every update was skipped
    return state.replace(policy_version=version + changed.astype(version.dtype)), metrics

  if state_shardings is None:
    jitted = jax.jit(update_step, donate_argnums=0)
  else:  # metrics and the controller's scalars replicated, like the state's scalars
    replicated = state_shardings.step
    jitted = jax.jit(update_step, donate_argnums=0,
                     in_shardings=(state_shardings, batch_shardings, replicated, replicated),
                     out_shardings=(state_shardings, replicated))
  algo = config.algorithm
  scalar = lambda value, default: jnp.asarray(default if value is None else value, jnp.float32)

  def step(state: TrainState, batch: RolloutBatch, kl_coef: float | jax.Array | None = None,
           clip_eps_high: float | jax.Array | None = None):
    return jitted(state, batch, scalar(kl_coef, algo.kl_coef),
                  scalar(clip_eps_high, algo.clip_eps_high))

  step.jitted = jitted
  step.minibatch = jax.jit(lambda state, batch, kl_coef=None, clip_eps_high=None: minibatch_update(
      state, batch, scalar(kl_coef, algo.kl_coef), scalar(clip_eps_high, algo.clip_eps_high)))
  return step
