"""The optimizer, its schedule, and where the train state and the learner's batches lie."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlx.config import OptimizerConfig
from rlx.mesh import logical_to_spec
from rlx.models.transformer import Params
from rlx.types import TrainState


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


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  """``optax.clip_by_global_norm`` as one multiplication by a scalar: gradients whose global
  norm exceeds ``max_norm`` are scaled to it. The same values up to a rounding (``g * (m /
  n)`` where optax computes ``g / n * m``), and XLA can fuse a multiplication into every
  reader of the clipped gradient where a division, which it does not repeat, is kept whole:
  at SmolLM2-135M's shapes optax's clip held a clipped copy of the gradient, 0.5 GB, in the
  update step's temporaries."""
  def update(updates, state, params=None):
    del params
    norm = optax.tree.norm(updates)
    scale = jnp.where(norm > max_norm, max_norm / norm, 1.0)
    return jax.tree.map(lambda g: g * scale.astype(g.dtype), updates), state
  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def moments_held_in(inner: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
  """``inner`` with the floating-point arrays of its state (Adam's two moments) held in
  ``dtype`` between steps: read up to float32 for each update, its math done there, and
  rounded back (to nearest) when kept. Half the moments' memory in bfloat16."""
  def cast(state, to):
    return jax.tree.map(lambda x: x.astype(to) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        state)

  def update(updates, state, params=None):
    updates, state = inner.update(updates, cast(state, jnp.float32), params)
    return updates, cast(state, dtype)

  return optax.GradientTransformation(lambda params: cast(inner.init(params), dtype), update)


def make_optimizer(config: OptimizerConfig, total_steps: int, peak: float | None = None):
  """AdamW with global-norm clipping; returns (optimizer, schedule). Adam's moments are kept in
  ``config.moments_dtype``."""
  schedule = make_schedule(config, total_steps, peak)
  parts = [clip_by_global_norm(config.max_grad_norm)] if config.max_grad_norm > 0 else []
  if config.moments_dtype == "float32":
    parts.append(optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.eps,
                             weight_decay=config.weight_decay))
  else:  # optax.adamw's own chain, its moments held in bfloat16
    parts += [moments_held_in(optax.scale_by_adam(config.b1, config.b2, config.eps),
                              jnp.dtype(config.moments_dtype)),
              optax.add_decayed_weights(config.weight_decay),
              optax.scale_by_learning_rate(schedule)]
  return optax.chain(*parts), schedule


def replicated_like(params: Params) -> NamedSharding | None:
  """Replicated on the mesh ``params`` lie on; None for params not placed with NamedSharding."""
  sharding = jax.tree.leaves(params)[0].sharding
  return NamedSharding(sharding.mesh, PartitionSpec()) if isinstance(sharding, NamedSharding) else None


def train_state_shardings(params: Params, optimizer: optax.GradientTransformation) -> TrainState:
  """The shardings of a train state over ``params`` (a tree of ``NamedSharding``): the params'
  own; the optimizer's copies of the params (Adam's moments) sharded exactly like them; the
  optimizer's counters, the step, key and policy version replicated on the params' mesh."""
  replicated = replicated_like(params)
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
                     key: jax.Array, donate: bool = False) -> TrainState:
  """A fresh train state, created in its shardings by one jitted program
  (``train_state_shardings``): the optimizer state is never materialised replicated, and the
  state is laid out exactly as ``update_step`` returns it, so that the second step hits the
  first step's compilation. (Params that are not placed with ``NamedSharding`` keep JAX's
  default placement.) ``donate``: the state takes ``params``' buffers (deleted for the
  caller), so that the two never stand whole at once."""
  def init(params, key):
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=optimizer.init(params), key=key,
                      policy_version=jnp.zeros((), jnp.int32))

  donated = (0,) if donate else ()
  if replicated_like(params) is None:
    return jax.jit(init, donate_argnums=donated)(params, key)
  return jax.jit(init, out_shardings=train_state_shardings(params, optimizer),
                 donate_argnums=donated)(params, key)


def batch_sharding(mesh: Mesh, rules, batch_size: int) -> NamedSharding:
  """How the learner's batches lie on ``mesh``: rows split over the mesh axes the logical
  ``batch`` axis maps to (``(data, fsdp)`` by default), every other dimension whole. A batch
  that does not split evenly is replicated (``batch_is_split`` says which)."""
  return NamedSharding(mesh, logical_to_spec(("batch",), (batch_size,), mesh, rules))


def batch_is_split(sharding: NamedSharding) -> bool:
  return any(axis is not None for axis in sharding.spec)
