"""The run configuration: one frozen, typed schema for everything rlx does.

Every section is a frozen, keyword-only dataclass; the docstring under each
field is its documentation (``python -m rlx.main --help`` prints them). Config
files under ``configs/`` build a ``RunConfig`` from ``configs/base.py`` with
``dataclasses.replace``; the command line overrides single fields with
``--config.section.field=value`` (see ``rlx.cli``).

This package is plain data: it imports only the standard library, so that a
config can be read, validated and printed without starting JAX.

The sections live in ``model`` (architecture, model, rollout), ``algorithm`` (objective,
optimizer, presets) and ``run`` (mesh, buffer, data, rewards, checkpoints, logging, trainer);
this module joins them into ``RunConfig``, checks what involves several of them (``check``),
and is where every name is imported from.
"""

from __future__ import annotations

import dataclasses
import math
import os

from rlx.config._checks import ConfigError, _check
from rlx.config.algorithm import GROUP_RELATIVE, PRESETS, AlgorithmConfig, OptimizerConfig
from rlx.config.model import LORA_TARGETS, ArchConfig, DType, LoraConfig, ModelConfig, RolloutConfig
from rlx.config.run import (BufferConfig, CheckpointConfig, DataConfig, EnvConfig, LoggingConfig,
                            MeshConfig, RewardConfig, TrainerConfig)

__all__ = ["AlgorithmConfig", "ArchConfig", "BufferConfig", "CheckpointConfig", "ConfigError",
           "DType", "DataConfig", "EnvConfig", "GROUP_RELATIVE", "LoggingConfig", "LORA_TARGETS", "LoraConfig", "MeshConfig", "ModelConfig",
           "OptimizerConfig", "PRESETS", "RewardConfig", "RolloutConfig", "RunConfig",
           "TrainerConfig", "check"]


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
  env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
  """Multi-turn episodes with an environment and tools (off: single-turn answers)."""
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


def _finite_floats(section, prefix: str = "") -> None:
  """Refuses inf and nan in every float field: no setting of rlx means "infinitely" (an
  infinite learning rate or coefficient turns the weights into NaN at the first update)."""
  for field in dataclasses.fields(section):
    value, name = getattr(section, field.name), f"{prefix}{field.name}"
    if dataclasses.is_dataclass(value):
      _finite_floats(value, name + ".")
    elif isinstance(value, float) and not math.isfinite(value):
      raise ConfigError(f"config.{name}: {value} is not a finite number; give a finite value"
                        + (" (None disables it)" if field.default is None else ""))


UNKNOWN_VOCAB = 2**20
"""A model read from disk has a vocabulary the config does not know: at most this many tokens."""
MIN_HANG_TIMEOUT_S = 30.0
"""The shortest watchdog timeout that can tell a hang from a long compile or checkpoint write."""


def _physical_memory_mb() -> float:
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
  except (ValueError, OSError, AttributeError):
    return math.inf


def _never_acts(config: RunConfig) -> list[tuple[bool, str, str]]:
  """``(acceptable, field, the range that can act)`` of the values that can never act or are
  sure to misbehave, one row each. (``trainer.warmup_sft_until`` without warm-up steps is let
  be: the base config sets it, and every run that turns the warm-up off would be refused.)"""
  algorithm, trainer, env = config.algorithm, config.trainer, config.env
  vocab = config.model.arch.vocab_size if not config.model.path else UNKNOWN_VOCAB
  reachable = math.log(vocab)
  memory = _physical_memory_mb()
  return [
      (algorithm.entropy_target is None or algorithm.entropy_target < reachable,
       "algorithm.entropy_target",
       f"must be below {reachable:.2f} nats, the entropy of a uniform policy over "
       f"{'the model' if config.model.path else 'the built-in model'}'s {vocab} tokens: no "
       "policy reaches more, so the bonus would only grow"),
      (config.checkpoint.write_buffer_mb <= memory, "checkpoint.write_buffer_mb",
       f"must fit in this machine's memory ({memory:.0f} MB)"),
      (trainer.hang_timeout_s == 0 or trainer.hang_timeout_s >= MIN_HANG_TIMEOUT_S,
       "trainer.hang_timeout_s", f"must be 0 (never) or at least {MIN_HANG_TIMEOUT_S:g} s: a "
       "shorter one ends healthy runs during a compile or a checkpoint write"),
      (not env.release_slots or bool(env.name or env.agent), "env.release_slots",
       "must be false without an environment (env.name or env.agent): it lets episodes that "
       "wait on their environment leave their slot, and this run has none"),
  ]


def check(config: RunConfig) -> RunConfig:
  """Checks what involves several fields (each field is checked when its section is built);
  returns the config. The command line calls it after the last override."""
  _finite_floats(config)
  for acceptable, key, message in _never_acts(config):
    _check(acceptable, key, message)
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
    _check(not mesh.multihost, "buffer.enabled",
           "needs a learner of one process (each process would age its groups by its own "
           "clock); set mesh.multihost=false, or buffer.enabled=false")
    _check(mesh.role != "generator", "buffer.enabled",
           "belongs to the learner job; a generator job has no buffer")
    _check(buffer.capacity >= config.data.prompts_per_step, "buffer.capacity",
           f"must hold at least one batch (data.prompts_per_step={config.data.prompts_per_step} "
           "groups)")
  _check(buffer.enabled or buffer.reuse == 1, "buffer.reuse",
         "reuses buffered groups: set buffer.enabled=true")
  if mesh.role != "both":
    _check(mesh.mode == "split", "mesh.role", f"{mesh.role!r} is one side of a split run; "
           "set config.mesh.mode=split (or role=both)")
    _check(mesh.weight_sync in ("orbax", "delta"), "mesh.weight_sync", f"must be 'delta' or "
           f"'orbax' with mesh.role={mesh.role!r}: separate jobs exchange weights through the "
           "shared workdir")
  _check(mesh.whole_version_every >= 1, "mesh.whole_version_every", "must be >= 1")
  _check(mesh.generators == 1 or mesh.role != "both", "mesh.generators",
         "counts generator jobs of a split run as jobs (mesh.role=learner or generator)")
  env = config.env
  if mesh.admission == "continuous":
    _check(mesh.mode == "split", "mesh.admission",
           "'continuous' streams split mode's generator (in one process, or a generator job): "
           "set config.mesh.mode=split, or admission=batch")
    _check(not mesh.multihost, "mesh.admission",
           "'continuous' needs a generator of one process (each would admit by its own clock); "
           "set mesh.admission=batch")
    _check(mesh.inflight_updates, "mesh.admission", "'continuous' never drains, so new weights "
           "reach it only in flight: set mesh.inflight_updates=true, or admission=batch")
    _check(not env.agent, "mesh.admission", "'continuous' does not stream agent programs "
           "(env.agent): set mesh.admission=batch")
  if env.name:
    _check(env.max_tokens <= config.rollout.max_new_tokens, "env.max_tokens",
           f"must fit in rollout.max_new_tokens={config.rollout.max_new_tokens}, the room the "
           "engine keeps after a prompt for everything an episode adds")
  return config
