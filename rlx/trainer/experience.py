"""From sampled completions and their rewards to the arrays the learner trains on.

    batch, stats = build_batch(completions, rewards, config, pad_id=tokenizer.pad_id)

Layout of row b (T = longest prompt + longest response of the batch)::

    [pad .. pad | prompt tokens | response tokens | pad .. pad]
                  (left-padded)                     (right-padded)

Per-token arrays are aligned with the target token (see ``rlx.types``): the
response mask is True on response tokens, the behaviour log-probs sit on them.

Advantages follow the algorithm: GRPO / DAPO / GSPO / CISPO use the
group-relative advantage, Dr.GRPO the same without the std, RLOO the
leave-one-out baseline, REINFORCE++ whitened returns-to-go. (PPO's GAE needs
the critic's values: the trainer computes it on device.) DAPO's soft overlong
punishment is added to the rewards when ``overlong_buffer > 0``, and overlong
filtering masks truncated responses out of the loss.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from rlx import algorithms
from rlx.config import RunConfig
from rlx.rollout import Completion
from rlx.types import RolloutBatch

def _bucket(length: int, smallest: int = 8) -> int:
  size = smallest
  while size < length:
    size *= 2
  return size


def layout(completions: Sequence[Completion], pad_id: int,
           bucket: bool = True) -> dict[str, np.ndarray]:
  """Token ids, attention and response masks, and behaviour log-probs [B, T] (NumPy).

  With ``bucket``, the prompt and response parts are padded to powers of two, so
  that the jitted learner step sees few distinct shapes (it compiles once per shape).
  """
  prompt_len = max(len(c.prompt_tokens) for c in completions)
  response_len = max(len(c.response_tokens) for c in completions)
  if bucket:
    prompt_len, response_len = _bucket(prompt_len), _bucket(response_len)
  B, T = len(completions), prompt_len + response_len
  tokens = np.full((B, T), pad_id, np.int32)
  attention = np.zeros((B, T), bool)
  response = np.zeros((B, T), bool)
  behaviour = np.zeros((B, T), np.float32)
  for b, c in enumerate(completions):
    start = prompt_len - len(c.prompt_tokens)
    end = prompt_len + len(c.response_tokens)
    tokens[b, start:prompt_len] = c.prompt_tokens
    tokens[b, prompt_len:end] = c.response_tokens
    attention[b, start:end] = True
    response[b, prompt_len:end] = True
    behaviour[b, prompt_len:end] = c.logprobs
  return {"tokens": tokens, "attention_mask": attention, "response_mask": response,
          "behaviour_logprobs": behaviour}


def shaped_rewards(completions: Sequence[Completion], rewards: np.ndarray,
                   config: RunConfig) -> np.ndarray:
  """Task rewards plus DAPO's soft overlong punishment (when ``overlong_buffer > 0``)."""
  rewards = np.asarray(rewards, np.float32)
  buffer = config.algorithm.overlong_buffer
  if buffer <= 0:
    return rewards
  lengths = np.array([len(c.response_tokens) for c in completions])
  # A response cut at the limit did not finish: count it as one token over.
  lengths = lengths + np.array([c.finish_reason == "length" for c in completions])
  penalty = algorithms.overlong_penalty(jnp.asarray(lengths), config.rollout.max_new_tokens, buffer)
  return rewards + np.asarray(penalty)


def advantages(config: RunConfig, rewards: np.ndarray, response_mask: np.ndarray) -> np.ndarray:
  """Per-token advantages [B, T] from the configured estimator (all but GAE, which needs the
  critic and is computed by the learner)."""
  estimator = config.algorithm.advantage_estimator
  if estimator not in algorithms.ADVANTAGES:
    raise ValueError(f"{estimator}: advantages come from the critic (GAE), computed by the trainer")
  return np.asarray(algorithms.ADVANTAGES[estimator](
      jnp.asarray(rewards, jnp.float32), jnp.asarray(response_mask), config.algorithm,
      config.rollout.group_size))


def build_batch(completions: Sequence[Completion], rewards: np.ndarray, config: RunConfig, *,
                pad_id: int, bucket: bool = True) -> tuple[RolloutBatch, dict[str, float]]:
  """The learner's batch (old log-probs still to be recomputed: they start as the behaviour
  log-probs) and statistics of the rewards and responses."""
  if len(completions) != len(rewards):
    raise ValueError(f"{len(completions)} completions but {len(rewards)} rewards")
  arrays = layout(completions, pad_id, bucket)
  shaped = shaped_rewards(completions, rewards, config)
  response_mask = arrays["response_mask"]
  truncated = np.array([c.finish_reason == "length" for c in completions])
  if config.algorithm.overlong_filter:
    response_mask = np.asarray(algorithms.overlong_filter(jnp.asarray(response_mask),
                                                          jnp.asarray(truncated)))
  advantage = (np.zeros(response_mask.shape, np.float32) if config.algorithm.uses_critic
               else advantages(config, shaped, response_mask))
  lengths = np.array([len(c.response_tokens) for c in completions])
  batch = RolloutBatch(
      tokens=arrays["tokens"], attention_mask=arrays["attention_mask"],
      response_mask=response_mask, advantages=advantage.astype(np.float32),
      old_logprobs=arrays["behaviour_logprobs"], behaviour_logprobs=arrays["behaviour_logprobs"],
      policy_version=np.array([c.policy_version for c in completions], np.int32))
  stats = {
      "reward/kept_mean": float(np.mean(rewards)),
      "reward/shaped_mean": float(np.mean(shaped)),
      "response/length_mean": float(lengths.mean()),
      "response/length_max": int(lengths.max()),
      "response/truncated_frac": float(truncated.mean()),
  }
  return batch, stats
