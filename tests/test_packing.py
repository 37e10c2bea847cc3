"""Sequence packing: the placement, and packed == unpacked for the transformer, every fused
log-prob implementation, every policy loss and aggregation (under micro-batching), the whole
update schedule (mini-batches, epochs) and prepare."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx import update
from rlx.config import ArchConfig, RunConfig
from rlx.kernels import pallas_logprobs
from rlx.models import init_model
from rlx.trainer.learn.experience import Sampled, make_prepare
from rlx.types import RolloutBatch
from rlx.update import packing

ARCH = ArchConfig(num_layers=2, vocab_size=64, hidden_size=32, intermediate_size=48, num_heads=4,
                  num_kv_heads=2, head_dim=8)
B, T = 8, 24


@pytest.fixture(scope="module")
def model():
  return init_model(ARCH, jax.random.key(0))


def _config(trainer=None, optimizer=None, **algorithm):
  config = RunConfig()
  return dataclasses.replace(
      config, algorithm=dataclasses.replace(config.algorithm, **algorithm),
      trainer=dataclasses.replace(config.trainer, **(trainer or {})),
      optimizer=dataclasses.replace(config.optimizer, learning_rate=1e-3, **(optimizer or {})),
      rollout=dataclasses.replace(config.rollout, max_new_tokens=T))


def _rows(seed=0, batch=B):
  """Rows laid out as the learner's are: left-padded prompts, right-padded responses, random
  lengths (short enough that several share a packed row); one row with no response token."""
  rng = np.random.default_rng(seed)
  prompt_len = 6
  prompts = rng.integers(2, prompt_len + 1, batch)
  responses = rng.integers(1, 8, batch)
  responses[-1] = 0
  positions = np.arange(T)[None]
  attention = (positions >= (prompt_len - prompts)[:, None]) & (
      positions < (prompt_len + responses)[:, None])
  response = attention & (positions >= prompt_len)
  tokens = np.where(attention, rng.integers(1, ARCH.vocab_size, (batch, T)), 0)
  return tokens.astype(np.int32), attention, response


def _lengths(attention):
  return np.asarray(attention).sum(1)


def _chunk_packing(attention, chunks=1):
  plan = packing.chunk_plan(_lengths(attention), chunks, T)
  assert plan is not None and plan.rows < attention.shape[0] // chunks  # packing saves rows
  return plan


def test_first_fit_places_every_sequence_once_within_its_row():
  rng = np.random.default_rng(0)
  for _ in range(20):
    lengths = rng.integers(0, 30, rng.integers(1, 40))
    row, offset, used = packing.first_fit(lengths, 32)
    grid = np.zeros((used, 32), int)
    for r, o, n in zip(row, offset, lengths):
      assert o + n <= 32
      grid[r, o:o + n] += 1
    assert grid.max() <= 1 and grid.sum() == lengths.sum()
    assert used <= max(1, np.count_nonzero(lengths))
  with pytest.raises(ValueError, match="does not fit"):
    packing.first_fit(np.array([33]), 32)


def test_packed_row_counts_are_few_shapes_split_evenly():
  assert {packing.rows_for(n, 64) for n in range(1, 65)} == set(range(8, 65, 8))
  assert packing.rows_for(3, 64, ways=16) == 16
  assert packing.rows_for(7, 8) == 7 and packing.rows_for(7, 8, ways=2) == 8
  # a plan that saves no row is no plan: the unpacked program runs
  full = np.full(8, T)
  assert packing.chunk_plan(full, 1, T) is None


@pytest.mark.parametrize("attention", ["reference", "fused"])
def test_packed_hidden_states_equal_the_unpacked_rows(model, attention):
  tokens, mask, _ = _rows()
  transformer = dataclasses.replace(model.transformer, attention=attention)
  expected, _ = transformer.hidden_states(model.params, jnp.asarray(tokens), jnp.asarray(mask))
  plan = jax.tree.map(lambda x: x[0], _chunk_packing(mask))
  dest = packing.destinations(plan, jnp.asarray(mask))
  segment_ids, positions = packing.segments(plan, jnp.asarray(mask), dest)
  packed, _ = transformer.hidden_states(model.params, packing.pack(jnp.asarray(tokens), dest, plan.rows),
                                        segment_ids=segment_ids, positions=positions)
  back = jax.vmap(lambda h: packing.unpack(h, dest), in_axes=-1, out_axes=-1)(packed)
  np.testing.assert_allclose(back[mask], expected[mask], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas-gpu", "pallas-tpu"])
def test_packed_logprobs_equal_unpacked_for_every_kernel(model, impl, monkeypatch):
  if impl.startswith("pallas"):  # both Pallas variants, in the interpreter on CPU
    variant = impl.split("-")[1]
    monkeypatch.setattr(
        "rlx.update.logprobs.fused_logprobs",
        lambda hidden, unembed, targets, mask, *, temperature, **_: pallas_logprobs(
            hidden, unembed, targets, mask, variant=variant, temperature=temperature,
            block_t=64, block_v=64, interpret=True))
  tokens, mask, response = _rows(1)
  temperatures = jnp.asarray(np.linspace(0.6, 1.4, B), jnp.float32)
  plan = jax.tree.map(lambda x: x[0], _chunk_packing(mask))
  for temperature in (0.8, temperatures):
    run = jax.jit(lambda params, plan: update.sequence_logprobs(
        model.transformer, params, jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(response),
        impl=impl, temperature=temperature, chunk=8, packing=plan))
    unpacked, packed = run(model.params, None), run(model.params, plan)
    for a, b in zip(packed, unpacked):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5)
    assert np.all(np.asarray(packed[0])[~response] == 0)
  with pytest.raises(ValueError, match="response mask"):
    update.sequence_logprobs(model.transformer, model.params, jnp.asarray(tokens),
                             jnp.asarray(mask), None, packing=plan)


def _batch(model, config, seed=0):
  tokens, attention, response = _rows(seed)
  rng = np.random.default_rng(seed)
  old = update.make_logprobs_fn(config, model.transformer)(model.params, tokens, attention)
  noise = jnp.asarray(rng.normal(scale=0.1, size=(B, T)), jnp.float32)
  response = jnp.asarray(response)
  advantages = jnp.asarray(rng.normal(size=B), jnp.float32)[:, None]
  return RolloutBatch(
      tokens=jnp.asarray(tokens), attention_mask=jnp.asarray(attention), response_mask=response,
      advantages=jnp.where(response, advantages, 0.0),
      old_logprobs=jnp.where(response, old + noise, 0.0),
      behaviour_logprobs=jnp.where(response, old + 2 * noise, 0.0),
      policy_version=jnp.asarray(np.arange(B) % 2, jnp.int32),
      ref_logprobs=jnp.where(response, old - noise, 0.0),
      temperature=jnp.asarray(np.linspace(0.7, 1.2, B), jnp.float32))


_loss_and_grads = jax.jit(update.loss_and_grads, static_argnames=("config", "transformer"))


# every policy loss, and every aggregation, with a KL and an entropy term and two micro-batches
@pytest.mark.parametrize("loss, loss_agg", [
    ("ppo_clip", "token-mean"), ("gspo", "seq-mean-token-mean"), ("cispo", "seq-mean-token-sum"),
    ("gmpo", "seq-mean-token-sum-norm"), ("sapo", "token-mean"), ("clip_cov", "token-mean"),
    ("kl_cov", "seq-mean-token-mean")])
def test_packed_loss_gradient_and_metrics_equal_unpacked(model, loss, loss_agg):
  config = _config(optimizer={"micro_batches": 2}, name="grpo", policy_loss=loss,
                   loss_agg=loss_agg, kl_coef=0.1, entropy_coef=0.01, off_policy="tis")
  batch = _batch(model, config)
  plan = packing.plan(_lengths(batch.attention_mask), np.arange(B).reshape(2, B // 2), T)
  assert plan is not None
  args = (model.params, batch, jnp.float32(0.1), None, None, jnp.int32(1))
  unpacked = _loss_and_grads(*args, config=config, transformer=model.transformer)
  packed = _loss_and_grads(*args, packing=plan, config=config, transformer=model.transformer)
  chex.assert_trees_all_close(packed, unpacked, rtol=1e-4, atol=1e-6)


def test_packed_update_schedule_and_prepare_equal_unpacked(model):
  """Two epochs of two mini-batches of two micro-batches, DAPO with the entropy bonus and a
  KL term: the new params, optimizer state and every metric; prepare's old and reference
  log-probs."""
  config = _config(trainer={"ppo_epochs": 2, "mini_batches": 2}, optimizer={"micro_batches": 2},
                   name="dapo", kl_coef=0.05, entropy_coef=0.01, off_policy="tis")
  optimizer, schedule = update.make_optimizer(config.optimizer, total_steps=10)
  tokens, attention, response = _rows(2, batch=16)
  rng = np.random.default_rng(2)
  sampled = Sampled(tokens=tokens, attention_mask=attention, response_mask=response,
                    behaviour_logprobs=np.where(response, -rng.exponential(size=response.shape),
                                                0).astype(np.float32),
                    rewards=rng.integers(0, 2, 16).astype(np.float32),
                    policy_version=np.zeros(16, np.int32),
                    temperature=np.full(16, 0.9, np.float32))
  prepare = make_prepare(config, model.transformer)
  lengths = _lengths(attention)
  chunks = packing.chunk_plan(lengths, 4, T)
  assert chunks is not None
  batch = prepare(model.params, model.params, None, sampled, 0.05)
  packed_batch = prepare(model.params, model.params, None, sampled, 0.05, packing=chunks)
  chex.assert_trees_all_close(packed_batch, batch, rtol=1e-5, atol=2e-5)

  step = update.make_update_step(config, model.transformer, optimizer, schedule)
  state = update.init_train_state(model.params, optimizer, jax.random.key(3))
  state = state.replace(step=jnp.int32(5))  # a later step draws another order
  order = np.asarray(update.schedule_order(state, 16, epochs=2, mini_batches=2))
  plan = packing.schedule_plan(lengths, order, 2, T)
  assert plan is not None and plan.rows < 4
  copy = lambda s: jax.tree.map(jnp.copy, s)
  unpacked_state, unpacked = step(copy(state), batch)
  packed_state, packed = step(copy(state), batch, packing=plan)
  without_key = lambda s: s.replace(key=None)
  chex.assert_trees_all_close(without_key(packed_state), without_key(unpacked_state),
                              rtol=1e-4, atol=1e-6)
  chex.assert_trees_all_close(packed, unpacked, rtol=1e-4, atol=1e-6)
  # the order the plan was made for is the one the step runs: another order's plan differs
  wrong = packing.schedule_plan(lengths, order[::-1], 2, T)
  _, other = step(copy(state), batch, packing=wrong)
  assert not np.allclose(other["loss"], unpacked["loss"], rtol=1e-6)
