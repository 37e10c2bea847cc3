"""What every learner step shares, the policy's and the critic's: micro-batches accumulated
exactly, an optimizer update that is kept only when everything it produced is finite, and
the ``ppo_epochs x mini_batches`` schedule run as one ``lax.scan``."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax

from rlx import unroll
from rlx.models.transformer import Params
from rlx.update.packing import Packing
from rlx.types import RolloutBatch, TrainState

Sums = dict[str, jax.Array]
# (params, micro-batch, its index, its packing or None) -> ((loss, sums), grads): the loss
# already divided by the whole mini-batch's denominator, so that the accumulated gradient is
# the mini-batch's exactly
GradFn = Callable[[Params, RolloutBatch, jax.Array, Packing | None],
                  tuple[tuple[jax.Array, Sums], Params]]


def split_micro(batch: RolloutBatch, micro_batches: int) -> RolloutBatch:
  """The batch with a leading [micro_batches] axis on every leaf."""
  if batch.batch_size % micro_batches:
    raise ValueError(f"batch of {batch.batch_size} sequences does not split into "
                     f"{micro_batches} micro-batches (config.optimizer.micro_batches)")
  return jax.tree.map(lambda x: x.reshape(micro_batches, -1, *x.shape[1:]), batch)


def accumulate(grad_fn: GradFn, params: Params, batch: RolloutBatch, micro_batches: int, *,
               maxima: tuple[str, ...] = (), packing: Packing | None = None
               ) -> tuple[jax.Array, Params, Sums]:
  """Loss, gradient and sums of ``batch``, one micro-batch at a time (a ``lax.scan``): losses,
  gradients and sums add up, except the sums named in ``maxima``, which take the maximum.
  ``packing``: each micro-batch's (a leading [micro_batches] axis), or None."""
  micro = split_micro(batch, micro_batches)
  first = jax.tree.map(lambda x: x[0], (micro, packing))
  sums_shape = jax.eval_shape(
      lambda: grad_fn(params, first[0], jnp.zeros((), jnp.int32), first[1])[0][1])
  zero_sums = {k: jnp.full(v.shape, -jnp.inf if k in maxima else 0.0, v.dtype)
               for k, v in sums_shape.items()}

  def add(carry, xs):
    loss_sum, grad_sum, sums = carry
    one, index, plan = xs
    (loss, one_sums), grads = grad_fn(params, one, index, plan)
    sums = {k: jnp.maximum(sums[k], v) if k in maxima else sums[k] + v
            for k, v in one_sums.items()}
    return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads), sums), None

  init = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params), zero_sums)
  (loss, grads, sums), _ = jax.lax.scan(add, init,
                                        (micro, jnp.arange(micro_batches), packing),
                                        unroll=unroll.factor())
  return loss, grads, sums


def all_finite(tree) -> jax.Array:
  """Whether every floating-point value of ``tree`` is finite: one reduction per leaf, inside
  the jitted step (an update can make the weights non-finite from a finite loss and gradient,
  e.g. at an infinite learning rate)."""
  leaves = [x for x in jax.tree.leaves(tree)
            if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves else jnp.True_


def _checked_norm(params: Params, updates: Params) -> jax.Array:
  """The norm of ``updates``; infinite where an update or the param it makes is not finite.
  One reduction per leaf reads each update once: the checks never hold a whole new copy of
  the params or the updates (XLA materialises an expensive value, such as Adam's division,
  that several reductions read)."""
  def leaf(p, u):
    ok = jnp.isfinite(optax.apply_updates(p, u))  # the new param: inf - inf or an overflow
    return jnp.sum(jnp.where(ok, jnp.square(u.astype(jnp.float32)), jnp.inf))
  return jnp.sqrt(sum(jax.tree.leaves(jax.tree.map(leaf, params, updates)), jnp.float32(0)))


def apply_if_finite(optimizer: optax.GradientTransformation, state: TrainState, loss: jax.Array,
                    grads: Params, empty: jax.Array | bool = False, max_update_ratio: float = 0.0
                    ) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimizer step on ``state``, kept only when the loss, the gradient norm, the update
  and the new params are all finite and (``max_update_ratio`` > 0) the update's norm is at
  most that fraction of the params' (else ``state`` comes back unchanged). Adam's new moments
  are not read: each is a convex combination of the old one and the gradient (or its square,
  at most the checked norm's square), so they are finite whenever the state was and the
  gradient norm is; a non-finite old moment makes the update non-finite. (Checking them read
  the moments through a predicate per element, which XLA:CPU materialises before reducing:
  0.2 GB more of the compiled step's temporaries at SmolLM2-135M.) Also returns
  ``grad_norm``, ``update_ratio``, ``skipped`` (int 0/1) and ``skipped_update`` (skipped
  although the loss and gradient were finite: the update itself overflowed or exploded). An
  ``empty`` mini-batch (no response token in the loss) is not a numerical failure: it leaves
  ``state`` unchanged (Adam's momentum would move the weights even on a zero gradient) and
  counts as ``empty``, not ``skipped``."""
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  grad_norm = optax.tree.norm(grads)
  gradient_finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  ratio = _checked_norm(state.params, updates) / jnp.maximum(optax.tree.norm(state.params), 1e-12)
  update_finite = jnp.isfinite(ratio)
  if max_update_ratio:
    update_finite &= ratio <= max_update_ratio
  finite = gradient_finite & update_finite
  empty = jnp.asarray(empty)

  def step(old: TrainState) -> TrainState:
    new_updates, new_opt_state = optimizer.update(grads, old.opt_state, old.params)
    return old.replace(step=old.step + 1, params=optax.apply_updates(old.params, new_updates),
                       opt_state=new_opt_state)

  # The step is computed again inside a conditional rather than selected with jnp.where from
  # the checked values: a select keeps the new params and moments alive beside the old ones
  # until the verdict (compiled for SmolLM2-135M: 2.08 GB of temporaries against 1.52 GB;
  # the elementwise optimizer math twice costs little beside the forward and backward passes).
  # A skipped step leaves params, optimizer state, step and policy version unchanged.
  return jax.lax.cond(finite & ~empty, step, lambda old: old, state), {
      "grad_norm": grad_norm, "update_ratio": ratio,
      "skipped": (~finite & ~empty).astype(jnp.int32),
      "skipped_update": (gradient_finite & ~update_finite & ~empty).astype(jnp.int32),
      "empty": empty.astype(jnp.int32)}


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


def schedule_order(state: TrainState, batch_size: int, *, epochs: int,
                   mini_batches: int) -> jax.Array:
  """The rows of each mini-batch of the next update step (``minibatch_order`` from
  ``fold_in(state.key, state.step)``)."""
  return minibatch_order(batch_size, jax.random.fold_in(state.key, state.step),
                         epochs=epochs, mini_batches=mini_batches)


def over_schedule(minibatch_step, state: TrainState, batch: RolloutBatch, *, epochs: int,
                  mini_batches: int, packing: Packing | None = None
                  ) -> tuple[TrainState, dict[str, jax.Array]]:
  """``minibatch_step(state, (mini_batch, packing)) -> (state, metrics)`` over the whole
  schedule: each pass a fresh permutation (``schedule_order``); metrics come back with a
  leading [updates] axis. ``packing`` (``rlx.update.packing``): the plan of every update's
  micro-batches, made for the order it carries, which replaces the drawn one."""
  if packing is None:
    order = schedule_order(state, batch.batch_size, epochs=epochs, mini_batches=mini_batches)
  else:
    order, packing = packing.order, packing.replace(order=None)
  return jax.lax.scan(minibatch_step, state, (schedule_batches(batch, order), packing),
                      unroll=unroll.factor())
