"""Shared prefixes in the learner: a group's prompt forwarded once per packed row, every hidden
state, log-prob, loss, gradient and update equal to the row-per-sample computation (float32,
random groups of uneven prompt and answer lengths), with micro-batches, mini-batches, remat,
LoRA and every fused log-prob implementation."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx import update
from rlx.config import ArchConfig, LoraConfig, RunConfig
from rlx.kernels import pallas_logprobs
from rlx.models import init_model, lora
from rlx.trainer.learn.experience import Sampled, make_prepare
from rlx.types import RolloutBatch
from rlx.update import packing

ARCH = ArchConfig(num_layers=2, vocab_size=64, hidden_size=32, intermediate_size=48, num_heads=4,
                  num_kv_heads=2, head_dim=8)
PROMPT, RESPONSE = 12, 8
T = PROMPT + RESPONSE


@pytest.fixture(scope="module")
def model():
  return init_model(ARCH, jax.random.key(0))


def _config(trainer=None, optimizer=None, **algorithm):
  config = RunConfig()
  return dataclasses.replace(
      config, algorithm=dataclasses.replace(config.algorithm, **algorithm),
      trainer=dataclasses.replace(config.trainer, **(trainer or {})),
      optimizer=dataclasses.replace(config.optimizer, learning_rate=1e-3, **(optimizer or {})),
      rollout=dataclasses.replace(config.rollout, max_new_tokens=RESPONSE))


def _groups(seed=0, groups=2, size=4):
  """Rows laid out as the learner's: ``groups`` groups of ``size`` samples, each group one
  left-padded prompt of its own length, the samples' answers of random lengths (one empty)."""
  rng = np.random.default_rng(seed)
  B = groups * size
  tokens = np.zeros((B, T), np.int32)
  attention = np.zeros((B, T), bool)
  for g in range(groups):
    length = int(rng.integers(3, PROMPT + 1))
    prompt = rng.integers(1, ARCH.vocab_size, length)
    for s in range(size):
      b = g * size + s
      answer = int(rng.integers(0 if b == B - 1 else 1, RESPONSE + 1))
      tokens[b, PROMPT - length:PROMPT] = prompt
      tokens[b, PROMPT:PROMPT + answer] = rng.integers(1, ARCH.vocab_size, answer)
      attention[b, PROMPT - length:PROMPT + answer] = True
  response = attention & (np.arange(T) >= PROMPT)[None]
  return tokens, attention, response


def _links(tokens, attention, response):
  return np.asarray(packing.shared_prefixes(jnp.asarray(tokens), jnp.asarray(attention),
                                            jnp.asarray(response)))


def _plan(tokens, attention, response, chunks=1):
  plan = packing.chunk_plan(attention.sum(1), chunks, T, links=_links(tokens, attention, response))
  assert plan is not None and plan.lead is not None and plan.prefix.any()
  return plan


def test_shared_prefixes_are_the_common_prompt_never_a_target():
  tokens, attention, response = _groups(1)
  links = _links(tokens, attention, response)
  prompts = attention[:, :PROMPT].sum(1)
  np.testing.assert_array_equal(links, np.where(np.arange(8) % 4 == 0, 0, prompts))
  # a row whose first answer token matches its neighbour's still shares only the prompt
  tokens[1, PROMPT] = tokens[0, PROMPT]
  assert _links(tokens, attention, response)[1] == prompts[1]
  # an environment token inside the prompt's columns stays shared context, a target ends it
  response[2, PROMPT - 2] = attention[2, PROMPT - 2]
  assert _links(tokens, attention, response)[2] == (prompts[2] - 2 if attention[2, PROMPT - 2]
                                                    else prompts[2])


def test_plan_places_every_token_once_and_shares_each_group_prompt():
  rng = np.random.default_rng(0)
  for seed in range(20):
    tokens, attention, response = _groups(seed, groups=int(rng.integers(1, 5)))
    lengths, links = attention.sum(1), _links(tokens, attention, response)
    plan = packing.chunk_plan(lengths, 1, T, links=links)
    if plan is None:
      continue
    one = jax.tree.map(lambda x: x[0], plan)
    dest = np.asarray(packing.destinations(one, jnp.asarray(attention)))
    place = np.asarray(packing.placements(one, jnp.asarray(attention), jnp.asarray(dest)))
    W = packing.width(one, attention)
    placed = place[place < one.rows * W]
    assert len(set(placed.tolist())) == placed.size  # each slot written once
    # every real token of every row reads a slot that holds that very token
    flat = np.asarray(packing.pack(jnp.asarray(tokens), jnp.asarray(place), one.rows, width=W))
    assert np.all(flat.reshape(-1)[dest[attention]] == tokens[attention])
    # the placed tokens are the rows' real tokens less every follower's shared prompt
    followers = np.asarray(one.lead) != np.arange(len(lengths))
    assert placed.size == lengths.sum() - np.asarray(one.prefix)[followers].sum()
    assert np.all(np.asarray(one.prefix) <= np.maximum(links, 0).max())


@pytest.mark.parametrize("attention", ["reference", "fused"])
def test_shared_hidden_states_equal_the_unpacked_rows(model, attention):
  tokens, mask, response = _groups()
  transformer = dataclasses.replace(model.transformer, attention=attention)
  expected, _ = transformer.hidden_states(model.params, jnp.asarray(tokens), jnp.asarray(mask))
  plan = jax.tree.map(lambda x: x[0], _plan(tokens, mask, response))
  mask = jnp.asarray(mask)
  dest = packing.destinations(plan, mask)
  place = packing.placements(plan, mask, dest)
  segment_ids, positions = packing.segments(plan, mask, place)
  group_ids, shared = packing.groups(plan, mask, place)
  W = packing.width(plan, mask)
  packed, _ = transformer.hidden_states(
      model.params, packing.pack(jnp.asarray(tokens), place, plan.rows, width=W),
      segment_ids=segment_ids, positions=positions, group_ids=group_ids, shared=shared)
  back = jax.vmap(lambda h: packing.unpack(h, dest), in_axes=-1, out_axes=-1)(packed)
  np.testing.assert_allclose(back[mask], expected[mask], rtol=1e-5, atol=1e-5)
  # fewer slots than the unpacked rows: the prompts are there once per group
  assert plan.rows * W < tokens.size


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas-gpu"])
def test_shared_logprobs_equal_unpacked_for_every_kernel(model, impl, monkeypatch):
  if impl.startswith("pallas"):
    monkeypatch.setattr(
        "rlx.update.logprobs.fused_logprobs",
        lambda hidden, unembed, targets, mask, *, temperature, **_: pallas_logprobs(
            hidden, unembed, targets, mask, variant="gpu", temperature=temperature,
            block_t=64, block_v=64, interpret=True))
  tokens, mask, response = _groups(2)
  plan = jax.tree.map(lambda x: x[0], _plan(tokens, mask, response))
  temperatures = jnp.asarray(np.linspace(0.6, 1.4, len(tokens)), jnp.float32)
  for temperature in (0.8, temperatures):
    run = jax.jit(lambda params, plan: update.sequence_logprobs(
        model.transformer, params, jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(response),
        impl=impl, temperature=temperature, chunk=8, packing=plan))
    unpacked, packed = run(model.params, None), run(model.params, plan)
    for a, b in zip(packed, unpacked):
      np.testing.assert_allclose(np.where(response, a, 0), np.where(response, b, 0),
                                 rtol=1e-5, atol=2e-5)
    assert np.all(np.asarray(packed[0])[~response] == 0)


def _batch(model, config, tokens, attention, response, seed=0):
  rng = np.random.default_rng(seed)
  B = len(tokens)
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


@pytest.mark.parametrize("loss, loss_agg, remat", [
    ("ppo_clip", "token-mean", "none"), ("gspo", "seq-mean-token-mean", "full"),
    ("cispo", "seq-mean-token-sum", "dots")])
def test_shared_loss_and_gradient_equal_unpacked(model, loss, loss_agg, remat):
  """Two micro-batches (one group each), a KL and an entropy term: the gradient through each
  prompt, placed once, is its samples' gradients summed."""
  config = _config(optimizer={"micro_batches": 2}, name="grpo", policy_loss=loss,
                   loss_agg=loss_agg, kl_coef=0.1, entropy_coef=0.01, off_policy="tis")
  tokens, attention, response = _groups(3)
  batch = _batch(model, config, tokens, attention, response)
  plan = packing.plan(attention.sum(1), np.arange(8).reshape(2, 4), T,
                      links=_links(tokens, attention, response))
  assert plan is not None and plan.prefix is not None
  transformer = dataclasses.replace(model.transformer, remat=remat)
  args = (model.params, batch, jnp.float32(0.1), None, None, jnp.int32(1))
  unpacked = _loss_and_grads(*args, config=config, transformer=transformer)
  shared = _loss_and_grads(*args, packing=plan, config=config, transformer=transformer)
  chex.assert_trees_all_close(shared, unpacked, rtol=1e-4, atol=1e-6)


def test_shared_lora_gradient_equals_unpacked(model):
  config = _config(name="grpo", kl_coef=0.0)
  tokens, attention, response = _groups(4)
  batch = _batch(model, config, tokens, attention, response)
  lora_config = LoraConfig(rank=4)
  adapters = lora.init_adapters(ARCH, lora_config, jax.random.key(1))
  adapters = jax.tree.map(lambda x: x + 0.05, adapters)  # B nonzero: the adapters matter
  transformer = dataclasses.replace(model.transformer, lora_scale=lora_config.scale)
  plan = packing.chunk_plan(attention.sum(1), 1, T, links=_links(tokens, attention, response))
  args = (adapters, batch, jnp.float32(0.0), None, None, jnp.int32(1), model.params)
  unpacked = _loss_and_grads(*args, config=config, transformer=transformer)
  shared = _loss_and_grads(*args, packing=plan, config=config, transformer=transformer)
  chex.assert_trees_all_close(shared, unpacked, rtol=1e-4, atol=1e-6)


def test_shared_update_schedule_and_prepare_equal_unpacked(model):
  """Two epochs of two mini-batches of two micro-batches (the schedule's permutations split the
  groups: each micro-batch shares what it holds of a group), DAPO with a KL term; prepare."""
  config = _config(trainer={"ppo_epochs": 2, "mini_batches": 2}, optimizer={"micro_batches": 2},
                   name="dapo", kl_coef=0.05, entropy_coef=0.01, off_policy="tis")
  optimizer, schedule = update.make_optimizer(config.optimizer, total_steps=10)
  tokens, attention, response = _groups(5, groups=4, size=4)
  B = len(tokens)
  rng = np.random.default_rng(5)
  sampled = Sampled(tokens=tokens, attention_mask=attention, response_mask=response,
                    behaviour_logprobs=np.where(response, -rng.exponential(size=response.shape),
                                                0).astype(np.float32),
                    rewards=rng.integers(0, 2, B).astype(np.float32),
                    policy_version=np.zeros(B, np.int32), temperature=np.full(B, 0.9, np.float32))
  prepare = make_prepare(config, model.transformer)
  lengths, links = attention.sum(1), _links(tokens, attention, response)
  chunks = packing.chunk_plan(lengths, 4, T, links=links)
  assert chunks is not None and chunks.prefix is not None
  batch = prepare(model.params, model.params, None, sampled, 0.05)
  shared_batch = prepare(model.params, model.params, None, sampled, 0.05, packing=chunks)
  chex.assert_trees_all_close(shared_batch, batch, rtol=1e-5, atol=2e-5)

  step = update.make_update_step(config, model.transformer, optimizer, schedule)
  state = update.init_train_state(model.params, optimizer, jax.random.key(3))
  order = np.asarray(update.schedule_order(state, B, epochs=2, mini_batches=2))
  plan = packing.schedule_plan(lengths, order, 2, T, links=links)
  assert plan is not None and plan.prefix is not None and np.asarray(plan.prefix).any()
  copy = lambda s: jax.tree.map(jnp.copy, s)
  unpacked_state, unpacked = step(copy(state), batch)
  shared_state, shared = step(copy(state), batch, packing=plan)
  without_key = lambda s: s.replace(key=None)
  chex.assert_trees_all_close(without_key(shared_state), without_key(unpacked_state),
                              rtol=1e-4, atol=1e-6)
  chex.assert_trees_all_close(shared, unpacked, rtol=1e-4, atol=1e-6)


def test_a_wrong_share_changes_the_result(model):
  """The equality tests can fail: a plan that shares the prompt of rows that differ in it
  gives other log-probs."""
  tokens, attention, response = _groups(6)
  links = _links(tokens, attention, response)
  other = tokens.copy()
  other[1, PROMPT - 1] = (other[1, PROMPT - 1] % (ARCH.vocab_size - 1)) + 1  # row 1's prompt
  plan = jax.tree.map(lambda x: x[0], packing.chunk_plan(attention.sum(1), 1, T, links=links))
  run = lambda plan: update.sequence_logprobs(
      model.transformer, model.params, jnp.asarray(other), jnp.asarray(attention),
      jnp.asarray(response), impl="xla", chunk=8, packing=plan)[0]
  assert not np.allclose(np.asarray(run(plan))[1], np.asarray(run(None))[1], atol=1e-4)


def test_float32_log_probs_do_not_depend_on_the_micro_batch_and_barely_on_the_layout(model):
  """What the learner reaches on CPU in float32: a sequence's log-probs agree to an ulp or two
  whatever micro-batch of rows it is computed in (bitwise at the SmolLM2 recipe's shapes,
  benchmarks/logprob_gap.py; XLA's matmul blocking follows the batch's size, so not bitwise
  at every shape), and to float32 rounding packed into a row with others or behind a shared
  prompt (the attention sums over another row width)."""
  from rlx.trainer.learn.experience import _by_micro_batch
  tokens, attention, response = map(jnp.asarray, _groups(5, groups=4, size=4))
  config = _config()
  fn = functools.partial(update.policy_logprobs, config, model.transformer, model.params)
  run = jax.jit(lambda *xs, packing=None, micro=1: _by_micro_batch(fn, micro, *xs,
                                                                   packing=packing),
                static_argnames="micro")
  lengths = np.asarray(attention).sum(1)
  reference = np.asarray(run(tokens, attention, response))
  mask, sharing = np.asarray(response), []
  for micro in (2, 4, 8):
    np.testing.assert_allclose(np.asarray(run(tokens, attention, response, micro=micro)),
                               reference, rtol=0, atol=1e-6)
    packed = packing.chunk_plan(lengths, micro, T)
    if packed is not None:  # where rows do share (not in chunks of two)
      sharing.append(micro)
      got = np.asarray(run(tokens, attention, response, micro=micro, packing=packed))
      np.testing.assert_allclose(got[mask], reference[mask], atol=2e-5)
    shared = _plan(tokens, attention, response, chunks=micro)
    got = np.asarray(run(tokens, attention, response, micro=micro, packing=shared))
    np.testing.assert_allclose(got[mask], reference[mask], atol=2e-5)
  assert sharing
