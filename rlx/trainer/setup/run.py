"""Building a run from its config: meshes, tokenizer, model (warmed up when asked), prompt
stream, held-out rows, rollout engine, weight sync and reward pool.

    run = prepare(config, workdir, say)
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import math
import pathlib
import shutil
import time

import jax

from rlx import distributed, rollout
from rlx.config import ConfigError, RunConfig
from rlx.envs import Renderer, ToolRunner, load_agent, load_factory, verifiers
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
from rlx.rewards import RewardPool, check, from_config
from rlx.rewards.limits import _PROCESSES_WITHOUT_CGROUP
from rlx.rewards.sandbox import capabilities, check_rows
from rlx.models import lora
from rlx.sync import LoraSync, OrbaxSync, ReshardSync, WeightSync
from rlx.versions import DeltaSync
from rlx.trainer import control
from rlx.trainer.common import EpisodesFailedError, NonFiniteError, Say
from rlx.trainer.episodes import EnvErrors, Episodes, tool_format
from rlx.update import all_finite, batch_sharding
from rlx.trainer.setup.warmup import sft_batches, warm_up


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
  tools: ToolRunner | None = None
  """The tool workers of a multi-turn run (config.env)."""
  tool_latencies: list[tuple[str, float]] = dataclasses.field(default_factory=list)
  """(tool name, seconds) of each tool call since the metrics last took them."""
  samples_written: float = 0.0
  """When sample episodes were last written (``time.time()``)."""
  endpoint: object = None
  """The OpenAI-compatible endpoint agent programs call (config.env.agent), once started."""
  agent_error: str | None = None
  """The first error an agent program raised (for the message when no group survives)."""
  env_errors: EnvErrors = dataclasses.field(default_factory=EnvErrors)
  """The rows whose environment could not start, and the first error (config.env)."""

  def close(self) -> None:
    self.pool.close()
    self.sync.close()
    if self.tools is not None:
      self.tools.close()
    if self.endpoint is not None:
      self.endpoint.stop()


def check_reward(config: RunConfig) -> dict | None:
  """Raises RewardError (naming the file and function) when the run's reward cannot be
  imported, and SandboxUnavailable when it is 'code' and this system cannot isolate programs;
  returns the sandbox's capabilities for 'code'."""
  reward = from_config(config.reward, config.data.source)
  check(reward)
  return capabilities() if reward.name == "code" else None


def _check_code_rows(config: RunConfig, source, eval_rows: list[dict], sample: int = 64) -> None:
  """The ``code`` reward's tests on up to ``sample`` rows spread over the data, and every
  held-out row, checked before the warm-up and the first step (rows without tests would score
  0 forever)."""
  step = max(len(source) // sample, 1)
  try:
    check_rows([source[i] for i in range(0, len(source), step)][:sample] + eval_rows,
               from_config(config.reward, config.data.source).code)
  except ValueError as error:
    raise DataError(str(error)) from None


def prepare(config: RunConfig, workdir: str | pathlib.Path, say: Say = print) -> Run:
  """Meshes, tokenizer, model (warmed up when asked), prompt stream, eval rows, rollout engine,
  weight sync and reward pool."""
  workdir = pathlib.Path(workdir)
  sandbox = check_reward(config)  # an unusable reward is reported before the model is built
  if config.env.name:
    try:
      load_factory(config.env.name)
    except ValueError as error:
      raise ConfigError(f"config.env.name: {error}") from None
  if config.env.agent:
    try:
      load_agent(config.env.agent, config.env.verifiers_config)
    except ValueError as error:
      raise ConfigError(f"config.env.agent: {error}") from None
    missing = [name for name in ("fastapi", "uvicorn", "openai", "httpx")
               if importlib.util.find_spec(name) is None]
    if missing:
      raise ConfigError(f"config.env.agent: agent programs call the run's OpenAI-compatible "
                        f"endpoint, which needs {', '.join(missing)}: pip install 'rlx[serve]'")
  if sandbox:
    say(f"rlx: code sandbox: namespaces {', '.join(sandbox['namespaces'])}; {sandbox['user']}; "
        f"seccomp, rlimits, no network, a tmpfs root; memory: {sandbox['memory']}")
    if not sandbox.get("cgroup"):  # the address space is what a program may use, not RSS
      share = config.reward.code_memory_mb // _PROCESSES_WITHOUT_CGROUP
      say(f"rlx: warning: without a memory cgroup a program gets {share} MiB of address space "
          f"per process (config.reward.code_memory_mb={config.reward.code_memory_mb} / "
          f"{_PROCESSES_WITHOUT_CGROUP}), and the interpreter takes ~30 MiB of it: raise "
          "code_memory_mb if the tasks' programs need more, or run where cgroup v2 is delegated")
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
  if sandbox:
    _check_code_rows(config, source, eval_rows)
  stream = PromptStream(source, batch_size=config.data.prompts_per_step,
                        seed=config.data.shuffle_seed, num_epochs=config.data.num_epochs,
                        encode=prompt_encoder(config, tokenizer),
                        max_prompt_tokens=config.rollout.max_prompt_len,
                        on_bad_row=config.data.on_bad_row,
                        # a generator job of several: its own share of the prompts
                        shard=((config.mesh.generator_id, config.mesh.generators)
                               if config.mesh.role == "generator" else (0, 1)))
  r = config.rollout
  # an agent program's later requests hold its earlier turns in their prompts
  engine = rollout.Engine(model.transformer, max_slots=r.max_slots,
                          max_len=r.max_prompt_len + r.max_new_tokens,
                          # (or an episode released while its environment works, prefilled
                          # again whole)
                          max_prompt_len=(r.max_prompt_len + r.max_new_tokens - 1
                                          if config.env.agent or config.env.release_slots
                                          else r.max_prompt_len),
                          mesh=meshes.generation,
                          decode_steps=r.decode_steps, min_decode_width=r.min_decode_width,
                          layout=None if r.cache_layout == "auto" else r.cache_layout)
  pool = RewardPool(from_config(config.reward, config.data.source), num_workers=config.reward.num_workers,
                    timeout_s=config.reward.timeout_s, memory_mb=config.reward.memory_mb,
                    batch_size=config.reward.batch_size, log_path=workdir / "reward.log")
  if config.env.name:  # before minutes of warm-up: the episodes' first prompts must fit
    _check_episode_prompts(config, source, tokenizer)
  warmup_started = time.perf_counter()
  if warms_up(config) and config.mesh.role != "generator":  # it gets the learner's
    if config.model.path:
      say(f"rlx: supervised warm-up of {config.model.path}: "
          f"{config.trainer.warmup_sft_steps} steps at lr {config.trainer.warmup_sft_learning_rate} "
          "before RL (config.trainer.warmup_sft=always)")
    model = _warmed_up(config, model, source, tokenizer, meshes, workdir / "warmup", say)
  sync = make_sync(config, model, meshes, workdir, prepare=engine.decode_params)
  tools = None
  if config.env.name:
    e = config.env
    tools = ToolRunner(num_workers=e.tool_workers, timeout_s=e.tool_timeout_s,
                       memory_mb=e.tool_memory_mb, max_chars=e.max_observation_chars)
  run = Run(config, meshes, tokenizer, model, engine, sync, pool, source, stream, eval_rows,
            workdir, tools=tools)
  run.seconds["warm-up"] = time.perf_counter() - warmup_started
  return run


def make_sync(config: RunConfig, model: Model, meshes: Meshes, workdir: pathlib.Path,
              prepare=None) -> WeightSync:
  """How the learner's versions reach the generator (``mesh.weight_sync``). With LoRA only the
  adapters cross: ``LoraSync`` over a sync in the adapters' layout, merging them into the
  generator's copy of ``model`` (the base, after any warm-up; a generator job of a warmed-up
  run loads the learner's warm-up when the first version has landed). ``prepare``: the form
  the generator keeps each version in (the engine's ``decode_params``)."""
  decoding = {} if prepare is None else {"prepare": prepare}
  # a sync's own copy (resharded or restored) is prepared in place, one array at a time
  owning = {} if prepare is None else {"prepare": functools.partial(prepare, owned=True)}
  rules = config.mesh.logical_axis_rules
  lora_config = config.model.lora
  if lora_config.enabled:
    shardings = lora.adapter_shardings(model.arch, lora_config, meshes.generation, rules)
    like = jax.eval_shape(lambda: lora.init_adapters(model.arch, lora_config, jax.random.key(0)))
  else:
    shardings = param_shardings(model.arch, meshes.generation, rules)
    like = model.params
  # versions a reader may still be restoring stay on storage: k + 3 of them. A learner job
  # only writes them: in the background, while it trains the next batch (its generator's gate
  # waits until the version is on storage).
  # with LoRA the inner sync ships adapters, and the merged model is what the generator keeps
  inner = {} if lora_config.enabled else owning
  keep = control.bound(config) + 3
  if config.mesh.weight_sync == "orbax":
    sync = OrbaxSync(workdir / "policy_versions", shardings, like=like, keep=keep,
                     asynchronous=config.mesh.role == "learner", **inner)
  elif config.mesh.weight_sync == "delta":
    sync = DeltaSync(workdir / "policy_versions", shardings, like=like, keep=keep,
                     whole_every=config.mesh.whole_version_every, **inner)
  else:
    sync = ReshardSync(shardings, **inner)
  if not lora_config.enabled:
    return sync
  generation = param_shardings(model.arch, meshes.generation, rules)
  if config.mesh.role == "generator" and warms_up(config):
    # the learner's warmed-up base, loaded once its first version is out
    warmed = dataclasses.replace(config.model, path=str(workdir / "warmup"))
    base = lambda: build_model(warmed, meshes.generation, rules).params  # noqa: E731
  else:
    base = functools.partial(_generation_copy, model.params, generation)
  return LoraSync(sync, base, lora_config.scale, reference=base_reference(config, workdir),
                  reference_file=workdir / "lora_base.json", **decoding)


def _generation_copy(params, shardings):
  """``params`` in the generation layout (this process's devices with several processes)."""
  if jax.process_count() > 1:
    params = distributed.local_replica(params)
  return jax.device_put(params, shardings)


def base_reference(config: RunConfig, workdir: pathlib.Path) -> dict:
  """Which base a LoRA run's adapters belong to: its path and fingerprint (the model
  directory's files, or the built-in model's arch and seed, plus the warm-up's settings)."""
  warmed = warms_up(config)
  path = config.model.path
  return {"path": str(workdir / "warmup") if warmed else (path or "the built-in model"),
          "fingerprint": lora.model_fingerprint(path, config.model.arch, config.model.seed,
                                                warmup_fingerprint(config) if warmed else None)}


def _named(open_source, field: str, path: str, **options):
  """``open_source(path)``, its refusal naming the config field that gave the path."""
  try:
    return open_source(path, **options)
  except DataError as error:
    if f"config.{field}" in str(error):
      raise
    raise DataError(f"config.{field}={path!r}: {error}") from None


def _sources(config: RunConfig, tokenizer: Tokenizer, say: Say) -> tuple[object, list[dict]]:
  """The training source and the held-out rows (tokenized): a built-in task's eval split, the
  rows of data.eval_source, or data.eval_fraction of the data file, held out."""
  data, wanted = config.data, config.trainer.eval_prompts
  options = dict(prompt_field=data.prompt_field, answer_field=data.answer_field,
                 answer_format=data.answer_format, on_bad_row=data.on_bad_row,
                 seed=data.shuffle_seed,
                 eval_fraction=data.eval_fraction)
  taskset = verifiers.taskset_id(config.env.agent)
  if taskset is not None:  # a verifiers environment: its tasks are the prompts
    source = verifiers.TaskRows(taskset, config.env.verifiers_config)
    say(f"rlx: data: the {len(source)} tasks of the verifiers taskset {source.taskset} are the "
        f"prompts (config.data.source={data.source!r} is not read)")
    data = dataclasses.replace(data, eval_source="")
  else:
    source = _named(open_source, "data.source", data.source, **options)
  if source.skipped:
    say(f"rlx: data: skipped {source.skipped} malformed row(s) (config.data.on_bad_row=skip); "
        f"the first: {source.first_skipped}")
  held = None
  if wanted and data.eval_source:
    held = _named(open_source, "data.eval_source", data.eval_source, **dict(options, split="eval"))
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
      tokens = prompt_encoder(config, tokenizer)(row["prompt"])
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


def _episode_prompted(config: RunConfig, tokenizer: Tokenizer, batches):
  """Warm-up batches whose prompts are what the episodes will see: each row's environment's
  first messages with the tools' schemas (a row whose reset fails is left out)."""
  episodes = Episodes(config, tokenizer, [], 1)
  try:
    for batch in batches:
      first = len(episodes.prompts)
      episodes.add(batch)
      yield [dict(row, prompt_tokens=prompt) for row, prompt in
             zip(episodes.rows[first:], episodes.prompts[first:])]
      for p in range(first, len(episodes.prompts)):
        episodes.forget(p)
  finally:
    episodes.close()


def _check_episode_prompts(config: RunConfig, source, tokenizer: Tokenizer, rows: int = 8) -> None:
  """Starts the environments of the first ``rows`` rows once, as the episodes will (their
  first messages with the tools' schemas), and refuses a prompt past rollout.max_prompt_len
  now rather than at the first draw. Every row's reset failing ends the run here, in one
  ``env.step_timeout_s``: their resets run at once."""
  probe = PromptStream(source, batch_size=min(rows, len(source)), seed=config.data.shuffle_seed,
                       encode=prompt_encoder(config, tokenizer), on_bad_row="skip")
  rows = next(probe)
  episodes = Episodes(config, tokenizer, rows, 1)
  episodes.close()
  if rows and episodes.failed_rows == len(rows):
    raise EpisodesFailedError(episodes.errors.none_started(config, len(rows), "tried at start"))


def prompt_encoder(config: RunConfig, tokenizer: Tokenizer):
  """``encode(prompt) -> ids``: a row's prompt rendered as the run renders every prompt, with
  ``data.system_prompt`` and ``data.chat_template_kwargs``."""
  return functools.partial(tokenizer.encode_prompt, system=config.data.system_prompt,
                           template_kwargs=config.data.template_kwargs)


def warms_up(config: RunConfig) -> bool:
  """Whether the run starts with the supervised warm-up: by default only the built-in model on
  a built-in task (a real checkpoint already knows how to answer; see trainer.warmup_sft)."""
  trainer = config.trainer
  if not trainer.warmup_sft_steps or trainer.warmup_sft == "never":
    return False
  return trainer.warmup_sft == "always" or (config.model.path is None
                                            and config.data.source in TASKS)


PROBE_ROWS = 256
"""The prompts ``trainer.warmup_sft_until`` is judged on."""

FINGERPRINT = "rlx_warmup.json"
"""The settings a saved warm-up was made with, beside its weights."""


def warmup_fingerprint(config: RunConfig) -> dict:
  """What the supervised warm-up's result depends on: a saved warm-up is reused only when
  every one of these is the same."""
  t = config.trainer
  return json.loads(json.dumps({"model.path": config.model.path, "model.seed": config.model.seed,
          "model.arch": dataclasses.asdict(config.model.arch),
          "data.source": config.data.source, "data.shuffle_seed": config.data.shuffle_seed,
          "data.system_prompt": config.data.system_prompt,
          "data.chat_template_kwargs": config.data.chat_template_kwargs,
          "rollout.max_prompt_len": config.rollout.max_prompt_len,
          "env.enabled": config.env.enabled,
          # an environment's first messages (tool schemas) are the warm-up's prompts
          **({"env.name": config.env.name} if config.env.name else {}),
          "trainer.warmup_sft_steps": t.warmup_sft_steps,
          "trainer.warmup_sft_learning_rate": t.warmup_sft_learning_rate,
          "trainer.warmup_sft_batch": t.warmup_sft_batch,
          **({"trainer.warmup_sft_until": t.warmup_sft_until} if t.warmup_sft_until else {})
          }))  # as it reads back


def _read_fingerprint(directory: pathlib.Path) -> dict | None:
  try:
    return json.loads((directory / FINGERPRINT).read_text())
  except (OSError, ValueError):
    return None


def _warmed_up(config: RunConfig, model: Model, source, tokenizer: Tokenizer, meshes: Meshes,
               directory: pathlib.Path, say: Say) -> Model:
  """The model after the supervised warm-up, saved with its tokenizer in Hugging Face format
  under ``directory`` (a resumed run loads it from there instead of training it again; any run
  can start from it with ``--config.model.path``)."""
  wanted = warmup_fingerprint(config)
  made = _read_fingerprint(directory)
  # every process takes the lead's view of the files: one decision, one warm-up or none
  stale = distributed.agree((directory / "config.json").is_file() and made != wanted)
  if stale:
    aside = directory.with_name(f"{directory.name}.stale-{time.strftime('%Y%m%d-%H%M%S')}")
    changed = sorted(k for k in wanted if (made or {}).get(k) != wanted[k])
    if jax.process_index() == 0:
      directory.rename(aside)
    say("rlx: supervised warm-up: the one in the workdir was made with other settings ("
        + (", ".join(f"{k}: {made.get(k)!r} -> {wanted[k]!r}" for k in changed) if made
           else "an older rlx that did not record them")
        + f"); moved it to {aside} and warming up again")
  if (directory / "config.json").is_file():
    say(f"rlx: supervised warm-up: loading the warmed-up model from {directory}")
    loaded = build_model(dataclasses.replace(config.model, path=str(directory)), meshes.learning,
                         config.mesh.logical_axis_rules)
    if _finite(loaded.params):
      return loaded
    aside = directory.with_name(f"{directory.name}.nonfinite-{time.strftime('%Y%m%d-%H%M%S')}")
    if jax.process_index() == 0:
      directory.rename(aside)
    say(f"rlx: supervised warm-up: the saved model holds NaN or inf (written by an earlier "
        f"version); moved it to {aside} and warming up again")
  trainer = config.trainer
  stream = PromptStream(source, batch_size=trainer.warmup_sft_batch,
                        seed=config.data.shuffle_seed + 1,
                        encode=prompt_encoder(config, tokenizer),
                        max_prompt_tokens=config.rollout.max_prompt_len, on_bad_row="skip")
  started = time.perf_counter()
  rows = _episode_prompted(config, tokenizer, stream) if config.env.name else stream
  renderer = None
  if config.env.enabled:  # the targets' tool calls and results as the episodes write them
    renderer = Renderer(tokenizer, tool_format(config, tokenizer))
  probe = None
  if trainer.warmup_sft_until:  # a fixed sample of the prompts, in another order
    sample = PromptStream(source, batch_size=PROBE_ROWS, seed=config.data.shuffle_seed + 2,
                          encode=prompt_encoder(config, tokenizer),
                          max_prompt_tokens=config.rollout.max_prompt_len, on_bad_row="skip")
    probe = next(sft_batches(_episode_prompted(config, tokenizer, sample) if config.env.name
                             else sample, tokenizer, renderer))
  model, losses = warm_up(model, rows, tokenizer, steps=trainer.warmup_sft_steps,
                          learning_rate=trainer.warmup_sft_learning_rate,
                          renderer=renderer, say=say,
                          until=trainer.warmup_sft_until, probe=probe,
                          row_sharding=batch_sharding(meshes.learning, config.mesh.logical_axis_rules,
                                              trainer.warmup_sft_batch))
  if not (all(map(math.isfinite, losses)) and _finite(model.params)):
    bad = next((i for i, loss in enumerate(losses) if not math.isfinite(loss)), None)
    raise NonFiniteError(
        "the supervised warm-up made the weights NaN or inf" + (
            f" (its loss was {losses[bad]} at step {bad + 1})" if bad is not None else
            " although its loss stayed finite") + f"; nothing was saved. Lower "
        f"config.trainer.warmup_sft_learning_rate={trainer.warmup_sft_learning_rate}")
  save_hf(model, tokenizer, directory)
  if jax.process_index() == 0:
    (directory / FINGERPRINT).write_text(json.dumps(wanted, indent=1))
  say(f"rlx: supervised warm-up: {len(losses)} steps in {time.perf_counter() - started:.0f}s, "
      f"loss per token {losses[0]:.3f} -> {losses[-1]:.3f}; saved to {directory}")
  return model


def _finite(params) -> bool:
  return bool(jax.jit(all_finite)(params))


def save_hf(model: Model, tokenizer: Tokenizer, directory: pathlib.Path) -> pathlib.Path:
  """Writes ``model`` and ``tokenizer`` in Hugging Face format under a temporary name and
  renames it to ``directory`` when complete, so that a kill mid-write never leaves a
  half-written model where a later start would load it."""
  return _written_whole(directory, tokenizer, functools.partial(save_pretrained, model))


def save_adapter(adapters, arch, lora_config, tokenizer: Tokenizer, directory: pathlib.Path,
                 base_path: str | None = None) -> pathlib.Path:
  """Writes LoRA ``adapters`` in the PEFT format, with the tokenizer, as ``save_hf`` writes a
  model (whole or not at all)."""
  return _written_whole(directory, tokenizer, functools.partial(
      lora.save_peft, adapters, arch, lora_config, base_path=base_path))


def _written_whole(directory: pathlib.Path, tokenizer: Tokenizer, write) -> pathlib.Path:
  """``write(path)`` and the tokenizer into a temporary directory, renamed to ``directory``."""
  partial = directory.with_name(directory.name + ".partial")
  if jax.process_index() == 0 and partial.exists():
    shutil.rmtree(partial)
  write(partial)
  if jax.process_index() == 0:
    tokenizer.save_pretrained(partial)
    if directory.exists():
      shutil.rmtree(directory)
    partial.rename(directory)
  return directory
