"""Appending a turn into a parked slot's cache (``Engine.extend``) against a full recompute of
the whole sequence: the next token's policy log-prob and the following decode steps match."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx.config import ArchConfig
from rlx.models import init_model
from rlx.rollout.engine import Engine, SamplingParams, np_stop_ids

ARCH = ArchConfig(num_layers=2, vocab_size=48, hidden_size=32, intermediate_size=48, num_heads=4,
                  num_kv_heads=2, head_dim=8, eos_token_ids=(3,))


@pytest.fixture(scope="module")
def model():
  model = init_model(ARCH, jax.random.key(1))
  return model.replace(params=jax.tree.map(lambda p: p * 8 if p.ndim > 1 else p, model.params))


def _sampling(count, max_new, stop=(3,), width=8):
  return SamplingParams(temperature=np.ones(count, np.float32), top_k=np.zeros(count, np.int32),
                        top_p=np.ones(count, np.float32),
                        max_new_tokens=np.full(count, max_new, np.int32),
                        stop_ids=np.tile(np_stop_ids(stop, width), (count, 1)))


def _policy_logprobs(model, tokens, length=64):
  """Log-softmax [len(tokens), V] of a full (no-cache) forward pass."""
  padded = list(tokens) + [0] * (length - len(tokens))
  return np.asarray(jax.nn.log_softmax(model(jnp.array([padded]))[0, :len(tokens)]))


@pytest.mark.parametrize("platform", ["cpu", "tpu"])  # the per_layer and stacked cache layouts
def test_extend_matches_full_recompute(model, platform):
  engine = Engine(model.transformer, max_slots=4, max_len=64, max_prompt_len=16, decode_steps=4,
                  platform=platform)
  prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]
  state = engine.init_decode_state()
  tokens = np.zeros((2, 8), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  prefix = engine.prefill(model.params, tokens, np.array([len(p) for p in prompts]))
  keys = jax.random.split(jax.random.key(3), 2)
  # slots 1 and 2 hold the two requests; the first turn is 5 tokens each (no stop token)
  state = engine.insert(prefix, state, np.array([1, 2]), np.array([0, 1]), keys,
                        _sampling(2, max_new=5, stop=()))
  sequences = [list(p) for p in prompts]
  firsts = np.asarray(state.last_token)[[1, 2]]
  for s, token in zip(sequences, firsts):
    s.append(int(token))
  while bool(np.asarray(state.active).any()):
    state, chunk = engine.generate(model.params, state, engine.attend_bucket(32))
    for step in range(chunk.tokens.shape[0]):
      for i, slot in enumerate((1, 2)):
        if chunk.emitted[step, slot]:
          sequences[i].append(int(chunk.tokens[step, slot]))
  assert [len(s) - len(p) for s, p in zip(sequences, prompts)] == [5, 5]
  # The environment's tokens, different lengths: appended after the last sampled token (which
  # is not in the cache yet).
  observations = [[20, 21, 22], [30, 31, 32, 33, 34, 35]]
  width = 1 + max(map(len, observations))
  appended = np.zeros((3, width), np.int32)  # a padding row (slot 4 = max_slots) as well
  lengths = np.ones(3, np.int32)
  for i, (s, obs) in enumerate(zip(sequences, observations)):
    row = [s[-1], *obs]
    appended[i, :len(row)] = row
    lengths[i] = len(row)
    s.extend(obs)
  turn_keys = jax.random.split(jax.random.key(4), 3)
  state = engine.extend(model.params, state, np.array([1, 2, 4]), appended, lengths, turn_keys,
                        _sampling(3, max_new=6, stop=()))
  assert np.asarray(state.cache["index"])[[1, 2]].tolist() == [len(s) for s in sequences]
  got = np.asarray(state.last_policy_logprob)[[1, 2]]
  nexts = np.asarray(state.last_token)[[1, 2]]
  for i, s in enumerate(sequences):
    want = _policy_logprobs(model, s)[-1][nexts[i]]
    np.testing.assert_allclose(got[i], want, atol=2e-5)
    s.append(int(nexts[i]))
  # the second turn decodes on top of the extended cache: its log-probs match a full recompute
  logprobs = [[], []]
  while bool(np.asarray(state.active).any()):
    state, chunk = engine.generate(model.params, state, engine.attend_bucket(40))
    for step in range(chunk.tokens.shape[0]):
      for i, slot in enumerate((1, 2)):
        if chunk.emitted[step, slot]:
          sequences[i].append(int(chunk.tokens[step, slot]))
          logprobs[i].append(float(chunk.policy_logprobs[step, slot]))
  for s, lp in zip(sequences, logprobs):
    assert len(lp) == 5
    full = _policy_logprobs(model, s)
    want = [full[len(s) - 6 + j][s[len(s) - 5 + j]] for j in range(5)]
    np.testing.assert_allclose(lp, want, atol=2e-5)
