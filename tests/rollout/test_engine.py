"""The engine and the continuous-batching driver against full recompute: greedy tokens,
behaviour log-probs, stop tokens and limits, ordering, determinism, no recompilation,
weight swap, sharding."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx import mesh as mesh_lib
from rlx import rollout
from rlx.config import ArchConfig, MeshConfig
from rlx.models import init_model
from rlx.rollout import engine as engine_lib
from rlx.rollout.engine import Engine

ARCH = ArchConfig(num_layers=2, vocab_size=48, hidden_size=32, intermediate_size=48, num_heads=4,
                  num_kv_heads=2, head_dim=8, eos_token_ids=(3,))


def _model(seed=0, scale=20.0):
  model = init_model(ARCH, jax.random.key(seed))
  # Sharper than init, so greedy decoding is far from ties.
  return model.replace(params=jax.tree.map(lambda p: p * scale if p.ndim > 1 else p, model.params))


@pytest.fixture(scope="module")
def model():
  return _model()


PROMPTS = [[5, 6, 7], list(range(10, 21)), [9], [30, 31, 32, 33, 34], [40, 41], list(range(1, 15))]


REFERENCE_LEN = 32  # the references right-pad to one length: causal, so earlier logits are
# unchanged, and the model compiles once instead of once per length


def _logits(model, tokens):
  """Logits [len(tokens), V] of the full (no-cache) forward pass."""
  padded = list(tokens) + [0] * (REFERENCE_LEN - len(tokens))
  return model(jnp.array([padded]))[0, :len(tokens)]


def greedy_reference(model, prompt, max_new, stop=()):
  tokens, logprobs = list(prompt), []
  for _ in range(max_new):
    log_softmax = jax.nn.log_softmax(_logits(model, tokens)[-1])
    token = int(jnp.argmax(log_softmax))
    tokens.append(token)
    logprobs.append(float(log_softmax[token]))
    if token in stop:
      break
  return tokens[len(prompt):], logprobs


def full_recompute_logprobs(model, prompt, response, temperature=1.0):
  logits = _logits(model, list(prompt) + list(response)) / temperature
  log_softmax = jax.nn.log_softmax(logits[len(prompt) - 1:-1])
  return np.asarray(log_softmax[np.arange(len(response)), np.array(response)])


def test_greedy_equals_full_recompute_under_continuous_batching(model):
  # 6 prompts x 2 samples on 4 slots: slots free and refill at different times.
  completions = rollout.generate(model, PROMPTS, n=2, max_new_tokens=7, temperature=0.0,
                                 stop_token_ids=[], max_slots=4)
  assert [(c.prompt_index, c.sample_index) for c in completions] == [
      (p, s) for p in range(len(PROMPTS)) for s in range(2)]
  for c in completions:
    expected, logprobs = greedy_reference(model, PROMPTS[c.prompt_index], 7)
    assert c.response_tokens == expected
    assert c.prompt_tokens == PROMPTS[c.prompt_index]
    assert c.finish_reason == "length"
    np.testing.assert_allclose(c.policy_logprobs, logprobs, atol=1e-5)
    assert c.logprobs == [0.0] * 7  # greedy: a point mass


def test_each_request_alone_equals_batched(model):
  batched = rollout.generate(model, PROMPTS, max_new_tokens=6, temperature=0.0, stop_token_ids=[],
                             max_slots=2)
  for prompt, c in zip(PROMPTS, batched):
    alone = rollout.generate(model, [prompt], max_new_tokens=6, temperature=0.0, stop_token_ids=[],
                             max_slots=2)
    assert alone[0].response_tokens == c.response_tokens


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.8, 5)])
def test_behaviour_logprobs_equal_full_recompute(temperature, top_k):
  model = _model(scale=4.0)  # logits of order 1-10, as in a trained model
  completions = rollout.generate(model, PROMPTS[:4], n=3, max_new_tokens=6, temperature=temperature,
                                 top_k=top_k, stop_token_ids=[], seed=1, max_slots=4)
  for c in completions:
    prompt, response = c.prompt_tokens, c.response_tokens
    logits = _logits(model, prompt + response)[len(prompt) - 1:-1]
    n = len(response)
    truncated = rollout.truncate_logits(logits, jnp.full((n,), temperature), jnp.full((n,), top_k),
                                        jnp.ones((n,)))
    expected = jax.nn.log_softmax(truncated)[np.arange(n), np.array(response)]
    np.testing.assert_allclose(c.logprobs, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(c.policy_logprobs, full_recompute_logprobs(model, prompt, response),
                               rtol=1e-5, atol=1e-5)


def test_stop_tokens_and_limits(model):
  expected, _ = greedy_reference(model, PROMPTS[1], 8)
  stop = expected[2]
  (c,) = rollout.generate(model, [PROMPTS[1]], max_new_tokens=8, temperature=0.0,
                          stop_token_ids=[stop])
  assert c.response_tokens == expected[:expected.index(stop) + 1]
  assert c.finish_reason == "stop"
  (c,) = rollout.generate(model, [PROMPTS[1]], max_new_tokens=1, temperature=0.0, stop_token_ids=[])
  assert c.response_tokens == expected[:1] and c.finish_reason == "length"
  # None means the model's eos ids (ARCH.eos_token_ids); sampled responses never run past them.
  for c in rollout.generate(model, PROMPTS, n=4, max_new_tokens=12, temperature=1.5, seed=3):
    assert 3 not in c.response_tokens[:-1]
    assert (c.finish_reason == "stop") == (c.response_tokens[-1] == 3)
    assert len(c.response_tokens) <= 12


def test_seed_fixes_samples_whatever_the_scheduling(model):
  kwargs = dict(n=3, max_new_tokens=5, temperature=1.0, seed=7, stop_token_ids=[])
  few_slots = rollout.generate(model, PROMPTS, max_slots=2, **kwargs)
  many_slots = rollout.generate(model, PROMPTS, max_slots=16, **kwargs)
  assert [c.response_tokens for c in few_slots] == [c.response_tokens for c in many_slots]
  other_seed = rollout.generate(model, PROMPTS, max_slots=16, **dict(kwargs, seed=8))
  assert [c.response_tokens for c in other_seed] != [c.response_tokens for c in many_slots]
  # The samples of a group differ from each other.
  assert len({tuple(c.response_tokens) for c in few_slots[:3]}) > 1


def test_no_recompilation_and_weight_swap(model):
  engine = Engine(model.transformer, max_slots=4, max_len=32, max_prompt_len=16)
  other = _model(seed=1)

  def sizes():
    return (engine_lib._prefill._cache_size(), engine_lib._insert._cache_size(),
            engine_lib._generate_chunk._cache_size())

  kwargs = dict(max_new_tokens=6, temperature=0.0, stop_token_ids=[])
  rollout.generate(engine, PROMPTS, params=model.params, **kwargs)
  rollout.generate(engine, PROMPTS, params=other.params, **kwargs)
  before = sizes()
  for i in range(3):
    rollout.generate(engine, PROMPTS[i:] + PROMPTS[:i], params=model.params, **kwargs)
  swapped = rollout.generate(engine, PROMPTS, params=other.params, policy_version=5, **kwargs)
  assert sizes() == before
  for prompt, c in zip(PROMPTS, swapped):
    assert c.response_tokens == greedy_reference(other, prompt, 6)[0]
    assert c.policy_version == 5


def test_sharded_engine_gives_the_same_greedy_output(model):
  mesh = mesh_lib.make_mesh(MeshConfig(data=4, fsdp=1, tensor=2))
  engine = Engine(model.transformer, max_slots=8, max_len=32, max_prompt_len=16, mesh=mesh)
  params = rollout.shard_params(jax.tree.map(jnp.copy, model.params), model.transformer, mesh,
                                MeshConfig().logical_axis_rules)
  assert params["layers"]["k"].sharding.spec[2] == "tensor"
  kwargs = dict(n=2, max_new_tokens=6, temperature=0.0, stop_token_ids=[])
  sharded = rollout.generate(engine, PROMPTS, params=params, **kwargs)
  single = rollout.generate(model, PROMPTS, max_slots=8, **kwargs)
  assert [c.response_tokens for c in sharded] == [c.response_tokens for c in single]


def test_the_abstract_decode_state_is_laid_out_like_the_real_one(model):
  mesh = mesh_lib.make_mesh(MeshConfig(data=4, fsdp=1, tensor=2))
  engine = Engine(model.transformer, max_slots=8, max_len=32, max_prompt_len=16, mesh=mesh)
  real, abstract = engine.init_decode_state(), engine.abstract_decode_state()
  assert jax.tree.map(lambda x: (x.shape, x.dtype), real) == jax.tree.map(
      lambda x: (x.shape, x.dtype), abstract)
  for name in ("k", "v"):  # the cache as placed; the small fields are replicated on the mesh
    for layer, placed in zip(real.cache[name], abstract.cache[name]):
      assert layer.sharding.is_equivalent_to(placed.sharding, 4)
  assert abstract.cache["k"][0].sharding.spec[:2] == ("data", "tensor")  # slots, kv heads
  assert abstract.active.sharding.mesh == mesh


def test_bad_requests_are_refused(model):
  with pytest.raises(ValueError, match="longer than max_prompt_len"):
    rollout.generate(Engine(model.transformer, max_slots=2, max_len=24, max_prompt_len=8),
                     [list(range(9))], params=model.params, max_new_tokens=4)
  with pytest.raises(ValueError, match="at least one token"):
    rollout.generate(model, [[]], max_new_tokens=4)
  with pytest.raises(ValueError, match="leaves no room"):
    Engine(model.transformer, max_slots=2, max_len=8, max_prompt_len=8)


@pytest.mark.parametrize("steps", [5, 16])
def test_chunked_decode_equals_the_single_step_path(steps):
  # Sampled (not greedy) responses with stop tokens, 18 requests on 4 slots: slots finish
  # inside chunks and refill between them; responses run past 64 tokens so the attention
  # length grows through its buckets (64, 128). Same keys -> the same tokens and log-probs.
  model = _model(scale=4.0)
  kwargs = dict(params=model.params, n=3, max_new_tokens=90, temperature=1.0, top_k=20,
                stop_token_ids=[3, 4], seed=5)
  single = Engine(model.transformer, max_slots=4, max_len=106, max_prompt_len=16, decode_steps=1)
  chunked = Engine(model.transformer, max_slots=4, max_len=106, max_prompt_len=16,
                   decode_steps=steps)
  reference = rollout.generate(single, PROMPTS, **kwargs)
  finished = []
  fast = rollout.generate(chunked, PROMPTS, on_finished=finished.append, **kwargs)
  assert len(finished) == len(fast) == 18
  lengths = [len(c.response_tokens) for c in reference]
  # Some finish inside a chunk (the first token is drawn at insert), some run past 64.
  assert any((n - 1) % steps for n in lengths) and max(lengths) > 64
  assert {c.finish_reason for c in reference} == {"stop", "length"}
  for a, b in zip(reference, fast):
    assert (a.prompt_index, a.sample_index, a.finish_reason) == (b.prompt_index, b.sample_index,
                                                                 b.finish_reason)
    assert a.response_tokens == b.response_tokens
    np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(a.policy_logprobs, b.policy_logprobs, rtol=1e-5, atol=1e-6)


def test_the_cache_layouts_give_the_same_completions():
  # The stacked cache (TPU) and the per-layer one (GPU, CPU), both run here on the CPU:
  # sampled responses that grow the per-layer cache through its buckets (64, 128).
  model = _model(scale=4.0)
  kwargs = dict(params=model.params, n=2, max_new_tokens=80, temperature=1.0, stop_token_ids=[3],
                seed=2)
  engines = [Engine(model.transformer, max_slots=4, max_len=96, max_prompt_len=16,
                    platform=platform) for platform in ("tpu", "cpu")]
  assert [e.cache_layout for e in engines] == ["stacked", "per_layer"]
  gpu = lambda **kw: Engine(model.transformer, max_slots=4, max_len=96, max_prompt_len=16,
                           platform="gpu", **kw)
  assert gpu().cache_layout == "per_layer" and gpu(layout="stacked").cache_layout == "stacked"
  with pytest.raises(ValueError, match="per_layer"):
    gpu(layout="per-layer")
  stacked, per_layer = (rollout.generate(e, PROMPTS, **kwargs) for e in engines)
  assert max(len(c.response_tokens) for c in stacked) > 64
  for a, b in zip(stacked, per_layer):
    assert a.response_tokens == b.response_tokens
    np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("platform", ["cpu", "tpu"])  # per-layer cache (resized) / stacked
def test_attending_to_the_filled_part_equals_the_whole_cache(model, platform):
  engine = Engine(model.transformer, max_slots=4, max_len=200, max_prompt_len=16, decode_steps=1,
                  platform=platform)
  prefix = engine.prefill(model.params, np.array([PROMPTS[1] + [0] * 5, PROMPTS[3] + [0] * 11]),
                          np.array([11, 5]))
  state = engine.init_decode_state()
  sampling = engine_lib.SamplingParams(
      temperature=jnp.ones((2,)), top_k=jnp.zeros((2,), jnp.int32), top_p=jnp.ones((2,)),
      max_new_tokens=jnp.full((2,), 100, jnp.int32),
      stop_ids=jnp.full((2, engine.max_stop_tokens), engine_lib.NO_STOP, jnp.int32))
  state = engine.insert(prefix, state, np.array([0, 2]), np.array([0, 1]),
                        jax.random.split(jax.random.key(0), 2), sampling)
  whole = jax.tree.map(jnp.copy, state)
  for _ in range(20):
    state, part = engine.generate(model.params, state, engine.attend_bucket(40))
    whole, full = engine.generate(model.params, whole, None)
    np.testing.assert_array_equal(part.tokens, full.tokens)
    # float32 softmaxes over 64 and 200 slots sum in different orders: a few 1e-6 apart
    np.testing.assert_allclose(part.policy_logprobs, full.policy_logprobs, rtol=1e-5, atol=2e-5)
  assert engine.attend_bucket(40) == 64 and engine.attend_bucket(64) == 128
  assert engine.attend_bucket(190) == 200


def test_a_chunk_ends_once_refill_at_slots_have_finished(model):
  engine = Engine(model.transformer, max_slots=4, max_len=64, max_prompt_len=16, decode_steps=16)
  prefix = engine.prefill(model.params, np.array([PROMPTS[1] + [0] * 5, PROMPTS[3] + [0] * 11]),
                          np.array([11, 5]))
  sampling = engine_lib.SamplingParams(
      temperature=jnp.ones((2,)), top_k=jnp.zeros((2,), jnp.int32), top_p=jnp.ones((2,)),
      max_new_tokens=jnp.array([4, 40], jnp.int32),
      stop_ids=jnp.full((2, engine.max_stop_tokens), engine_lib.NO_STOP, jnp.int32))

  def chunk(refill_at):
    state = engine.insert(prefix, engine.init_decode_state(), np.array([0, 2]), np.array([0, 1]),
                          jax.random.split(jax.random.key(0), 2), sampling)
    return engine.generate(model.params, state, engine.attend_bucket(11), refill_at)[1]

  whole, early = chunk(None), chunk(1)
  # Slot 0 draws its 4th token at step 3 (the first was drawn at insert); the chunk stops there.
  assert whole.emitted[:, 2].all() and whole.finished[2, 0]
  assert early.emitted[:3].any() and not early.emitted[3:].any()
  np.testing.assert_array_equal(early.tokens[:3], whole.tokens[:3])


@pytest.mark.parametrize("platform", ["cpu", "tpu"])  # per-layer cache / stacked
def test_decoding_only_the_leading_slots_gives_the_same_completions(model, platform,
                                                                     monkeypatch):
  # 16 slots, few requests at a time (a stream with most episodes away on their tools): the
  # chunks decode 2, 4 or 8 leading slots instead of 16, and sample what all 16 would.
  engine = Engine(model.transformer, max_slots=16, max_len=48, max_prompt_len=16,
                  decode_steps=4, platform=platform)
  assert engine.decode_widths == (2, 4, 8, 16) and engine.decode_width(3) == 4
  assert dataclasses.replace(engine, min_decode_width=1).decode_widths == (1, 2, 4, 8, 16)
  kwargs = dict(params=model.params, n=2, max_new_tokens=20, temperature=1.0,
                stop_token_ids=[3], seed=5)
  widths, generate = [], Engine.generate
  def spy(self, params, state, attend_len=None, refill_at=None, width=None):
    widths.append(width)
    return generate(self, params, state, attend_len, refill_at, width)
  monkeypatch.setattr(Engine, "generate", spy)
  stats = {}
  narrow = rollout.generate(engine, PROMPTS[:3], stats=stats, **kwargs)
  assert set(widths) == {8}  # 6 requests in slots 0-5
  # the occupancy counts the slots a chunk computed: 6 of 8 busy at first, not 6 of 16
  assert 0.5 < stats["busy_steps"] / stats["slot_steps"] <= 0.75
  narrow += rollout.generate(engine, PROMPTS, **kwargs)  # 12 requests: some chunks at 16
  assert {8, 16} <= set(widths)
  monkeypatch.setattr(Engine, "decode_width", lambda self, slots: self.max_slots)
  full = rollout.generate(engine, PROMPTS[:3], **kwargs) + rollout.generate(engine, PROMPTS,
                                                                             **kwargs)
  assert set(widths[-2:]) == {16}
  for a, b in zip(narrow, full):
    assert a.response_tokens == b.response_tokens
    np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="decode widths"):
    generate(engine, model.params, engine.init_decode_state(), None, None, 3)


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_weights_held_per_layer_decode_the_same_and_need_no_copy_per_chunk(model, platform):
  # A generator keeps each version as the engine decodes fastest from it: per layer for a
  # per-layer cache (no per-chunk copy of the weights), as they are for a stacked one.
  engine = Engine(model.transformer, max_slots=4, max_len=48, max_prompt_len=16,
                  decode_steps=4, platform=platform)
  held = engine.decode_params(model.params)
  assert isinstance(held["layers"], list) == (platform == "cpu")
  assert engine.decode_params(held) is held
  kwargs = dict(n=2, max_new_tokens=20, temperature=1.0, stop_token_ids=[3], seed=5)
  stacked = rollout.generate(engine, PROMPTS, params=model.params, **kwargs)
  per_layer = rollout.generate(engine, PROMPTS, params=held, **kwargs)
  for a, b in zip(stacked, per_layer):
    assert a.response_tokens == b.response_tokens
    np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-6)
  # the plain forward (the learner's log-probs of a generator's weights) takes them too
  tokens = jnp.array([list(range(1, 13))])
  np.testing.assert_allclose(model.transformer(held, tokens)[0],
                             model.transformer(model.params, tokens)[0], rtol=1e-5, atol=1e-5)
  if platform == "tpu":
    return
  # compiled, a chunk over stacked weights holds a per-layer copy of them in its temporaries
  state = jax.eval_shape(engine.init_decode_state)
  weights = sum(x.nbytes for x in jax.tree.leaves(model.params["layers"]))
  temps = {name: engine_lib._generate_chunk.lower(
      model.transformer, jax.eval_shape(lambda p=p: p), state, 4, 48, None,
      jnp.int32(5)).compile().memory_analysis().temp_size_in_bytes
      for name, p in (("stacked", model.params), ("per_layer", held))}
  assert temps["stacked"] - temps["per_layer"] >= weights, (temps, weights)


def test_decode_params_of_an_owned_copy_unstack_it_in_place(model):
  """``owned``: the per-layer form of a copy the caller gives up, each stacked array deleted
  once sliced; the same values as unstacking it whole, the layers' order kept."""
  engine = Engine(model.transformer, max_slots=2, max_len=16, max_prompt_len=8)
  if engine.cache_layout != "per_layer":
    pytest.skip("this engine decodes from stacked weights")
  params = model.params
  copy = jax.tree.map(jnp.copy, params)
  got = engine.decode_params(copy, owned=True)
  want = engine.decode_params(params)
  jax.tree.map(np.testing.assert_array_equal, got, want)
  assert all(x.is_deleted() for x in jax.tree.leaves(copy["layers"]))
  assert not any(x.is_deleted() for x in jax.tree.leaves(got))
  assert not any(x.is_deleted() for x in jax.tree.leaves(params))  # not owned: left as it is


def test_slot_counts_tell_computed_held_and_busy_slot_steps_apart(model):
  """``stats`` of a call (``rollout/slot_occupancy`` and ``rollout/slots_held_frac``): 3
  requests in 4 slots decoded 4 wide hold 3 of each step's 4 slots, and produce a token on at
  most those."""
  engine = Engine(model.transformer, max_slots=4, max_len=32, max_prompt_len=8,
                  min_decode_width=4)
  stats = {}
  rollout.generate(engine, [[1, 2], [3, 4, 5], [6]], params=model.params, max_new_tokens=12,
                   temperature=1.0, stop_token_ids=[], stats=stats)
  assert stats["slot_steps"] == 4 * stats["held_steps"] // 3  # every step: 4 computed, 3 held
  assert 0 < stats["busy_steps"] <= stats["held_steps"] < stats["slot_steps"]


def test_a_sequence_moved_to_a_lower_slot_keeps_its_length(model):
  """When the others finish, the long sequence left in a high slot moves down (the decode
  narrows to the slots in use) and takes its cached length with it: past 64 tokens, a length
  left behind would shrink what it attends to. Two prompts stop at token 6 within four
  tokens; the third never writes a 6 and decodes 100 greedily, as it does alone."""
  engine = Engine(model.transformer, max_slots=16, max_len=128, max_prompt_len=8,
                  min_decode_width=1)  # 16 slots: decodes 1, 2, 4, 8 or 16 wide
  short, other, long = [14, 13], [14, 20], [5, 41]
  alone = rollout.generate(engine, [long], params=model.params, max_new_tokens=100,
                           temperature=0.0, stop_token_ids=[6])[0]
  assert len(alone.response_tokens) == 100 and 6 not in alone.response_tokens
  stats = {}
  together = rollout.generate(engine, [short, other, long], params=model.params,
                              max_new_tokens=100, temperature=0.0, stop_token_ids=[6],
                              stats=stats)
  assert all(len(c.response_tokens) <= 4 for c in together[:2])  # they stopped early
  assert stats["slot_steps"] < 2 * 100  # it went on alone, 1 wide (in slot 0), not 4
  assert together[2].response_tokens == alone.response_tokens
