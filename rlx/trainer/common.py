"""What the colocated and split loops share: building a run from its config, drawing and scoring
rollouts (with DAPO's dynamic sampling), held-out evaluation, and the learner.

    run = prepare(config, say)                      # meshes, model (+ warm-up), data, engine, pool
    learner = Learner(run, workdir)                 # train state, critic, reference, checkpoints
    draw = collect(run, gen_params, version, seed)  # a full batch of groups, scored
    metrics = learner.learn(draw)                   # one update (and the critic's)

The same ``Learner.learn`` runs in both deployments: the loss code never knows
how fresh its data is beyond what each rollout's policy version says.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from rlx import algorithms, distributed, rollout, update
from rlx.checkpoint import Checkpointer
from rlx.config import ConfigError, RunConfig
from rlx.data import PromptStream, TaskSource, open_source
from rlx.mesh import Meshes, make_meshes
from rlx.models import (
  Model,
  Tokenizer,
  build_model,
  builtin_tokenizer,
  load_tokenizer,
  param_shardings,
  save_pretrained,
)
from rlx.rewards import VERIFIERS, RewardPool, Scored
from rlx.rollout import Completion
from rlx.sync import OrbaxSync, ReshardSync
from rlx.trainer.experience import make_prepare, sample_arrays
from rlx.trainer.warmup import warm_up

Say = Callable[[str], None]


class TrainingError(RuntimeError):
  """The run cannot go on; the message says why, what to change and what is saved."""


class DynamicSamplingError(TrainingError):
  """DAPO's dynamic sampling could not fill a batch with groups of varied rewards."""


class NonFiniteError(TrainingError):
  """Too many updates in a row had a non-finite loss or gradient norm."""


def verifier_name(config: RunConfig) -> str:
  if config.reward.name != "auto":
    return config.reward.name
  return config.data.source if config.data.source in VERIFIERS else "math"


@dataclasses.dataclass
class Run:
  """A run's parts, built once from its config."""

  config: RunConfig
  meshes: Meshes
  tokenizer: Tokenizer
  model: Model
  engine: rollout.Engine
  sync: ReshardSync | OrbaxSync
  pool: RewardPool
  source: object
  """Where the prompts come from (a file or a built-in task)."""
  stream: PromptStream
  eval_rows: list[dict]
  workdir: pathlib.Path
  seconds: dict[str, float] = dataclasses.field(default_factory=dict)
  """Where the run's time went: start-up, warm-up, RL loop, evals (the closing summary)."""

  def close(self) -> None:
    self.pool.close()
    self.sync.close()


def prepare(config: RunConfig, workdir: str | pathlib.Path, say: Say = print) -> Run:
  """Meshes, tokenizer, model (warmed up when asked), prompt stream, eval rows, rollout engine,
  weight sync and reward pool."""
  workdir = pathlib.Path(workdir)
  processes = jax.process_count()
  if config.data.prompts_per_step % processes:
    raise ConfigError(f"config.data.prompts_per_step={config.data.prompts_per_step} does not "
                      f"split over {processes} processes (each samples its share of the "
                      f"prompts); choose a multiple of {processes}")
  # one side of a split run as its own job: every device of the job is that side's
  meshes = make_meshes(config.mesh if config.mesh.role == "both"
                       else dataclasses.replace(config.mesh, mode="colocated"))
  model = build_model(config.model, meshes.learning, config.mesh.logical_axis_rules)
  tokenizer = load_tokenizer(config.model.path) if config.model.path else builtin_tokenizer()
  if tokenizer.vocab_size > model.arch.vocab_size:
    raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab is "
                      f"{model.arch.vocab_size}; the tokenizer belongs to another model")
  data = config.data
  source = open_source(data.source, prompt_field=data.prompt_field, answer_field=data.answer_field,
                       on_bad_row=data.on_bad_row, seed=data.shuffle_seed,
                       eval_fraction=data.eval_fraction)
  if source.skipped:
    say(f"rlx: data: skipped {source.skipped} malformed row(s) (config.data.on_bad_row=skip); "
        f"the first: {source.first_skipped}")
  stream = PromptStream(source, batch_size=data.prompts_per_step, seed=data.shuffle_seed,
                        num_epochs=data.num_epochs, encode=tokenizer.encode_prompt,
                        max_prompt_tokens=config.rollout.max_prompt_len,
                        on_bad_row=data.on_bad_row)
  eval_rows = []
  if isinstance(source, TaskSource) and config.trainer.eval_prompts:
    eval_source = TaskSource(source.task, seed=data.shuffle_seed, split="eval",
                             eval_fraction=source.eval_fraction)
    eval_rows = [dict(eval_source[i], prompt_tokens=tokenizer.encode_prompt(eval_source[i]["prompt"]))
                 for i in range(config.trainer.eval_prompts)]
  r = config.rollout
  engine = rollout.Engine(model.transformer, max_slots=r.max_slots,
                          max_len=r.max_prompt_len + r.max_new_tokens,
                          max_prompt_len=r.max_prompt_len, mesh=meshes.generation)
  shardings = param_shardings(model.arch, meshes.generation, config.mesh.logical_axis_rules)
  # versions a reader may still be restoring stay on storage: k + 2 of them
  sync = (OrbaxSync(workdir / "policy_versions", shardings,
                    keep=max(config.mesh.max_staleness + 2, 2))
          if config.mesh.weight_sync == "orbax" else ReshardSync(shardings))
  pool = RewardPool(verifier_name(config), format_weight=config.reward.format_weight,
                    num_workers=config.reward.num_workers, timeout_s=config.reward.timeout_s)
  warmup_started = time.perf_counter()
  if config.trainer.warmup_sft_steps and config.mesh.role != "generator":  # it gets the learner's
    model = _warmed_up(config, model, source, tokenizer, meshes, workdir / "warmup", say)
  run = Run(config, meshes, tokenizer, model, engine, sync, pool, source, stream, eval_rows,
            workdir)
  run.seconds["warm-up"] = time.perf_counter() - warmup_started
  return run


def _warmed_up(config: RunConfig, model: Model, source, tokenizer: Tokenizer, meshes: Meshes,
               directory: pathlib.Path, say: Say) -> Model:
  """The model after the supervised warm-up, saved with its tokenizer in Hugging Face format
  under ``directory`` (a resumed run loads it from there instead of training it again; any run
  can start from it with ``--config.model.path``)."""
  if (directory / "config.json").is_file():
    say(f"rlx: supervised warm-up: loading the warmed-up model from {directory}")
    return build_model(dataclasses.replace(config.model, path=str(directory)), meshes.learning,
                       config.mesh.logical_axis_rules)
  trainer = config.trainer
  stream = PromptStream(source, batch_size=trainer.warmup_sft_batch,
                        seed=config.data.shuffle_seed + 1, encode=tokenizer.encode_prompt,
                        max_prompt_tokens=config.rollout.max_prompt_len, on_bad_row="skip")
  started = time.perf_counter()
  model, losses = warm_up(model, stream, tokenizer, steps=trainer.warmup_sft_steps,
                          learning_rate=trainer.warmup_sft_learning_rate)
  save_hf(model, tokenizer, directory)
  say(f"rlx: supervised warm-up: {len(losses)} steps in {time.perf_counter() - started:.0f}s, "
      f"loss per token {losses[0]:.3f} -> {losses[-1]:.3f}; saved to {directory}")
  return model


def save_hf(model: Model, tokenizer: Tokenizer, directory: pathlib.Path) -> pathlib.Path:
  """Writes ``model`` and ``tokenizer`` in Hugging Face format under a temporary name and
  renames it to ``directory`` when complete, so that a kill mid-write never leaves a
  half-written model where a later start would load it."""
  partial = directory.with_name(directory.name + ".partial")
  if jax.process_index() == 0 and partial.exists():
    shutil.rmtree(partial)
  save_pretrained(model, partial)
  if jax.process_index() == 0:
    tokenizer.save_pretrained(partial)
    if directory.exists():
      shutil.rmtree(directory)
    partial.rename(directory)
  return directory


def evaluation_due(config: RunConfig, step: int, stopping: bool) -> bool:
  """Whether the loop evaluates after ``step`` (never once the run is stopping)."""
  every = config.trainer.eval_every
  return bool(every and step % every == 0 and not stopping)


def begin(config: RunConfig, workdir: str | pathlib.Path,
          say: Say) -> tuple[Run, Learner, int | None, float | None]:
  """Builds a run and its learner, resumes from the newest checkpoint if there is one, publishes
  the first weights and (on a fresh run) measures the held-out accuracy before RL.

  Returns ``(run, learner, resumed_step or None, accuracy_before or None)``.
  """
  started = time.perf_counter()
  run = prepare(config, workdir, say)
  learner = Learner(run, say)
  start = learner.restore()
  if start is not None:
    say(f"rlx: resumed from {learner.checkpointer.directory} at step {start}")
  learner.publish()
  accuracy_before = evaluate(run, learner.generation_params()) if start is None else None
  if accuracy_before is not None:
    say(f"rlx: held-out accuracy before RL: {accuracy_before:.1%}")
  evals = run.seconds.setdefault("evals", 0.0)
  run.seconds["start-up"] = time.perf_counter() - started - run.seconds["warm-up"] - evals
  run.seconds["loop started"], run.seconds["evals before loop"] = time.perf_counter(), evals
  return run, learner, start, accuracy_before


def finish(run: Run, learner: Learner, *, start: int | None, step: int, stop, data_state: dict,
           accuracy_before: float | None, metrics_path: pathlib.Path, say: Say,
           save_meta: dict | None = None) -> dict:
  """Saves the last step (unless that save is already started), waits until it is on disk,
  and returns the run's summary with the held-out accuracy after RL (skipped after a stop
  signal, so that a stop takes seconds)."""
  seconds = run.seconds
  seconds["RL loop"] = (time.perf_counter() - seconds.pop("loop started")
                        - (seconds["evals"] - seconds.pop("evals before loop")))
  if step != (start or 0) and learner.saved_step != step:
    learner.save(step, data_state, **(save_meta or {}))
  learner.close()  # waits for every started save
  if run.stream.skipped:
    say(f"rlx: data: skipped {run.stream.skipped} prompt(s) longer than "
        f"config.rollout.max_prompt_len (config.data.on_bad_row=skip); the first: "
        f"{run.stream.first_skipped}")
  if stop.agree():
    saved = learner.checkpointer.latest_step()
    where = (f"checkpoint saved at step {saved} in {learner.checkpointer.directory}"
             if saved is not None else "no checkpoint to save yet")
    say(f"rlx: stopped by {stop.received} after step {step}: {where}; the final evaluation is "
        "skipped; rerun the same command to resume")
    accuracy_after = None
  else:
    accuracy_after = evaluate(run, learner.generation_params())
  run.close()
  return {"steps": step, "seconds": dict(seconds), "eval_accuracy_before": accuracy_before,
          "eval_accuracy_after": accuracy_after, "metrics": str(metrics_path),
          "checkpoints": str(learner.checkpointer.directory), "stopped": stop.agreed}


def generate_and_score(run: Run, params, rows: list[dict], *, n: int, temperature: float,
                       seed: int, version: int,
                       first_prompt_index: int = 0) -> tuple[list[Completion], Scored]:
  """``n`` samples of each row's prompt, and their rewards and verdicts from the host pool
  (``first_prompt_index``: where ``rows`` start in the batch the processes share)."""
  r = run.config.rollout
  completions = rollout.generate(
      run.engine, [row["prompt_tokens"] for row in rows], params=params, n=n,
      max_new_tokens=r.max_new_tokens, temperature=temperature, top_p=r.top_p, top_k=r.top_k,
      stop_token_ids=run.tokenizer.eos_ids, seed=seed, policy_version=version,
      first_prompt_index=first_prompt_index)
  texts = [run.tokenizer.decode(c.response_tokens) for c in completions]
  return completions, run.pool.score(texts, [rows[c.prompt_index]["answer"] for c in completions])


def evaluate(run: Run, params) -> float | None:
  """Held-out accuracy (greedy): the share of eval prompts whose answer the verifier accepts
  (a format bonus never counts). With several processes, each answers its share of the
  prompts and the accuracy is over all of them."""
  if not run.eval_rows:
    return None
  started = time.perf_counter()
  count, index = jax.process_count(), jax.process_index()
  rows = run.eval_rows[index::count]
  correct = 0.0
  if rows:
    _, scored = generate_and_score(run, params, rows, n=1, temperature=0.0, seed=0, version=0)
    correct = float(np.sum(scored.correct))
  total = distributed.sum_over_processes([correct])[0]
  run.seconds["evals"] = run.seconds.get("evals", 0.0) + time.perf_counter() - started
  return float(total / len(run.eval_rows))


@dataclasses.dataclass
class Draw:
  """A full batch of scored groups (this process's share of it), and what it cost."""

  completions: list[Completion]
  rewards: np.ndarray
  """float32 [N]: the reward of each kept completion."""
  correct: np.ndarray
  """bool [N]: the verifier's verdict on each kept completion."""
  counts: dict
  generate_seconds: float
  data_state: dict


def collect(run: Run, params_fn: Callable[[], tuple[object, int]], seed: int) -> Draw:
  """``prompts_per_step`` groups of ``group_size`` samples. With dynamic sampling, groups whose
  rewards are all equal are dropped and more prompts drawn (at most
  ``algorithm.dynamic_sampling_max_draws`` draws).

  ``params_fn()`` gives the (params, version) to sample with; it is asked before every
  draw, so a refill uses the newest policy the generator has.

  With several processes, every process draws the same prompt batches and samples its own
  contiguous share of them (groups never cross processes); they draw again as long as any
  of them lacks groups, so that their data streams and control flow stay the same, and the
  counts (``reward/mean`` ...) are over every process's samples.
  """
  config, group = run.config, run.config.rollout.group_size
  max_draws = config.algorithm.dynamic_sampling_max_draws
  wanted = config.data.prompts_per_step * group // jax.process_count()
  completions, rewards, correct, draws, dropped = [], [], [], 0, 0
  counts: dict[str, int] = {}
  sampled_reward, sampled_correct, sampled = 0.0, 0.0, 0  # every group drawn, kept or not
  started = time.perf_counter()
  while distributed.any_process(len(completions) < wanted):
    if draws == max_draws:
      raise DynamicSamplingError(
          f"dynamic sampling kept {len(completions) // group} of {wanted // group} groups after "
          f"{draws} draws: rewards are all equal in almost every group; make the task easier, "
          "raise config.rollout.group_size or config.algorithm.dynamic_sampling_max_draws, or set "
          "config.algorithm.dynamic_sampling=false")
    rows, first = distributed.local_share(next(run.stream), "prompts per step")
    params, version = params_fn()
    drawn, scored = generate_and_score(
        run, params, rows, n=group, temperature=config.rollout.temperature,
        seed=seed * max_draws + draws, version=version, first_prompt_index=first)
    scores = scored.rewards
    sampled_reward += float(np.sum(scores))
    sampled_correct += float(np.sum(scored.correct))
    sampled += len(scores)
    for key, value in scored.counts.items():
      counts[key] = counts.get(key, 0) + value
    keep = (np.asarray(algorithms.dynamic_sampling_keep(jnp.asarray(scores), group))
            if config.algorithm.dynamic_sampling else np.ones(len(scores), bool))
    dropped += int((~keep).sum()) // group
    completions += [drawn[i] for i in np.flatnonzero(keep)]
    rewards += [scores[i] for i in np.flatnonzero(keep)]
    correct += [scored.correct[i] for i in np.flatnonzero(keep)]
    draws += 1
  keys = sorted(counts)  # the pool's counts (the same keys on every process)
  totals = distributed.sum_over_processes(
      [sampled_reward, sampled_correct, sampled, dropped, *(counts[key] for key in keys)])
  counts = {key: int(total) for key, total in zip(keys, totals[4:])}
  counts.update({"rollout/dropped_groups": int(totals[3]), "rollout/draws": draws,
            # what the sampling policy produced, before dynamic sampling dropped any group
            "reward/mean": float(totals[0] / totals[2]),
            "reward/accuracy": float(totals[1] / totals[2])})
  return Draw(completions[:wanted], np.array(rewards[:wanted], np.float32),
              np.array(correct[:wanted], bool), counts,
              time.perf_counter() - started, run.stream.get_state())


class Learner:
  """The policy's train state (and the critic's, for PPO), the reference policy, the jitted
  steps and the checkpoints; ``learn`` turns a draw into one update."""

  def __init__(self, run: Run, say: Say = print):
    config = self.config = run.config
    self.say = say
    self.run = run
    updates = config.trainer.steps * config.trainer.ppo_epochs * config.trainer.mini_batches
    optimizer, schedule = update.make_optimizer(config.optimizer, total_steps=updates)
    algo, transformer = config.algorithm, run.model.transformer
    # One sharding plan: the params' logical axes and the batch's rows over (data, fsdp); every
    # jitted program of the learner has explicit shardings, so none retraces as steps go by.
    self.batch_sharding = update.batch_sharding(
        run.meshes.learning, config.mesh.logical_axis_rules,
        config.data.prompts_per_step * config.rollout.group_size)
    if not update.batch_is_split(self.batch_sharding) and run.meshes.learning.size > 1:
      say(f"rlx: warning: a batch of {config.data.prompts_per_step * config.rollout.group_size} "
          f"sequences does not split over the learning mesh {dict(run.meshes.learning.shape)}: "
          "every learning device computes the whole batch; make data.prompts_per_step x "
          "rollout.group_size a multiple of mesh data x fsdp")
    self.state = update.init_train_state(run.model.params, optimizer,
                                         jax.random.key(config.trainer.seed))
    self.state_shardings = jax.tree.map(lambda x: x.sharding, self.state)
    self.ref_params = jax.tree.map(jnp.copy, run.model.params) if algo.uses_reference else None
    self.step_fn = update.make_update_step(config, transformer, optimizer, schedule,
                                           state_shardings=self.state_shardings,
                                           batch_shardings=self.batch_sharding)
    self.critic = self.critic_step = None
    critic_shardings = None
    if algo.uses_critic:
      critic_optimizer, _ = update.make_optimizer(
          config.optimizer, total_steps=updates,
          peak=config.optimizer.critic_learning_rate)
      critic_params = update.init_critic_params(jax.tree.map(jnp.copy, run.model.params),
                                                jax.random.key(config.trainer.seed + 1))
      self.critic = update.init_train_state(critic_params, critic_optimizer,
                                            jax.random.key(config.trainer.seed + 1))
      critic_state_shardings = jax.tree.map(lambda x: x.sharding, self.critic)
      critic_shardings = critic_state_shardings.params
      self.critic_step = update.make_critic_step(config, transformer, critic_optimizer,
                                                 state_shardings=critic_state_shardings,
                                                 batch_shardings=self.batch_sharding)
    self.prepare_fn = make_prepare(config, transformer,
                                   param_shardings=self.state_shardings.params,
                                   critic_shardings=critic_shardings,
                                   batch_sharding=self.batch_sharding)
    self.kl_coef = algo.kl_coef
    self.skipped_steps = 0
    """Updates skipped so far (non-finite loss or gradient norm): ``train/skipped_steps``."""
    self.skipped_in_a_row = 0
    self.saved_step = None
    """The step of the newest save started by this learner (it may still be writing)."""
    self.restored_meta: dict = {}
    """The metadata of the checkpoint the learner resumed from (empty on a fresh run)."""
    self.checkpointer = Checkpointer(run.workdir / "checkpoints", config.checkpoint)
    self.abstract_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                        self.state.params)
    """The params' shapes and dtypes (what ``OrbaxSync.latest`` restores into)."""

  @property
  def version(self) -> int:
    return int(self.state.policy_version)

  def restore(self) -> int | None:
    """Resumes from the newest checkpoint, if any; returns its step."""
    restored = self.checkpointer.restore(self.state, like_critic=self.critic, say=self.say)
    if restored is None:
      return None
    self.state, self.critic = restored.state, restored.critic
    self.kl_coef = restored.meta.get("kl_coef", self.kl_coef)
    self.run.stream.set_state(restored.data_state)
    saved, now = restored.meta.get("data_fingerprint"), self.run.source.fingerprint()
    if saved is not None and saved != now:
      self.say(f"rlx: warning: the data changed since the checkpoint was written ({saved} then, "
               f"{now} now); the run resumes at the saved position of the changed data")
    self.saved_step = restored.step
    self.restored_meta = restored.meta
    return restored.step

  def save(self, step: int, data_state: dict, **meta) -> None:
    """Starts saving ``step`` (with ``meta`` beside the learner's own: version, KL
    coefficient, data fingerprint)."""
    self.saved_step = step
    self.checkpointer.save(step, self.state, critic=self.critic, data_state=data_state,
                           meta={"policy_version": self.version, "kl_coef": self.kl_coef,
                                 "data_fingerprint": self.run.source.fingerprint(), **meta})

  def checkpoint_due(self, step: int, stopping: bool) -> bool:
    every = self.config.checkpoint.every_steps
    return stopping or bool(every and step % every == 0)

  def export_due(self, step: int) -> pathlib.Path | None:
    """Writes the policy as a Hugging Face directory ``WORKDIR/hf/step_N`` every
    ``checkpoint.export_hf_every`` steps; returns where, or None."""
    every = self.config.checkpoint.export_hf_every
    if not every or step % every:
      return None
    model = dataclasses.replace(self.run.model, params=self.state.params)
    return save_hf(model, self.run.tokenizer, self.run.workdir / "hf" / f"step_{step}")

  def publish(self) -> float:
    """Hands the current params to the generator; returns the sync's seconds."""
    return self.run.sync.publish(self.state.params, self.version)

  def generation_params(self):
    """The newest published params, in the generation layout."""
    return self.run.sync.latest(like=self.abstract_params)[0]

  def learn(self, draw: Draw) -> dict:
    """The policy's updates on ``draw`` (``trainer.ppo_epochs`` passes of
    ``trainer.mini_batches`` optimizer steps, one jitted call), and the critic's."""
    config = self.config
    # every process lays its rows out at the same (bucketed) lengths: the batch is one array
    lengths = distributed.max_over_processes(
        [max(len(c.prompt_tokens) for c in draw.completions),
         max(len(c.response_tokens) for c in draw.completions)])
    sampled, stats = sample_arrays(draw.completions, draw.rewards, config,
                                   pad_id=self.run.tokenizer.pad_id, lengths=tuple(lengths))
    lag = self.version - sampled.policy_version
    sampled = distributed.global_tree(self.batch_sharding, sampled)
    batch = self.prepare_fn(self.state.params, self.ref_params,
                            None if self.critic is None else self.critic.params, sampled,
                            self.kl_coef)
    metrics = {}
    if self.critic is not None:
      self.critic, critic_metrics = self.critic_step(self.critic, batch)
      metrics.update(critic_metrics)
    self.state, step_metrics = self.step_fn(self.state, batch, self.kl_coef)
    metrics.update(step_metrics)
    metrics = distributed.to_host(metrics)  # replicated: the same values on every process
    self._count_skipped(int(metrics.pop("train/skipped")))
    algo = config.algorithm
    if algo.kl_target is not None and "policy/kl" in metrics:
      self.kl_coef = float(algorithms.adaptive_kl_coef(
          self.kl_coef, metrics["policy/kl"], algo.kl_target, algo.kl_horizon,
          steps=batch.batch_size))
    # this process's rows: every process has as many, so means of means are exact
    means = dict(stats, **{"reward/kept_accuracy": float(np.mean(draw.correct)),
                           "rollout/policy_lag_mean": float(lag.mean())})
    maxima = {"response/length_max": stats.pop("response/length_max"),
              "rollout/policy_lag_max": int(lag.max())}
    means.pop("response/length_max")
    totals = distributed.sum_over_processes(list(means.values())) / jax.process_count()
    metrics.update(zip(means, map(float, totals)))
    metrics.update(zip(maxima, map(int, distributed.max_over_processes(list(maxima.values())))))
    metrics.update(draw.counts)
    metrics.update({"train/skipped_steps": self.skipped_steps,
                    "data/skipped_rows": self.run.source.skipped + self.run.stream.skipped})
    return metrics

  def _count_skipped(self, skipped: int) -> None:
    """Counts updates skipped for a non-finite loss or gradient; stops the run after
    ``trainer.max_skipped_steps`` in a row."""
    self.skipped_steps += skipped
    self.skipped_in_a_row = self.skipped_in_a_row + skipped if skipped else 0
    limit = self.config.trainer.max_skipped_steps
    if self.skipped_in_a_row >= limit:
      self.checkpointer.wait()
      last = self.checkpointer.latest_step()
      saved = (f"the last good checkpoint is step {last} in {self.checkpointer.directory}"
               if last is not None else "no checkpoint was saved yet")
      raise NonFiniteError(
          f"{self.skipped_in_a_row} updates in a row had a non-finite loss or gradient norm and "
          f"were skipped (config.trainer.max_skipped_steps={limit}); {saved}. Lower "
          "config.optimizer.learning_rate or config.optimizer.max_grad_norm, or check the rewards")

  def close(self) -> None:
    self.checkpointer.close()
