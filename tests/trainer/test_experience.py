"""Completions + rewards -> the learner's batch: layout, advantages per algorithm, DAPO shaping."""

import dataclasses

import numpy as np
import pytest

from rlx import algorithms
from rlx.config import RunConfig
from rlx.rollout import Completion
from rlx.trainer import build_batch, layout


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
  batch, stats = build_batch(completions, rewards, _config(name), pad_id=0)
  expected = {"grpo": algorithms.group_relative, "dapo": algorithms.group_relative,
              "dr_grpo": lambda r, g: algorithms.group_relative(r, g, scale_by_std=False),
              "rloo": algorithms.rloo}[name](rewards, 2)
  mask = np.asarray(batch.response_mask)
  for b in range(4):
    np.testing.assert_allclose(np.asarray(batch.advantages)[b][mask[b]], expected[b], rtol=1e-6)
    assert np.all(np.asarray(batch.advantages)[b][~mask[b]] == 0)
  assert stats["reward/kept_mean"] == 0.25 and stats["response/length_mean"] == 2.5
  np.testing.assert_array_equal(batch.policy_version, [3, 3, 3, 3])


def test_reinforce_plus_plus_puts_the_reward_on_the_last_token():
  completions = [_completion([1], [3, 3]), _completion([1], [3, 3, 3])]
  batch, _ = build_batch(completions, np.array([1.0, 0.0]), _config("reinforce_pp"), pad_id=0)
  advantage = np.asarray(batch.advantages)
  # Returns-to-go: row 0 all 1, row 1 all 0; whitened over the five response tokens.
  returns = np.array([1, 1, 0, 0, 0], np.float64)
  expected = (returns - returns.mean()) / np.sqrt(returns.var(ddof=1) + 1e-8)
  np.testing.assert_allclose(advantage[np.asarray(batch.response_mask)], expected, rtol=1e-5)


def test_dapo_overlong_shaping_and_filter():
  config = _config("dapo", overlong_buffer=4, overlong_filter=True)
  completions = [_completion([1], [2] * 3), _completion([1], [2] * 6),
                 _completion([1], [2] * 8, finish="length"), _completion([1], [2] * 2)]
  batch, stats = build_batch(completions, np.ones(4), config, pad_id=0)
  # L_max = 8, L_cache = 4: 3 -> 0, 6 -> -0.5, cut at 8 -> -1; the last group is then (1, 1).
  assert stats["reward/shaped_mean"] == pytest.approx((1 + 0.5 + 0 + 1) / 4)
  assert not np.asarray(batch.response_mask)[2].any()  # truncated: filtered out of the loss
  assert stats["response/truncated_frac"] == 0.25


def test_ppo_leaves_advantages_to_the_critic_and_sizes_must_match():
  batch, _ = build_batch([_completion([1], [2])], np.ones(1), _config("ppo", group=1), pad_id=0)
  assert not np.asarray(batch.advantages).any()
  with pytest.raises(ValueError, match="1 completions but 2 rewards"):
    build_batch([_completion([1], [2])], np.ones(2), _config(), pad_id=0)
