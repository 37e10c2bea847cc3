"""What every loop shares, apart from the learner (``rlx.trainer.learner``): building a run
from its config, drawing and scoring rollouts (with DAPO's dynamic sampling, across processes),
held-out evaluation, and the errors that stop a run.

    run = prepare(config, workdir, say)             # meshes, model (+ warm-up), data, engine, pool
    draw = collect(run, params_fn, seed)            # a full batch of groups, scored
    accuracy = evaluate(run, params)                # greedy, held-out prompts
"""

from __future__ import annotations

import dataclasses
import pathlib
import queue
import shutil
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from rlx import algorithms, distributed, rollout
from rlx.config import ConfigError, RunConfig
from rlx.data import TASKS, DataError, PromptStream, TaskSource, hold_out, open_source
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
from rlx.rewards import RewardPool, Scored, check, from_config
from rlx.rewards.sandbox import capabilities
from rlx.rollout import Completion
from rlx.sync import OrbaxSync, ReshardSync, WeightSync
from rlx.trainer import control
from rlx.trainer.warmup import warm_up

Say = Callable[[str], None]


class TrainingError(RuntimeError):
  """The run cannot go on; the message says why, what to change and what is saved."""


class DynamicSamplingError(TrainingError):
  """DAPO's dynamic sampling could not fill a batch with groups of varied rewards."""


class NonFiniteError(TrainingError):
  """Too many updates in a row had a non-finite loss or gradient norm."""


@dataclasses.dataclass
class Run:
  """A run's parts, built once from its config."""

  config: RunConfig
  meshes: Meshes
  tokenizer: Tokenizer
  model: Model
  engine: rollout.Engine
  sync: WeightSync
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


def check_reward(config: RunConfig) -> dict | None:
  """Raises RewardError (naming the file and function) when the run's reward cannot be
  imported, and SandboxUnavailable when it is 'code' and this system cannot isolate programs;
  returns the sandbox's capabilities for 'code'."""
  reward = from_config(config.reward, config.data.source)
  check(reward)
  return capabilities() if reward.name == "code" else None


def prepare(config: RunConfig, workdir: str | pathlib.Path, say: Say = print) -> Run:
  """Meshes, tokenizer, model (warmed up when asked), prompt stream, eval rows, rollout engine,
  weight sync and reward pool."""
  workdir = pathlib.Path(workdir)
  sandbox = check_reward(config)  # an unusable reward is reported before the model is built
  if sandbox:
    say(f"rlx: code sandbox: namespaces {', '.join(sandbox['namespaces'])}; {sandbox['user']}; "
        "seccomp, rlimits, no network, a tmpfs root")
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
  source, eval_rows = _sources(config, tokenizer, say)
  stream = PromptStream(source, batch_size=config.data.prompts_per_step,
                        seed=config.data.shuffle_seed, num_epochs=config.data.num_epochs,
                        encode=tokenizer.encode_prompt,
                        max_prompt_tokens=config.rollout.max_prompt_len,
                        on_bad_row=config.data.on_bad_row,
                        # a generator job of several: its own share of the prompts
                        shard=((config.mesh.generator_id, config.mesh.generators)
                               if config.mesh.role == "generator" else (0, 1)))
  r = config.rollout
  engine = rollout.Engine(model.transformer, max_slots=r.max_slots,
                          max_len=r.max_prompt_len + r.max_new_tokens,
                          max_prompt_len=r.max_prompt_len, mesh=meshes.generation,
                          decode_steps=r.decode_steps)
  shardings = param_shardings(model.arch, meshes.generation, config.mesh.logical_axis_rules)
  # versions a reader may still be restoring stay on storage: k + 2 of them
  # the learner job's writes go on in the background (a reader in another job sees only
  # complete versions); in one process the generator thread reads the same manager
  sync = (OrbaxSync(workdir / "policy_versions", shardings, like=model.params,
                    keep=control.bound(config) + 2,
                    asynchronous=config.mesh.role == "learner")
          if config.mesh.weight_sync == "orbax" else ReshardSync(shardings))
  pool = RewardPool(from_config(config.reward, config.data.source), num_workers=config.reward.num_workers,
                    timeout_s=config.reward.timeout_s, memory_mb=config.reward.memory_mb,
                    batch_size=config.reward.batch_size)
  warmup_started = time.perf_counter()
  if warms_up(config) and config.mesh.role != "generator":  # it gets the learner's
    if config.model.path:
      say(f"rlx: supervised warm-up of {config.model.path}: "
          f"{config.trainer.warmup_sft_steps} steps at lr {config.trainer.warmup_sft_learning_rate} "
          "before RL (config.trainer.warmup_sft=always)")
    model = _warmed_up(config, model, source, tokenizer, meshes, workdir / "warmup", say)
  run = Run(config, meshes, tokenizer, model, engine, sync, pool, source, stream, eval_rows,
            workdir)
  run.seconds["warm-up"] = time.perf_counter() - warmup_started
  return run


def _sources(config: RunConfig, tokenizer: Tokenizer, say: Say) -> tuple[object, list[dict]]:
  """The training source and the held-out rows (tokenized): a built-in task's eval split, the
  rows of data.eval_source, or data.eval_fraction of the data file, held out."""
  data, wanted = config.data, config.trainer.eval_prompts
  options = dict(prompt_field=data.prompt_field, answer_field=data.answer_field,
                 on_bad_row=data.on_bad_row, seed=data.shuffle_seed,
                 eval_fraction=data.eval_fraction)
  source = open_source(data.source, **options)
  if source.skipped:
    say(f"rlx: data: skipped {source.skipped} malformed row(s) (config.data.on_bad_row=skip); "
        f"the first: {source.first_skipped}")
  held = None
  if wanted and data.eval_source:
    held = open_source(data.eval_source, **dict(options, split="eval"))
  elif wanted and isinstance(source, TaskSource):
    held = TaskSource(source.task, seed=data.shuffle_seed, split="eval",
                      eval_fraction=source.eval_fraction)
  elif wanted:
    total = len(source)
    source, held = hold_out(source, data.eval_fraction)
    say(f"rlx: data: {len(held)} of the {total} rows of {data.source} are held out for "
        f"evaluation, never trained on (data.eval_fraction={data.eval_fraction}); give "
        "data.eval_source, or set trainer.eval_prompts=0 to train on every row")
  eval_rows, too_long = [], 0
  for i in range(min(wanted, len(held)) if held is not None else 0):
    row = held[i]
    try:
      tokens = tokenizer.encode_prompt(row["prompt"])
    except ValueError as error:
      raise DataError(f"{row['where']}: {error}") from None
    if len(tokens) > config.rollout.max_prompt_len:
      too_long += 1
      continue
    eval_rows.append(dict(row, prompt_tokens=tokens))
  if too_long:
    say(f"rlx: eval: {too_long} held-out prompt(s) are longer than config.rollout.max_prompt_len="
        f"{config.rollout.max_prompt_len} and are left out; {len(eval_rows)} are scored")
  if held is not None and not eval_rows:
    raise DataError(f"no held-out prompt fits config.rollout.max_prompt_len="
                    f"{config.rollout.max_prompt_len}; raise it")
  return source, eval_rows


def warms_up(config: RunConfig) -> bool:
  """Whether the run starts with the supervised warm-up: by default only the built-in model on
  a built-in task (a real checkpoint already knows how to answer; see trainer.warmup_sft)."""
  trainer = config.trainer
  if not trainer.warmup_sft_steps or trainer.warmup_sft == "never":
    return False
  return trainer.warmup_sft == "always" or (config.model.path is None
                                            and config.data.source in TASKS)


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


def device_memory() -> dict[str, float]:
  """``device/memory_in_use_gib`` and ``device/memory_peak_gib``: the fullest local device,
  where the backend reports memory (GPU, TPU); nothing on CPU."""
  stats = [d.memory_stats() for d in jax.local_devices()]
  stats = [s for s in stats if s and "bytes_in_use" in s]
  if not stats:
    return {}
  gib = 1024 ** 3
  return {"device/memory_in_use_gib": max(s["bytes_in_use"] for s in stats) / gib,
          "device/memory_peak_gib": max(s.get("peak_bytes_in_use", s["bytes_in_use"])
                                        for s in stats) / gib}


def throughput(draw: Draw, seconds: float) -> dict[str, float]:
  """``throughput/tokens_per_s`` and ``throughput/samples_per_s`` of a step that took
  ``seconds``, counting every process's share of the batch (call it on every process)."""
  tokens, samples = distributed.sum_over_processes(
      [sum(len(c.response_tokens) for c in draw.completions), len(draw.completions)])
  return {"throughput/tokens_per_s": float(tokens) / seconds,
          "throughput/samples_per_s": float(samples) / seconds}


def evaluation_due(config: RunConfig, step: int, stopping: bool) -> bool:
  """Whether the loop evaluates after ``step`` (never once the run is stopping)."""
  every = config.trainer.eval_every
  return bool(every and step % every == 0 and not stopping)


def generate_and_score(run: Run, params, rows: list[dict], *, n: int, temperature: float,
                       seed: int, version: int,
                       first_prompt_index: int = 0) -> tuple[list[Completion], Scored]:
  """``n`` samples of each row's prompt, and their rewards and verdicts from the host pool
  (``first_prompt_index``: where ``rows`` start in the batch the processes share). Each
  completion is scored as soon as it finishes, while the others are still decoding."""
  r = run.config.rollout
  scorer = _Scorer(run, rows)
  try:
    completions = rollout.generate(
        run.engine, [row["prompt_tokens"] for row in rows], params=params, n=n,
        max_new_tokens=r.max_new_tokens, temperature=temperature, top_p=r.top_p, top_k=r.top_k,
        stop_token_ids=run.tokenizer.eos_ids, seed=seed, policy_version=version,
        first_prompt_index=first_prompt_index, on_finished=scorer.submit)
  finally:
    parts = scorer.finish()
  return completions, _in_order(completions, parts)


class _Scorer:
  """Scores completions in a thread as generation hands them over, in batches of whatever
  has finished since the last call of the pool."""

  def __init__(self, run: Run, rows: list[dict]):
    self.run, self.rows = run, rows
    self.queue: queue.Queue[Completion | None] = queue.Queue()
    self.parts: list[tuple[list[Completion], Scored]] = []
    self.error: BaseException | None = None
    self.thread = threading.Thread(target=self._work, name="rlx-scorer", daemon=True)
    self.thread.start()

  def submit(self, completion: Completion) -> None:
    self.queue.put(completion)

  def _work(self) -> None:
    done = False
    while not done:
      batch = [self.queue.get()]
      while True:
        try:
          batch.append(self.queue.get_nowait())
        except queue.Empty:
          break
      done = batch[-1] is None
      batch = [c for c in batch if c is not None]
      if not batch or self.error is not None:
        continue
      try:
        texts = [self.run.tokenizer.decode(c.response_tokens) for c in batch]
        self.parts.append((batch, self.run.pool.score(
            texts, [self.rows[c.prompt_index] for c in batch])))
      except BaseException as error:  # noqa: BLE001 - raised in the generating thread
        self.error = error

  def finish(self) -> list[tuple[list[Completion], Scored]]:
    self.queue.put(None)
    self.thread.join()
    if self.error is not None:
      raise self.error
    return self.parts


def _in_order(completions: list[Completion],
              parts: list[tuple[list[Completion], Scored]]) -> Scored:
  """One ``Scored`` for ``completions`` from the parts scored as they finished."""
  where = {(c.prompt_index, c.sample_index): i for i, c in enumerate(completions)}
  count = len(completions)
  rewards, correct = np.zeros(count, np.float32), np.zeros(count, bool)
  counts: dict[str, int] = {"reward/errors": 0, "reward/timeouts": 0}
  components: dict[str, np.ndarray] = {}
  for batch, scored in parts:
    index = [where[(c.prompt_index, c.sample_index)] for c in batch]
    rewards[index], correct[index] = scored.rewards, scored.correct
    for key, value in scored.counts.items():
      counts[key] = counts.get(key, 0) + value
    for name, values in scored.components.items():
      components.setdefault(name, np.full(count, np.nan, np.float32))[index] = values
  return Scored(rewards, correct, counts, components)


def evaluate(run: Run, params) -> dict[str, float]:
  """Held-out metrics: ``eval/accuracy``, the share of eval prompts whose greedy answer is
  correct (a format bonus never counts); with ``trainer.eval_samples`` = n, also
  ``eval/pass@n`` (some sample of n correct) and ``eval/sampled_accuracy`` (the share of
  samples correct). Empty when there are no eval rows. With several processes, each answers
  its share of the prompts and the metrics are over all of them."""
  if not run.eval_rows:
    return {}
  started = time.perf_counter()
  count, index = jax.process_count(), jax.process_index()
  rows = run.eval_rows[index::count]
  n = run.config.trainer.eval_samples
  totals = np.zeros(3)  # greedy correct, prompts with a correct sample, correct samples
  if rows:
    _, scored = generate_and_score(run, params, rows, n=1, temperature=0.0, seed=0, version=0)
    totals[0] = np.sum(scored.correct)
    if n:
      completions, scored = generate_and_score(run, params, rows, n=n,
                                               temperature=run.config.rollout.temperature,
                                               seed=1, version=0)
      solved = np.zeros(len(rows), bool)
      for completion, correct in zip(completions, scored.correct):
        solved[completion.prompt_index] |= correct
      totals[1], totals[2] = solved.sum(), np.sum(scored.correct)
  totals = distributed.sum_over_processes(totals)
  run.seconds["evals"] = run.seconds.get("evals", 0.0) + time.perf_counter() - started
  prompts = len(run.eval_rows)
  metrics = {"eval/accuracy": float(totals[0] / prompts)}
  if n:
    metrics.update({f"eval/pass@{n}": float(totals[1] / prompts),
                    "eval/sampled_accuracy": float(totals[2] / (prompts * n))})
  return metrics


def _component_key(name: str) -> str:
  """The metric of a reward's named component (never one of the loop's own reward metrics)."""
  own = ("mean", "accuracy", "errors", "timeouts")
  return f"reward/{name}" if name not in own else f"reward/component_{name}"


@dataclasses.dataclass
class Draw:
  """A full batch of scored groups (this process's share of it), and what it cost."""

  completions: list[Completion]
  rewards: np.ndarray
  """float32 [N]: the reward of each kept completion."""
  correct: np.ndarray
  """bool [N]: the verifier's verdict on each kept completion."""
  counts: dict
  """Metrics of the draw: reward mean and accuracy, errors, dropped groups, components..."""
  generate_seconds: float
  data_state: dict
  temperature: float | None = None
  """The sampling temperature (an entropy controller may have raised it); None: rollout.temperature."""
  born: float = 0.0
  """Wall-clock time (``time.time()``) sampling started: the data's age is measured from it."""


def collect(run: Run, params_fn: Callable[[], tuple[object, int]], seed: int,
            temperature: float | None = None) -> Draw:
  """``prompts_per_step`` groups of ``group_size`` samples. With dynamic sampling, groups whose
  rewards are all equal are dropped and more prompts drawn (at most
  ``algorithm.dynamic_sampling_max_draws`` draws).

  ``params_fn()`` gives the (params, version) to sample with; it is asked before every
  draw, so a refill uses the newest policy the generator has. ``temperature`` overrides
  ``rollout.temperature`` (the entropy controller's).

  With several processes, every process draws the same prompt batches and samples its own
  contiguous share of them (groups never cross processes); they draw again as long as any
  of them lacks groups, so that their data streams and control flow stay the same, and the
  counts (``reward/mean`` ...) are over every process's samples.
  """
  config, group = run.config, run.config.rollout.group_size
  max_draws = config.algorithm.dynamic_sampling_max_draws
  wanted = config.data.prompts_per_step * group // jax.process_count()
  completions, rewards, correct, draws, dropped, alike = [], [], [], 0, 0, 0
  counts: dict[str, int] = {}
  sampled_reward, sampled_correct, sampled = 0.0, 0.0, 0  # every group drawn, kept or not
  parts: dict[str, list[float]] = {}  # a reward's named components: [sum, count]
  started, born = time.perf_counter(), time.time()
  temperature = config.rollout.temperature if temperature is None else temperature
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
        run, params, rows, n=group, temperature=temperature, seed=seed * max_draws + draws,
        version=version, first_prompt_index=first)
    scores = scored.rewards
    sampled_reward += float(np.sum(scores))
    sampled_correct += float(np.sum(scored.correct))
    sampled += len(scores)
    for key, value in scored.counts.items():
      counts[key] = counts.get(key, 0) + value
    for name, values in scored.components.items():
      given = values[~np.isnan(values)]
      part = parts.setdefault(name, [0.0, 0])
      part[0], part[1] = part[0] + float(given.sum()), part[1] + given.size
    varied = np.asarray(algorithms.dynamic_sampling_keep(jnp.asarray(scores), group))
    alike += int((~varied).sum()) // group  # groups with a zero group-relative advantage
    keep = varied if config.algorithm.dynamic_sampling else np.ones(len(scores), bool)
    dropped += int((~keep).sum()) // group
    completions += [drawn[i] for i in np.flatnonzero(keep)]
    rewards += [scores[i] for i in np.flatnonzero(keep)]
    correct += [scored.correct[i] for i in np.flatnonzero(keep)]
    draws += 1
  keys = sorted(counts)  # the pool's counts (the same keys on every process)
  names = distributed.union_over_processes(parts)  # components may differ between processes
  totals = distributed.sum_over_processes(
      [sampled_reward, sampled_correct, sampled, dropped, alike, *(counts[key] for key in keys),
       *(value for name in names for value in parts.get(name, (0.0, 0)))])
  counts = {key: int(total) for key, total in zip(keys, totals[5:5 + len(keys)])}
  for i, name in enumerate(names):
    part_sum, part_count = totals[5 + len(keys) + 2 * i:7 + len(keys) + 2 * i]
    if part_count:
      counts[_component_key(name)] = float(part_sum / part_count)
  counts.update({"rollout/dropped_groups": int(totals[3]), "rollout/draws": draws,
            # what the sampling policy produced, before dynamic sampling dropped any group
            "reward/mean": float(totals[0] / totals[2]),
            "reward/accuracy": float(totals[1] / totals[2]),
            # of every group drawn: samples that all scored alike give no gradient
            "advantage/zero_groups_frac": float(totals[4] * group / totals[2])})
  return Draw(completions[:wanted], np.array(rewards[:wanted], np.float32),
              np.array(correct[:wanted], bool), counts,
              time.perf_counter() - started, run.stream.get_state(), temperature, born)
