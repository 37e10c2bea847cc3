"""Numerical safety of the losses, weights and KL estimators at extreme log-ratios, and what
the KL estimators' gradients follow (each of these failed before the log-ratio clamps, the
k3 input clamp and k3+ existed)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx import algorithms
from rlx.config import AlgorithmConfig, ConfigError


def _token_mean(loss):
  return loss.mean()


@pytest.mark.parametrize("loss", ["ppo_clip", "cispo", "gspo", "gmpo", "sapo"])
def test_a_huge_log_ratio_gives_a_finite_loss_and_gradient(loss):
  old = jnp.zeros((1, 2))
  advantages = jnp.ones((1, 2))
  mask = jnp.ones((1, 2), bool)
  algo = AlgorithmConfig(name="grpo", policy_loss=loss)

  def total(logprobs):
    value, diagnostics = algorithms.POLICY_LOSSES[loss](logprobs, old, advantages, mask, algo,
                                                        algo.eps_high)
    return _token_mean(value), diagnostics

  logprobs = jnp.array([[0.0, 100.0]])
  (value, diagnostics), grad = jax.value_and_grad(total, has_aux=True)(logprobs)
  assert np.isfinite(float(value)), loss
  assert np.all(np.isfinite(grad)), (loss, grad)
  for name, x in diagnostics.items():
    assert np.all(np.isfinite(x)), (loss, name, x)


def test_ppo_clip_past_the_overflow_cuts_the_token_instead_of_poisoning_the_step():
  # the case: log-ratio 100 on the second token, A = 1, token mean
  loss = lambda lp: algorithms.ppo_clip(lp, jnp.zeros(2), jnp.ones(2), 0.2, 0.2)[0].mean()
  np.testing.assert_allclose(jax.grad(loss)(jnp.array([0.0, 100.0])), [-0.5, 0.0])


def test_off_policy_weights_stay_finite_and_gspo_s_sequence_ratio_is_bounded():
  old, behaviour = jnp.array([[100.0, 0.0]]), jnp.zeros((1, 2))
  for kind in algorithms.OFF_POLICY:
    weights = algorithms.off_policy_weights(old, behaviour, kind)
    assert np.all(np.isfinite(weights)), kind
  assert float(algorithms.off_policy_weights(old, behaviour, "decoupled")[0, 0]) == pytest.approx(
      np.exp(20.0), rel=1e-5)
  _, diagnostics = algorithms.gspo(jnp.array([[50.0, 50.0]]), jnp.zeros((1, 2)), jnp.ones((1, 2)),
                                   jnp.ones((1, 2), bool), 3e-4, 4e-4)
  np.testing.assert_allclose(diagnostics["ratio"], np.exp(10.0), rtol=1e-5)


@pytest.mark.parametrize("estimator", ["k3", "k3+"])
def test_k3_at_a_very_negative_log_ratio_has_a_finite_gradient(estimator):
  kl = lambda lp: algorithms.kl_estimate(lp, jnp.array([100.0]), estimator).sum()
  assert float(kl(jnp.array([0.0]))) == 10.0  # the output clamp
  assert np.all(np.isfinite(jax.grad(kl)(jnp.array([0.0]))))


def _softmax_case():
  theta = jnp.array([0.3, -0.5, 0.8])
  ref = jax.nn.log_softmax(jnp.array([0.1, 0.4, -0.2]))
  return theta, ref


def _loss_gradient(estimator, theta, ref):
  """The expected gradient of a KL loss term over the exact distribution: tokens are drawn
  from pi (a stop-gradient weight), the term differentiates through log pi only."""
  def expected(t):
    logp = jax.nn.log_softmax(t)
    weights = jax.lax.stop_gradient(jnp.exp(logp))
    return jnp.sum(weights * algorithms.kl_estimate(logp, ref, estimator))
  return jax.grad(expected)(theta)


def test_kl_estimator_gradients_follow_the_kl_their_docs_name():
  theta, ref = _softmax_case()
  forward = jax.grad(lambda t: jnp.sum(jnp.exp(jax.nn.log_softmax(t))
                                       * (jax.nn.log_softmax(t) - ref)))(theta)  # KL(pi || ref)
  reverse = jax.grad(lambda t: jnp.sum(jnp.exp(ref) * (ref - jax.nn.log_softmax(t))))(theta)
  np.testing.assert_allclose(_loss_gradient("k2", theta, ref), forward, atol=1e-6)
  np.testing.assert_allclose(_loss_gradient("k3+", theta, ref), forward, atol=1e-6)
  np.testing.assert_allclose(_loss_gradient("k3", theta, ref), reverse, atol=1e-6)
  np.testing.assert_allclose(_loss_gradient("k1", theta, ref), 0.0, atol=1e-6)
  assert not np.allclose(forward, reverse, atol=1e-3)  # the case tells them apart
  # k3+ reports k3's value
  logp = jax.nn.log_softmax(theta)
  np.testing.assert_allclose(algorithms.kl_estimate(logp, ref, "k3+"),
                             algorithms.kl_estimate(logp, ref, "k3"), rtol=1e-6)


def test_k1_in_the_loss_is_refused_and_allowed_in_the_reward():
  with pytest.raises(ConfigError, match="k1 in the loss"):
    AlgorithmConfig(kl_coef=0.1, kl_estimator="k1")
  AlgorithmConfig(kl_coef=0.1, kl_estimator="k1", kl_in_reward=True)
  AlgorithmConfig(kl_coef=0.1, kl_estimator="k3+")


PAPER_VALUES = {  # name: (eps_low, eps_high, aggregation, advantage, loss)
    "ppo": (0.2, 0.2, "token-mean", "gae", "ppo_clip"),
    "grpo": (0.2, 0.2, "seq-mean-token-mean", "grpo", "ppo_clip"),
    "dapo": (0.2, 0.28, "token-mean", "grpo", "ppo_clip"),
    "dr_grpo": (0.2, 0.2, "seq-mean-token-sum-norm", "dr_grpo", "ppo_clip"),
    "gspo": (3e-4, 4e-4, "seq-mean-token-mean", "grpo", "gspo"),
    "cispo": (1.0, 5.0, "token-mean", "grpo", "cispo"),
    "gmpo": (0.4, 0.4, "seq-mean-token-mean", "grpo", "gmpo"),
    "sapo": (0.2, 0.2, "token-mean", "grpo", "sapo"),
}


@pytest.mark.parametrize("name", sorted(PAPER_VALUES))
def test_each_preset_runs_its_paper_s_values_and_cites_them(name):
  algo = AlgorithmConfig(name=name)
  assert (algo.eps_low, algo.eps_high, algo.aggregation, algo.advantage_estimator,
          algo.loss) == PAPER_VALUES[name]
  assert "arXiv" in algo.preset.source
  # DAPO's name brings its dynamic sampling; overlong filtering was not its final recipe
  assert algo.dynamic == (name == "dapo") and not algo.filters_overlong
  assert not dataclasses.replace(algo, dynamic_sampling=False).dynamic
  # a value the user sets wins over the preset's
  mine = dataclasses.replace(algo, clip_eps_high=0.5, loss_agg="token-mean")
  assert mine.eps_high == 0.5 and mine.aggregation == "token-mean"
  assert AlgorithmConfig().dual_clip == 3.0  # on by default: ratios past 3 occur in long runs


def test_cispo_has_no_lower_bound_on_its_weight():
  algo = AlgorithmConfig(name="cispo")
  logprobs, old = jnp.array([-5.0, 0.0]), jnp.zeros(2)
  grad = jax.grad(lambda lp: algorithms.cispo(lp, old, jnp.ones(2), algo.eps_low,
                                              algo.eps_high)[0].sum())(logprobs)
  np.testing.assert_allclose(grad, [-np.exp(-5.0), -1.0], rtol=1e-5)  # the weight is r itself
