"""How a run is laid out and driven: mesh and deployment, replay buffer, data, rewards,
checkpoints, logging and the training loop."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Literal

from rlx.config._checks import _check, _positive


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
  inflight_updates: bool = True
  """Split mode: a newly published policy version reaches sequences still decoding, swapped in between decode chunks without draining (partial rollouts); each token keeps the version that sampled it and its behaviour log-prob, and a batch's staleness is its oldest token's. A generator job of several processes takes new weights between batches only. false: weights change only between draws."""
  admission: Literal["batch", "continuous"] = "batch"
  """Split mode: 'batch' samples a batch at a time (it is done when its slowest sample is); 'continuous' runs generation as one stream, admitting new prompts into the slots that finished or parked samples leave and handing groups over as they complete (rlx.trainer.produce.stream); needs inflight_updates, one process, and no env.agent."""
  groups_in_flight: int = 0
  """Split mode with admission='continuous': the most groups admitted and not yet handed over; 0: one batch (data.prompts_per_step) and twice the groups the slots hold."""
  lag_threshold: int | None = None
  """Split mode: a batch holding a rollout more than this many versions old is expired (dropped and counted), and when the mean lag over control_window batches exceeds it the controller lowers the effective staleness bound below max_staleness, raising it again when healthy (rlx.trainer.control); None disables both."""
  control_window: int = 4
  """Batches (or steps) each controller decision looks back over; after a change it waits this many before the next."""
  weight_sync: Literal["reshard", "orbax", "delta"] = "reshard"
  """How weights go learner -> generator: device_put across sub-meshes (one job), or through shared storage between jobs: Orbax checkpoints, or rlx's own whole and delta version files (``rlx.versions``: most versions are the XOR of their bits with the last one's, compressed)."""
  whole_version_every: int = 10
  """weight_sync=delta: a whole version at least every this many (the others are deltas; a generator that joins late reads the newest whole version and the deltas after it)."""
  role: Literal["both", "learner", "generator"] = "both"
  """Split mode: 'both' runs generator and learner in this job (a thread each); 'learner' or 'generator' runs one side as its own job, the two exchanging weights (Orbax versions) and rollouts (files) through the shared workdir (see launch/local.sh --learner N --generator M)."""
  generators: int = 1
  """Split as jobs: how many generator jobs feed the learner job; generator job g of them writes rollouts g, g + generators, ... from its own share of the prompts (launch/local.sh --generator M)."""
  generator_id: int = 0
  """Split as jobs: which generator job this is, 0 .. generators - 1."""
  job_timeout_s: float = 120.0
  """Split as jobs: a job waiting on another (the learner on a generator, a generator on the learner) stops with an error once the other has been silent this long (no heartbeat in WORKDIR/jobs/), has not started, or has got nothing done this long (no decode chunk, update, reward or compile) while not waiting on its own peer: a hung process whose heartbeat thread still beats; a failed job, or one killed on this host, stops its peers sooner."""
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
    _check(self.generators >= 1, "mesh.generators", "must be >= 1")
    _check(0 <= self.generator_id < self.generators, "mesh.generator_id",
           f"must be in 0 .. mesh.generators - 1 = {self.generators - 1}")
    _check(self.job_timeout_s > 0, "mesh.job_timeout_s", "must be > 0 seconds")
    _check(self.groups_in_flight >= 0, "mesh.groups_in_flight", "must be >= 0 (0: sized from the slots)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BufferConfig:
  """A replay buffer of scored groups in front of the learner, in any deployment of a one-process learner (rlx.trainer.learn.buffer)."""

  enabled: bool = False
  """Train from a buffer of groups: the learner takes a batch whenever prompts_per_step usable groups are buffered, without waiting for the generator's next batch; groups the controller no longer calls fresh (past mesh.max_staleness, mesh.lag_threshold or data.max_age_s) are evicted."""
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
  answer_format: Literal["plain", "gsm8k"] = "plain"
  """How the answer field reads: as it is, or GSM8K's rationale ending in '#### 72' (the reference answer is what follows the last '####', without thousands commas)."""
  system_prompt: str = ""
  """A system message put before every prompt (a row whose prompt is a list of messages that already starts with one keeps its own), and first in every episode whose environment starts without one (e.g. to describe the tools to a model whose chat template takes no tool list); without a chat template, plain text before the prompt. '' none."""
  chat_template_kwargs: str = ""
  """Extra variables for the chat template, as a JSON object, e.g. '{"enable_thinking": false}' for Qwen3; '' none."""

  @property
  def template_kwargs(self) -> dict:
    """``chat_template_kwargs`` parsed."""
    return json.loads(self.chat_template_kwargs) if self.chat_template_kwargs else {}

  def __post_init__(self):
    _check(self.prompts_per_step > 0, "data.prompts_per_step", "must be positive")
    try:
      kwargs = self.template_kwargs
    except json.JSONDecodeError as error:
      kwargs = error
    _check(isinstance(kwargs, dict), "data.chat_template_kwargs",
           f"must be a JSON object like '{{\"enable_thinking\": false}}' ({kwargs})")
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
  extra: tuple[tuple[str, float], ...] = ()
  """More rewards added to `name`'s with weights, e.g. '[["my_rewards.py:brevity", 0.1]]': each named as `name` is (a built-in or your per-response function), logged as reward/<function name>; the verdict (accuracy) stays `name`'s. A negative weight makes one a penalty (a length or repetition cost)."""
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
  max_error_steps: int = 3
  """Stop the run (exit code 2, with the first error's message) once every reward call of this many steps in a row raised, timed out or gave a non-finite reward: a reward that never works teaches nothing."""

  def __post_init__(self):
    _check(bool(self.name.strip()), "reward.name", "must not be empty")
    _check(self.max_error_steps >= 1, "reward.max_error_steps", "must be >= 1")
    _check(self.num_workers >= 0, "reward.num_workers", "must be >= 0 (0 scores in the trainer)")
    _check(self.format_weight >= 0, "reward.format_weight", "must be >= 0")
    _check(self.memory_mb >= 0, "reward.memory_mb", "must be >= 0 (0 is unlimited)")
    _positive(self, "reward", "timeout_s", "batch_size", "code_timeout_s", "code_memory_mb")
    for name, weight in self.extra:
      _check(bool(str(name).strip()) and math.isfinite(weight), "reward.extra",
             f"each entry is [name, finite weight], got [{name!r}, {weight!r}]")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvConfig:
  """Multi-turn episodes: an environment answers each assistant turn (tool calls run, their
  results shown to the model) until it says done or a limit is hit."""

  name: str = ""
  """'' for single-turn answers; 'calc' or 'code' (built-in tool environments); or your own factory as 'package.module:function' or 'path/to/file.py:function' ((row) -> an environment, see rlx.envs)."""
  tool_format: Literal["auto", "builtin", "qwen", "llama"] = "auto"
  """How the model writes tool calls: 'builtin' <call>name("arg")</call> (the built-in model), 'qwen' <tool_call>{json}</tool_call> (Qwen2.5 / Qwen3, Hermes), 'llama' a JSON object (Llama 3.1+); 'auto': 'builtin' for the built-in model, else from the chat template."""
  max_turns: int = 4
  """Assistant turns per episode; an episode still calling tools after them ends truncated."""
  max_tokens: int = 256
  """Tokens an episode may add after its prompt (sampled and environment's together); past it, it ends truncated. An agent program's episode is bounded by the engine instead: its whole conversation within rollout.max_prompt_len + rollout.max_new_tokens."""
  turn_max_new_tokens: int | None = None
  """Longest assistant turn; None: rollout.max_new_tokens."""
  tool_timeout_s: float = 5.0
  """A tool call that runs longer is killed and answered with a timeout error the model sees."""
  tool_workers: int = 2
  """Worker processes that run tool calls (0: in the trainer, without timeouts, for debugging): the most calls that run at once. With slow tools they bound generation; raise it (a calculator that sleeps 0-2 s: 32 workers gave colocated 1.6x and a split stream 2.0x the samples/s of 16, docs/deployment.md)."""
  tool_memory_mb: int = 2048
  """Address space of a tool worker; a call that needs more becomes an error observation."""
  max_observation_chars: int = 2000
  """A tool result longer than this is cut (the model sees that it was)."""
  step_timeout_s: float = 30.0
  """An environment step (yours, on the host) that runs longer ends its episode, truncated, and is counted."""
  release_slots: bool = False
  """An episode waiting for its environment leaves its decode slot to other work, and is prefilled again whole (prompt, turns, reply) into the next free slot when the reply comes; False keeps the slot parked. Pays where tools are slow against decoding (most slots would wait on tools), at the price of prefilling the episode again each turn."""
  agent: str = ""
  """An agent program instead of an environment: 'path/to/file.py:run' or 'package.module:run', an 'async def run(client, row)' that reaches the policy only through an openai.AsyncOpenAI client (the run's OpenAI-compatible endpoint) and returns the episode's reward (or None: the run's reward scores its final answer); or 'verifiers:TASKSET_ID', a verifiers environment whose tasks become the run's prompts (pip install 'rlx[verifiers]'). Needs pip install 'rlx[serve]'."""
  verifiers_config: str = ""
  """With env.agent='verifiers:TASKSET_ID': the rest of the verifiers environment's config as JSON (its SingleAgentEnvConfig: agent.harness, agent.runtime, timeout, taskset options); the runtime defaults to a local subprocess."""
  agent_timeout_s: float = 120.0
  """An agent program's episode that runs longer is cancelled; its group is dropped and counted."""
  trajectory: Literal["last", "longest"] = "last"
  """Which of an agent episode's trajectories is trained on when it has several (it rewrote its history, or asked for n > 1): 'last', the one of its last request; 'longest', the one with the most sampled tokens."""
  endpoint_host: str = "127.0.0.1"
  """Where the run's OpenAI-compatible endpoint listens (each episode's key is its API key)."""
  endpoint_port: int = 0
  """Its port; 0 picks a free one."""

  @property
  def enabled(self) -> bool:
    return bool(self.name.strip() or self.agent.strip())

  def __post_init__(self):
    _check(self.max_turns >= 1, "env.max_turns", "must be >= 1")
    _check(self.turn_max_new_tokens is None or self.turn_max_new_tokens >= 1,
           "env.turn_max_new_tokens", "must be >= 1 (or None: rollout.max_new_tokens)")
    _check(self.tool_workers >= 0, "env.tool_workers", "must be >= 0 (0 runs tools in the trainer)")
    _check(self.tool_memory_mb >= 0, "env.tool_memory_mb", "must be >= 0 (0 is unlimited)")
    _positive(self, "env", "max_tokens", "tool_timeout_s", "max_observation_chars",
              "step_timeout_s", "agent_timeout_s")
    _check(not (self.name.strip() and self.agent.strip()), "env.agent",
           f"an agent program and an environment (env.name={self.name!r}) both drive episodes; "
           "set one of them")
    _check(0 <= self.endpoint_port < 65536, "env.endpoint_port", "must be 0 (any free port) .. 65535")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
  """Orbax checkpoints of the whole training state."""

  every_steps: int = 50
  """Save every N steps (and on SIGTERM / SIGINT); 0 saves only at the end."""
  max_to_keep: int = 3
  """Checkpoints kept on disk (at least 1: a run always saves its last step)."""
  async_save: bool = True
  """Write checkpoints in the background while training goes on."""
  write_buffer_mb: int = 256
  """Host memory a save's writes may hold at once (raised to the largest array where that is
  larger). Orbax's own bound is 96 GB: a whole state's encoded copy in flight (SmolLM2-135M:
  1.5 GB above the state, for the length of the write)."""
  export_hf_every: int = 0
  """Also write the policy as a Hugging Face directory (WORKDIR/hf/step_N) every N steps; 0 never."""
  export_merged: bool = False
  """With LoRA, exports (hf/final, hf/step_N) are PEFT adapters; this also writes each merged into a whole Hugging Face model beside it (hf/final_merged, ...)."""
  stop_grace_s: float = 25.0
  """After a stop signal, how long the run may take to finish its step and save; past it, it
  exits with status 75 from the newest checkpoint on disk (a scheduler's grace period before
  SIGKILL is often 30 s). 0 waits for the step however long it takes."""

  def __post_init__(self):
    _check(self.every_steps >= 0, "checkpoint.every_steps", "must be >= 0 (0 saves only at the end)")
    _check(self.stop_grace_s >= 0, "checkpoint.stop_grace_s",
           "must be >= 0 (0 waits for the step however long it takes)")
    _check(self.export_hf_every >= 0, "checkpoint.export_hf_every", "must be >= 0 (0 never)")
    _check(self.write_buffer_mb > 0, "checkpoint.write_buffer_mb", "must be positive")
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
  wandb_project: str = ""
  """Also log every step to this Weights & Biases project (needs the wandb extra and a login, or WANDB_MODE=offline); a missing package, login or network prints one warning and the run goes on. '' never."""
  samples_every: int = 10
  """Every N steps, write the prompt, response, reward and verdict of a few sampled groups to WORKDIR/samples.jsonl (what the model actually generates); 0 never."""
  samples_groups: int = 2
  """Groups written to samples.jsonl each time (all their samples)."""
  samples_console: bool = False
  """Also print one of those samples (prompt, response, reward) on the console each time."""
  warn_after_steps: int = 10
  """Print one warning line when the run is not learning for this many steps in a row (every group's rewards equal, no reward at all, entropy collapsed, most responses truncated), naming the likely cause and the field to change; 0 never."""
  mismatch_every: int = 10
  """Split mode: every N batches, the generator recomputes its batch's log-probs with the learner's code under the weights that sampled it, for rollout/mismatch_kl (colocated runs measure it on every step for free); 0 never."""
  profile_steps: str = ""
  """'A:B' writes a jax.profiler trace of training steps A .. B-1 (counted from 0) to WORKDIR/profile (one folder per process; open it in TensorBoard or Perfetto); '' never."""

  def __post_init__(self):
    _positive(self, "logging", "every_steps")
    _check(self.mismatch_every >= 0, "logging.mismatch_every", "must be >= 0 (0 never)")
    _check(self.warn_after_steps >= 0, "logging.warn_after_steps", "must be >= 0 (0 never)")
    _check(self.samples_every >= 0, "logging.samples_every", "must be >= 0 (0 never)")
    _check(self.samples_groups >= 1, "logging.samples_groups", "must be >= 1")
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
  warmup_sft_until: float = 0.0
  """Stop the supervised warm-up early, once the model answers this share of a fixed sample of 256 training prompts exactly with their targets (greedy; checked every 2 steps); warmup_sft_steps is then the most it runs. 0 runs every step."""
  eval_prompts: int = 64
  """Held-out prompts scored (greedy) at each evaluation, before and after training; 0 evaluates never (and holds out no rows of a data file)."""
  eval_samples: int = 0
  """Also sample each held-out prompt this many times (at rollout.temperature) for eval/pass@k (k = 1, 2, 4, ..., N; the unbiased estimate) and eval/sampled_accuracy; 0 only answers greedily."""
  max_skipped_steps: int = 5
  """Updates whose loss or gradient norm is not finite are skipped (params unchanged); this many in a row stop the run."""
  pack_sequences: bool = False
  """Pack several sequences into each row of the learner's forward passes (the old and reference log-probs, the update), placed first-fit by length, each attending only to itself: the results are the unpacked ones, with less compute spent on padding. Pays where lengths vary (short answers beside long ones); a batch that packs into no fewer rows runs unpacked. train/pad_frac and train/packed_pad_frac say what it saved. The PPO critic runs unpacked."""
  share_prefix: bool = True
  """Forward a group's shared prompt once per packed row in the learner (the old and reference log-probs, the update), each sample's answer attending to it and to itself: the results are the row-per-sample ones, the prompt's compute paid once per group instead of once per sample. Applies where consecutive rows of a batch begin with the same tokens (a GRPO group's samples, in the micro-batch that holds them); otherwise the batch runs as pack_sequences says. train/packed_pad_frac and train/shared_prefix_frac say what it saved. The PPO critic runs unpacked."""
  compile_cache: str = "~/.cache/rlx/jax"
  """JAX's persistent compilation cache: a second run of the same programs loads them instead of compiling; '' turns it off."""
  hang_timeout_s: float = 1800.0
  """End the run, with every thread's stack and exit status 70, when this process has got nothing done for this long (no decode chunk, update, reward or compile) while not waiting on a peer job or a checkpoint write: a hung process then takes the run down loudly instead of holding its devices. 0 never."""

  def __post_init__(self):
    _positive(self, "trainer", "steps", "ppo_epochs", "mini_batches", "warmup_sft_learning_rate",
              "warmup_sft_batch", "max_skipped_steps")
    for name in ("eval_every", "warmup_sft_steps", "eval_prompts", "eval_samples",
                 "hang_timeout_s"):
      _check(getattr(self, name) >= 0, f"trainer.{name}", "must be >= 0")
    _check(0 <= self.warmup_sft_until <= 1, "trainer.warmup_sft_until",
           "must be a share of prompts in [0, 1] (0 runs every warm-up step)")
