"""The run configuration: one frozen, typed schema for everything rlx does.

Every section is a frozen, keyword-only dataclass; the docstring under each
field is its documentation (``python -m rlx.main --help`` prints them). Config
files under ``configs/`` build a ``RunConfig`` from ``configs/base.py`` with
``dataclasses.replace``; the command line overrides single fields with
``--config.section.field=value`` (see ``rlx.cli``).

This module is plain data: it imports only the standard library, so that a
config can be read, validated and printed without starting JAX.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

DType = Literal["float32", "bfloat16"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArchConfig:
  """Architecture of a decoder-only transformer (Llama / Qwen2 / Qwen3 family).

  Mirrors the fields of a Hugging Face ``config.json``; ``rlx.models`` reads one
  into this class and writes this class back out.
  """

  family: Literal["llama", "qwen2", "qwen3"] = "llama"
  """Model family; decides the Hugging Face architecture name and bias layout."""
  vocab_size: int = 512
  """Number of token ids."""
  hidden_size: int = 128
  """Width of the residual stream (D)."""
  intermediate_size: int = 384
  """Width of the SwiGLU MLP (F)."""
  num_layers: int = 4
  """Number of decoder layers (stacked and scanned)."""
  num_heads: int = 4
  """Number of query heads."""
  num_kv_heads: int = 2
  """Number of key/value heads (GQA when smaller than num_heads)."""
  head_dim: int = 32
  """Width of one attention head; independent of hidden_size (Qwen3)."""
  rope_theta: float = 10000.0
  """RoPE base frequency."""
  rope_scaling: Literal["none", "llama3", "linear"] = "none"
  """RoPE frequency scaling: 'llama3' (Llama 3.1+), 'linear', or none."""
  rope_factor: float = 1.0
  """Scaling factor of 'llama3' and 'linear' rope scaling."""
  rope_low_freq_factor: float = 1.0
  """'llama3' scaling: wavelengths above original_len / low_freq_factor are divided by rope_factor."""
  rope_high_freq_factor: float = 4.0
  """'llama3' scaling: wavelengths below original_len / high_freq_factor are kept."""
  rope_original_max_len: int = 8192
  """'llama3' scaling: the context length the model was pre-trained with."""
  rms_norm_eps: float = 1e-6
  """Epsilon of every RMSNorm."""
  qkv_bias: bool = False
  """Bias on the q, k and v projections (always on for Qwen2)."""
  o_bias: bool = False
  """Bias on the attention output projection."""
  qk_norm: bool = False
  """RMSNorm over each query and key head before RoPE (Qwen3)."""
  tie_word_embeddings: bool = True
  """Use the input embedding as the unembedding matrix."""
  max_position_embeddings: int = 4096
  """Longest sequence the model is meant for."""
  bos_token_id: int | None = None
  """Beginning-of-sequence id recorded in config.json."""
  eos_token_ids: tuple[int, ...] = ()
  """End-of-sequence ids recorded in config.json (Llama 3 instruct models have several)."""

  def __post_init__(self):
    _check(self.num_heads % self.num_kv_heads == 0, "model.arch.num_heads",
           f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim"):
      _check(getattr(self, name) > 0, f"model.arch.{name}", "must be positive")
    _check(self.head_dim % 2 == 0, "model.arch.head_dim", "must be even for RoPE")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """Which policy model to train and how to run it."""

  path: str | None = None
  """Hugging Face model directory (config.json + safetensors). None builds `arch` with random weights."""
  arch: ArchConfig = dataclasses.field(default_factory=ArchConfig)
  """Architecture of the built-in model; ignored when `path` is set."""
  dtype: DType = "float32"
  """Dtype of activations and matmuls."""
  param_dtype: DType = "float32"
  """Dtype the parameters are stored in."""
  attention: Literal["auto", "fused", "reference"] = "auto"
  """Training attention: 'fused' is jax.nn.dot_product_attention (cuDNN flash on GPU when the mask allows), 'reference' plain einsum softmax, 'auto' picks fused."""
  remat: Literal["none", "full", "dots", "dots_no_batch"] = "full"
  """Activation checkpointing per layer: recompute everything ('full'), save matmul outputs ('dots', 'dots_no_batch'), or save all ('none')."""
  seed: int = 0
  """Seed of the random initialisation of the built-in model."""
  logprob_impl: Literal["auto", "reference", "xla", "pallas"] = "auto"
  """Fused log-prob/entropy implementation (rlx.kernels.fused_logprobs); 'auto' picks by backend."""
  logprob_chunk: int = 128
  """Tokens per chunk of the 'xla' fused log-prob path."""

  def __post_init__(self):
    _positive(self, "model", "logprob_chunk")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
  """The generation engine and sampling."""

  max_slots: int = 16
  """Number of concurrent decode slots (continuous batching)."""
  max_prompt_len: int = 128
  """Longest prompt, in tokens; longer prompts are refused."""
  max_new_tokens: int = 64
  """Longest response, in tokens; responses that reach it finish with reason 'length'."""
  group_size: int = 8
  """Samples per prompt (the GRPO group, n)."""
  temperature: float = 1.0
  """Sampling temperature; 0 is greedy."""
  temperature_max: float = 1.5
  """Highest temperature the entropy-floor controller may raise sampling to (algorithm.entropy_floor, entropy_control='temperature')."""
  top_p: float = 1.0
  """Nucleus sampling mass; 1 disables it."""
  top_k: int = 0
  """Keep the k most likely tokens; 0 disables it."""
  decode_steps: int = 16
  """Tokens every slot decodes per dispatch (one host round trip per chunk); 1 is the single-step path. 16 was fastest in benchmarks/rollout_throughput.py."""

  def __post_init__(self):
    _check(self.temperature >= 0, "rollout.temperature", "must be >= 0")
    _check(self.temperature_max >= self.temperature, "rollout.temperature_max",
           f"must be >= rollout.temperature={self.temperature}")
    _check(0 < self.top_p <= 1, "rollout.top_p", "must be in (0, 1]")
    _check(self.top_k >= 0, "rollout.top_k", "must be >= 0")
    for name in ("max_slots", "max_prompt_len", "max_new_tokens", "group_size", "decode_steps"):
      _check(getattr(self, name) > 0, f"rollout.{name}", "must be positive")


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
  """The device mesh and how generation and learning share it."""

  mode: Literal["colocated", "split"] = "colocated"
  """'colocated': generation and learning time-slice the same devices; 'split': disjoint sub-meshes run at once."""
  data: int = 1
  """Size of the pure data-parallel mesh axis."""
  fsdp: int = -1
  """Size of the fully sharded data-parallel axis; -1 takes the remaining devices."""
  tensor: int = 1
  """Size of the tensor-parallel axis."""
  generation_devices: int = 0
  """Split mode: devices given to generation (the rest learn); 0 gives half."""
  generation_tensor: int = 1
  """Tensor-parallel size of the generation (sub-)mesh; the rest of it is data-parallel."""
  max_staleness: int = 1
  """Split mode: the learner never trains on data more than this many policy versions old; 0 is synchronous."""
  lag_threshold: int | None = None
  """Split mode: a batch holding a rollout more than this many versions old is expired (dropped and counted), and when the mean lag over control_window batches exceeds it the controller lowers the effective staleness bound below max_staleness, raising it again when healthy (rlx.trainer.control); None disables both."""
  control_window: int = 4
  """Batches (or steps) each controller decision looks back over; after a change it waits this many before the next."""
  weight_sync: Literal["reshard", "orbax"] = "reshard"
  """How weights go learner -> generator: device_put across sub-meshes, or Orbax checkpoints on shared storage."""
  role: Literal["both", "learner", "generator"] = "both"
  """Split mode: 'both' runs generator and learner in this job (a thread each); 'learner' or 'generator' runs one side as its own job, the two exchanging weights (Orbax versions) and rollouts (files) through the shared workdir (see launch/local.sh --learner N --generator M)."""
  multihost: bool = False
  """Join a multi-process run with jax.distributed.initialize() first: SLURM, TPU pods and GKE are detected; elsewhere set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID (see launch/)."""
  check_agreement: bool = False
  """Debug a multi-process run: every step, check that the processes agree on the loop's state (step, policy version, data position) and fail loudly where they diverge, instead of hanging."""
  cpu_devices: int = 8
  """On the CPU backend, the number of JAX devices the host CPU is split into, so sharding and split mode run on a laptop."""
  logical_axis_rules: tuple[tuple[str, str | None], ...] = (
      ("batch", "data_fsdp"),
      ("embed", "fsdp"),
      ("vocab", "tensor"),
      ("heads", "tensor"),
      ("kv_heads", "tensor"),
      ("mlp", "tensor"),
      ("layers", None),
      ("head_dim", None),
  )
  """Map from the model's logical parameter axes to mesh axes ('data_fsdp' is data and fsdp together)."""

  def __post_init__(self):
    for name in ("data", "tensor", "generation_tensor", "cpu_devices"):
      _check(getattr(self, name) > 0, f"mesh.{name}", "must be positive")
    _check(self.fsdp == -1 or self.fsdp > 0, "mesh.fsdp", "must be positive or -1")
    _check(self.max_staleness >= 0, "mesh.max_staleness", "must be >= 0")
    _check(self.lag_threshold is None or self.lag_threshold >= 0, "mesh.lag_threshold",
           "must be >= 0 (or None to disable it)")
    _check(self.control_window >= 1, "mesh.control_window", "must be >= 1")
    _check(self.generation_devices >= 0, "mesh.generation_devices", "must be >= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BufferConfig:
  """Split mode: a replay buffer of scored groups between generator and learner (rlx.trainer.buffer)."""

  enabled: bool = False
  """Train from a buffer of groups: the learner takes a batch whenever prompts_per_step usable groups are buffered, without waiting for the generator's next batch; groups past the lag bound (mesh.lag_threshold, else mesh.max_staleness) or data.max_age_s are evicted."""
  reuse: int = 1
  """Updates a group may be used in while it is fresh; 1 trains on every group once."""
  capacity: int = 64
  """Most groups held; the oldest are evicted first."""

  def __post_init__(self):
    _check(self.reuse >= 1, "buffer.reuse", "must be >= 1")
    _check(self.capacity >= 1, "buffer.capacity", "must be >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
  """Where prompts come from."""

  source: str = "arithmetic"
  """A built-in synthetic task ('arithmetic', 'countdown', 'sort') or a path to a .jsonl / .parquet file."""
  prompt_field: str = "prompt"
  """Field of a row that holds the prompt."""
  answer_field: str = "answer"
  """Field of a row that holds the reference answer."""
  prompts_per_step: int = 8
  """Prompts per training step (each expanded to rollout.group_size samples)."""
  shuffle_seed: int = 0
  """Seed of the deterministic shuffle."""
  num_epochs: int | None = None
  """Passes over the data; None repeats forever."""
  on_bad_row: Literal["error", "skip"] = "error"
  """A malformed row either stops the run (naming file and line) or is skipped and counted."""
  eval_fraction: float = 0.1
  """Fraction of problems held out for evaluation (never trained on): of a built-in task, or of a data file when there is no eval_source (rows are assigned by a hash of their prompt)."""
  max_age_s: float | None = None
  """Split mode: a batch sampled longer ago than this many seconds when the learner takes it is expired (dropped and counted as rollout/expired_batches); None disables it."""
  eval_source: str | None = None
  """A .jsonl / .parquet file of held-out rows (same fields as source) for eval/accuracy; None holds out eval_fraction of the source instead."""

  def __post_init__(self):
    _check(self.prompts_per_step > 0, "data.prompts_per_step", "must be positive")
    _check(self.max_age_s is None or self.max_age_s > 0, "data.max_age_s",
           "must be > 0 (or None to disable it)")
    _check(0 < self.eval_fraction < 1, "data.eval_fraction", "must be in (0, 1)")
    _check(self.num_epochs is None or self.num_epochs >= 1, "data.num_epochs",
           "must be >= 1 (or None to repeat forever)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardConfig:
  """How responses are scored (on the host, off the device path)."""

  name: str = "auto"
  """'math', 'arithmetic', 'countdown', 'sort', 'code' (programs run against the row's tests in a sandbox), your own function as 'package.module:function' or 'path/to/file.py:function' ((response, row) -> float or dict), or 'auto': the one that matches data.source ('math' for files)."""
  batched: bool = False
  """Your function takes lists (responses, rows) and returns a list; it may be async (a reward served over HTTP)."""
  batch_size: int = 64
  """Responses per call of a batched function (each call has its own timeout)."""
  format_weight: float = 0.0
  """Weight of the format reward added to the verifier's reward."""
  num_workers: int = 2
  """Host worker processes that score responses; 0 scores in the trainer (no timeouts, prints shown: for debugging a reward)."""
  timeout_s: float = 5.0
  """A reward call that runs longer scores 0 and is counted (its worker is replaced)."""
  memory_mb: int = 4096
  """Address space of a reward worker: a call that needs more scores 0, and a worker grown past half of it is replaced; 0 leaves it unlimited."""
  code_tests_field: str = "tests"
  """'code' reward: the row field with the tests: assert statements, or stdin/stdout pairs ([{"input", "output"}] or {"inputs": [...], "outputs": [...]})."""
  code_scoring: Literal["fraction", "all"] = "fraction"
  """'code' reward: the fraction of tests passed, or 1 only when all pass; 'correct' always means all pass."""
  code_timeout_s: float = 3.0
  """'code' reward: wall-clock seconds a program may run, all its tests together."""
  code_memory_mb: int = 512
  """'code' reward: address space a program may use."""

  def __post_init__(self):
    _check(bool(self.name.strip()), "reward.name", "must not be empty")
    _check(self.num_workers >= 0, "reward.num_workers", "must be >= 0 (0 scores in the trainer)")
    _check(self.format_weight >= 0, "reward.format_weight", "must be >= 0")
    _check(self.memory_mb >= 0, "reward.memory_mb", "must be >= 0 (0 is unlimited)")
    _positive(self, "reward", "timeout_s", "batch_size", "code_timeout_s", "code_memory_mb")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
  """Orbax checkpoints of the whole training state."""

  every_steps: int = 50
  """Save every N steps (and on SIGTERM / SIGINT); 0 saves only at the end."""
  max_to_keep: int = 3
  """Checkpoints kept on disk (at least 1: a run always saves its last step)."""
  async_save: bool = True
  """Write checkpoints in the background while training goes on."""
  export_hf_every: int = 0
  """Also write the policy as a Hugging Face directory (WORKDIR/hf/step_N) every N steps; 0 never."""

  def __post_init__(self):
    _check(self.every_steps >= 0, "checkpoint.every_steps", "must be >= 0 (0 saves only at the end)")
    _check(self.export_hf_every >= 0, "checkpoint.export_hf_every", "must be >= 0 (0 never)")
    _check(self.max_to_keep >= 1, "checkpoint.max_to_keep",
           "must be >= 1: with 0 no checkpoint is kept and a rerun starts over")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoggingConfig:
  """Where metrics go."""

  every_steps: int = 1
  """Write metrics every N steps."""
  jsonl: bool = True
  """Write WORKDIR/metrics.jsonl."""
  tensorboard: bool = True
  """Write TensorBoard event files under WORKDIR/tb."""
  progress_bar: bool = True
  """Show a console progress bar."""
  profile_steps: str = ""
  """'A:B' writes a jax.profiler trace of training steps A .. B-1 (counted from 0) to WORKDIR/profile (one folder per process; open it in TensorBoard or Perfetto); '' never."""

  def __post_init__(self):
    _positive(self, "logging", "every_steps")
    if self.profile_steps:
      parts = self.profile_steps.split(":")
      _check(len(parts) == 2 and all(p.strip().isdigit() for p in parts)
             and int(parts[0]) < int(parts[1]), "logging.profile_steps",
             f"must be 'A:B' with whole numbers A < B (steps A .. B-1), got {self.profile_steps!r}")

  @property
  def profile_window(self) -> tuple[int, int] | None:
    """(first step, step after the last) to trace, or None."""
    if not self.profile_steps:
      return None
    first, end = self.profile_steps.split(":")
    return int(first), int(end)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerConfig:
  """The training loop."""

  steps: int = 20
  """Number of policy updates."""
  seed: int = 0
  """Seed of the run: sampling, shuffling and every other random choice derive from it."""
  eval_every: int = 0
  """Held-out evaluation every N steps; 0 never."""
  ppo_epochs: int = 1
  """Passes over each rollout batch; each pass is a fresh permutation of its sequences."""
  mini_batches: int = 1
  """Optimizer steps per pass: the rollout batch is cut into this many mini-batches (the old log-probs are those of the policy before the first step), so the clipped objective acts from the second step on."""
  warmup_sft_steps: int = 0
  """Supervised steps on the rows' SFT targets before RL (teaches a fresh model the answer format); see warmup_sft."""
  warmup_sft: Literal["builtin", "always", "never"] = "builtin"
  """When the supervised warm-up runs: 'builtin' only for the built-in model (no model.path) on a built-in task; 'always' for any model and data (a row's 'sft_target' field, else '<answer>{answer}</answer>', is the target); 'never'."""
  warmup_sft_learning_rate: float = 1e-3
  """Learning rate of the supervised warm-up."""
  warmup_sft_batch: int = 32
  """Examples per supervised warm-up step."""
  eval_prompts: int = 64
  """Held-out prompts scored (greedy) at each evaluation, before and after training; 0 evaluates never (and holds out no rows of a data file)."""
  eval_samples: int = 0
  """Also sample each held-out prompt this many times (at rollout.temperature) for eval/pass@N and eval/sampled_accuracy; 0 only answers greedily."""
  max_skipped_steps: int = 5
  """Updates whose loss or gradient norm is not finite are skipped (params unchanged); this many in a row stop the run."""
  compile_cache: str = "~/.cache/rlx/jax"
  """JAX's persistent compilation cache: a second run of the same programs loads them instead of compiling; '' turns it off."""

  def __post_init__(self):
    _positive(self, "trainer", "steps", "ppo_epochs", "mini_batches", "warmup_sft_learning_rate",
              "warmup_sft_batch", "max_skipped_steps")
    for name in ("eval_every", "warmup_sft_steps", "eval_prompts", "eval_samples"):
      _check(getattr(self, name) >= 0, f"trainer.{name}", "must be >= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
  """Everything one rlx run needs."""

  name: str = "rlx"
  """Name of the run (shown in logs)."""
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  """The policy model."""
  rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
  """The generation engine and sampling."""
  algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
  """The RL objective."""
  optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
  """The optimizer."""
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  """The device mesh and deployment mode."""
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  """The prompt source."""
  buffer: BufferConfig = dataclasses.field(default_factory=BufferConfig)
  """Split mode: the replay buffer between generator and learner."""
  reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
  """The reward functions."""
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  """Checkpointing."""
  logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
  """Metrics output."""
  trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
  """The training loop."""

  @property
  def samples_per_step(self) -> int:
    """Rollouts per training step: prompts times group size."""
    return self.data.prompts_per_step * self.rollout.group_size


PRESETS = {
    "ppo": ("gae", "ppo_clip"), "grpo": ("grpo", "ppo_clip"), "dapo": ("grpo", "ppo_clip"),
    "dr_grpo": ("dr_grpo", "ppo_clip"), "gspo": ("grpo", "gspo"), "cispo": ("grpo", "cispo"),
    "rloo": ("rloo", "ppo_clip"), "reinforce_pp": ("reinforce_pp", "ppo_clip"),
}
"""algorithm.name -> (advantage estimator, policy loss)."""

GROUP_RELATIVE = ("grpo", "dr_grpo", "rloo")
"""Advantage estimators that compare the samples of one prompt's group."""


def check(config: RunConfig) -> RunConfig:
  """Checks what involves several fields (each field is checked when its section is built);
  returns the config. The command line calls it after the last override."""
  rollout, algorithm = config.rollout, config.algorithm
  estimator = algorithm.advantage_estimator
  _check(estimator not in GROUP_RELATIVE or rollout.group_size >= 2, "rollout.group_size",
         f"must be >= 2 for the {estimator!r} advantage (algorithm.name={algorithm.name!r}): it "
         "compares the samples of a group, and a group of 1 has no baseline")
  _check(not algorithm.kl_in_reward or algorithm.uses_critic, "algorithm.kl_in_reward",
         f"needs per-token returns, which only the 'gae' advantage has (this run's is "
         f"{estimator!r}); use algorithm.kl_coef as a loss term instead")
  mini_batches = config.trainer.mini_batches
  _check(config.samples_per_step % mini_batches == 0, "trainer.mini_batches",
         f"must divide the {config.samples_per_step} samples of a step "
         "(data.prompts_per_step x rollout.group_size)")
  _check((config.samples_per_step // mini_batches) % config.optimizer.micro_batches == 0,
         "optimizer.micro_batches", f"must divide the {config.samples_per_step // mini_batches} "
         f"samples of a mini-batch (data.prompts_per_step x rollout.group_size / "
         "trainer.mini_batches)")
  reward = config.reward
  code = reward.name == "code" or (reward.name == "auto" and config.data.source == "code")
  _check(not code or reward.timeout_s > reward.code_timeout_s + 1, "reward.timeout_s",
         f"must exceed reward.code_timeout_s={reward.code_timeout_s} by more than 1s (a call "
         "runs the program, then judges it)")
  mesh = config.mesh
  for key, value in (("mesh.lag_threshold", mesh.lag_threshold),
                     ("data.max_age_s", config.data.max_age_s),
                     ("algorithm.max_is_clip_frac", algorithm.max_is_clip_frac)):
    _check(value is None or mesh.mode == "split", key, "bounds the staleness of a split run "
           "(colocated data is never stale); set config.mesh.mode=split or leave it None")
  _check(algorithm.entropy_floor is None or algorithm.entropy_control != "temperature"
         or rollout.temperature > 0, "algorithm.entropy_floor", "cannot raise the temperature "
         "of greedy sampling (rollout.temperature=0); use algorithm.entropy_control=clip_eps_high")
  buffer = config.buffer
  if buffer.enabled:
    _check(mesh.mode == "split" and mesh.role == "both", "buffer.enabled",
           "needs a one-process split run (mesh.mode=split, mesh.role=both); the learner and "
           "generator jobs exchange rollout files without a buffer")
    _check(buffer.capacity >= config.data.prompts_per_step, "buffer.capacity",
           f"must hold at least one batch (data.prompts_per_step={config.data.prompts_per_step} "
           "groups)")
  _check(buffer.enabled or buffer.reuse == 1, "buffer.reuse",
         "reuses buffered groups: set buffer.enabled=true")
  if mesh.role != "both":
    _check(mesh.mode == "split", "mesh.role", f"{mesh.role!r} is one side of a split run; "
           "set config.mesh.mode=split (or role=both)")
    _check(mesh.weight_sync == "orbax", "mesh.weight_sync", f"must be 'orbax' with "
           f"mesh.role={mesh.role!r}: separate jobs exchange weights through the shared workdir")
  return config


class ConfigError(ValueError):
  """A config value or override is invalid; the message names the key and the fix."""


def _check(ok: bool, key: str, message: str) -> None:
  if not ok:
    raise ConfigError(f"config.{key}: {message}")


def _positive(section, prefix: str, *names: str) -> None:
  for name in names:
    value = getattr(section, name)
    _check(value > 0, f"{prefix}.{name}", f"must be > 0, got {value}")
