"""Building a run from its config: meshes, tokenizer, model (warmed up when asked), prompt
stream, held-out rows, rollout engine, weight sync and reward pool.

    run = prepare(config, workdir, say)
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import pathlib
import time

import jax

from rlx import distributed, rollout
from rlx.config import ConfigError, RunConfig
from rlx.envs import ToolRunner, load_agent, load_factory
from rlx.data import DataError, PromptStream
from rlx.mesh import Meshes, make_meshes
from rlx.models import (
  Model,
  Tokenizer,
  build_model,
  builtin_tokenizer,
  load_tokenizer,
  param_shardings,
)
from rlx.rewards import RewardPool, check, from_config
from rlx.rewards.limits import _PROCESSES_WITHOUT_CGROUP
from rlx.rewards.sandbox import capabilities, check_rows
from rlx.models import lora
from rlx.sync import LoraSync, OrbaxSync, ReshardSync, WeightSync
from rlx.versions import DeltaSync
from rlx.trainer import control
from rlx.trainer.setup.prompts import check_episode_prompts, prompt_encoder, sources
from rlx.trainer.setup.warmup import warmed_up, warms_up, warmup_fingerprint
from rlx.trainer.common import Say
from rlx.trainer.episodes import EnvErrors


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Run:
  """A run's parts, built once from its config; no part is replaced afterwards (the learner
  takes the model's weights: ``Learner.for_run``)."""

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
  warmup_s: float = 0.0
  """Seconds the supervised warm-up took (0 without one)."""
  tools: ToolRunner | None = None
  """The tool workers of a multi-turn run (config.env)."""
  endpoint: object = None
  """The OpenAI-compatible endpoint agent programs call (config.env.agent), serving every batch
  of the run."""
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
  source, eval_rows = sources(config, tokenizer, say)
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
    check_episode_prompts(config, source, tokenizer)
  warmup_started = time.perf_counter()
  if warms_up(config) and config.mesh.role != "generator":  # it gets the learner's
    if config.model.path:
      say(f"rlx: supervised warm-up of {config.model.path}: "
          f"{config.trainer.warmup_sft_steps} steps at lr {config.trainer.warmup_sft_learning_rate} "
          "before RL (config.trainer.warmup_sft=always)")
    model = warmed_up(config, model, source, tokenizer, meshes, workdir / "warmup", say)
  sync = make_sync(config, model, meshes, workdir, prepare=engine.decode_params)
  tools = None
  if config.env.name:
    e = config.env
    tools = ToolRunner(num_workers=e.tool_workers, timeout_s=e.tool_timeout_s,
                       memory_mb=e.tool_memory_mb, max_chars=e.max_observation_chars)
  endpoint = agent_endpoint(config, engine, tokenizer) if config.env.agent else None
  return Run(config, meshes, tokenizer, model, engine, sync, pool, source, stream, eval_rows,
             workdir, warmup_s=time.perf_counter() - warmup_started, tools=tools,
             endpoint=endpoint)


def agent_endpoint(config: RunConfig, engine: rollout.Engine, tokenizer: Tokenizer):
  """The OpenAI-compatible endpoint a run's agent programs call, started."""
  from rlx.serve.endpoint import Endpoint  # noqa: PLC0415 - needs rlx[serve]

  e = config.env
  return Endpoint(engine, tokenizer, None, host=e.endpoint_host, port=e.endpoint_port,
                  episodes=True, tool_format=None if e.tool_format == "auto" else e.tool_format,
                  max_n=max(16, config.rollout.group_size)).start()


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


