"""The learner step: exact micro-batch accumulation, no retracing, the right direction,
sharded = unsharded, the critic step, the fused path against full logits."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rlx import mesh as mesh_lib
from rlx import update
from rlx.config import ArchConfig, MeshConfig, RunConfig
from rlx.models import init_model, param_shardings
from rlx.types import RolloutBatch, TrainState

ARCH = ArchConfig(num_layers=2, vocab_size=64, hidden_size=32, intermediate_size=48, num_heads=4,
                  num_kv_heads=2, head_dim=8)
B, T = 8, 12


def _config(trainer=None, **algorithm):
  config = RunConfig()
  return dataclasses.replace(
      config, algorithm=dataclasses.replace(config.algorithm, **algorithm),
      trainer=dataclasses.replace(config.trainer, **(trainer or {})),
      optimizer=dataclasses.replace(config.optimizer, learning_rate=1e-3),
      rollout=dataclasses.replace(config.rollout, max_new_tokens=T))


def _batch(model, config, seed=0, advantages=None):
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(0, ARCH.vocab_size, (B, T)))
  prompt = rng.integers(2, 5, B)
  lengths = rng.integers(1, T - 4, B)
  positions = np.arange(T)[None]
  left_pad = np.zeros(B, int)
  left_pad[::3] = 1
  attention = positions >= left_pad[:, None]
  attention &= positions < (prompt + lengths)[:, None]
  response = (positions >= prompt[:, None]) & attention
  if advantages is None:
    advantages = rng.normal(size=B)
  old = update.make_logprobs_fn(config, model.transformer)(model.params, tokens, jnp.asarray(attention))
  noise = jnp.asarray(rng.normal(scale=0.1, size=(B, T)), jnp.float32)
  return RolloutBatch(
      tokens=tokens, attention_mask=jnp.asarray(attention), response_mask=jnp.asarray(response),
      advantages=jnp.where(jnp.asarray(response), jnp.asarray(advantages, jnp.float32)[:, None], 0.0),
      old_logprobs=old + noise, behaviour_logprobs=old + 2 * noise,
      policy_version=jnp.zeros(B, jnp.int32), ref_logprobs=old - noise)


# compiled: eager execution of a whole loss and gradient takes tens of seconds per call
_loss_and_grads = jax.jit(update.loss_and_grads, static_argnames=("config", "transformer"))


@pytest.fixture(scope="module")
def model():
  return init_model(ARCH, jax.random.key(0))


# one case per aggregation (exactness depends on the denominators; every per-token loss is
# checked against NumPy in tests/algorithms), GSPO for a loss that reads whole rows
@pytest.mark.parametrize("name, loss_agg", [
    ("dapo", "token-mean"), ("grpo", "seq-mean-token-mean"), ("dr_grpo", "seq-mean-token-sum-norm"),
    ("gspo", "seq-mean-token-sum")])
def test_microbatch_accumulation_equals_full_batch(model, loss_agg, name):
  config = _config(name=name, loss_agg=loss_agg, kl_coef=0.1, entropy_coef=0.01, off_policy="tis")
  batch = _batch(model, config)
  full = _loss_and_grads(model.params, batch, jnp.float32(0.1), config=config,
                         transformer=model.transformer)
  micro_config = dataclasses.replace(config, optimizer=dataclasses.replace(config.optimizer,
                                                                           micro_batches=4))
  micro = _loss_and_grads(model.params, batch, jnp.float32(0.1), config=micro_config,
                          transformer=model.transformer)
  chex.assert_trees_all_close(micro[0], full[0], rtol=1e-5, atol=1e-7)
  chex.assert_trees_all_close(micro[1], full[1], rtol=1e-4, atol=1e-7)
  chex.assert_trees_all_close(micro[2], full[2], rtol=1e-5, atol=1e-6)


def test_update_step_never_retraces(model, monkeypatch):
  traces = []
  traced = update.policy.loss_and_grads
  monkeypatch.setattr(update.policy, "loss_and_grads", lambda *a, **k: traces.append(1) or traced(*a, **k))
  config = _config(name="grpo", kl_coef=0.04)
  optimizer, schedule = update.make_optimizer(config.optimizer, total_steps=10)
  params = jax.tree.map(jnp.copy, model.params)
  state = update.init_train_state(params, optimizer, jax.random.key(0))
  step = update.make_update_step(config, model.transformer, optimizer, schedule)
  for i in range(4):
    state, metrics = step(state, _batch(model, config, seed=i), kl_coef=0.04 * (i + 1))
  assert len(traces) == 1  # traced (and compiled) once, whatever the data and the KL coefficient
  assert int(state.step) == 4 and int(state.policy_version) == 4
  expected_keys = {"loss", "policy/loss", "policy/kl", "policy/entropy", "policy/clip_frac_low",
                   "policy/clip_frac_high", "policy/approx_kl", "policy/ratio_mean",
                   "policy/ratio_max", "advantage/mean", "advantage/std", "optim/grad_norm",
                   "optim/lr"}
  assert expected_keys <= set(metrics)
  assert all(np.isfinite(float(v)) for v in metrics.values())


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_one_step_moves_the_policy_the_right_way(model, sign):
  config = _config(name="grpo", off_policy="none")
  batch = _batch(model, config, advantages=np.full(B, sign))
  batch = batch.replace(old_logprobs=update.make_logprobs_fn(config, model.transformer)(
      model.params, batch.tokens, batch.attention_mask))
  batch = batch.replace(behaviour_logprobs=batch.old_logprobs)
  optimizer, _ = update.make_optimizer(config.optimizer, total_steps=1)
  state = update.init_train_state(jax.tree.map(jnp.copy, model.params), optimizer, jax.random.key(0))
  step = update.make_update_step(config, model.transformer, optimizer)
  loss = lambda params: float(_loss_and_grads(params, batch, jnp.float32(0), config=config,
                                              transformer=model.transformer)[0])
  before = loss(state.params)
  state, _ = step(state, batch)
  after = loss(state.params)
  assert after < before
  new_logprobs = update.make_logprobs_fn(config, model.transformer)(
      state.params, batch.tokens, batch.attention_mask)
  change = float(jnp.sum(jnp.where(batch.response_mask, new_logprobs - batch.old_logprobs, 0.0)))
  assert sign * change > 0  # reinforced tokens become likelier, penalised ones less likely


def test_sequence_logprobs_equal_full_logits(model):
  config = _config()
  batch = _batch(model, config)
  logprobs, entropy = update.sequence_logprobs(model.transformer, model.params, batch.tokens,
                                               batch.attention_mask, impl="xla", chunk=16)
  logits, _ = model.transformer(model.params, batch.tokens, batch.attention_mask)
  log_softmax = jax.nn.log_softmax(logits[:, :-1], axis=-1)
  expected = jnp.take_along_axis(log_softmax, batch.tokens[:, 1:, None], axis=-1)[..., 0]
  np.testing.assert_allclose(logprobs[:, 1:], expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(entropy[:, 1:], -(jnp.exp(log_softmax) * log_softmax).sum(-1),
                             rtol=1e-5, atol=1e-5)
  assert float(jnp.abs(logprobs[:, 0]).max()) == 0.0


def test_traced_temperatures_and_clip_range_equal_the_configs_constants(model):
  """The learner's step takes each row's sampling temperature from the batch and the upper clip
  range as a traced scalar (a controller moving them compiles nothing): the same loss and
  gradient as a program with both as the config's constants."""
  constants = dataclasses.replace(_config(name="dapo", clip_eps_high=0.28),
                                  rollout=dataclasses.replace(_config().rollout, temperature=0.7,
                                                              max_new_tokens=T))
  batch = _batch(model, constants)
  expected = _loss_and_grads(model.params, batch, jnp.float32(0.1), config=constants,
                             transformer=model.transformer)
  traced = _loss_and_grads(model.params, batch.replace(temperature=jnp.full(B, 0.7)),
                           jnp.float32(0.1), jnp.float32(0.28), config=_config(name="dapo"),
                           transformer=model.transformer)
  chex.assert_trees_all_close(traced, expected, rtol=2e-5, atol=2e-6)
  narrower = _loss_and_grads(model.params, batch.replace(temperature=jnp.full(B, 0.7)),
                             jnp.float32(0.1), jnp.float32(0.02), config=_config(name="dapo"),
                             transformer=model.transformer)
  assert float(narrower[2]["clip_high"]) > 0 and float(narrower[0]) != float(expected[0])

  # one temperature per row: each row as if its program had its own constant
  temperatures = jnp.asarray([0.5, 0.7, 1.0, 1.3] * 2, jnp.float32)
  per_row = update.sequence_logprobs(model.transformer, model.params, batch.tokens,
                                     batch.attention_mask, temperature=temperatures)
  for t in (0.5, 0.7, 1.0, 1.3):
    rows = np.flatnonzero(np.isclose(temperatures, t))
    alone = update.sequence_logprobs(model.transformer, model.params, batch.tokens[rows],
                                     batch.attention_mask[rows], temperature=t)
    chex.assert_trees_all_close(tuple(x[rows] for x in per_row), alone, rtol=1e-5, atol=1e-6)


def test_sharded_update_equals_single_device(model):
  config = _config(name="dapo", clip_eps_high=0.28)
  batch = _batch(model, config)
  optimizer, schedule = update.make_optimizer(config.optimizer, total_steps=2)
  single_state = update.init_train_state(jax.tree.map(jnp.copy, model.params), optimizer,
                                         jax.random.key(0))
  single_state, single_metrics = update.make_update_step(config, model.transformer, optimizer,
                                                         schedule)(single_state, batch)
  mesh = mesh_lib.make_mesh(MeshConfig(fsdp=4, tensor=2))
  # A copy: device_put may reuse buffers, and the step donates (deletes) its input state.
  sharded_params = jax.device_put(jax.tree.map(jnp.copy, model.params), param_shardings(ARCH, mesh))
  state = update.init_train_state(sharded_params, optimizer, jax.random.key(0))
  state_shardings = jax.tree.map(lambda x: x.sharding, state)
  batch_shardings = jax.tree.map(
      lambda x: NamedSharding(mesh, P(("data", "fsdp"), *([None] * (x.ndim - 1)))), batch)
  step = update.make_update_step(config, model.transformer, optimizer, schedule,
                                 state_shardings=state_shardings, batch_shardings=batch_shardings)
  state, metrics = step(state, jax.device_put(batch, batch_shardings))
  assert state.params["layers"]["q"].sharding == sharded_params["layers"]["q"].sharding
  chex.assert_trees_all_close(jax.device_get(metrics), jax.device_get(single_metrics),
                              rtol=1e-4, atol=1e-6)
  chex.assert_trees_all_close(jax.device_get(state.params), jax.device_get(single_state.params),
                              rtol=1e-4, atol=1e-6)


def test_critic_step_fits_the_returns(model):
  config = _config(name="ppo", value_clip=None)
  critic_config = dataclasses.replace(config, optimizer=dataclasses.replace(
      config.optimizer, learning_rate=3e-3, micro_batches=2))
  batch = _batch(model, config)
  returns = jnp.where(batch.response_mask, 0.5, 0.0)
  batch = batch.replace(returns=returns, old_values=jnp.zeros((B, T)))
  optimizer, _ = update.make_optimizer(critic_config.optimizer, total_steps=20)
  params = update.init_critic_params(jax.tree.map(jnp.copy, model.params), jax.random.key(1))
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params,
                     opt_state=optimizer.init(params), key=jax.random.key(0),
                     policy_version=jnp.zeros((), jnp.int32))
  step = update.make_critic_step(critic_config, model.transformer, optimizer)
  errors = []
  for _ in range(15):
    state, metrics = step(state, batch)
    errors.append(float(metrics["critic/value_mse"]))
  assert errors[0] == pytest.approx(0.25)  # a zero head predicts 0 against returns of 0.5
  assert errors[-1] < 0.5 * errors[0]


def test_schedule_warms_up():
  config = dataclasses.replace(RunConfig().optimizer, learning_rate=1.0, warmup_steps=4,
                               schedule="cosine")
  schedule = update.make_schedule(config, total_steps=12)
  np.testing.assert_allclose([schedule(i) for i in (0, 2, 4, 12)], [0.0, 0.5, 1.0, 0.0], atol=1e-6)


def test_micro_batches_must_divide_the_batch(model):
  config = dataclasses.replace(_config(), optimizer=dataclasses.replace(RunConfig().optimizer,
                                                                        micro_batches=3))
  with pytest.raises(ValueError, match="does not split into 3 micro-batches"):
    update.loss_and_grads(model.params, _batch(model, config), jnp.float32(0), config=config,
                          transformer=model.transformer)


@pytest.mark.parametrize("poison", ["advantages", "old_logprobs"])
def test_a_non_finite_step_is_skipped_and_leaves_the_state_unchanged(model, poison):
  config = _config(name="grpo")
  optimizer, schedule = update.make_optimizer(config.optimizer, total_steps=10)
  step = update.make_update_step(config, model.transformer, optimizer, schedule)
  fresh = lambda: update.init_train_state(jax.tree.map(jnp.copy, model.params), optimizer,
                                          jax.random.key(0))
  batch = _batch(model, config)
  first_response_token = (batch.response_mask[0].argmax())
  bad = batch.replace(**{poison: getattr(batch, poison).at[0, first_response_token].set(jnp.nan)})
  before = jax.device_get(fresh())
  after, metrics = step(fresh(), bad)
  assert int(metrics["train/skipped"]) == 1
  chex.assert_trees_all_equal(jax.device_get(after.params), before.params)
  chex.assert_trees_all_equal(jax.device_get(after.opt_state), before.opt_state)
  assert int(after.step) == 0 and int(after.policy_version) == 0
  # the same state then takes a good step
  after, metrics = step(after, batch)
  assert int(metrics["train/skipped"]) == 0 and int(after.policy_version) == 1
  assert np.isfinite(float(metrics["loss"]))


SCHEDULE = {"ppo_epochs": 2, "mini_batches": 2}


@pytest.mark.parametrize("name, clip_low, clip_high", [("dapo", 0.2, 0.28), ("gspo", 3e-4, 4e-4)])
def test_minibatch_schedule_equals_the_step_by_step_reference(model, name, clip_low, clip_high):
  """The scanned ppo_epochs x mini_batches schedule against one jitted optimizer step per
  mini-batch, called from Python on the same permutation."""
  config = _config(trainer=SCHEDULE, name=name, clip_eps_low=clip_low, clip_eps_high=clip_high,
                   off_policy="tis")
  config = dataclasses.replace(config, optimizer=dataclasses.replace(
      config.optimizer, learning_rate=3e-2, micro_batches=2))
  optimizer, schedule = update.make_optimizer(config.optimizer, total_steps=8)
  fresh = lambda: update.init_train_state(jax.tree.map(jnp.copy, model.params), optimizer,
                                          jax.random.key(7))
  step = update.make_update_step(config, model.transformer, optimizer, schedule)
  batch = _batch(model, config)
  state = fresh()
  order = update.minibatch_order(B, jax.random.fold_in(state.key, state.step), epochs=2,
                                 mini_batches=2)
  assert sorted(np.asarray(order[:2]).ravel()) == list(range(B))  # a pass sees every row once
  assert sorted(np.asarray(order[2:]).ravel()) == list(range(B))
  assert not np.array_equal(order[:2], order[2:])  # each pass draws its own permutation
  scheduled = update.schedule_batches(batch, order)
  reference = fresh()
  ratio_max = []
  for i in range(4):
    reference, metrics = step.minibatch(reference, jax.tree.map(lambda x: x[i], scheduled))
    ratio_max.append(float(metrics["policy/ratio_max"]))
  state, metrics = step(state, batch)
  # Adam's g / sqrt(v) turns a float rounding in a near-zero gradient into ~1e-6 of a weight
  # (each step moves a weight by up to the learning rate, 3e-2)
  chex.assert_trees_all_close(jax.device_get(state.params), jax.device_get(reference.params),
                              rtol=2e-5, atol=1e-5)
  assert int(state.step) == 4 and int(state.policy_version) == 1
  assert float(metrics["policy/ratio_max"]) == pytest.approx(max(ratio_max), rel=1e-5)
  assert int(metrics["train/updates"]) == 4


def test_later_mini_batches_move_the_ratio_and_clip(model):
  """With several optimizer steps per rollout batch the ratio leaves 1 and clipping acts;
  with one it cannot (the old log-probs are the current policy's)."""
  def run(trainer):
    config = _config(trainer=trainer, name="dapo", clip_eps_low=0.2, clip_eps_high=0.28,
                     off_policy="none")
    config = dataclasses.replace(config, optimizer=dataclasses.replace(config.optimizer,
                                                                       learning_rate=3e-2))
    batch = _batch(model, config)
    old = update.make_logprobs_fn(config, model.transformer)(model.params, batch.tokens,
                                                             batch.attention_mask)
    batch = batch.replace(old_logprobs=old, behaviour_logprobs=old)
    optimizer, _ = update.make_optimizer(config.optimizer, total_steps=8)
    state = update.init_train_state(jax.tree.map(jnp.copy, model.params), optimizer,
                                    jax.random.key(0))
    return update.make_update_step(config, model.transformer, optimizer)(state, batch)[1]

  single = run({"ppo_epochs": 1, "mini_batches": 1})
  assert float(single["policy/ratio_max"]) == pytest.approx(1.0, abs=1e-4)
  assert float(single["policy/clip_frac_high"]) == 0.0
  several = run({"ppo_epochs": 2, "mini_batches": 2})
  assert float(several["policy/ratio_max"]) > 1.05
  assert float(several["policy/clip_frac_high"]) + float(several["policy/clip_frac_low"]) > 0


def test_a_typed_loss_choice_runs_what_its_preset_runs(model):
  preset = _config(name="gspo", clip_eps_low=3e-4, clip_eps_high=4e-4)
  typed = _config(name="grpo", policy_loss="gspo", clip_eps_low=3e-4, clip_eps_high=4e-4)
  batch = _batch(model, preset)
  run = lambda config: _loss_and_grads(model.params, batch, jnp.float32(0), config=config,
                                       transformer=model.transformer)
  chex.assert_trees_all_close(run(typed), run(preset))
  plain = run(_config(name="grpo", clip_eps_low=3e-4, clip_eps_high=4e-4))
  assert float(plain[0]) != pytest.approx(float(run(preset)[0]))  # the choice matters


@pytest.mark.parametrize("name", ["grpo", "gspo"])
def test_one_update_without_old_logprobs_equals_one_with_them(model, name):
  # One update per batch: the old policy is the params being updated, so the update may take
  # its own log-probs (no gradient) instead of the prepared ones. Same params and metrics.
  config = _config(name=name, kl_coef=0.05, off_policy="tis")
  batch = _batch(model, config)
  exact = batch.replace(old_logprobs=update.make_logprobs_fn(config, model.transformer)(
      model.params, batch.tokens, batch.attention_mask))
  optimizer, schedule = update.make_optimizer(config.optimizer, total_steps=10)
  results = []
  for b in (exact, batch.replace(old_logprobs=None)):
    state = update.init_train_state(jax.tree.map(jnp.copy, model.params), optimizer,
                                    jax.random.key(0))
    results.append(update.make_update_step(config, model.transformer, optimizer, schedule)(state, b))
  (with_old, metrics_old), (without, metrics) = results
  chex.assert_trees_all_close(without.params, with_old.params, rtol=1e-5, atol=1e-6)
  for key in ("loss", "policy/loss", "policy/ratio_mean", "policy/is_weight_mean", "optim/grad_norm"):
    np.testing.assert_allclose(metrics[key], metrics_old[key], rtol=1e-5, atol=1e-6, err_msg=key)
  assert not np.allclose(without.params["embed"], model.params["embed"])  # it did move


def _one_step_at(model, learning_rate: float):
  """One DAPO update of fresh params at ``learning_rate`` (no warm-up): the config, the params
  before, the state after and the metrics."""
  config = _config(name="dapo")
  config = dataclasses.replace(config, optimizer=dataclasses.replace(
      config.optimizer, learning_rate=learning_rate, warmup_steps=0))
  batch = _batch(model, config)
  optimizer, schedule = update.make_optimizer(config.optimizer, total_steps=2)
  state = update.init_train_state(jax.tree.map(jnp.copy, model.params), optimizer,
                                  jax.random.key(0))
  before = jax.device_get(state.params)
  state, metrics = update.make_update_step(config, model.transformer, optimizer,
                                           schedule)(state, batch)
  return config, before, state, metrics


def test_an_update_that_overflows_the_weights_is_skipped_and_named(model):
  """A finite loss and gradient, but a learning rate so large that the new weights overflow:
  the step is skipped (state unchanged) and counted as an update overflow."""
  _, before, state, metrics = _one_step_at(model, 1e39)  # inf in float32
  assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["optim/grad_norm"]))
  assert int(metrics["train/skipped"]) == 1 and int(metrics["train/skipped_update"]) == 1
  chex.assert_trees_all_equal(jax.device_get(state.params), before)
  assert bool(update.all_finite({"a": jnp.ones(3), "step": jnp.int32(1)}))
  assert not bool(update.all_finite({"a": jnp.array([1.0, jnp.inf])}))


def test_an_all_masked_mini_batch_is_empty_not_a_numerical_failure(model):
  """A mini-batch whose responses were all filtered out (e.g. every one overlong) gives loss
  0, no update and ``train/empty_steps``, never ``train/skipped`` (which stops a run)."""
  config = _config(name="dapo")
  optimizer, schedule = update.make_optimizer(config.optimizer, total_steps=10)
  step = update.make_update_step(config, model.transformer, optimizer, schedule)
  batch = _batch(model, config)
  empty = batch.replace(response_mask=jnp.zeros_like(batch.response_mask),
                        advantages=jnp.zeros_like(batch.advantages))
  state = update.init_train_state(jax.tree.map(jnp.copy, model.params), optimizer,
                                  jax.random.key(0))
  before = jax.device_get(state)
  after, metrics = step(state, empty)
  assert float(metrics["loss"]) == 0.0
  assert int(metrics["train/skipped"]) == 0 and int(metrics["train/empty_steps"]) == 1
  chex.assert_trees_all_equal(jax.device_get(after.params), before.params)
  assert int(after.step) == 0 and int(after.policy_version) == 0


def test_mismatch_kl_is_measured_on_the_rows_the_current_params_sampled(model):
  config = _config(name="dapo")
  optimizer, schedule = update.make_optimizer(config.optimizer, total_steps=10)
  step = update.make_update_step(config, model.transformer, optimizer, schedule)
  batch = _batch(model, config)
  version = jnp.where(jnp.arange(B) % 2 == 0, 0, -1).astype(jnp.int32)  # odd rows: stale
  batch = batch.replace(policy_version=version)
  fresh = lambda: update.init_train_state(jax.tree.map(jnp.copy, model.params), optimizer,
                                          jax.random.key(0))
  _, metrics = step(fresh(), batch)
  current = np.asarray(batch.response_mask) & (np.asarray(version) == 0)[:, None]
  log_w = np.asarray(batch.old_logprobs) - np.asarray(batch.behaviour_logprobs)
  k3 = np.exp(log_w) - 1 - log_w  # KL(behaviour || old) on the behaviour's samples
  assert float(metrics["rollout/mismatch_tokens"]) == current.sum()
  assert float(metrics["rollout/mismatch_kl_sum"]) / current.sum() == pytest.approx(
      k3[current].mean(), rel=1e-4)
  assert "policy/is_rejected_frac" not in metrics  # tis never rejects: no constant 0 logged
  _, stale = step(fresh(), batch.replace(policy_version=jnp.full(B, 5, jnp.int32)))
  assert float(stale["rollout/mismatch_tokens"]) == 0


@pytest.mark.parametrize("learning_rate, skipped", [(1e30, 1), (1e4, 1), (1e-3, 0)])
def test_an_update_that_explodes_the_weights_is_skipped_though_finite(model, learning_rate,
                                                                      skipped):
  """Finite weights of 1e29 are not "good": an update larger than the weights themselves
  (optimizer.max_update_ratio) is skipped like one that overflows; a sane one is kept, its
  ratio far under the bound."""
  config, before, state, metrics = _one_step_at(model, learning_rate)
  assert int(metrics["train/skipped"]) == skipped == int(metrics["train/skipped_update"])
  after = jax.device_get(state.params)
  assert np.all(np.isfinite(jax.tree.leaves(after)[0]))
  if skipped:
    chex.assert_trees_all_equal(after, before)
  else:
    assert 0 < float(metrics["optim/update_ratio"]) < 0.1 * config.optimizer.max_update_ratio


def test_nan_in_the_optimizer_moments_alone_is_skipped(model):
  """The params finite, the Adam moments not: the update they make is skipped, and counted."""
  config = _config(name="dapo")
  batch = _batch(model, config)
  optimizer, schedule = update.make_optimizer(config.optimizer, total_steps=2)
  state = update.init_train_state(jax.tree.map(jnp.copy, model.params), optimizer,
                                  jax.random.key(0))
  poisoned = state.replace(opt_state=jax.tree.map(
      lambda x: jnp.full_like(x, jnp.nan) if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim
      else x, state.opt_state))
  before = jax.device_get(poisoned.params)
  after, metrics = update.make_update_step(config, model.transformer, optimizer,
                                           schedule)(poisoned, batch)
  assert int(metrics["train/skipped"]) == 1
  chex.assert_trees_all_equal(jax.device_get(after.params), before)


@pytest.mark.parametrize("max_norm", [1e-3, 1.0, 1e6])
def test_the_clip_by_global_norm_equals_optax(max_norm):
  """The reference is optax's clip: the same values up to a rounding, below, at and above the
  norm, and the same (empty) state, so checkpoints of either load in the other."""
  from rlx.update.optimizer import clip_by_global_norm

  rng = np.random.default_rng(0)
  grads = {"a": jnp.asarray(rng.normal(size=(7, 5)), jnp.float32),
           "b": [jnp.asarray(rng.normal(size=(3,)) * 100, jnp.float32)]}
  ours, theirs = clip_by_global_norm(max_norm), optax.clip_by_global_norm(max_norm)
  assert jax.tree.structure(ours.init(grads)) == jax.tree.structure(theirs.init(grads))
  got, _ = ours.update(grads, ours.init(grads))
  expected, _ = theirs.update(grads, theirs.init(grads))
  jax.tree.map(lambda g, e: np.testing.assert_allclose(g, e, rtol=2e-7, atol=0), got, expected)
  assert float(optax.tree.norm(got)) <= max_norm * (1 + 1e-6)


def test_adam_with_bfloat16_moments_follows_float32_adam_at_half_the_memory():
  """``optimizer.moments_dtype=bfloat16``: the moments are stored in bfloat16 (half the bytes)
  and the trajectory over 30 steps of noisy gradients stays within a small fraction of the
  distance float32 AdamW moved the params; with float32 moments it is optax's AdamW exactly."""
  from rlx.config import OptimizerConfig
  from rlx.update.optimizer import make_optimizer

  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(64, 32)) * 0.02, jnp.float32)}
  target = jnp.asarray(rng.normal(size=(64, 32)) * 0.02, jnp.float32)
  trajectories, states = {}, {}
  for dtype in ("float32", "bfloat16"):
    config = OptimizerConfig(learning_rate=1e-3, weight_decay=0.01, moments_dtype=dtype)
    optimizer, _ = make_optimizer(config, total_steps=30)
    p, state = params, optimizer.init(params)
    for step in range(30):
      noise = jnp.asarray(np.random.default_rng(step).normal(size=(64, 32)) * 0.01, jnp.float32)
      grads = {"w": p["w"] - target + noise}
      updates, state = optimizer.update(grads, state, p)
      p = optax.apply_updates(p, updates)
    trajectories[dtype], states[dtype] = p["w"], state
  moments = lambda state: [x for x in jax.tree.leaves(state) if x.ndim == 2]
  assert [x.dtype for x in moments(states["float32"])] == [jnp.float32] * 2
  assert [x.dtype for x in moments(states["bfloat16"])] == [jnp.bfloat16] * 2
  moved = float(jnp.linalg.norm(trajectories["float32"] - params["w"]))
  apart = float(jnp.linalg.norm(trajectories["bfloat16"] - trajectories["float32"]))
  assert 0 < apart < 0.02 * moved, (apart, moved)
