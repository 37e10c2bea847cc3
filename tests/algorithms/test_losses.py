"""Policy and value losses, KL estimators, aggregation and DAPO pieces, against NumPy written
from the papers (DAPO, GRPO, Dr.GRPO, GSPO, CISPO, AReaL) and small hand-computed cases."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx import algorithms

B, T = 6, 10


def _batch(seed):
  rng = np.random.default_rng(seed)
  logprobs = -rng.uniform(0.1, 3.0, size=(B, T))
  old_logprobs = logprobs + rng.normal(scale=0.3, size=(B, T))
  behaviour_logprobs = old_logprobs + rng.normal(scale=0.3, size=(B, T))
  ref_logprobs = logprobs + rng.normal(scale=0.5, size=(B, T))
  seq_adv = rng.normal(size=B)
  mask = np.zeros((B, T), bool)
  for b in range(B):
    start = rng.integers(1, 4)
    mask[b, start:start + rng.integers(1, T - start + 1)] = True
  advantages = np.where(mask, seq_adv[:, None], 0.0)
  return logprobs, old_logprobs, behaviour_logprobs, ref_logprobs, advantages, mask


def _j(*xs):
  return [jnp.asarray(x, jnp.float32) for x in xs]


def numpy_clipped_objective(ratio, adv, eps_low, eps_high):
  """min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), elementwise."""
  return np.minimum(ratio * adv, np.clip(ratio, 1 - eps_low, 1 + eps_high) * adv)


@pytest.mark.parametrize("seed", range(3))
def test_dapo_objective(seed):
  """DAPO eq. 8: token-level mean over all tokens of the group, clip-higher (0.2, 0.28)."""
  logprobs, old, _, _, adv, mask = _batch(seed)
  ratio = np.exp(logprobs - old)
  expected = numpy_clipped_objective(ratio, adv, 0.2, 0.28)[mask].sum() / mask.sum()
  loss, _ = algorithms.ppo_clip(*_j(logprobs, old, adv), eps_low=0.2, eps_high=0.28)
  total = algorithms.mean_of(*algorithms.aggregate(loss, jnp.asarray(mask), "token-mean"))
  np.testing.assert_allclose(total, -expected, rtol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_grpo_objective(seed):
  """DeepSeekMath eq. 3: 1/G sum_i 1/|o_i| sum_t [min(r A, clip(r) A) - beta KL_k3]."""
  logprobs, old, _, ref, adv, mask = _batch(seed)
  beta = 0.04
  ratio = np.exp(logprobs - old)
  kl = np.exp(ref - logprobs) - (ref - logprobs) - 1
  per_token = numpy_clipped_objective(ratio, adv, 0.2, 0.2) - beta * kl
  expected = np.mean([per_token[b][mask[b]].mean() for b in range(B)])
  loss, _ = algorithms.ppo_clip(*_j(logprobs, old, adv), eps_low=0.2, eps_high=0.2)
  loss = loss + beta * algorithms.kl_estimate(*_j(logprobs, ref), "k3")
  total = algorithms.mean_of(*algorithms.aggregate(loss, jnp.asarray(mask), "seq-mean-token-mean"))
  np.testing.assert_allclose(total, -expected, rtol=1e-5)


def test_dr_grpo_objective():
  """Dr.GRPO (arXiv 2503.20783): per-sequence token sums over a constant (G x max length)."""
  logprobs, old, _, _, adv, mask = _batch(7)
  ratio = np.exp(logprobs - old)
  per_token = numpy_clipped_objective(ratio, adv, 0.2, 0.2)
  expected = sum(per_token[b][mask[b]].sum() for b in range(B)) / (B * T)
  loss, _ = algorithms.ppo_clip(*_j(logprobs, old, adv), eps_low=0.2, eps_high=0.2)
  total = algorithms.mean_of(*algorithms.aggregate(loss, jnp.asarray(mask), "seq-mean-token-sum-norm",
                                                   norm=T))
  np.testing.assert_allclose(total, -expected, rtol=1e-5)


def test_dual_clip():
  ratio = np.array([[0.5, 1.0, 3.0, 5.0, 5.0]])
  adv = np.array([[1.0, 1.0, -1.0, -1.0, 1.0]])
  loss, _ = algorithms.ppo_clip(*_j(np.log(ratio), np.zeros_like(ratio), adv), eps_low=0.2,
                                eps_high=0.2, dual_clip=3.0)
  # A>0: -min(rA, clip(r)A): 0.5 -> -0.5; 1 -> -1; 5 -> -1.2.  A<0: min(-min(rA, clip(r)A), -cA) = min(r, 3).
  np.testing.assert_allclose(loss, [[-0.5, -1.0, 3.0, 3.0, -1.2]], rtol=1e-6)


def test_clip_fractions_by_hand():
  ratio = jnp.array([[1.5, 1.5, 0.5, 0.5, 1.0]])
  adv = jnp.array([[1.0, -1.0, -1.0, 1.0, 1.0]])
  _, diag = algorithms.ppo_clip(jnp.log(ratio), jnp.zeros_like(ratio), adv, eps_low=0.2, eps_high=0.28)
  np.testing.assert_array_equal(diag["clip_high"], [[1, 0, 0, 0, 0]])
  np.testing.assert_array_equal(diag["clip_low"], [[0, 0, 1, 0, 0]])


@pytest.mark.parametrize("seed", range(3))
def test_gspo_sequence_objective_and_gradient(seed):
  """GSPO eq. 5-7: s_i = (pi/pi_old)^(1/|y_i|) over the sequence, clipped at the sequence level."""
  logprobs, old, _, _, adv, mask = _batch(seed)
  eps_low, eps_high = 3e-2, 4e-2
  seq_adv = adv.max(1) + adv.min(1)  # the sequence's advantage (constant on its tokens)
  s = np.array([np.exp((logprobs[b] - old[b])[mask[b]].mean()) for b in range(B)])
  expected = np.mean(numpy_clipped_objective(s, seq_adv, eps_low, eps_high))

  def ours(lp):
    loss, _ = algorithms.gspo(lp, jnp.asarray(old, jnp.float32), jnp.asarray(adv, jnp.float32),
                              jnp.asarray(mask), eps_low, eps_high)
    return algorithms.mean_of(*algorithms.aggregate(loss, jnp.asarray(mask), "seq-mean-token-mean"))

  def sequence_level(lp):  # an independent, sequence-level implementation
    m = jnp.asarray(mask)
    s = jnp.exp(jnp.where(m, lp - old, 0.0).sum(1) / m.sum(1))
    a = jnp.asarray(seq_adv, jnp.float32)
    return -jnp.mean(jnp.minimum(s * a, jnp.clip(s, 1 - eps_low, 1 + eps_high) * a))

  lp = jnp.asarray(logprobs, jnp.float32)
  np.testing.assert_allclose(ours(lp), -expected, rtol=1e-5)
  np.testing.assert_allclose(jax.grad(ours)(lp), jax.grad(sequence_level)(lp), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_cispo_objective_and_gradient(seed):
  """CISPO eq. 4: J = 1/sum|o_i| sum_it sg(clip(r)) A log pi; every token keeps a gradient."""
  logprobs, old, _, _, adv, mask = _batch(seed)
  eps_low, eps_high = 1.0, 0.28  # MiniMax-M1 sets no lower bound in effect
  weight = np.clip(np.exp(logprobs - old), 1 - eps_low, 1 + eps_high)
  expected = (weight * adv * logprobs)[mask].sum() / mask.sum()
  expected_grad = np.where(mask, -weight * adv / mask.sum(), 0.0)

  def ours(lp):
    loss, _ = algorithms.cispo(lp, jnp.asarray(old, jnp.float32), jnp.asarray(adv, jnp.float32),
                               eps_low, eps_high)
    return algorithms.mean_of(*algorithms.aggregate(loss, jnp.asarray(mask), "token-mean"))

  lp = jnp.asarray(logprobs, jnp.float32)
  np.testing.assert_allclose(ours(lp), -expected, rtol=1e-5)
  np.testing.assert_allclose(jax.grad(ours)(lp), expected_grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("seed", range(3))
def test_areal_decoupled_objective(seed):
  """AReaL eq. 5: E[pi_prox/pi_behav * min(u A, clip(u, 1 +- eps) A)], u = pi_theta/pi_prox."""
  logprobs, prox, behav, _, adv, mask = _batch(seed)
  u = np.exp(logprobs - prox)
  expected = (np.exp(prox - behav) * numpy_clipped_objective(u, adv, 0.2, 0.2))[mask].mean()
  loss, _ = algorithms.ppo_clip(*_j(logprobs, prox, adv), eps_low=0.2, eps_high=0.2)
  weights = algorithms.off_policy_weights(*_j(prox, behav), "decoupled")
  total = algorithms.mean_of(*algorithms.aggregate(weights * loss, jnp.asarray(mask), "token-mean"))
  np.testing.assert_allclose(total, -expected, rtol=1e-5)


def test_truncated_importance_weights():
  old = jnp.log(jnp.array([0.5, 0.9, 0.1]))
  behaviour = jnp.log(jnp.array([0.5, 0.3, 0.4]))
  np.testing.assert_allclose(algorithms.off_policy_weights(old, behaviour, "tis", cap=2.0),
                             [1.0, 2.0, 0.25], rtol=1e-6)
  np.testing.assert_array_equal(algorithms.off_policy_weights(old, behaviour, "none"), [1, 1, 1])
  grad = jax.grad(lambda o: algorithms.off_policy_weights(o, behaviour, "tis").sum())(old)
  np.testing.assert_array_equal(grad, [0, 0, 0])


def test_kl_estimators_by_hand_and_unbiasedness():
  logprobs, ref = jnp.array([-1.0]), jnp.array([-2.0])  # log ratio 1
  np.testing.assert_allclose(algorithms.kl_estimate(logprobs, ref, "k1"), [1.0])
  np.testing.assert_allclose(algorithms.kl_estimate(logprobs, ref, "k2"), [0.5])
  np.testing.assert_allclose(algorithms.kl_estimate(logprobs, ref, "k3"), [np.exp(-1.0)], rtol=1e-6)
  assert float(algorithms.kl_estimate(jnp.array([0.0]), jnp.array([30.0]), "k3")[0]) == 10.0
  # k1 and k3 are unbiased estimators of KL(p || q) under samples of p.
  rng = np.random.default_rng(0)
  p, q = np.array([0.1, 0.2, 0.3, 0.25, 0.15]), np.array([0.3, 0.1, 0.2, 0.2, 0.2])  # q/p < 10: no clamping
  samples = rng.choice(5, size=200_000, p=p)
  exact = np.sum(p * np.log(p / q))
  for estimator in ("k1", "k3"):
    estimate = algorithms.kl_estimate(jnp.log(p[samples]), jnp.log(q[samples]), estimator).mean()
    np.testing.assert_allclose(estimate, exact, atol=0.01)


def test_k3_keeps_its_precision_for_nearly_equal_policies():
  """k3 = exp(-x) - 1 + x cancels almost wholly when x is small: between an engine and a
  learner that agree to 1e-5 it must still be x^2 / 2, not float32 rounding noise."""
  rng = np.random.default_rng(0)
  for scale in (1e-6, 1e-5, 1e-4, 1e-2):
    x = (rng.normal(size=1000) * scale).astype(np.float32)
    exact = np.expm1(-x.astype(np.float64)) + x.astype(np.float64)
    for estimator in ("k3", "k3+"):
      got = np.asarray(algorithms.kl_estimate(jnp.asarray(x), jnp.zeros_like(x), estimator))
      np.testing.assert_allclose(got, exact, rtol=1e-3, atol=1e-30)


def test_kl_reward_penalty_and_adaptive_coefficient():
  rewards = jnp.array([[0.0, 0.0, 1.0]])
  mask = jnp.array([[False, True, True]])
  penalised = algorithms.kl_reward_penalty(rewards, jnp.array([[-1.0, -1.0, -1.0]]),
                                           jnp.array([[-2.0, -1.5, -1.0]]), mask, 0.1)
  np.testing.assert_allclose(penalised, [[0.0, -0.05, 1.0]], atol=1e-7)
  # KL twice the target: error clipped at +0.2, over 100 of a 1000-step horizon: x1.02.
  np.testing.assert_allclose(algorithms.adaptive_kl_coef(0.1, 0.2, 0.1, 1000, 100), 0.102, rtol=1e-6)
  np.testing.assert_allclose(algorithms.adaptive_kl_coef(0.1, 0.09, 0.1, 10, 1), 0.1 * (1 - 0.01), rtol=1e-5)


def test_aggregation_modes_by_hand():
  loss = jnp.array([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]])
  mask = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], bool)
  cases = {"token-mean": (10.0, 4.0), "seq-mean-token-sum": (10.0, 2.0),
           "seq-mean-token-mean": (2.0 + 4.0, 2.0), "seq-mean-token-sum-norm": (10.0, 12.0)}
  for mode, expected in cases.items():
    np.testing.assert_allclose(algorithms.aggregate(loss, mask, mode, norm=4), expected, err_msg=mode)
  with pytest.raises(ValueError, match="constant norm"):
    algorithms.aggregate(loss, mask, "seq-mean-token-sum-norm")


def test_value_loss_by_hand():
  values, old, returns = jnp.array([1.5, 0.0]), jnp.array([1.0, 0.0]), jnp.array([0.0, 1.0])
  # Token 0: unclipped (1.5)^2, clipped V = 1.2 -> (1.2)^2; max = 2.25. Token 1: 1.
  np.testing.assert_allclose(algorithms.value_loss(values, old, returns, 0.2), [1.125, 0.5])
  np.testing.assert_allclose(algorithms.value_loss(values, old, returns, None), [1.125, 0.5])
  values = jnp.array([0.5])  # moving toward the return: the clip binds and the loss is the larger one
  np.testing.assert_allclose(algorithms.value_loss(values, jnp.array([1.0]), jnp.array([0.0]), 0.2),
                             [0.5 * 0.8 ** 2])


def test_dapo_overlong_penalty_in_tokens():
  lengths = jnp.array([10, 16, 18, 20, 21])
  np.testing.assert_allclose(algorithms.overlong_penalty(lengths, max_length=20, buffer=4),
                             [0.0, 0.0, -0.5, -1.0, -1.0])
  with pytest.raises(ValueError, match="overlong buffer"):
    algorithms.overlong_penalty(lengths, 20, 0)


def test_dapo_dynamic_sampling_and_overlong_filter():
  rewards = jnp.array([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
  np.testing.assert_array_equal(algorithms.dynamic_sampling_keep(rewards, 3),
                                [False] * 3 + [True] * 3 + [False] * 3)
  mask = jnp.ones((2, 3), bool)
  np.testing.assert_array_equal(algorithms.overlong_filter(mask, jnp.array([True, False])),
                                [[0, 0, 0], [1, 1, 1]])


def test_masked_helpers():
  x, mask = jnp.array([1.0, 2.0, 3.0, 100.0]), jnp.array([1, 1, 1, 0], bool)
  assert float(algorithms.masked_mean(x, mask)) == 2.0
  np.testing.assert_allclose(algorithms.masked_var(x, mask), 1.0)
  np.testing.assert_allclose(algorithms.masked_whiten(x, mask), [-1, 0, 1, 0], atol=1e-6)
  assert float(algorithms.masked_mean(x, jnp.zeros(4, bool))) == 0.0
