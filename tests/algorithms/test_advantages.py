"""Advantage estimators against NumPy loops written from their papers, and hand-computed cases."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx import algorithms


def _response_mask(rng, B, T):
  """Each row: a prompt, then a response of random length, then padding."""
  mask = np.zeros((B, T), bool)
  for b in range(B):
    start = rng.integers(1, T // 2)
    mask[b, start:start + rng.integers(1, T - start + 1)] = True
  return mask


def numpy_gae(rewards, values, mask, gamma, lam):
  B, T = rewards.shape
  advantages = np.zeros((B, T))
  for b in range(B):
    positions = np.flatnonzero(mask[b])
    running, next_value = 0.0, 0.0
    for t in positions[::-1]:
      delta = rewards[b, t] + gamma * next_value - values[b, t]
      running = delta + gamma * lam * running
      advantages[b, t] = running
      next_value = values[b, t]
  return advantages, np.where(mask, advantages + values, 0.0)


@pytest.mark.parametrize("seed", range(3))
def test_gae_scan_equals_python_loop(seed):
  rng = np.random.default_rng(seed)
  B, T = 5, 13
  rewards, values = rng.normal(size=(B, T)), rng.normal(size=(B, T))
  mask = _response_mask(rng, B, T)
  gamma, lam = rng.uniform(0.8, 1.0), rng.uniform(0.5, 1.0)
  advantages, returns = algorithms.gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask),
                                       gamma, lam)
  expected_adv, expected_ret = numpy_gae(rewards, values, mask, gamma, lam)
  np.testing.assert_allclose(advantages, expected_adv, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(returns, expected_ret, rtol=1e-5, atol=1e-5)


def test_gae_by_hand():
  # Three response tokens, reward 1 at the end, gamma = 1, lam = 0.5, values 0.1 0.2 0.3.
  rewards = jnp.array([[0.0, 0.0, 0.0, 1.0, 0.0]])
  values = jnp.array([[9.0, 0.1, 0.2, 0.3, 9.0]])
  mask = jnp.array([[False, True, True, True, False]])
  advantages, _ = algorithms.gae(rewards, values, mask, 1.0, 0.5)
  # d3 = 1 - 0.3 = 0.7; d2 = 0.3 - 0.2 = 0.1; d1 = 0.2 - 0.1 = 0.1
  # A3 = 0.7; A2 = 0.1 + 0.35 = 0.45; A1 = 0.1 + 0.225 = 0.325
  np.testing.assert_allclose(advantages, [[0.0, 0.325, 0.45, 0.7, 0.0]], atol=1e-6)


def test_group_relative_grpo_and_dr_grpo():
  rng = np.random.default_rng(0)
  rewards = rng.integers(0, 2, size=(4, 6)).astype(np.float64)
  rewards[0] = 1.0  # a constant group: advantage 0, not NaN
  ours = np.asarray(algorithms.group_relative(jnp.asarray(rewards.reshape(-1)), 6))
  expected = [(g - g.mean()) / (g.std(ddof=1) + 1e-6) for g in rewards]
  np.testing.assert_allclose(ours, np.concatenate(expected), rtol=1e-5, atol=1e-6)
  dr = np.asarray(algorithms.group_relative(jnp.asarray(rewards.reshape(-1)), 6, scale_by_std=False))
  np.testing.assert_allclose(dr, np.concatenate([g - g.mean() for g in rewards]), atol=1e-6)
  # By hand: group (1, 0, 0, 1): mean 0.5, sample std sqrt(1/3).
  hand = algorithms.group_relative(jnp.array([1.0, 0.0, 0.0, 1.0]), 4, eps=0.0)
  np.testing.assert_allclose(hand, np.array([1, -1, -1, 1]) * 0.5 / np.sqrt(1 / 3), rtol=1e-6)


def test_rloo_leave_one_out():
  rng = np.random.default_rng(1)
  rewards = rng.normal(size=12)
  ours = np.asarray(algorithms.rloo(jnp.asarray(rewards), 4))
  expected = []
  for group in rewards.reshape(3, 4):
    expected += [group[i] - np.mean(np.delete(group, i)) for i in range(4)]
  np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(algorithms.rloo(jnp.array([1.0, 0.0, 0.0]), 3), [1.0, -0.5, -0.5])
  with pytest.raises(ValueError, match="group_size >= 2"):
    algorithms.rloo(jnp.zeros(3), 1)


def test_reinforce_plus_plus_whitens_returns_to_go():
  rng = np.random.default_rng(2)
  B, T = 4, 9
  mask = _response_mask(rng, B, T)
  rewards = np.where(mask, rng.normal(size=(B, T)), 0.0)
  ours = np.asarray(algorithms.reinforce_plus_plus(jnp.asarray(rewards), jnp.asarray(mask)))
  returns = np.zeros((B, T))
  for b in range(B):
    running = 0.0
    for t in np.flatnonzero(mask[b])[::-1]:
      running = rewards[b, t] + running
      returns[b, t] = running
  valid = returns[mask]
  expected = np.where(mask, (returns - valid.mean()) / np.sqrt(valid.var(ddof=1) + 1e-8), 0.0)
  np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-5)


def test_group_shape_is_checked():
  with pytest.raises(ValueError, match="multiple of group_size=4"):
    algorithms.group_relative(jnp.zeros(6), 4)


def test_per_token_broadcast():
  mask = jnp.array([[0, 1, 1], [1, 1, 0]], bool)
  np.testing.assert_array_equal(algorithms.per_token(jnp.array([2.0, -1.0]), mask),
                                [[0, 2, 2], [-1, -1, 0]])


def test_gae_is_jittable():
  f = jax.jit(lambda r, v, m: algorithms.gae(r, v, m, 0.99, 0.95))
  out = f(jnp.ones((2, 4)), jnp.zeros((2, 4)), jnp.ones((2, 4), bool))
  assert out[0].shape == (2, 4)


def test_gae_skips_environment_tokens_and_the_return_flows_across_them():
  """A multi-turn episode's environment tokens (outside the mask) are not actions: GAE over
  the episode equals GAE over its sampled tokens alone, and they get no advantage or target."""
  rng = np.random.default_rng(0)
  mask = np.array([[0, 1, 1, 0, 0, 0, 1, 1, 1, 0]], bool)  # prompt, turn, env tokens, turn, pad
  rewards = np.where(mask, rng.normal(size=mask.shape), 0).astype(np.float32)
  values = rng.normal(size=mask.shape).astype(np.float32)
  advantages, returns = algorithms.gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask),
                                       0.9, 0.8)
  kept = np.flatnonzero(mask[0])
  compact_a, compact_r = algorithms.gae(jnp.asarray(rewards[:, kept]), jnp.asarray(values[:, kept]),
                                        jnp.ones((1, kept.size), bool), 0.9, 0.8)
  np.testing.assert_allclose(np.asarray(advantages)[0, kept], np.asarray(compact_a)[0], rtol=1e-6)
  np.testing.assert_allclose(np.asarray(returns)[0, kept], np.asarray(compact_r)[0], rtol=1e-6)
  assert not np.asarray(advantages)[~mask].any() and not np.asarray(returns)[~mask].any()
