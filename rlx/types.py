"""Pytrees shared across rlx: the rollout batch the learner trains on, and the train state.

Shapes: B sequences, T token positions (prompt, left-padded, then response,
right-padded). Per-token arrays are aligned with the *target* token: entry
``[b, t]`` belongs to ``tokens[b, t]``, predicted from positions ``< t``; position
0 is never a target.
"""

from __future__ import annotations

import jax
from flax import struct


@struct.dataclass
class RolloutBatch:
  """What the learner needs of a batch of sampled sequences."""

  tokens: jax.Array
  """int32 [B, T] prompt + response ids."""
  attention_mask: jax.Array
  """bool [B, T] True on real (non-padding) tokens."""
  response_mask: jax.Array
  """bool [B, T] True on response tokens that enter the loss."""
  advantages: jax.Array
  """float32 [B, T] per-token advantages (0 outside the response)."""
  old_logprobs: jax.Array | None
  """float32 [B, T] log-probs of the old (proximal) policy, recomputed by the learner; None when
  the batch gets exactly one update: the params being updated are then the old policy, and the
  loss takes its own log-probs (without gradient) instead of a second forward pass."""
  behaviour_logprobs: jax.Array
  """float32 [B, T] log-probs of the policy that sampled the tokens (from the rollout engine)."""
  policy_version: jax.Array
  """int32 [B] version of the params that generated each sequence."""
  ref_logprobs: jax.Array | None = None
  """float32 [B, T] log-probs of the reference policy; None when no KL term is used."""
  returns: jax.Array | None = None
  """float32 [B, T] value targets (PPO critic)."""
  old_values: jax.Array | None = None
  """float32 [B, T] critic values at sampling time (PPO value clipping)."""
  temperature: jax.Array | None = None
  """float32 [B] the temperature each sequence was sampled at: the learner's log-probs divide
  the logits by it, to match the behaviour log-probs. A traced value, so that a controller
  moving the temperature never recompiles; None takes the config's rollout.temperature."""

  @property
  def batch_size(self) -> int:
    return self.tokens.shape[0]


@struct.dataclass
class TrainState:
  """Everything an update changes: one pytree, created sharded, donated to each step."""

  step: jax.Array
  """int32 scalar: updates applied so far."""
  params: dict
  """The model parameters."""
  opt_state: object
  """The optax optimizer state."""
  key: jax.Array
  """PRNG key of the run; per-step keys are fold_in(key, step)."""
  policy_version: jax.Array
  """int32 scalar: version of ``params``; rollouts record it, the learner measures lag against it."""
