"""The second round of estimators and losses (Lite PPO's batch std, REINFORCE++-baseline, the
pass@k advantage, GMPO, SAPO, Clip-Cov, KL-Cov), the off-policy correction table and the
entropy tools, each against NumPy written from its paper."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx import algorithms, update
from rlx.config import AlgorithmConfig, RunConfig
from rlx.trainer.produce.evaluate import pass_at_k, pass_ks
from rlx.types import RolloutBatch

from tests.algorithms.test_losses import _batch, _j


def _rewards(seed, groups=4, size=4):
  return np.random.default_rng(seed).integers(0, 3, groups * size).astype(np.float32), size


@pytest.mark.parametrize("seed", range(3))
def test_batch_std_and_reinforce_pp_baseline(seed):
  rewards, g = _rewards(seed)
  groups = rewards.reshape(-1, g)
  centred = (groups - groups.mean(1, keepdims=True)).ravel()
  np.testing.assert_allclose(algorithms.group_mean_batch_std(jnp.asarray(rewards), g),
                             centred / (rewards.std(ddof=1) + 1e-6), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(algorithms.reinforce_pp_baseline(jnp.asarray(rewards), g),
                             (centred - centred.mean()) / (centred.std(ddof=1) + 1e-8),
                             rtol=1e-5, atol=1e-5)


def test_pass_at_k_advantage_moves_only_the_best_sample_by_its_margin():
  rewards = jnp.array([0.0, 1.0, 0.5, 0.0, 2.0, 2.0, 1.0, 0.0])
  np.testing.assert_allclose(algorithms.pass_at_k(rewards, 4),
                             [0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])  # a tie: no margin
  np.testing.assert_allclose(algorithms.pass_at_k(jnp.array([0.0, 0.0, 1.0, 0.0]), 4),
                             [0.0, 0.0, 1.0, 0.0])


@pytest.mark.parametrize("seed", range(3))
def test_gmpo_is_the_clipped_geometric_mean_objective(seed):
  logprobs, old, _, _, advantages, mask = _batch(seed)
  eps = 0.4
  expected = []
  for b in range(len(mask)):
    m = mask[b]
    a = advantages[b][m][0]
    s = 1.0 if a >= 0 else -1.0
    lr = (logprobs[b] - old[b])[m]
    bounded = np.minimum(s * lr, s * np.clip(lr, -eps, eps))
    expected.append(np.exp(np.mean(s * bounded)) * a)
  loss, _ = algorithms.gmpo(*_j(logprobs, old, advantages), jnp.asarray(mask), eps, eps)
  total = algorithms.mean_of(*algorithms.aggregate(loss, jnp.asarray(mask), "seq-mean-token-mean"))
  np.testing.assert_allclose(total, -np.mean(expected), rtol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_sapo_is_the_soft_gate_and_reinforce_on_policy(seed):
  logprobs, old, _, _, advantages, mask = _batch(seed)
  r = np.exp(logprobs - old)
  tau = np.where(advantages > 0, 1.0, 1.05)
  gate = 1 / (1 + np.exp(-tau * (r - 1))) * 4 / tau
  loss, _ = algorithms.sapo(*_j(logprobs, old, advantages), 1.0, 1.05)
  np.testing.assert_allclose(np.where(mask, loss, 0), np.where(mask, -gate * advantages, 0),
                             rtol=1e-5, atol=1e-6)
  # at r = 1 the gate's slope is 1: the gradient is REINFORCE's, -A
  grad = jax.grad(lambda lp: algorithms.sapo(lp, jnp.asarray(logprobs, jnp.float32),
                                             jnp.asarray(advantages, jnp.float32), 1.0,
                                             1.05)[0].sum())(jnp.asarray(logprobs, jnp.float32))
  np.testing.assert_allclose(grad, -advantages, rtol=1e-5, atol=1e-6)


def _covariance(logprobs, advantages, mask):
  lp, a = logprobs[mask], advantages[mask]
  cov = np.full(mask.shape, -np.inf)
  cov[mask] = (lp - lp.mean()) * (a - a.mean())
  return cov


def test_kl_cov_adds_the_kl_term_on_the_top_covariance_tokens_only():
  logprobs, old, _, _, advantages, mask = _batch(0)
  ratio, coef = 0.1, 1.0
  cov = _covariance(logprobs, advantages, mask)
  k = max(int(ratio * mask.sum()), 1)
  top = np.zeros(mask.shape, bool)
  top.flat[np.argsort(-cov, axis=None)[:k]] = True
  r = np.exp(logprobs - old)
  expected = -r * advantages + np.where(top, coef * np.abs(logprobs - old), 0.0)
  loss, diagnostics = algorithms.kl_cov(*_j(logprobs, old, advantages), jnp.asarray(mask),
                                        ratio, coef)
  np.testing.assert_allclose(np.where(mask, loss, 0), np.where(mask, expected, 0), rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_array_equal(np.asarray(diagnostics["cov_selected"], bool), top)


def test_clip_cov_detaches_a_random_share_of_the_in_band_tokens():
  logprobs, old, _, _, advantages, mask = _batch(1)
  advantages = advantages * 3  # covariances reach the band
  lp, o, a = _j(logprobs, old, advantages)
  ratio, bounds = 0.1, (0.5, 5.0)
  cov = _covariance(logprobs, advantages, mask)
  r = np.exp(logprobs - old)
  unclipped = np.clip(r, 0.8, 1.2) * advantages >= r * advantages
  candidates = mask & (cov > 0.5) & (cov < 5) & unclipped
  k = max(int(ratio * mask.sum()), 1)
  assert candidates.sum() > k  # the draw has a choice to make
  total = lambda x: algorithms.clip_cov(x, o, a, jnp.asarray(mask), 0.2, 0.2, None, ratio,
                                        bounds)[0].sum()
  _, diagnostics = algorithms.clip_cov(lp, o, a, jnp.asarray(mask), 0.2, 0.2, None, ratio, bounds)
  chosen = np.asarray(diagnostics["cov_selected"], bool)
  assert chosen.sum() == k and not (chosen & ~candidates).any()
  grad, reference = jax.grad(total)(lp), jax.grad(
      lambda x: algorithms.ppo_clip(x, o, a, 0.2, 0.2)[0].sum())(lp)
  np.testing.assert_array_equal(np.asarray(grad)[chosen], 0.0)
  np.testing.assert_allclose(np.asarray(grad)[~chosen], np.asarray(reference)[~chosen], rtol=1e-6)
  assert np.any(np.asarray(reference)[chosen] != 0)


def _numpy_off_policy(kind, old, behav, mask, advantages, cap=2.0, delta=0.01):
  log_w = np.clip(old - behav, -20, 20)
  w = np.exp(log_w)
  n = np.maximum(mask.sum(-1, keepdims=True), 1)
  seq_sum = np.where(mask, log_w, 0).sum(-1, keepdims=True)
  geo = seq_sum / n
  ones = np.ones_like(w)
  return {
      "none": ones, "tis": np.minimum(w, cap), "decoupled": w,
      "token_mask": np.where(w > cap, 0.0, w),
      "seq_tis": ones * np.minimum(np.exp(seq_sum), cap),
      "geo_tis": ones * np.minimum(np.exp(geo), cap),
      "seq_reject": ones * (np.abs(geo) <= np.log(cap)),
      "opsm": ones * ~((np.where(mask, advantages, 0).sum(-1, keepdims=True) < 0)
                       & (-geo > delta)),
      "icepop": np.where(np.abs(log_w) > np.log(cap), 0.0, 1.0),
  }[kind]


@pytest.mark.parametrize("kind", sorted(algorithms.OFF_POLICY))
@pytest.mark.parametrize("seed", range(2))
def test_off_policy_corrections(kind, seed):
  _, old, behav, _, advantages, mask = _batch(seed)
  behav = old + 5 * (behav - old)  # far enough for the bands and caps to act
  got = algorithms.off_policy_weights(*_j(old, behav), kind, cap=2.0,
                                      response_mask=jnp.asarray(mask),
                                      advantages=jnp.asarray(advantages, jnp.float32))
  want = _numpy_off_policy(kind, old, behav, mask, advantages)
  np.testing.assert_allclose(np.where(mask, got, 0), np.where(mask, want, 0), rtol=1e-5)
  grad = jax.grad(lambda o: algorithms.off_policy_weights(
      o, jnp.asarray(behav, jnp.float32), kind, response_mask=jnp.asarray(mask)).sum())(
          jnp.asarray(old, jnp.float32))
  np.testing.assert_array_equal(grad, 0.0)


def test_off_policy_masks_act_on_this_case():
  """Every masking kind rejects something here, and keeps something (not vacuous)."""
  _, old, behav, _, advantages, mask = _batch(0)
  behav = old + 5 * (behav - old)
  for kind in ("token_mask", "seq_reject", "icepop", "opsm"):
    w = _numpy_off_policy(kind, old, behav, mask, advantages)[mask]
    assert 0 < (w == 0).sum() < w.size, kind


def _loss_batch(seed=0):
  logprobs, old, behav, _, advantages, mask = _batch(seed)
  return logprobs, RolloutBatch(
      tokens=jnp.zeros(mask.shape, jnp.int32), attention_mask=jnp.asarray(mask),
      response_mask=jnp.asarray(mask), advantages=jnp.asarray(advantages, jnp.float32),
      old_logprobs=jnp.asarray(old, jnp.float32),
      behaviour_logprobs=jnp.asarray(behav, jnp.float32),
      policy_version=jnp.zeros(mask.shape[0], jnp.int32))


def test_top_entropy_quantile_keeps_the_policy_loss_of_the_highest_entropy_tokens():
  logprobs, batch = _loss_batch()
  entropy = jnp.asarray(np.random.default_rng(3).uniform(0, 2, logprobs.shape), jnp.float32)
  mask = np.asarray(batch.response_mask)
  config = RunConfig(algorithm=AlgorithmConfig(name="dapo", top_entropy_quantile=0.25,
                                               off_policy="none"))
  loss, diagnostics = update.policy_loss(config, jnp.asarray(logprobs, jnp.float32), entropy,
                                         batch, jnp.float32(0))
  threshold = np.quantile(np.asarray(entropy)[mask], 0.75)
  kept = mask & (np.asarray(entropy) >= threshold)
  assert 0.2 <= kept.sum() / mask.sum() <= 0.3
  np.testing.assert_array_equal(np.asarray(diagnostics["entropy_kept"], bool), kept)
  full, _ = update.policy_loss(RunConfig(algorithm=AlgorithmConfig(name="dapo", off_policy="none")),
                               jnp.asarray(logprobs, jnp.float32), entropy, batch, jnp.float32(0))
  np.testing.assert_allclose(np.asarray(loss)[kept], np.asarray(full)[kept])
  np.testing.assert_array_equal(np.asarray(loss)[mask & ~kept], 0.0)


def test_adaptive_entropy_coefficient_steps_towards_the_target():
  assert algorithms.adaptive_entropy_coef(0.01, 0.1, 0.2, 0.005) == pytest.approx(0.015)
  assert algorithms.adaptive_entropy_coef(0.01, 0.3, 0.2, 0.005) == pytest.approx(0.005)
  assert algorithms.adaptive_entropy_coef(0.002, 0.3, 0.2, 0.005) == 0.0


def test_the_traced_entropy_coefficient_is_the_bonus():
  logprobs, batch = _loss_batch()
  entropy = jnp.ones(logprobs.shape, jnp.float32)
  config = RunConfig(algorithm=AlgorithmConfig(name="dapo", entropy_target=0.5,
                                               off_policy="none"))
  at = lambda coef: update.policy_loss(config, jnp.asarray(logprobs, jnp.float32), entropy, batch,
                                       jnp.float32(0), None, jnp.float32(coef))[0]
  np.testing.assert_allclose(at(0.0) - at(0.1), 0.1, rtol=1e-5)


@pytest.mark.parametrize("n, c, k", [(8, 0, 1), (8, 3, 1), (8, 3, 4), (8, 8, 2), (5, 1, 5),
                                     (16, 2, 8)])
def test_unbiased_pass_at_k(n, c, k):
  from math import comb
  expected = 1 - comb(n - c, k) / comb(n, k)
  assert pass_at_k(n, np.array([c]), k)[0] == pytest.approx(expected)
  # unbiased: the mean over every subset of k of the n samples of "some correct"
  rng = np.random.default_rng(0)
  outcomes = np.array([1] * c + [0] * (n - c))
  draws = [outcomes[rng.choice(n, k, replace=False)].any() for _ in range(20000)]
  assert np.mean(draws) == pytest.approx(expected, abs=0.015)


def test_pass_ks():
  assert pass_ks(8) == [1, 2, 4, 8] and pass_ks(6) == [1, 2, 4, 6] and pass_ks(1) == [1]
