"""The learner's step: ``update_step(state, batch) -> (state, metrics)``, pure and jitted once.

    optimizer = make_optimizer(config.optimizer, total_steps=config.trainer.steps)
    state = init_train_state(model.params, optimizer, jax.random.key(0))
    step = make_update_step(config, model.transformer, optimizer)
    state, metrics = step(state, batch)            # state is donated

One step: for each micro-batch, the policy's log-probs and entropy come from the
final hidden states and the unembedding through ``rlx.kernels.fused_logprobs``;
the per-token policy loss (PPO-clip / GSPO / CISPO by algorithm), the
off-policy weight, the KL and entropy terms are aggregated as (numerator,
denominator) with the denominator of the *whole* batch, so the accumulated
gradient equals the full-batch gradient exactly. Gradients are clipped by
global norm and applied by AdamW with a warm-up schedule. A step whose loss or
gradient norm is not finite is skipped inside the jitted step (the state comes
back unchanged) and reported as ``train/skipped``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlx import algorithms
from rlx.config import OptimizerConfig, RunConfig
from rlx.kernels import fused_logprobs
from rlx.mesh import logical_to_spec
from rlx.models.transformer import Params, Transformer
from rlx.types import RolloutBatch, TrainState

Metrics = dict[str, jax.Array]


def make_schedule(config: OptimizerConfig, total_steps: int, peak: float | None = None):
  """Linear warm-up from 0 to the peak, then constant or cosine decay to 0 at ``total_steps``."""
  peak = config.learning_rate if peak is None else peak
  warmup = config.warmup_steps
  if config.schedule == "constant":
    after = optax.constant_schedule(peak)
  else:
    after = optax.cosine_decay_schedule(peak, max(total_steps - warmup, 1))
  if warmup == 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def make_optimizer(config: OptimizerConfig, total_steps: int, peak: float | None = None):
  """AdamW with global-norm clipping; returns (optimizer, schedule)."""
  schedule = make_schedule(config, total_steps, peak)
  parts = [optax.clip_by_global_norm(config.max_grad_norm)] if config.max_grad_norm > 0 else []
  parts.append(optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.eps,
                           weight_decay=config.weight_decay))
  return optax.chain(*parts), schedule


def _replicated_like(params: Params) -> NamedSharding | None:
  sharding = jax.tree.leaves(params)[0].sharding
  return NamedSharding(sharding.mesh, PartitionSpec()) if isinstance(sharding, NamedSharding) else None


def train_state_shardings(params: Params, optimizer: optax.GradientTransformation) -> TrainState:
  """The shardings of a train state over ``params`` (a tree of ``NamedSharding``): the params'
  own; the optimizer's copies of the params (Adam's moments) sharded exactly like them; the
  optimizer's counters, the step, key and policy version replicated on the params' mesh."""
  replicated = _replicated_like(params)
  if replicated is None:
    raise ValueError("train_state_shardings needs params placed with NamedSharding "
                     "(see rlx.models.param_shardings)")
  shardings = jax.tree.map(lambda x: x.sharding, params)
  abstract = jax.eval_shape(optimizer.init, params)
  opt_state = optax.tree_map_params(optimizer, lambda _, sharding: sharding, abstract, shardings,
                                    transform_non_params=lambda _: replicated)
  return TrainState(step=replicated, params=shardings, opt_state=opt_state, key=replicated,
                    policy_version=replicated)


def init_train_state(params: Params, optimizer: optax.GradientTransformation,
                     key: jax.Array) -> TrainState:
  """A fresh train state, created in its shardings by one jitted program
  (``train_state_shardings``): the optimizer state is never materialised replicated, and the
  state is laid out exactly as ``update_step`` returns it, so that the second step hits the
  first step's compilation. (Params that are not placed with ``NamedSharding`` keep JAX's
  default placement.)"""
  def init(params, key):
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=optimizer.init(params), key=key,
                      policy_version=jnp.zeros((), jnp.int32))

  if _replicated_like(params) is None:
    return jax.jit(init)(params, key)
  return jax.jit(init, out_shardings=train_state_shardings(params, optimizer))(params, key)


def batch_sharding(mesh: Mesh, rules, batch_size: int) -> NamedSharding:
  """How the learner's batches lie on ``mesh``: rows split over the mesh axes the logical
  ``batch`` axis maps to (``(data, fsdp)`` by default), every other dimension whole. A batch
  that does not split evenly is replicated (``batch_is_split`` says which)."""
  return NamedSharding(mesh, logical_to_spec(("batch",), (batch_size,), mesh, rules))


def batch_is_split(sharding: NamedSharding) -> bool:
  return any(axis is not None for axis in sharding.spec)


def sequence_logprobs(transformer: Transformer, params: Params, tokens: jax.Array,
                      attention_mask: jax.Array, response_mask: jax.Array | None = None, *,
                      impl: str = "auto", temperature: float | jax.Array = 1.0,
                      chunk: int = 128, rows: NamedSharding | None = None
                      ) -> tuple[jax.Array, jax.Array]:
  """Log-prob and entropy [B, T] of every target token (position 0 gets 0), via the fused path.

  Args:
    tokens: int [B, T]; attention_mask: bool [B, T].
    response_mask: bool [B, T] the targets that are needed (others get 0, and
      the Pallas kernels skip whole blocks of them); None computes all.
    temperature: the sampling temperature, so that these match the behaviour log-probs: a
      Python float (a constant of the compiled program), or float32 [B], one per sequence
      (traced: any temperature runs the same program). An array scales the hidden states,
      ``(h / t) @ W == (h @ W) / t``, so the kernels see temperature 1.
    rows: how the sequences are split over the mesh (the learner's batch sharding): the
      Pallas kernels then run per device on its own rows (``fused_logprobs``), when the
      sequences split evenly.
  """
  hidden, _ = transformer.hidden_states(params, tokens, attention_mask)
  B, T, D = hidden.shape
  if not isinstance(temperature, (int, float)):
    hidden = hidden / jnp.asarray(temperature, hidden.dtype)[:, None, None]
    temperature = 1.0
  if rows is not None and B % _ways(rows):  # not split after all: every device has every row
    rows = NamedSharding(rows.mesh, PartitionSpec())
  mask = None if response_mask is None else response_mask[:, 1:].reshape(-1)
  logprobs, entropy = fused_logprobs(
      hidden[:, :-1].reshape(B * (T - 1), D), transformer.unembedding(params),
      tokens[:, 1:].reshape(-1), mask, impl=impl, temperature=temperature, chunk=chunk,
      rows=rows)
  pad = lambda x: jnp.pad(x.reshape(B, T - 1), ((0, 0), (1, 0)))
  return pad(logprobs), pad(entropy)


def _ways(sharding: NamedSharding) -> int:
  """Into how many parts ``sharding`` splits dimension 0."""
  axes = sharding.spec[0] if sharding.spec else None
  axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
  return int(math.prod(sharding.mesh.shape[a] for a in axes))


def sampling_temperature(temperature: float) -> float:
  """The temperature the learner takes log-probs at for data sampled at ``temperature``: itself,
  or 1 for greedy data (0), whose behaviour log-probs the engine takes at 1."""
  return temperature if temperature > 0 else 1.0


def _temperature(config: RunConfig) -> float:
  return sampling_temperature(config.rollout.temperature)


def policy_logprobs(config: RunConfig, transformer: Transformer, params: Params,
                    tokens: jax.Array, attention_mask: jax.Array,
                    response_mask: jax.Array | None = None,
                    temperature: jax.Array | None = None, *,
                    rows: NamedSharding | None = None) -> jax.Array:
  """Log-probs [B, T] of the target tokens under ``params`` at the sampling temperature (float32
  [B] per sequence, or None: the config's), through the same fused path as the loss (old and
  reference log-probs)."""
  return sequence_logprobs(transformer, params, tokens, attention_mask, response_mask,
                           impl=config.model.logprob_impl,
                           temperature=_temperature(config) if temperature is None else temperature,
                           chunk=config.model.logprob_chunk, rows=rows)[0]


def make_logprobs_fn(config: RunConfig, transformer: Transformer):
  """Jitted ``(params, tokens, attention_mask, response_mask=None) -> logprobs [B, T]``."""
  return jax.jit(functools.partial(policy_logprobs, config, transformer))


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
  temperature = _temperature(config) if batch.temperature is None else batch.temperature
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


def _split(batch: RolloutBatch, micro_batches: int) -> RolloutBatch:
  if batch.batch_size % micro_batches:
    raise ValueError(f"batch of {batch.batch_size} sequences does not split into "
                     f"{micro_batches} micro-batches (config.optimizer.micro_batches)")
  return jax.tree.map(lambda x: x.reshape(micro_batches, -1, *x.shape[1:]), batch)


def loss_and_grads(params: Params, batch: RolloutBatch, kl_coef: jax.Array,
                   clip_eps_high: jax.Array | None = None, *, config: RunConfig,
                   transformer: Transformer, rows: NamedSharding | None = None
                   ) -> tuple[jax.Array, Params, dict[str, jax.Array]]:
  """Full-batch loss and gradient, accumulated over ``config.optimizer.micro_batches``."""
  denominator = loss_denominator(config, batch.response_mask)
  grad_fn = jax.value_and_grad(
      functools.partial(microbatch_loss, config=config, transformer=transformer, rows=rows),
      has_aux=True)

  def accumulate(carry, micro):
    loss_sum, grad_sum, sums = carry
    (loss, micro_sums), grads = grad_fn(params, micro, denominator, kl_coef, clip_eps_high)
    sums = {k: jnp.maximum(sums[k], v) if k == "ratio_max" else sums[k] + v
            for k, v in micro_sums.items()}
    return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads), sums), None

  micro_batches = _split(batch, config.optimizer.micro_batches)
  first = jax.tree.map(lambda x: x[0], micro_batches)
  sums_shape = jax.eval_shape(
      lambda: grad_fn(params, first, denominator, kl_coef, clip_eps_high)[0][1])
  zero_sums = {k: jnp.full(v.shape, -jnp.inf if k == "ratio_max" else 0.0, v.dtype)
               for k, v in sums_shape.items()}
  zero_grads = jax.tree.map(jnp.zeros_like, params)
  (loss, grads, sums), _ = jax.lax.scan(
      accumulate, (jnp.zeros(()), zero_grads, zero_sums), micro_batches)
  return loss, grads, sums


def all_finite(tree) -> jax.Array:
  """Whether every floating-point value of ``tree`` is finite: one reduction per leaf, inside
  the jitted step (an update can make the weights non-finite from a finite loss and gradient,
  e.g. at an infinite learning rate)."""
  leaves = [x for x in jax.tree.leaves(tree)
            if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves else jnp.True_


def _finite_or_unchanged(ok: jax.Array, new: TrainState, old: TrainState) -> TrainState:
  """``new`` when ``ok``, else ``old`` (a skipped step: params, optimizer state, step and
  policy version all unchanged). A select inside the jitted step, so it needs no host sync."""
  pick = lambda a, b: jax.tree.map(lambda x, y: jnp.where(ok, x, y), a, b)
  return new.replace(step=pick(new.step, old.step), params=pick(new.params, old.params),
                     opt_state=pick(new.opt_state, old.opt_state),
                     policy_version=pick(new.policy_version, old.policy_version))


def minibatch_order(batch_size: int, key: jax.Array, *, epochs: int,
                    mini_batches: int) -> jax.Array:
  """Row indices int [epochs * mini_batches, batch_size // mini_batches]: each pass over the
  batch is a fresh permutation (``fold_in(key, pass)``) cut into ``mini_batches`` slices.
  One mini-batch keeps the batch's own order (the order of a full batch changes nothing)."""
  if batch_size % mini_batches:
    raise ValueError(f"batch of {batch_size} sequences does not split into {mini_batches} "
                     "mini-batches (config.trainer.mini_batches)")
  if mini_batches == 1:
    return jnp.tile(jnp.arange(batch_size), (epochs, 1))
  passes = [jax.random.permutation(jax.random.fold_in(key, e), batch_size) for e in range(epochs)]
  return jnp.stack(passes).reshape(epochs * mini_batches, batch_size // mini_batches)


def schedule_batches(batch: RolloutBatch, order: jax.Array) -> RolloutBatch:
  """The batch's rows gathered as ``order`` says: every leaf gets a leading [updates] axis."""
  return jax.tree.map(lambda x: x[order], batch)


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
  metrics)``: the whole
  ``trainer.ppo_epochs x trainer.mini_batches`` schedule on one rollout batch.

  Each pass draws a fresh permutation of the sequences from ``fold_in(state.key,
  state.step)``; every mini-batch is one optimizer step (its micro-batches accumulated
  exactly, normalised by the mini-batch's own denominator), run as a ``lax.scan``. The
  policy version goes up by one per call (unless every update was skipped): the generator
  sees one new policy per rollout batch. Jitted once, the state donated, with explicit
  shardings when ``state_shardings`` (a ``TrainState`` of shardings) and ``batch_shardings`` (a
  prefix of the batch) are given. ``kl_coef`` and ``clip_eps_high`` (None: the config's) are
  traced scalars, like the batch's sampling temperatures: a controller that moves them never
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
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    grad_norm = optax.tree.norm(grads)
    gradient_finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    update_finite = all_finite(params) & all_finite(opt_state)
    finite = gradient_finite & update_finite
    tokens = jnp.maximum(sums.pop("tokens"), 1.0)
    ratio_max = sums.pop("ratio_max")
    metrics = {
        "loss": loss,
        "policy/loss": sums["policy_loss"] / tokens,
        "policy/entropy": sums["entropy"] / tokens,
        "policy/clip_frac_low": sums["clip_low"] / tokens,
        "policy/clip_frac_high": sums["clip_high"] / tokens,
        "policy/approx_kl": sums["approx_kl"] / tokens,
        "policy/kl_behaviour": sums["kl_behaviour"] / tokens,
        "policy/ratio_mean": sums["ratio"] / tokens,
        "policy/ratio_max": ratio_max,
        "policy/is_weight_mean": sums["is_weight"] / tokens,
        "policy/is_clip_frac": sums["is_clip"] / tokens,
        "optim/grad_norm": grad_norm,
        "train/skipped": jnp.logical_not(finite).astype(jnp.int32),
        # skipped although the loss and gradient were finite: the update itself overflowed
        "train/skipped_update": (gradient_finite & ~update_finite).astype(jnp.int32),
        "optim/lr": jnp.asarray(schedule(state.step) if schedule else jnp.nan, jnp.float32),
        "response/tokens": tokens,
    }
    if "kl" in sums:
      metrics["policy/kl"] = sums["kl"] / tokens
    updated = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    return _finite_or_unchanged(finite, updated, state), metrics

  def update_step(state: TrainState, batch: RolloutBatch, kl_coef: jax.Array,
                  clip_eps_high: jax.Array):
    order = minibatch_order(batch.batch_size, jax.random.fold_in(state.key, state.step),
                            epochs=epochs, mini_batches=mini_batches)
    version = state.policy_version
    state, metrics = jax.lax.scan(lambda s, b: minibatch_update(s, b, kl_coef, clip_eps_high),
                                  state, schedule_batches(batch, order))
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


# --- the critic (PPO) ---------------------------------------------------------------------------

def init_critic_params(policy_params: Params, key: jax.Array) -> Params:
  """A critic initialised from the policy: the transformer's params plus a zero scalar head."""
  del key  # the head starts at zero, so the first values are 0 for every state
  hidden_size = policy_params["final_norm"].shape[0]
  head = lambda: {"kernel": jnp.zeros((hidden_size,), jnp.float32),
                  "bias": jnp.zeros((), jnp.float32)}
  # the head replicated on the policy's mesh, created there (never via a default device)
  return {"model": policy_params, "value_head": jax.jit(
      head, out_shardings=_replicated_like(policy_params))()}


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
  ``ppo_epochs x mini_batches`` schedule as the policy (permutations from the critic's key)."""
  clip = config.algorithm.value_clip
  epochs, mini_batches = config.trainer.ppo_epochs, config.trainer.mini_batches

  def microbatch(params, micro: RolloutBatch, denominator):
    values = critic_values(transformer, params, micro.tokens, micro.attention_mask)
    loss = algorithms.value_loss(values, micro.old_values, micro.returns, clip)
    mask = micro.response_mask.astype(bool)
    error = algorithms.masked_sum(jnp.square(values - micro.returns), mask)
    return algorithms.masked_sum(loss, mask) / denominator, error

  grad_fn = jax.value_and_grad(microbatch, has_aux=True)

  def minibatch_step(state: TrainState, batch: RolloutBatch):
    denominator = jnp.maximum(batch.response_mask.sum().astype(jnp.float32), 1.0)

    def accumulate(carry, micro):
      loss_sum, grad_sum, error_sum = carry
      (loss, error), grads = grad_fn(state.params, micro, denominator)
      return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads), error_sum + error), None

    init = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, state.params), jnp.zeros(()))
    (loss, grads, error), _ = jax.lax.scan(accumulate, init,
                                           _split(batch, config.optimizer.micro_batches))
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    updated = state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                            opt_state=opt_state)
    grad_norm = optax.tree.norm(grads)
    finite = (jnp.isfinite(loss) & jnp.isfinite(grad_norm) & all_finite(updated.params)
              & all_finite(updated.opt_state))
    return _finite_or_unchanged(finite, updated, state), {
        "critic/loss": loss, "critic/value_mse": error / denominator, "critic/grad_norm": grad_norm,
        "critic/skipped": jnp.logical_not(finite).astype(jnp.int32)}

  def critic_step(state: TrainState, batch: RolloutBatch):
    if batch.returns is None or batch.old_values is None:
      raise ValueError("the critic step needs batch.returns and batch.old_values")
    order = minibatch_order(batch.batch_size, jax.random.fold_in(state.key, state.step),
                            epochs=epochs, mini_batches=mini_batches)
    state, metrics = jax.lax.scan(minibatch_step, state, schedule_batches(batch, order))
    return state, {name: values.sum() if name == "critic/skipped" else values.mean()
                   for name, values in metrics.items()}

  if state_shardings is None:
    return jax.jit(critic_step, donate_argnums=0)
  return jax.jit(critic_step, donate_argnums=0, in_shardings=(state_shardings, batch_shardings),
                 out_shardings=(state_shardings, state_shardings.step))
