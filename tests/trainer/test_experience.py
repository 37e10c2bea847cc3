"""Completions + rewards -> the learner's complete batch: layout, DAPO shaping, advantages per
estimator, and the jitted preparation (old / reference log-probs, values, GAE) with no placeholder."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx import algorithms, update
from rlx.config import ArchConfig, RunConfig
from rlx.models import init_model
from rlx.rollout import Completion
from rlx.trainer import layout, make_prepare, sample_arrays, sequence_advantages


def _completion(prompt, response, finish="stop", version=3, prompt_index=0, sample_index=0):
  return Completion(prompt_tokens=list(prompt), response_tokens=list(response),
                    logprobs=[-0.5] * len(response), policy_logprobs=[-0.4] * len(response),
                    finish_reason=finish, policy_version=version, prompt_index=prompt_index,
                    sample_index=sample_index)


def _config(name="grpo", group=2, **algorithm):
  config = RunConfig()
  return dataclasses.replace(
      config, rollout=dataclasses.replace(config.rollout, group_size=group, max_new_tokens=8),
      algorithm=dataclasses.replace(config.algorithm, name=name, **algorithm))


def test_layout_left_pads_prompts_and_right_pads_responses():
  arrays = layout([_completion([5, 6], [7, 8, 9]), _completion([1, 2, 3], [4])], pad_id=0,
                  bucket=False)
  np.testing.assert_array_equal(arrays["tokens"], [[0, 5, 6, 7, 8, 9], [1, 2, 3, 4, 0, 0]])
  np.testing.assert_array_equal(arrays["attention_mask"], [[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
  np.testing.assert_array_equal(arrays["response_mask"], [[0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 0, 0]])
  np.testing.assert_array_equal(arrays["behaviour_logprobs"][1], [0, 0, 0, -0.5, 0, 0])
  bucketed = layout([_completion([5] * 9, [7, 8, 9])], pad_id=0)
  assert bucketed["tokens"].shape == (1, 16 + 8)  # prompt and response parts in powers of two


@pytest.mark.parametrize("name", ["grpo", "dapo", "dr_grpo", "rloo"])
def test_sequence_advantages_follow_the_algorithm(name):
  completions = [_completion([1, 2], [3] * n) for n in (1, 2, 3, 4)]
  rewards = np.array([1.0, 0.0, 0.0, 0.0])
  config = _config(name)
  sampled, stats = sample_arrays(completions, rewards, config, pad_id=0)
  advantages = np.asarray(sequence_advantages(config, sampled.rewards, sampled.response_mask))
  expected = {"grpo": algorithms.group_relative, "dapo": algorithms.group_relative,
              "dr_grpo": lambda r, g: algorithms.group_relative(r, g, scale_by_std=False),
              "rloo": algorithms.rloo}[name](rewards, 2)
  mask = sampled.response_mask
  for b in range(4):
    np.testing.assert_allclose(advantages[b][mask[b]], expected[b], rtol=1e-6)
    assert np.all(advantages[b][~mask[b]] == 0)
  assert stats["reward/kept_mean"] == 0.25 and stats["response/length_mean"] == 2.5
  np.testing.assert_array_equal(sampled.policy_version, [3, 3, 3, 3])


def test_reinforce_plus_plus_puts_the_reward_on_the_last_token():
  completions = [_completion([1], [3, 3]), _completion([1], [3, 3, 3])]
  config = _config("reinforce_pp")
  sampled, _ = sample_arrays(completions, np.array([1.0, 0.0]), config, pad_id=0)
  advantage = np.asarray(sequence_advantages(config, sampled.rewards, sampled.response_mask))
  # Returns-to-go: row 0 all 1, row 1 all 0; whitened over the five response tokens.
  returns = np.array([1, 1, 0, 0, 0], np.float64)
  expected = (returns - returns.mean()) / np.sqrt(returns.var(ddof=1) + 1e-8)
  np.testing.assert_allclose(advantage[sampled.response_mask], expected, rtol=1e-5)


def test_dapo_overlong_shaping_and_filter():
  config = _config("dapo", overlong_buffer=4, overlong_filter=True)
  completions = [_completion([1], [2] * 3), _completion([1], [2] * 6),
                 _completion([1], [2] * 8, finish="length"), _completion([1], [2] * 2)]
  sampled, stats = sample_arrays(completions, np.ones(4), config, pad_id=0)
  # L_max = 8, L_cache = 4: 3 -> 0, 6 -> -0.5, cut at 8 -> -1; the last group is then (1, 1).
  assert stats["reward/shaped_mean"] == pytest.approx((1 + 0.5 + 0 + 1) / 4)
  np.testing.assert_allclose(sampled.rewards, [1, 0.5, 0, 1])
  assert not sampled.response_mask[2].any()  # truncated: filtered out of the loss
  assert stats["response/truncated_frac"] == 0.25


def test_sizes_must_match():
  with pytest.raises(ValueError, match="1 completions but 2 rewards"):
    sample_arrays([_completion([1], [2])], np.ones(2), _config(), pad_id=0)


ARCH = ArchConfig(num_layers=1, vocab_size=32, hidden_size=32, intermediate_size=48, num_heads=2,
                  num_kv_heads=1, head_dim=16)


def _random_completions(rng, n, version=0):
  return [_completion(rng.integers(1, 32, rng.integers(2, 6)), rng.integers(1, 32, rng.integers(1, 8)),
                      finish="length" if rng.random() < 0.2 else "stop", version=version)
          for _ in range(n)]


@pytest.mark.parametrize("name,chunks", [("grpo", (1, 1)), ("grpo", (2, 1)), ("ppo", (2, 2))])
def test_prepare_gives_a_complete_batch_equal_to_its_parts(name, chunks):
  """Old and reference log-probs are the params' own (computed in chunks of the update's
  micro-batch size, equal to one pass), values the critic's, advantages the estimator's; GAE's
  returns are advantages-before-whitening + values. With one update per batch and no critic
  there are no old log-probs (the update takes its own)."""
  mini, micro = chunks
  config = _config(name, group=2, kl_coef=0.1, kl_in_reward=name == "ppo")
  config = dataclasses.replace(
      config, trainer=dataclasses.replace(config.trainer, mini_batches=mini),
      optimizer=dataclasses.replace(config.optimizer, micro_batches=micro),
      model=dataclasses.replace(config.model, arch=ARCH))
  rng = np.random.default_rng(0)
  model = init_model(ARCH, jax.random.key(0))
  ref = init_model(ARCH, jax.random.key(1)).params
  critic = update.init_critic_params(model.params, jax.random.key(2)) if name == "ppo" else None
  if critic is not None:  # a head that gives values that are not all zero
    critic["value_head"]["kernel"] = jnp.asarray(rng.normal(size=ARCH.hidden_size), jnp.float32)
  sampled, _ = sample_arrays(_random_completions(rng, 8), rng.random(8).round(), config, pad_id=0)
  batch = make_prepare(config, model.transformer)(model.params, ref, critic, sampled, 0.1)

  logprobs = update.make_logprobs_fn(config, model.transformer)
  args = (sampled.tokens, sampled.attention_mask, sampled.response_mask)
  chex.assert_trees_all_close(batch.ref_logprobs, logprobs(ref, *args), atol=1e-5)
  if mini == 1 and name == "grpo":
    assert batch.old_logprobs is None
  else:
    chex.assert_trees_all_close(batch.old_logprobs, logprobs(model.params, *args), atol=1e-5)
    assert not np.allclose(batch.old_logprobs, sampled.behaviour_logprobs)  # no placeholder left
  mask = sampled.response_mask
  if name == "grpo":
    assert batch.returns is None and batch.old_values is None
    chex.assert_trees_all_close(batch.advantages, sequence_advantages(config, sampled.rewards, mask))
    return
  values = update.critic_values(model.transformer, critic, sampled.tokens, sampled.attention_mask)
  chex.assert_trees_all_close(batch.old_values, values, atol=1e-5)
  assert np.abs(np.asarray(values)[mask]).min() > 0
  last = (np.cumsum(mask, 1) == mask.sum(1, keepdims=True)) & mask
  rewards = np.where(last, sampled.rewards[:, None], 0.0)
  rewards = rewards - 0.1 * np.where(mask, algorithms.kl_estimate(
      batch.old_logprobs, batch.ref_logprobs, "k3"), 0.0)
  # GAE step by step (gamma 1, lambda 0.95 by default), NumPy
  raw = np.zeros(mask.shape)
  for b in range(mask.shape[0]):
    positions = np.flatnonzero(mask[b])
    following_value, following_advantage = 0.0, 0.0
    for t in positions[::-1]:
      delta = rewards[b, t] + following_value - float(values[b, t])
      raw[b, t] = delta + 0.95 * following_advantage
      following_value, following_advantage = float(values[b, t]), raw[b, t]
  np.testing.assert_allclose(np.asarray(batch.returns)[mask], (raw + np.asarray(values))[mask],
                             rtol=1e-4, atol=1e-4)
  whitened = (raw[mask] - raw[mask].mean()) / np.sqrt(raw[mask].var(ddof=1) + 1e-8)
  np.testing.assert_allclose(np.asarray(batch.advantages)[mask], whitened, rtol=1e-3, atol=1e-4)
  assert not np.asarray(batch.advantages)[~mask].any()


def test_the_learner_compiles_once_per_bucket(tmp_path, caplog):
  """The learner's real path (layout, prepare, critic step, update step; PPO has them all):
  responses and prompts of any length within a bucket reuse the bucket's compilation, and so
  do data sampled at another temperature and another upper clip range (an entropy
  controller's moves)."""
  from rlx.trainer import Draw, Learner, prepare
  from tests.trainer import tiny

  config = tiny.config("ppo_colocated", "--config.trainer.warmup_sft_steps=0",
                       "--config.trainer.mini_batches=2")
  run = prepare(config, tmp_path, say=lambda line: None)
  try:
    learner = Learner.for_run(run, say=lambda line: None)
    rng = np.random.default_rng(0)

    def draw(prompt_len, temperature=None):
      completions = [_completion(rng.integers(1, 32, prompt_len), rng.integers(1, 32, rng.integers(1, 9)),
                                 version=learner.version) for _ in range(4)]
      return Draw(completions=completions, rewards=np.array([1.0, 0.0, 0.0, 1.0], np.float32),
                  correct=np.array([True, False, False, True]), counts={}, generate_seconds=0.0,
                  data_state={}, temperature=temperature)

    programs = ["prepare", "update_step", "critic_step"]

    def compiled():
      lines = [r.getMessage() for r in caplog.records]
      return [sum(f"compilation of jit({name})" in line for line in lines) for name in programs]

    with jax.log_compiles(), caplog.at_level("WARNING"):
      for prompt_len, temperature, clip in ((3, None, 0.2), (5, 1.3, 0.28), (8, 0.7, 0.35)):
        # prompts bucketed to 8 tokens, responses to 8; the clip range a traced input
        metrics = learner.learn(draw(prompt_len, temperature), clip_eps_high=clip)
      assert compiled() == [1] * len(programs)
      for prompt_len in (12, 16, 2, 9):  # a 16-token prompt bucket, then both again
        metrics = learner.learn(draw(prompt_len))
      assert compiled() == [2] * len(programs)
    assert learner.version == 7 and int(learner.state.step) == 14  # 2 updates per batch
    assert np.isfinite(metrics["loss"])
  finally:
    run.close()
