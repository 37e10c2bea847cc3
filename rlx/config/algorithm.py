"""The RL objective and its optimizer, and the algorithm presets."""

from __future__ import annotations

import dataclasses
from typing import Literal

from rlx.config._checks import _check, _positive


@dataclasses.dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
  """The RL objective: advantages, policy loss, KL, aggregation."""

  name: Literal["ppo", "grpo", "dapo", "dr_grpo", "gspo", "cispo", "rloo", "reinforce_pp"] = "grpo"
  """Preset: fills `advantage` and `policy_loss` where they are 'auto' (see PRESETS); the DAPO pieces (clip-higher, dynamic sampling, overlong shaping) are their own fields."""
  advantage: Literal["auto", "gae", "grpo", "dr_grpo", "rloo", "reinforce_pp"] = "auto"
  """Advantage estimator: GAE over a learned critic (PPO), group-normalised (GRPO), group mean only (Dr.GRPO), leave-one-out (RLOO), batch-normalised returns (REINFORCE++); 'auto' takes the preset's."""
  policy_loss: Literal["auto", "ppo_clip", "gspo", "cispo"] = "auto"
  """Policy loss: token-level clipped ratio (PPO/GRPO/DAPO), sequence-level clipped ratio (GSPO), clipped-IS-weight REINFORCE (CISPO); 'auto' takes the preset's."""
  clip_eps_low: float = 0.2
  """Lower clip range of the importance ratio (1 - eps_low); GSPO's sequence-level ratio wants ~3e-4."""
  clip_eps_high: float = 0.2
  """Upper clip range of the importance ratio (1 + eps_high); DAPO's clip-higher uses 0.28, GSPO ~4e-4."""
  dual_clip: float | None = None
  """Dual-clip constant c (> 1) for negative advantages; None disables it."""
  kl_coef: float = 0.0
  """Coefficient beta of the KL penalty to the reference policy; 0 drops the reference model."""
  kl_estimator: Literal["k1", "k2", "k3"] = "k3"
  """KL estimator (Schulman's k1, k2, k3)."""
  kl_in_reward: bool = False
  """Apply the KL as a per-token reward penalty instead of a loss term."""
  kl_target: float | None = None
  """Adaptive KL coefficient (Ziegler et al. 2019): the KL it steers towards; None keeps kl_coef fixed."""
  kl_horizon: int = 10000
  """Adaptive KL coefficient: horizon of the proportional controller, in steps."""
  entropy_coef: float = 0.0
  """Coefficient of the entropy bonus."""
  loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
  """How per-token losses are reduced to one number."""
  value_clip: float | None = 0.2
  """PPO critic: clip range of the value update around the old values; None disables it."""
  gamma: float = 1.0
  """Discount of GAE (PPO)."""
  lam: float = 0.95
  """Lambda of GAE (PPO)."""
  dynamic_sampling: bool = False
  """DAPO: drop groups whose rewards are all equal and refill the batch."""
  dynamic_sampling_max_draws: int = 16
  """DAPO: most prompt batches drawn to fill one training batch before the run stops with an error."""
  overlong_filter: bool = False
  """DAPO: mask truncated responses out of the loss."""
  overlong_buffer: int = 0
  """DAPO soft overlong punishment: length of the penalty interval L_cache in tokens; 0 disables it."""
  off_policy: Literal["none", "tis", "decoupled"] = "tis"
  """Correction of stale data: truncated importance sampling, or AReaL's decoupled objective."""
  tis_cap: float = 2.0
  """Truncation of the behaviour importance weight (tis); policy/is_clip_frac counts the tokens whose weight exceeds it."""
  max_is_clip_frac: float | None = None
  """Split mode: when the mean policy/is_clip_frac over mesh.control_window batches exceeds this, the controller lowers the effective staleness k (rlx.trainer.control); None disables it."""
  entropy_floor: float | None = None
  """When the mean policy/entropy over mesh.control_window steps falls below this, the controller raises entropy_control's knob one step, and lowers it again once entropy is back above 1.25 x the floor; None disables it."""
  entropy_control: Literal["temperature", "clip_eps_high"] = "temperature"
  """The knob the entropy floor moves: the sampling temperature (up to rollout.temperature_max) or the upper clip range (up to clip_eps_high_max)."""
  clip_eps_high_max: float = 0.4
  """Highest upper clip range the entropy-floor controller may raise clip_eps_high to."""

  @property
  def advantage_estimator(self) -> str:
    """The advantage estimator this config runs (``advantage``, or the preset's)."""
    return PRESETS[self.name][0] if self.advantage == "auto" else self.advantage

  @property
  def loss(self) -> str:
    """The policy loss this config runs (``policy_loss``, or the preset's)."""
    return PRESETS[self.name][1] if self.policy_loss == "auto" else self.policy_loss

  @property
  def uses_critic(self) -> bool:
    """GAE needs a learned value function."""
    return self.advantage_estimator == "gae"

  @property
  def uses_reference(self) -> bool:
    """A KL term (in the loss or the reward) needs the reference policy's log-probs."""
    return self.kl_coef > 0 or self.kl_in_reward

  def __post_init__(self):
    _check(self.clip_eps_low >= 0 and self.clip_eps_high >= 0, "algorithm.clip_eps_low",
           "clip ranges must be >= 0")
    _check(self.dual_clip is None or self.dual_clip > 1, "algorithm.dual_clip", "must be > 1")
    _check(0 <= self.gamma <= 1 and 0 <= self.lam <= 1, "algorithm.gamma",
           "gamma and lam must be in [0, 1]")
    _check(self.dynamic_sampling_max_draws >= 1, "algorithm.dynamic_sampling_max_draws",
           "must be >= 1")
    for name in ("kl_coef", "entropy_coef", "overlong_buffer"):
      _check(getattr(self, name) >= 0, f"algorithm.{name}", "must be >= 0")
    _check(self.kl_target is None or self.kl_target > 0, "algorithm.kl_target",
           "must be > 0 (or None for a fixed kl_coef)")
    _check(self.value_clip is None or self.value_clip > 0, "algorithm.value_clip",
           "must be > 0 (or None to disable it)")
    _positive(self, "algorithm", "kl_horizon", "tis_cap")
    _check(self.max_is_clip_frac is None or 0 <= self.max_is_clip_frac < 1,
           "algorithm.max_is_clip_frac", "must be in [0, 1) (or None to disable it)")
    _check(self.entropy_floor is None or self.entropy_floor > 0, "algorithm.entropy_floor",
           "must be > 0 (or None to disable it)")
    _check(self.clip_eps_high_max >= self.clip_eps_high, "algorithm.clip_eps_high_max",
           f"must be >= algorithm.clip_eps_high={self.clip_eps_high}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
  """The optax optimizer (AdamW) and its schedule."""

  learning_rate: float = 1e-6
  """Peak learning rate."""
  warmup_steps: int = 0
  """Linear warm-up steps from 0 to the peak."""
  schedule: Literal["constant", "cosine"] = "constant"
  """Schedule after warm-up."""
  weight_decay: float = 0.0
  """AdamW decoupled weight decay."""
  b1: float = 0.9
  """Adam beta1."""
  b2: float = 0.999
  """Adam beta2."""
  eps: float = 1e-8
  """Adam epsilon."""
  max_grad_norm: float = 1.0
  """Clip gradients to this global norm; 0 disables clipping."""
  micro_batches: int = 1
  """Gradient accumulation: micro-batches per update."""
  critic_learning_rate: float = 1e-5
  """Peak learning rate of the critic (PPO)."""

  def __post_init__(self):
    _positive(self, "optimizer", "learning_rate", "micro_batches", "eps", "critic_learning_rate")
    for name in ("warmup_steps", "weight_decay", "max_grad_norm"):
      _check(getattr(self, name) >= 0, f"optimizer.{name}", "must be >= 0")
    for name in ("b1", "b2"):
      _check(0 <= getattr(self, name) < 1, f"optimizer.{name}", "must be in [0, 1)")


PRESETS = {
    "ppo": ("gae", "ppo_clip"), "grpo": ("grpo", "ppo_clip"), "dapo": ("grpo", "ppo_clip"),
    "dr_grpo": ("dr_grpo", "ppo_clip"), "gspo": ("grpo", "gspo"), "cispo": ("grpo", "cispo"),
    "rloo": ("rloo", "ppo_clip"), "reinforce_pp": ("reinforce_pp", "ppo_clip"),
}
"""algorithm.name -> (advantage estimator, policy loss)."""

GROUP_RELATIVE = ("grpo", "dr_grpo", "rloo")
"""Advantage estimators that compare the samples of one prompt's group."""
