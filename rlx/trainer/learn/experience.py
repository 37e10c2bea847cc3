"""From sampled completions and their rewards to the complete batch the learner trains on, in
two steps: the host lays the rollouts out in arrays, one jitted function computes everything
else.

    sampled, stats = sample_arrays(completions, rewards, config, pad_id=tokenizer.pad_id)
    prepare = make_prepare(config, transformer)
    batch = prepare(params, ref_params, critic_params, sampled, kl_coef)   # a RolloutBatch

Layout of row b (T = longest prompt + longest response of the batch, each part
bucketed to a power of two so that the jitted steps see few shapes)::

    [pad .. pad | prompt tokens | response tokens | pad .. pad]
                  (left-padded)                     (right-padded)

Per-token arrays are aligned with the target token (see ``rlx.types``): the
response mask is True on response tokens the policy sampled (a multi-turn episode's
environment tokens are response positions outside it), the behaviour log-probs sit on them.
DAPO's soft overlong punishment is added to the rewards when
``overlong_buffer > 0``, and overlong filtering masks truncated responses out of
the loss (host side: both depend on lengths only).

``prepare`` returns a batch with no placeholder: the old (proximal) log-probs of
the params about to be updated, the reference log-probs (when there is a KL
term), the critic's values (PPO), and the advantages and returns of the
configured estimator: group-relative, RLOO or REINFORCE++ from the rewards, or
GAE over the critic's values. Log-probs and values are computed in chunks of the
update's micro-batch size, so that preparing never needs more memory than updating.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec

from rlx import algorithms, update
from rlx.config import RunConfig
from rlx.models.transformer import Params, Transformer
from rlx.rollout import Completion
from rlx.trainer.draw import layout
from rlx.types import RolloutBatch

def shaped_rewards(completions: Sequence[Completion], rewards: np.ndarray,
                   config: RunConfig) -> np.ndarray:
  """Task rewards plus DAPO's soft overlong punishment (when ``overlong_buffer > 0``)."""
  rewards = np.asarray(rewards, np.float32)
  buffer = config.algorithm.overlong_buffer
  if buffer <= 0:
    return rewards
  lengths = np.array([len(c.response_tokens) for c in completions])
  # A response cut at the limit did not finish: count it as one token over.
  lengths = lengths + np.array([c.finish_reason == "length" for c in completions])
  penalty = algorithms.overlong_penalty(jnp.asarray(lengths), config.rollout.max_new_tokens, buffer)
  return rewards + np.asarray(penalty)


@struct.dataclass
class Sampled:
  """The rollouts of one batch as arrays (host NumPy or device): what the learner is given."""

  tokens: jax.Array
  """int32 [B, T] prompt + response ids."""
  attention_mask: jax.Array
  """bool [B, T] True on real (non-padding) tokens."""
  response_mask: jax.Array
  """bool [B, T] True on the response tokens that enter the loss (after overlong filtering)."""
  behaviour_logprobs: jax.Array
  """float32 [B, T] log-probs of the sampling policy, from the rollout engine."""
  rewards: jax.Array
  """float32 [B] the task rewards, with DAPO's overlong punishment when configured."""
  policy_version: jax.Array
  """int32 [B] version of the params that generated each sequence."""
  temperature: jax.Array | None = None
  """float32 [B] the temperature each sequence was sampled at (the learner's log-probs are
  taken at it); None: the config's rollout.temperature, a constant of the compiled programs."""


def sample_arrays(completions: Sequence[Completion], rewards: np.ndarray, config: RunConfig, *,
                  pad_id: int, bucket: bool = True, lengths: tuple[int, int] = (0, 0),
                  temperature: float | None = None) -> tuple[Sampled, dict[str, float]]:
  """The rollouts laid out in arrays (see ``layout``), and statistics of the rewards and
  responses. ``temperature`` is what they were sampled at (None: rollout.temperature); the
  learner takes the log-probs of greedy data (0) at temperature 1 (the engine records their
  behaviour log-probs as 0, a point mass)."""
  if len(completions) != len(rewards):
    raise ValueError(f"{len(completions)} completions but {len(rewards)} rewards")
  arrays = layout(completions, pad_id, bucket, lengths)
  shaped = shaped_rewards(completions, rewards, config)
  response_mask = arrays["response_mask"]
  truncated = np.array([c.finish_reason == "length" for c in completions])
  if config.algorithm.filters_overlong:
    response_mask = np.asarray(algorithms.overlong_filter(jnp.asarray(response_mask),
                                                          jnp.asarray(truncated)))
  lengths = np.array([len(c.response_tokens) for c in completions])
  sampled = Sampled(tokens=arrays["tokens"], attention_mask=arrays["attention_mask"],
                    response_mask=response_mask,
                    behaviour_logprobs=arrays["behaviour_logprobs"], rewards=shaped,
                    policy_version=np.array([c.policy_version for c in completions], np.int32),
                    temperature=np.full(len(completions), update.sampling_temperature(
                        config.rollout.temperature if temperature is None else temperature),
                        np.float32))
  stats = {
      "reward/kept_mean": float(np.mean(rewards)),
      "reward/shaped_mean": float(np.mean(shaped)),
      "response/length_mean": float(lengths.mean()),
      "response/length_max": int(lengths.max()),
      "response/truncated_frac": float(truncated.mean()),
  }
  return sampled, stats


def _by_micro_batch(fn, micro_batches: int, *arrays: jax.Array,
                    packing: update.Packing | None = None) -> jax.Array:
  """``fn(*arrays)`` [B, ...] computed in ``micro_batches`` equal chunks of rows (a ``lax.map``),
  so that the peak memory is one micro-batch's, as in the update. With ``packing`` (each
  chunk's, a leading [micro_batches] axis), ``fn(*chunk, packing=its packing)``."""
  call = fn if packing is None else lambda *xs: fn(*xs[:-1], packing=xs[-1])
  if micro_batches == 1:
    return call(*arrays, *(() if packing is None else
                           (jax.tree.map(lambda x: x[0], packing),)))
  if arrays[0].shape[0] % micro_batches:
    raise ValueError(f"batch of {arrays[0].shape[0]} sequences does not split into "
                     f"{micro_batches} chunks (config.trainer.mini_batches x "
                     "config.optimizer.micro_batches)")
  split = [x.reshape(micro_batches, -1, *x.shape[1:]) for x in arrays]
  out = jax.lax.map(lambda xs: call(*xs), split + ([] if packing is None else [packing]))
  return out.reshape(-1, *out.shape[2:])


def gae_advantages(config: RunConfig, sampled: Sampled, values: jax.Array, old_logprobs: jax.Array,
                   ref_logprobs: jax.Array | None, kl_coef: jax.Array) -> tuple[jax.Array, jax.Array]:
  """PPO: (advantages, returns) [B, T] by GAE over the critic's values, the task reward on the
  last response token, the KL to the reference a per-token penalty when ``kl_in_reward``;
  advantages whitened over the response tokens."""
  algo = config.algorithm
  mask = sampled.response_mask.astype(bool)
  last = (jnp.cumsum(mask, axis=1) == mask.sum(1, keepdims=True)) & mask
  token_rewards = jnp.where(last, sampled.rewards[:, None], 0.0)
  if algo.kl_in_reward and ref_logprobs is not None:
    token_rewards = algorithms.kl_reward_penalty(token_rewards, old_logprobs, ref_logprobs, mask,
                                                 kl_coef, algo.kl_estimator)
  advantages, returns = algorithms.gae(token_rewards, values, mask, algo.gamma, algo.lam)
  advantages = algorithms.masked_whiten(advantages, mask)
  return jnp.where(mask, advantages, 0.0), returns


def sequence_advantages(config: RunConfig, rewards: jax.Array, response_mask: jax.Array) -> jax.Array:
  """Per-token advantages [B, T] of a critic-free estimator (GRPO, Dr.GRPO, RLOO, REINFORCE++)."""
  estimator = config.algorithm.advantage_estimator
  if estimator not in algorithms.ADVANTAGES:
    raise ValueError(f"{estimator}: advantages come from the critic's values (gae_advantages)")
  return algorithms.ADVANTAGES[estimator](jnp.asarray(rewards, jnp.float32),
                                          jnp.asarray(response_mask), config.algorithm,
                                          config.rollout.group_size)


def make_prepare(config: RunConfig, transformer: Transformer, *, param_shardings: Any = None,
                 ref_shardings: Any = None, critic_shardings: Any = None,
                 batch_sharding: NamedSharding | None = None):
  """The jitted ``prepare(params, ref_params, critic_params, sampled, kl_coef, packing=None)
  -> RolloutBatch``: a complete batch for ``update_step`` (and the critic's step); ``packing``
  (``rlx.update.packing``, one per chunk of rows) runs the policy's forward passes on packed
  rows. ``ref_params`` is given exactly
  when the algorithm has a reference (``algorithm.uses_reference``), ``critic_params`` when it
  has a critic; ``kl_coef`` (only used by ``kl_in_reward``) is traced, so that an adaptive
  coefficient never retraces. With ``batch_sharding``, the program has explicit shardings: the
  params' (``param_shardings``, ``critic_shardings``) in, the batch's rows split as
  ``batch_sharding`` says in and out. ``ref_shardings``: the reference's, when they are not the
  params' (with LoRA the reference is the base alone)."""
  algo = config.algorithm
  # chunks of the update's micro-batch size: B / (mini-batches x micro-batches) rows
  chunks = config.trainer.mini_batches * config.optimizer.micro_batches
  logprobs = functools.partial(update.policy_logprobs, config, transformer, rows=batch_sharding)
  # One update per batch: the params about to be updated are the old policy, and the update
  # takes the old log-probs from its own forward pass (GAE still needs them here).
  skip_old = config.trainer.ppo_epochs * config.trainer.mini_batches == 1 and not algo.uses_critic

  def prepare(params: Params, ref_params: Params | None, critic_params: Params | None,
              sampled: Sampled, kl_coef: jax.Array,
              packing: update.Packing | None = None) -> RolloutBatch:
    inputs = (sampled.tokens, sampled.attention_mask, sampled.response_mask)
    if sampled.temperature is not None:  # traced, one per row: chunked with the rows
      inputs += (sampled.temperature,)
    old = (None if skip_old else _by_micro_batch(functools.partial(logprobs, params), chunks,
                                                 *inputs, packing=packing))
    ref = (None if ref_params is None else
           _by_micro_batch(functools.partial(logprobs, ref_params), chunks, *inputs,
                           packing=packing))
    returns = values = None
    if algo.uses_critic:
      values = _by_micro_batch(functools.partial(update.critic_values, transformer, critic_params),
                               chunks, *inputs[:2])
      advantages, returns = gae_advantages(config, sampled, values, old, ref, kl_coef)
    else:
      advantages = sequence_advantages(config, sampled.rewards, sampled.response_mask)
    return RolloutBatch(tokens=sampled.tokens, attention_mask=sampled.attention_mask,
                        response_mask=sampled.response_mask, advantages=advantages,
                        old_logprobs=old, behaviour_logprobs=sampled.behaviour_logprobs,
                        policy_version=sampled.policy_version, ref_logprobs=ref,
                        returns=returns, old_values=values, temperature=sampled.temperature)

  if batch_sharding is None:
    jitted = jax.jit(prepare)
  else:
    replicated = NamedSharding(batch_sharding.mesh, PartitionSpec())
    jitted = jax.jit(prepare, out_shardings=batch_sharding, in_shardings=(
        param_shardings, (ref_shardings or param_shardings) if algo.uses_reference else None,
        critic_shardings if algo.uses_critic else None, batch_sharding, replicated, replicated))

  def run(params, ref_params, critic_params, sampled: Sampled, kl_coef=None,
          packing: update.Packing | None = None) -> RolloutBatch:
    if algo.uses_critic != (critic_params is not None):
      raise ValueError(f"advantage {algo.advantage_estimator!r} needs critic params exactly when "
                       "it uses a critic (gae)")
    if algo.uses_reference != (ref_params is not None):
      raise ValueError("reference params are needed exactly when the algorithm has a KL term "
                       "(algorithm.kl_coef > 0 or kl_in_reward)")
    coef = algo.kl_coef if kl_coef is None else kl_coef
    return jitted(params, ref_params, critic_params, sampled, jnp.asarray(coef, jnp.float32),
                  packing)

  return run


def make_mismatch(config: RunConfig, transformer: Transformer, pad_id: int):
  """``measure(params, completions, version, temperature) -> (kl, tokens) | None``: the
  engine/learner mismatch of a batch, ``KL(behaviour || learner)`` per response token (k3 on
  the engine's samples), where the learner's log-probs are recomputed with the learner's code
  under ``params``, the weights of ``version``. Only the rows ``version`` sampled wholly count; None
  when there are none. Both sides run the same model code, so it should be tiny: a large
  value means the engine and the learner disagree on the numbers (dtype, kernels, sampling
  settings), which the off-policy correction then pays for."""
  logprobs = jax.jit(functools.partial(update.policy_logprobs, config, transformer))

  def measure(params, completions: Sequence[Completion], version: int,
              temperature: float | None = None) -> tuple[float, int] | None:
    rows = [c for c in completions if c.policy_version == c.newest_version == version]
    if not rows:
      return None
    arrays = layout(rows, pad_id)
    temperature = config.rollout.temperature if temperature is None else temperature
    temperatures = np.full(len(rows), update.sampling_temperature(temperature), np.float32)
    learner = np.asarray(logprobs(params, arrays["tokens"], arrays["attention_mask"],
                                  arrays["response_mask"], temperatures))
    mask = arrays["response_mask"]
    log_w = np.clip(learner - arrays["behaviour_logprobs"], -20, 20)[mask]
    return float(np.mean(np.exp(log_w) - 1 - log_w)), int(mask.sum())

  return measure
