"""The RL objective and its optimizer, and the algorithm presets."""

from __future__ import annotations

import dataclasses
from typing import Literal

from rlx.config._checks import _check, _positive


@dataclasses.dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
  """The RL objective: advantages, policy loss, KL, aggregation."""

  name: Literal["ppo", "grpo", "dapo", "dr_grpo", "gspo", "cispo", "gmpo", "sapo", "rloo",
                 "reinforce_pp", "reinforce_pp_baseline"] = "grpo"
  """Preset: fills `advantage`, `policy_loss`, `clip_eps_low`, `clip_eps_high`, `loss_agg`, `dynamic_sampling` and `overlong_filter` where they are left to it, with its paper's values (see PRESETS); DAPO's soft overlong punishment needs its size (`overlong_buffer`)."""
  advantage: Literal["auto", "gae", "grpo", "dr_grpo", "grpo_batch_std", "rloo", "reinforce_pp",
                     "reinforce_pp_baseline", "passk"] = "auto"
  """Advantage estimator: GAE over a learned critic (PPO), group-normalised (GRPO), group mean only (Dr.GRPO), group mean with the batch's std (Lite PPO), leave-one-out (RLOO), batch-whitened returns (REINFORCE++), group mean then batch-whitened (REINFORCE++-baseline), best-beats-runner-up (the pass@k objective); 'auto' takes the preset's."""
  policy_loss: Literal["auto", "ppo_clip", "gspo", "cispo", "gmpo", "sapo", "clip_cov",
                       "kl_cov"] = "auto"
  """Policy loss: token-level clipped ratio (PPO/GRPO/DAPO), sequence-level clipped ratio (GSPO), clipped-IS-weight REINFORCE (CISPO), clipped geometric-mean ratio (GMPO), soft sigmoid gate (SAPO), PPO-clip with the high-covariance tokens detached (Clip-Cov) or held by a KL term (KL-Cov); 'auto' takes the preset's."""
  clip_eps_low: float | None = None
  """Lower clip range of the importance ratio (1 - eps_low; GMPO: log space); None takes the preset's (0.2; GSPO 3e-4; CISPO 1, i.e. no lower bound)."""
  clip_eps_high: float | None = None
  """Upper clip range of the importance ratio (1 + eps_high; GMPO: log space); None takes the preset's (0.2; DAPO 0.28; GSPO 4e-4; CISPO 5)."""
  dual_clip: float | None = 3.0
  """Dual-clip constant c (> 1): the loss of a token with a negative advantage is capped at -c A, however large its ratio (ppo_clip, clip_cov); None disables it."""
  kl_coef: float = 0.0
  """Coefficient beta of the KL penalty to the reference policy; 0 drops the reference model."""
  kl_estimator: Literal["k1", "k2", "k3", "k3+"] = "k3"
  """KL estimator (Schulman's k1, k2, k3; k3+ is k3's value with k2's gradient). In the loss, k2 and k3+ follow the gradient of KL(policy || ref), k3 that of KL(ref || policy); k1 is refused there (its expected gradient is 0) and allowed with kl_in_reward."""
  kl_in_reward: bool = False
  """Apply the KL as a per-token reward penalty instead of a loss term."""
  kl_target: float | None = None
  """Adaptive KL coefficient (Ziegler et al. 2019): the KL it steers towards; None keeps kl_coef fixed."""
  kl_horizon: int = 10000
  """Adaptive KL coefficient: horizon of the proportional controller, in steps."""
  entropy_coef: float = 0.0
  """Coefficient of the entropy bonus (with entropy_target: its starting value)."""
  entropy_target: float | None = None
  """Adaptive entropy coefficient (Skywork-OR1, arXiv 2505.22312): after each batch, the coefficient goes up by entropy_coef_step while policy/entropy is below this target and down (to 0 at least) while above; the bonus applies only while below. None keeps entropy_coef fixed."""
  entropy_coef_step: float = 0.005
  """Adaptive entropy coefficient: its change per batch."""
  top_entropy_quantile: float = 1.0
  """Train on the highest-entropy tokens only: the fraction of each micro-batch's response tokens, by entropy, whose policy loss is kept (Wang et al. 2025, arXiv 2506.01939: 0.2; TRL's top_entropy_quantile); 1 keeps every token."""
  cov_ratio: float = 0.0002
  """Clip-Cov / KL-Cov: the fraction of each micro-batch's response tokens detached (Clip-Cov) or held by the KL term (KL-Cov), among those of highest log-prob/advantage covariance, centred over the micro-batch as verl does (verl's 2e-4; a small batch needs more)."""
  cov_bounds: tuple[float, float] = (1.0, 5.0)
  """Clip-Cov: the covariance range of the tokens it may detach (verl's)."""
  kl_cov_coef: float = 1.0
  """KL-Cov: the coefficient of |log r| on its selected tokens (the paper's 1)."""
  sapo_tau_pos: float = 1.0
  """SAPO: gate temperature of tokens with a positive advantage (the paper's 1.0)."""
  sapo_tau_neg: float = 1.05
  """SAPO: gate temperature of the others (the paper's 1.05: negative updates fade faster)."""
  loss_agg: Literal["auto", "token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                    "seq-mean-token-sum-norm"] = "auto"
  """How per-token losses are reduced to one number; 'auto' takes the preset's (token-mean; GRPO, GSPO, GMPO seq-mean-token-mean; Dr.GRPO seq-mean-token-sum-norm over max_new_tokens). The entropy and KL metrics are token means whatever this is."""
  value_clip: float | None = 0.2
  """PPO critic: clip range of the value update around the old values; None disables it."""
  gamma: float = 1.0
  """Discount of GAE (PPO)."""
  lam: float = 0.95
  """Lambda of GAE (PPO)."""
  dynamic_sampling: bool | None = None
  """DAPO: drop groups whose rewards are all equal and refill the batch; None takes the preset's (on for dapo, off for the others)."""
  dynamic_sampling_max_draws: int = 16
  """DAPO: most prompt batches drawn to fill one training batch before the run stops with an error."""
  overlong_filter: bool | None = None
  """DAPO: mask truncated responses out of the loss; None takes the preset's (off: DAPO's final recipe shapes overlong responses with overlong_buffer instead)."""
  overlong_buffer: int = 0
  """DAPO soft overlong punishment: length of the penalty interval L_cache in tokens; 0 disables it."""
  off_policy: Literal["none", "tis", "decoupled", "token_mask", "seq_tis", "geo_tis",
                      "seq_reject", "opsm", "icepop"] = "tis"
  """Correction of data the learner did not sample (a stale policy's, or the engine's numerics), from w = pi_old / pi_behav: truncated IS (tis), AReaL's decoupled objective, tokens with w > tis_cap masked (token_mask), truncated sequence or geometric-mean weights (seq_tis, geo_tis), sequences with a geometric mean outside [1/tis_cap, tis_cap] rejected (seq_reject), negative-advantage sequences that drifted more than opsm_delta masked (opsm), tokens outside [1/tis_cap, tis_cap] masked (icepop). See rlx.algorithms.off_policy."""
  tis_cap: float = 2.0
  """The importance-weight bound of the off-policy correction (truncation, mask or rejection); policy/is_clip_frac counts the tokens whose weight exceeds it."""
  opsm_delta: float = 0.01
  """off_policy=opsm: the mean log(pi_behav / pi_old) above which a negative-advantage sequence is masked."""
  max_is_clip_frac: float | None = None
  """Split mode: when the mean policy/is_clip_frac over mesh.control_window batches exceeds this, the controller lowers the effective staleness k (rlx.trainer.control); None disables it."""
  entropy_floor: float | None = None
  """When the mean policy/entropy over mesh.control_window steps falls below this, the controller raises entropy_control's knob one step, and lowers it again once entropy is back above 1.25 x the floor; None disables it."""
  entropy_control: Literal["temperature", "clip_eps_high"] = "temperature"
  """The knob the entropy floor moves: the sampling temperature (up to rollout.temperature_max) or the upper clip range (up to clip_eps_high_max)."""
  clip_eps_high_max: float = 0.4
  """Highest upper clip range the entropy-floor controller may raise clip_eps_high to."""

  @property
  def preset(self) -> "Preset":
    """The preset this config is named after."""
    return PRESETS[self.name]

  @property
  def advantage_estimator(self) -> str:
    """The advantage estimator this config runs (``advantage``, or the preset's)."""
    return self.preset.advantage if self.advantage == "auto" else self.advantage

  @property
  def loss(self) -> str:
    """The policy loss this config runs (``policy_loss``, or the preset's)."""
    return self.preset.loss if self.policy_loss == "auto" else self.policy_loss

  @property
  def eps_low(self) -> float:
    """The lower clip range this config runs (``clip_eps_low``, or the preset's)."""
    return self.preset.eps_low if self.clip_eps_low is None else self.clip_eps_low

  @property
  def eps_high(self) -> float:
    """The upper clip range this config starts with (``clip_eps_high``, or the preset's)."""
    return self.preset.eps_high if self.clip_eps_high is None else self.clip_eps_high

  @property
  def aggregation(self) -> str:
    """The loss aggregation this config runs (``loss_agg``, or the preset's)."""
    return self.preset.loss_agg if self.loss_agg == "auto" else self.loss_agg

  @property
  def dynamic(self) -> bool:
    """Whether dynamic sampling runs (``dynamic_sampling``, or the preset's)."""
    return self.preset.dynamic_sampling if self.dynamic_sampling is None else self.dynamic_sampling

  @property
  def filters_overlong(self) -> bool:
    """Whether truncated responses are masked out (``overlong_filter``, or the preset's)."""
    return self.preset.overlong_filter if self.overlong_filter is None else self.overlong_filter

  def pinned_over_preset(self) -> list[str]:
    """The fields the preset fills that this config pins to another value, each as
    ``field=value (preset: value)``: what wins over the preset, said where a user sees it."""
    preset, pinned = self.preset, []
    for field, own, preset_value in (
        ("advantage", None if self.advantage == "auto" else self.advantage, preset.advantage),
        ("policy_loss", None if self.policy_loss == "auto" else self.policy_loss, preset.loss),
        ("clip_eps_low", self.clip_eps_low, preset.eps_low),
        ("clip_eps_high", self.clip_eps_high, preset.eps_high),
        ("loss_agg", None if self.loss_agg == "auto" else self.loss_agg, preset.loss_agg),
        ("dynamic_sampling", self.dynamic_sampling, preset.dynamic_sampling),
        ("overlong_filter", self.overlong_filter, preset.overlong_filter)):
      if own is not None and own != preset_value:
        pinned.append(f"{field}={own} ({self.name}'s: {preset_value})")
    return pinned

  @property
  def uses_critic(self) -> bool:
    """GAE needs a learned value function."""
    return self.advantage_estimator == "gae"

  @property
  def uses_reference(self) -> bool:
    """A KL term (in the loss or the reward) needs the reference policy's log-probs."""
    return self.kl_coef > 0 or self.kl_in_reward

  def __post_init__(self):
    _check(self.eps_low >= 0 and self.eps_high >= 0, "algorithm.clip_eps_low",
           "clip ranges must be >= 0")
    _check(self.kl_estimator != "k1" or self.kl_coef == 0 or self.kl_in_reward,
           "algorithm.kl_estimator", "k1 in the loss has an expected gradient of 0 (pure noise); "
           "use k2 or k3+ (the gradient of KL(policy || ref)) or k3, or set kl_in_reward=True")
    _check(0 < self.top_entropy_quantile <= 1, "algorithm.top_entropy_quantile",
           "must be in (0, 1] (1 keeps every token)")
    _check(0 < self.cov_ratio < 1, "algorithm.cov_ratio", "must be in (0, 1)")
    _check(self.cov_bounds[0] < self.cov_bounds[1], "algorithm.cov_bounds",
           "must be (low, high) with low < high")
    _check(self.entropy_target is None or self.entropy_target > 0, "algorithm.entropy_target",
           "must be > 0 (or None for a fixed entropy_coef)")
    _check(self.tis_cap > 1 or self.off_policy in ("none", "tis", "decoupled", "seq_tis",
                                                    "geo_tis", "opsm"),
           "algorithm.tis_cap", f"must be > 1 for off_policy={self.off_policy} (its band is "
           "[1/tis_cap, tis_cap])")
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
    _positive(self, "algorithm", "kl_horizon", "tis_cap", "kl_cov_coef", "sapo_tau_pos",
              "sapo_tau_neg", "entropy_coef_step")
    _check(self.max_is_clip_frac is None or 0 <= self.max_is_clip_frac < 1,
           "algorithm.max_is_clip_frac", "must be in [0, 1) (or None to disable it)")
    _check(self.entropy_floor is None or self.entropy_floor > 0, "algorithm.entropy_floor",
           "must be > 0 (or None to disable it)")
    _check(self.entropy_floor is None or self.entropy_control != "clip_eps_high"
           or self.clip_eps_high_max >= self.eps_high, "algorithm.clip_eps_high_max",
           f"must be >= the upper clip range {self.eps_high} (algorithm.clip_eps_high)")


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
  moments_dtype: Literal["float32", "bfloat16"] = "float32"
  """Where Adam's two moments are kept between steps (each update computes in float32):
  bfloat16 halves their memory (SmolLM2-135M: 1.08 -> 0.54 GB) at a rounding of each moment
  to 8 bits of mantissa per step."""
  max_update_ratio: float = 1.0
  """An update whose global norm exceeds this fraction of the trained params' own norm is skipped and counted (train/skipped_steps), like one that makes them non-finite: it would replace the weights rather than adjust them. Adam moves each weight by about the learning rate per step, against weights of about 0.02 at initialisation, so a sane step has a ratio near learning_rate / 0.02 (1e-4 to 5e-2); at 1 the update is as large as the weights. 0 disables the check."""

  def __post_init__(self):
    _positive(self, "optimizer", "learning_rate", "micro_batches", "eps", "critic_learning_rate")
    for name in ("warmup_steps", "weight_decay", "max_grad_norm", "max_update_ratio"):
      _check(getattr(self, name) >= 0, f"optimizer.{name}", "must be >= 0")
    for name in ("b1", "b2"):
      _check(0 <= getattr(self, name) < 1, f"optimizer.{name}", "must be in [0, 1)")


@dataclasses.dataclass(frozen=True)
class Preset:
  """What ``algorithm.name`` fills in, and where each number comes from."""

  advantage: str
  loss: str
  eps_low: float
  eps_high: float
  loss_agg: str
  source: str
  dynamic_sampling: bool = False
  overlong_filter: bool = False


PRESETS = {
    "ppo": Preset("gae", "ppo_clip", 0.2, 0.2, "token-mean",
                  "Schulman et al. 2017, arXiv 1707.06347, sec. 6.1: eps = 0.2"),
    "grpo": Preset("grpo", "ppo_clip", 0.2, 0.2, "seq-mean-token-mean",
                   "Shao et al. 2024, arXiv 2402.03300, eq. 3: 1/|o_i| inside the mean over the "
                   "group; eps = 0.2 as in PPO"),
    "dapo": Preset("grpo", "ppo_clip", 0.2, 0.28, "token-mean",
                   "Yu et al. 2025, arXiv 2503.14476, sec. 3.1 (clip-higher: eps_low 0.2, "
                   "eps_high 0.28), 3.2 (dynamic sampling), 3.3 (token-level loss) and 3.4 "
                   "(overlong reward shaping: the soft punishment is the final recipe, its "
                   "interval overlong_buffer sized by the user, the paper's 4096 of 20480 "
                   "tokens; overlong filtering was the intermediate step, off)",
                   dynamic_sampling=True),
    "dr_grpo": Preset("dr_grpo", "ppo_clip", 0.2, 0.2, "seq-mean-token-sum-norm",
                      "Liu et al. 2025, arXiv 2503.20783, eq. 3 and appendix: no std, a "
                      "constant normaliser (max generation length) instead of |o_i|"),
    "gspo": Preset("grpo", "gspo", 3e-4, 4e-4, "seq-mean-token-mean",
                   "Zheng et al. 2025, arXiv 2507.18071, sec. 5.1: left and right clip ranges "
                   "3e-4 and 4e-4; eq. 5: a mean over sequences"),
    "cispo": Preset("grpo", "cispo", 1.0, 5.0, "token-mean",
                    "MiniMax 2025, arXiv 2506.13585, sec. 3.1: no lower bound on the IS weight, "
                    "token-level normalisation (eq. 4); eps_max = 5 as ScaleRL (Khatri et al. "
                    "2025, arXiv 2510.13786) and TRL recommend"),
    "gmpo": Preset("grpo", "gmpo", 0.4, 0.4, "seq-mean-token-mean",
                   "Zhao et al. 2025, arXiv 2507.20673, sec. 4: clip range (e^-0.4, e^0.4) in "
                   "log space, a mean over sequences"),
    "sapo": Preset("grpo", "sapo", 0.2, 0.2, "token-mean",
                   "Gao et al. 2025, arXiv 2511.20347: tau_pos 1.0, tau_neg 1.05 "
                   "(algorithm.sapo_tau_*); no clip (its eps only scale the clip metrics' "
                   "band)"),
    "rloo": Preset("rloo", "ppo_clip", 0.2, 0.2, "token-mean",
                   "Ahmadian et al. 2024, arXiv 2402.14740: leave-one-out baseline"),
    "reinforce_pp": Preset("reinforce_pp", "ppo_clip", 0.2, 0.2, "token-mean",
                           "Hu 2025, arXiv 2501.03262: PPO's clip with batch-whitened returns"),
    "reinforce_pp_baseline": Preset(
        "reinforce_pp_baseline", "ppo_clip", 0.2, 0.2, "token-mean",
        "Hu et al. 2025, arXiv 2501.03262 (v3+): group mean subtracted, then batch-whitened"),
}
"""algorithm.name -> what it fills in where the config leaves it ('auto' / None)."""

GROUP_RELATIVE = ("grpo", "dr_grpo", "grpo_batch_std", "rloo", "reinforce_pp_baseline", "passk")
"""Advantage estimators that compare the samples of one prompt's group."""
