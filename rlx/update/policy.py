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
from rlx.models import lora
from rlx.models.transformer import Params, Transformer
from rlx.types import RolloutBatch, TrainState
from rlx.update.logprobs import config_temperature, sequence_logprobs
from rlx.update.packing import Packing
from rlx.update.steps import accumulate, apply_if_finite, over_schedule


def policy_loss(config: RunConfig, logprobs: jax.Array, entropy: jax.Array, batch: RolloutBatch,
                kl_coef: jax.Array, clip_eps_high: jax.Array | None = None,
                entropy_coef: jax.Array | None = None
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Per-token loss [B, T] of the configured algorithm, and per-token diagnostics;
  ``clip_eps_high`` and ``entropy_coef`` (traced) replace the config's when given.

  The loss is the policy loss (times the off-policy weight; only the top-entropy tokens with
  ``top_entropy_quantile < 1``), plus ``kl_coef`` times the KL to the reference (unless it
  is in the reward), minus ``entropy_coef`` times the entropy. The diagnostic
  ``policy_loss`` (logged as ``policy/loss``) is the policy loss alone, before the weight."""
  algo = config.algorithm
  mask = batch.response_mask.astype(bool)
  old = jax.lax.stop_gradient(logprobs) if batch.old_logprobs is None else batch.old_logprobs
  eps_high = algo.eps_high if clip_eps_high is None else clip_eps_high
  loss, diagnostics = algorithms.POLICY_LOSSES[algo.loss](
      logprobs, old, batch.advantages, batch.response_mask, algo, eps_high)
  weights = algorithms.off_policy_weights(
      old, batch.behaviour_logprobs, algo.off_policy, cap=algo.tis_cap,
      response_mask=batch.response_mask, advantages=batch.advantages,
      opsm_delta=algo.opsm_delta)
  # tokens whose behaviour importance weight pi_old / pi_behav exceeds the cap (truncated by
  # tis): how far the data's sampler has drifted from the policy, whatever the correction
  is_clip = (old - batch.behaviour_logprobs > math.log(algo.tis_cap)).astype(jnp.float32)
  diagnostics = dict(diagnostics, policy_loss=loss, is_weight=weights, is_clip=is_clip,
                     kl_behaviour=algorithms.kl_estimate(logprobs, batch.behaviour_logprobs, "k3"),
                     # KL(behaviour || old) on the behaviour's samples: the engine against the
                     # learner, where both ran the same weights (rows of the current version)
                     mismatch_kl=algorithms.kl_estimate(batch.behaviour_logprobs, old, "k3"))
  if algo.off_policy in algorithms.MASKING:  # the others never zero a token: no constant 0 logged
    diagnostics["is_rejected"] = (weights == 0).astype(jnp.float32)
  loss = weights * loss
  if algo.top_entropy_quantile < 1:
    kept = _top_entropy(entropy, mask, algo.top_entropy_quantile)
    loss = jnp.where(kept, loss, 0.0)
    diagnostics["entropy_kept"] = kept.astype(jnp.float32)
  if batch.ref_logprobs is not None:
    kl = algorithms.kl_estimate(logprobs, batch.ref_logprobs, algo.kl_estimator)
    diagnostics["kl"] = jax.lax.stop_gradient(kl)
    if algo.kl_coef > 0 and not algo.kl_in_reward:
      loss = loss + kl_coef * kl
  coef = algo.entropy_coef if entropy_coef is None else entropy_coef
  if algo.entropy_coef or algo.entropy_target is not None:
    loss = loss - coef * entropy
  diagnostics["entropy"] = jax.lax.stop_gradient(entropy)
  return loss, jax.tree.map(jax.lax.stop_gradient, diagnostics)


def _top_entropy(entropy: jax.Array, mask: jax.Array, quantile: float) -> jax.Array:
  """True on the response tokens whose entropy is in the top ``quantile`` of the batch's."""
  entropy = jax.lax.stop_gradient(entropy)
  threshold = jnp.nanquantile(jnp.where(mask, entropy, jnp.nan), 1.0 - quantile)
  return mask & (entropy >= threshold)


def _loss_norm(config: RunConfig) -> float:
  return float(config.rollout.max_new_tokens)


def loss_denominator(config: RunConfig, response_mask: jax.Array) -> jax.Array:
  """The aggregation denominator of a whole batch (it depends on the mask only)."""
  return algorithms.aggregate(jnp.zeros(response_mask.shape), response_mask,
                              config.algorithm.aggregation, _loss_norm(config))[1]


def microbatch_loss(params: Params, batch: RolloutBatch, denominator: jax.Array, kl_coef: jax.Array,
                    clip_eps_high: jax.Array | None = None, entropy_coef: jax.Array | None = None,
                    version: jax.Array | None = None, frozen: Params | None = None,
                    dropout_key: jax.Array | None = None, packing: Packing | None = None, *,
                    config: RunConfig, transformer: Transformer,
                    rows: NamedSharding | None = None):
  """(numerator / full-batch denominator, sums of diagnostics) of one micro-batch. An
  all-masked batch (denominator 0) has loss 0, not NaN. ``version``: the params' policy
  version (the rows sampled by it measure the engine/learner mismatch). ``frozen``: with LoRA,
  the base the adapters ``params`` sit on (never differentiated); ``dropout_key``: the
  adapters' dropout key; ``packing``: the micro-batch's packed rows (``rlx.update.packing``),
  or None."""
  temperature = config_temperature(config) if batch.temperature is None else batch.temperature
  if frozen is not None:
    params = lora.with_dropout_key(lora.combine(frozen, params), dropout_key)
  logprobs, entropy = sequence_logprobs(
      transformer, params, batch.tokens, batch.attention_mask, batch.response_mask,
      impl=config.model.logprob_impl, temperature=temperature,
      chunk=config.model.logprob_chunk, rows=rows, packing=packing)
  loss, diagnostics = policy_loss(config, logprobs, entropy, batch, kl_coef, clip_eps_high,
                                  entropy_coef)
  numerator, _ = algorithms.aggregate(loss, batch.response_mask, config.algorithm.aggregation,
                                      _loss_norm(config))
  mask = batch.response_mask.astype(bool)
  current = mask if version is None else mask & (batch.policy_version == version)[:, None]
  sums = {name: algorithms.masked_sum(value, mask) for name, value in diagnostics.items()
          if name != "mismatch_kl"}
  sums["mismatch_kl"] = algorithms.masked_sum(diagnostics["mismatch_kl"], current)
  sums["mismatch_tokens"] = current.sum().astype(jnp.float32)
  sums["ratio_max"] = jnp.max(jnp.where(mask, diagnostics["ratio"], -jnp.inf))
  sums["tokens"] = mask.sum().astype(jnp.float32)
  return algorithms.mean_of(numerator, denominator), sums


def loss_and_grads(params: Params, batch: RolloutBatch, kl_coef: jax.Array,
                   clip_eps_high: jax.Array | None = None, entropy_coef: jax.Array | None = None,
                   version: jax.Array | None = None, frozen: Params | None = None,
                   dropout_key: jax.Array | None = None, packing: Packing | None = None, *,
                   config: RunConfig, transformer: Transformer,
                   rows: NamedSharding | None = None
                   ) -> tuple[jax.Array, Params, dict[str, jax.Array]]:
  """Full-batch loss and gradient (of ``params`` only: with LoRA, the adapters on the
  ``frozen`` base), accumulated over ``config.optimizer.micro_batches`` (``packing``: each
  micro-batch's packed rows, a leading [micro_batches] axis)."""
  denominator = loss_denominator(config, batch.response_mask)
  grad_fn = jax.value_and_grad(
      functools.partial(microbatch_loss, config=config, transformer=transformer, rows=rows),
      has_aux=True)
  def micro_key(index):
    return None if dropout_key is None else jax.random.fold_in(dropout_key, index)

  return accumulate(
      lambda p, micro, index, plan: grad_fn(p, micro, denominator, kl_coef, clip_eps_high,
                                            entropy_coef, version, frozen, micro_key(index),
                                            plan),
      params, batch, config.optimizer.micro_batches, maxima=("ratio_max",), packing=packing)


def _reduce_over_updates(metrics: dict[str, jax.Array], epochs: int) -> dict[str, jax.Array]:
  """Per-update metrics [updates] -> one value each: maxima stay maxima, counts add up, the
  tokens of one pass add up, the rest are means over the updates."""
  reduced = {}
  for name, values in metrics.items():
    if name == "policy/ratio_max":
      reduced[name] = values.max()
    elif name in ("train/skipped", "train/skipped_update", "train/empty_steps",
                  "rollout/mismatch_kl_sum", "rollout/mismatch_tokens"):
      reduced[name] = values.sum()
    elif name == "response/tokens":
      reduced[name] = values.sum() / epochs
    else:
      reduced[name] = values.mean()
  return reduced


def make_update_step(config: RunConfig, transformer: Transformer,
                     optimizer: optax.GradientTransformation, schedule=None, *,
                     state_shardings: Any = None, batch_shardings: Any = None,
                     frozen_shardings: Any = None):
  """The jitted ``update_step(state, batch, kl_coef=None, clip_eps_high=None,
  entropy_coef=None) -> (state, metrics)``: the whole ``trainer.ppo_epochs x trainer.mini_batches`` schedule on one rollout
  batch.

  Each pass draws a fresh permutation of the sequences from ``fold_in(state.key,
  state.step)``; every mini-batch is one optimizer step (its micro-batches accumulated
  exactly, normalised by the mini-batch's own denominator), run as a ``lax.scan``. A step
  whose loss, gradient norm, new params or new optimizer state is not finite is skipped
  inside the jitted step and reported as ``train/skipped``. The policy version goes up by
  one per call (unless every update was skipped): the generator sees one new policy per
  rollout batch. Jitted once, the state donated, with explicit shardings when
  ``state_shardings`` (a ``TrainState`` of shardings) and ``batch_shardings`` (a prefix of
  the batch) are given. ``kl_coef``, ``clip_eps_high`` and ``entropy_coef`` (None: the
  config's) are traced scalars, like the batch's sampling temperatures: a controller that moves them never
  recompiles the step.
  With LoRA (``model.lora``) the state's params are the adapters and ``update_step`` takes the
  frozen base as its last argument (``frozen=``, in ``frozen_shardings``): the gradient, the
  optimizer and the state hold the adapters only.
  ``packing=`` (an ``rlx.update.packing.Packing`` the host made for this call's schedule,
  which it carries as ``packing.order``) runs the forward passes on packed rows; the result is
  the unpacked one. ``step.minibatch`` is one optimizer step on one mini-batch (the reference
  the schedule is tested against).
  """
  epochs, mini_batches = config.trainer.ppo_epochs, config.trainer.mini_batches
  # the Pallas kernels run per device on its rows when the batch is split over the mesh
  rows = batch_shardings if isinstance(batch_shardings, NamedSharding) else None

  dropout = config.model.lora.enabled and config.model.lora.dropout > 0

  def minibatch_update(state: TrainState, batch: RolloutBatch, kl_coef: jax.Array,
                       clip_eps_high: jax.Array, entropy_coef: jax.Array,
                       frozen: Params | None = None, packing: Packing | None = None):
    dropout_key = (jax.random.fold_in(jax.random.fold_in(state.key, state.step), 0x10a)
                   if dropout and frozen is not None else None)
    loss, grads, sums = loss_and_grads(state.params, batch, kl_coef, clip_eps_high,
                                       entropy_coef, state.policy_version, frozen, dropout_key,
                                       packing, config=config, transformer=transformer, rows=rows)
    empty = sums["tokens"] == 0
    new_state, applied = apply_if_finite(optimizer, state, loss, grads, empty,
                                         config.optimizer.max_update_ratio)
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
        "rollout/mismatch_kl_sum": sums["mismatch_kl"],
        "rollout/mismatch_tokens": sums["mismatch_tokens"],
        "optim/grad_norm": applied["grad_norm"],
        "optim/update_ratio": applied["update_ratio"],
        "train/skipped": applied["skipped"],
        "train/skipped_update": applied["skipped_update"],
        "train/empty_steps": applied["empty"],
        "optim/lr": jnp.asarray(schedule(state.step) if schedule else jnp.nan, jnp.float32),
        "response/tokens": tokens,
    }
    if "kl" in sums:
      metrics["policy/kl"] = sums["kl"] / tokens
    if "is_rejected" in sums:
      metrics["policy/is_rejected_frac"] = sums["is_rejected"] / tokens
    if "entropy_kept" in sums:
      metrics["policy/entropy_kept_frac"] = sums["entropy_kept"] / tokens
    if "cov_selected" in sums:
      metrics["policy/cov_selected_frac"] = sums["cov_selected"] / tokens
    return new_state, metrics

  def update_step(state: TrainState, batch: RolloutBatch, kl_coef: jax.Array,
                  clip_eps_high: jax.Array, entropy_coef: jax.Array, frozen: Params | None,
                  packing: Packing | None):
    version = state.policy_version
    state, metrics = over_schedule(
        lambda s, scheduled: minibatch_update(s, scheduled[0], kl_coef, clip_eps_high,
                                              entropy_coef, frozen, scheduled[1]),
        state, batch, epochs=epochs, mini_batches=mini_batches, packing=packing)
    metrics = _reduce_over_updates(metrics, epochs)
    mask = batch.response_mask.astype(bool)
    metrics["advantage/mean"] = algorithms.masked_mean(batch.advantages, mask)
    metrics["advantage/std"] = jnp.sqrt(algorithms.masked_var(batch.advantages, mask))
    metrics["train/updates"] = jnp.asarray(epochs * mini_batches, jnp.int32)
    if "policy/kl" in metrics:
      metrics["policy/kl_coef"] = jnp.asarray(kl_coef, jnp.float32)
    if algo.entropy_target is not None:
      metrics["policy/entropy_coef"] = jnp.asarray(entropy_coef, jnp.float32)
    # not every update was skipped or empty
    changed = metrics["train/skipped"] + metrics["train/empty_steps"] < epochs * mini_batches
    return state.replace(policy_version=version + changed.astype(version.dtype)), metrics

  if state_shardings is None:
    jitted = jax.jit(update_step, donate_argnums=0)
  else:  # metrics and the controllers' scalars replicated, like the state's scalars
    replicated = state_shardings.step
    jitted = jax.jit(update_step, donate_argnums=0,
                     in_shardings=(state_shardings, batch_shardings, replicated, replicated,
                                   replicated, frozen_shardings, replicated),
                     out_shardings=(state_shardings, replicated))
  algo = config.algorithm
  scalar = lambda value, default: jnp.asarray(default if value is None else value, jnp.float32)

  def scalars(kl_coef, clip_eps_high, entropy_coef):
    return (scalar(kl_coef, algo.kl_coef), scalar(clip_eps_high, algo.eps_high),
            scalar(entropy_coef, algo.entropy_coef))

  def step(state: TrainState, batch: RolloutBatch, kl_coef: float | jax.Array | None = None,
           clip_eps_high: float | jax.Array | None = None,
           entropy_coef: float | jax.Array | None = None, frozen: Params | None = None,
           packing: Packing | None = None):
    return jitted(state, batch, *scalars(kl_coef, clip_eps_high, entropy_coef), frozen, packing)

  step.jitted = jitted
  step.minibatch = jax.jit(
      lambda state, batch, kl_coef=None, clip_eps_high=None, entropy_coef=None, frozen=None,
      packing=None: minibatch_update(state, batch, *scalars(kl_coef, clip_eps_high,
                                                            entropy_coef), frozen, packing))
  return step
