"""Sampling: exact top-k / top-p masks, frequencies that match the softmax (chi-square),
behaviour log-probs of the truncated distribution, greedy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from rlx.rollout import sample, truncate_logits

LOGITS = jnp.log(jnp.array([[0.4, 0.3, 0.15, 0.1, 0.05]]))


def _kept(temperature=1.0, top_k=0, top_p=1.0, logits=LOGITS):
  out = truncate_logits(logits, jnp.array([temperature]), jnp.array([top_k]), jnp.array([top_p]))
  return np.isfinite(np.asarray(out[0]))


def test_top_k_and_top_p_masks_are_exact():
  assert _kept(top_k=2).tolist() == [True, True, False, False, False]
  assert _kept(top_k=0).all() and _kept(top_k=99).all()
  # top-p keeps the most likely tokens until their mass reaches p (the crossing token kept).
  assert _kept(top_p=0.4).tolist() == [True, False, False, False, False]
  assert _kept(top_p=0.41).tolist() == [True, True, False, False, False]
  assert _kept(top_p=0.7).tolist() == [True, True, False, False, False]
  assert _kept(top_p=0.71).tolist() == [True, True, True, False, False]
  # Together: top-k first, then top-p over the renormalised top-k distribution.
  assert _kept(top_k=3, top_p=0.9).tolist() == [True, True, True, False, False]
  assert _kept(top_k=3, top_p=0.8).tolist() == [True, True, False, False, False]  # 0.4/0.85 + 0.3/0.85 > 0.8
  # Ties at the boundary are kept together.
  tied = jnp.log(jnp.array([[0.3, 0.3, 0.2, 0.2]]))
  assert _kept(top_k=3, logits=tied).tolist() == [True, True, True, True]


def _draw(logits, count, temperature=1.0, top_k=0, top_p=1.0, seed=0):
  keys = jax.random.split(jax.random.key(seed), count)
  rows = jnp.broadcast_to(logits, (count, logits.shape[-1]))
  full = lambda v, dtype: jnp.full((count,), v, dtype)
  return jax.jit(sample)(rows, keys, full(temperature, jnp.float32), full(top_k, jnp.int32),
                         full(top_p, jnp.float32))


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 3, 1.0),
                                                       (1.3, 0, 0.75)])
def test_sample_frequencies_match_the_distribution(temperature, top_k, top_p):
  count = 40_000
  tokens, behaviour, policy = _draw(LOGITS, count, temperature, top_k, top_p)
  truncated = truncate_logits(LOGITS, jnp.array([temperature]), jnp.array([top_k]), jnp.array([top_p]))
  probs = np.asarray(jax.nn.softmax(truncated[0]), np.float64)
  probs = probs / probs.sum()
  observed = np.bincount(np.asarray(tokens), minlength=5)
  support = probs > 0
  assert observed[~support].sum() == 0
  _, p_value = stats.chisquare(observed[support], probs[support] * count)
  assert p_value > 1e-3
  # Behaviour log-prob: of the distribution the token was drawn from; policy: untruncated.
  np.testing.assert_allclose(np.exp(behaviour), probs[np.asarray(tokens)], rtol=1e-5)
  np.testing.assert_allclose(policy, np.asarray(jax.nn.log_softmax(LOGITS[0]))[np.asarray(tokens)],
                             rtol=1e-5)


def test_greedy_and_determinism():
  tokens, behaviour, policy = _draw(LOGITS, 8, temperature=0.0)
  assert np.all(np.asarray(tokens) == 0) and np.all(np.asarray(behaviour) == 0)
  np.testing.assert_allclose(policy, np.log(0.4), rtol=1e-6)
  first, _, _ = _draw(LOGITS, 64, seed=3)
  again, _, _ = _draw(LOGITS, 64, seed=3)
  np.testing.assert_array_equal(first, again)


@pytest.mark.parametrize("vocab", [48, 512])
def test_fast_paths_equal_the_sorted_reference(vocab):
  # Random logits with ties; per slot: top-k and top-p off, top-k alone (below and above the
  # lax.top_k limit), top-p alone, both. Each mix of slots takes one of the three paths.
  from rlx.rollout.sampling import FAST_TOP_K, sorted_truncation
  rng = np.random.default_rng(vocab)
  logits = jnp.asarray(np.round(rng.normal(size=(6, vocab)) * 3, 1), jnp.float32)
  temperature = jnp.asarray([1.0, 0.7, 1.3, 0.0, 1.0, 2.0], jnp.float32)
  mixes = {
      "off": ([0] * 6, [1.0] * 6),
      "top_k": ([0, 1, 5, FAST_TOP_K, vocab, 7], [1.0] * 6),
      "top_k_large": ([0, 3, FAST_TOP_K + 1, 9, 0, 2], [1.0] * 6),
      "top_p": ([0] * 6, [1.0, 0.3, 0.9, 1.0, 0.5, 0.99]),
      "both": ([4, 0, 9, 2, 0, 30], [0.8, 1.0, 0.6, 1.0, 0.95, 0.7]),
  }
  fast = jax.jit(truncate_logits)
  for name, (top_k, top_p) in mixes.items():
    args = (logits, temperature, jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32))
    np.testing.assert_array_equal(fast(*args), sorted_truncation(*args), err_msg=name)


@pytest.mark.parametrize("vocab, block", [(5, 256), (1000, 16), (777, 64)])
def test_categorical_draws_the_softmax_over_blocks(vocab, block):
  """The inverse-CDF draw against the softmax it inverts (chi-square), on vocabularies of one
  block, of many, and of a ragged last block; masked entries are never drawn; and against
  ``jax.random.categorical`` (the Gumbel reference) on the same distribution."""
  from rlx.rollout.sampling import categorical
  rng = np.random.default_rng(vocab)
  logits = rng.normal(scale=2.0, size=vocab).astype(np.float32)
  logits[rng.random(vocab) < 0.3] = -np.inf  # truncated entries
  logits[vocab - 1] = 3.0  # mass in the ragged last block
  count = 20_000
  keys = jax.random.split(jax.random.key(7), count)
  rows = jnp.broadcast_to(jnp.asarray(logits), (count, vocab))
  drawn = np.asarray(jax.jit(lambda k, x: categorical(k, x, block))(keys, rows))
  gumbel = np.asarray(jax.jit(jax.vmap(jax.random.categorical))(keys, rows))
  probs = np.asarray(jax.nn.softmax(jnp.asarray(logits)), np.float64)
  support = probs > 0
  for tokens in (drawn, gumbel):
    observed = np.bincount(tokens, minlength=vocab)
    assert observed[~support].sum() == 0
    common = support & (probs * count >= 5)  # chi-square over the entries it can test
    expected = probs[common] * count
    expected *= observed[common].sum() / expected.sum()
    _, p_value = stats.chisquare(observed[common], expected)
    assert p_value > 1e-3


def test_categorical_edges():
  from rlx.rollout.sampling import categorical
  keys = jax.random.split(jax.random.key(0), 512)
  one = jnp.full((512, 300), -jnp.inf).at[:, 257].set(0.0)  # one allowed entry, second block
  assert np.all(np.asarray(categorical(keys, one)) == 257)
  # a uniform at the very end of the mass still lands on an allowed entry
  edge = jnp.full((2, 40), -jnp.inf).at[:, 3].set(0.0).at[:, 20].set(1.0)
  drawn = np.asarray(categorical(jax.random.split(jax.random.key(1), 2), edge, block=8))
  assert set(drawn.tolist()) <= {3, 20}
