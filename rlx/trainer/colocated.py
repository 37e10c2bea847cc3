"""The colocated training loop: generate -> score -> learn on the same devices, time-sliced,
always on-policy (every rollout comes from the current params).

    summary = train_colocated(config, workdir)

Each step: a batch of prompts from the data stream; ``group_size`` samples each
from the rollout engine (params resharded from the learning layout to the
generation layout in device memory); rewards from the host pool; with DAPO's
dynamic sampling, groups whose rewards are all equal are dropped and more
prompts drawn until the batch is full; then the learner's batch, old (and
reference) log-probs through the fused path, and one ``update_step``. Metrics
go to the sink; checkpoints every ``checkpoint.every_steps``, and on
SIGTERM / SIGINT before exiting. A workdir with a checkpoint resumes from it.

PPO (the critic) and split deployment are not handled here yet.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from rlx import algorithms, rollout, update
from rlx.checkpoint import Checkpointer, StopSignal
from rlx.config import ConfigError, RunConfig
from rlx.data import PromptStream, TaskSource, open_source
from rlx.mesh import Meshes, make_meshes
from rlx.metrics import MetricsSink
from rlx.models import build_model, builtin_tokenizer, load_tokenizer, param_shardings
from rlx.rewards import RewardPool
from rlx.sync import ReshardSync
from rlx.trainer.experience import build_batch
from rlx.trainer.warmup import warm_up


class DynamicSamplingError(RuntimeError):
  """DAPO's dynamic sampling could not fill a batch with groups of varied rewards."""


def verifier_name(config: RunConfig) -> str:
  if config.reward.name != "auto":
    return config.reward.name
  return config.data.source if config.data.source in ("arithmetic", "countdown") else "math"


@dataclasses.dataclass
class _Run:
  config: RunConfig
  meshes: Meshes
  tokenizer: object
  transformer: object
  engine: rollout.Engine
  sync: ReshardSync
  pool: RewardPool
  stream: PromptStream
  eval_rows: list


def _prepare(config: RunConfig, say) -> tuple[_Run, object]:
  if config.algorithm.name == "ppo":
    raise ConfigError("config.algorithm.name=ppo: the colocated loop does not train a critic yet")
  meshes = make_meshes(config.mesh)
  tokenizer = load_tokenizer(config.model.path) if config.model.path else builtin_tokenizer()
  model = build_model(config.model, meshes.learning, config.mesh.logical_axis_rules)
  if tokenizer.vocab_size > model.arch.vocab_size:
    raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab is "
                      f"{model.arch.vocab_size}")
  data = config.data
  source = open_source(data.source, prompt_field=data.prompt_field, answer_field=data.answer_field,
                       on_bad_row=data.on_bad_row, seed=data.shuffle_seed,
                       eval_fraction=data.eval_fraction)
  stream = PromptStream(source, batch_size=data.prompts_per_step, seed=data.shuffle_seed,
                        num_epochs=data.num_epochs, encode=tokenizer.encode_prompt)
  eval_rows = []
  if isinstance(source, TaskSource) and config.trainer.eval_prompts:
    eval_source = TaskSource(source.task, seed=data.shuffle_seed, split="eval",
                             eval_fraction=source.eval_fraction)
    eval_rows = [dict(eval_source[i], prompt_tokens=tokenizer.encode_prompt(eval_source[i]["prompt"]))
                 for i in range(config.trainer.eval_prompts)]
  engine = rollout.Engine(model.transformer, max_slots=config.rollout.max_slots,
                          max_len=config.rollout.max_prompt_len + config.rollout.max_new_tokens,
                          max_prompt_len=config.rollout.max_prompt_len, mesh=meshes.generation)
  sync = ReshardSync(param_shardings(model.arch, meshes.generation, config.mesh.logical_axis_rules))
  pool = RewardPool(verifier_name(config), format_weight=config.reward.format_weight,
                    num_workers=config.reward.num_workers, timeout_s=config.reward.timeout_s)
  if config.trainer.warmup_sft_steps:
    warm_stream = PromptStream(source, batch_size=32, seed=data.shuffle_seed + 1,
                               encode=tokenizer.encode_prompt)
    model, losses = warm_up(model, warm_stream, tokenizer, steps=config.trainer.warmup_sft_steps,
                            learning_rate=config.trainer.warmup_sft_learning_rate)
    say(f"rlx: supervised warm-up: {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
  run = _Run(config, meshes, tokenizer, model.transformer, engine, sync, pool, stream, eval_rows)
  return run, model


def _generate(run: _Run, params, rows, *, n, temperature, seed, version):
  r = run.config.rollout
  completions = rollout.generate(
      run.engine, [row["prompt_tokens"] for row in rows], params=params, n=n,
      max_new_tokens=r.max_new_tokens, temperature=temperature, top_p=r.top_p, top_k=r.top_k,
      stop_token_ids=run.tokenizer.eos_ids, seed=seed, policy_version=version)
  texts = [run.tokenizer.decode(c.response_tokens) for c in completions]
  rewards, counts = run.pool.score(texts, [rows[c.prompt_index]["answer"] for c in completions])
  return completions, rewards, counts


def evaluate(run: _Run, params) -> float | None:
  """Held-out accuracy (greedy): the share of prompts whose answer the verifier accepts."""
  if not run.eval_rows:
    return None
  _, rewards, _ = _generate(run, params, run.eval_rows, n=1, temperature=0.0, seed=0, version=0)
  return float(np.mean(rewards >= 1.0))


def _collect(run: _Run, params, step: int, version: int):
  """A full batch of groups; with dynamic sampling, only groups of varied rewards."""
  config, group = run.config, run.config.rollout.group_size
  wanted = config.data.prompts_per_step
  kept_completions, kept_rewards, counts_total, tries, dropped = [], [], {}, 0, 0
  while len(kept_completions) < wanted * group:
    if tries == 8:
      raise DynamicSamplingError(
          f"dynamic sampling kept {len(kept_completions) // group} of {wanted} groups after "
          f"{tries} draws: rewards are all equal in almost every group; make the task easier, "
          "raise rollout.group_size, or set config.algorithm.dynamic_sampling=false")
    rows = next(run.stream)
    completions, rewards, counts = _generate(
        run, params, rows, n=group, temperature=config.rollout.temperature,
        seed=config.trainer.seed * 1_000_003 + step * 101 + tries, version=version)
    for key, value in counts.items():
      counts_total[key] = counts_total.get(key, 0) + value
    keep = (np.asarray(algorithms.dynamic_sampling_keep(jnp.asarray(rewards), group))
            if config.algorithm.dynamic_sampling else np.ones(len(rewards), bool))
    dropped += int((~keep).sum()) // group
    for i in np.flatnonzero(keep):
      kept_completions.append(completions[i])
      kept_rewards.append(rewards[i])
    tries += 1
  n = wanted * group
  counts_total.update({"rollout/dropped_groups": dropped, "rollout/draws": tries})
  return kept_completions[:n], np.array(kept_rewards[:n], np.float32), counts_total


def train_colocated(config: RunConfig, workdir: str | pathlib.Path, say=print) -> dict:
  """Runs (or resumes) a colocated run; returns a summary with the eval accuracy before and after."""
  workdir = pathlib.Path(workdir)
  run, model = _prepare(config, say)
  optimizer, schedule = update.make_optimizer(config.optimizer, total_steps=config.trainer.steps)
  state = update.init_train_state(model.params, optimizer, jax.random.key(config.trainer.seed))
  ref_params = (jax.tree.map(jnp.copy, model.params)
                if config.algorithm.kl_coef > 0 or config.algorithm.kl_in_reward else None)
  step_fn = update.make_update_step(config, run.transformer, optimizer, schedule)
  logprobs_fn = update.make_logprobs_fn(config, run.transformer)
  checkpointer = Checkpointer(workdir / "checkpoints", config.checkpoint)
  restored = checkpointer.restore(state)
  start = 0
  if restored is not None:
    state, start = restored.state, restored.step
    run.stream.set_state(restored.data_state)
    say(f"rlx: resumed from {checkpointer.directory} at step {start}")
  run.sync.publish(state.params, int(state.policy_version))
  accuracy_before = evaluate(run, run.sync.latest()[0]) if start == 0 else None
  if accuracy_before is not None:
    say(f"rlx: held-out accuracy before RL: {accuracy_before:.1%}")
  sink = MetricsSink(workdir, config.logging, total_steps=config.trainer.steps,
                     resume_step=start if restored else None)
  step = start
  with StopSignal() as stop, sink:
    while step < config.trainer.steps and not stop.requested:
      started = time.perf_counter()
      gen_params, version = run.sync.latest()
      completions, rewards, counts = _collect(run, gen_params, step, version)
      generated = time.perf_counter()
      batch, stats = build_batch(completions, rewards, config, pad_id=run.tokenizer.pad_id)
      batch = jax.tree.map(jnp.asarray, batch)
      old = logprobs_fn(state.params, batch.tokens, batch.attention_mask, batch.response_mask)
      batch = batch.replace(old_logprobs=old)
      if ref_params is not None:
        batch = batch.replace(ref_logprobs=logprobs_fn(ref_params, batch.tokens,
                                                       batch.attention_mask, batch.response_mask))
      state, metrics = step_fn(state, batch)
      sync_seconds = run.sync.publish(state.params, int(state.policy_version))
      step += 1
      elapsed = time.perf_counter() - started
      tokens = sum(len(c.response_tokens) for c in completions)
      metrics = {**metrics, **stats, **counts,
                 "reward/accuracy": float(np.mean(rewards >= 1.0)),
                 "rollout/policy_lag_mean": 0.0, "rollout/policy_lag_max": 0.0,
                 "time/step_s": elapsed, "time/generate_s": generated - started,
                 "time/sync_s": sync_seconds, "throughput/tokens_per_s": tokens / elapsed}
      if config.trainer.eval_every and step % config.trainer.eval_every == 0:
        metrics["eval/accuracy"] = evaluate(run, run.sync.latest()[0])
      sink.write(step, metrics)
      if stop.requested or (config.checkpoint.every_steps and step % config.checkpoint.every_steps == 0):
        checkpointer.save(step, state, data_state=run.stream.get_state(),
                          meta={"policy_version": int(state.policy_version)})
    if stop.requested:
      say(f"rlx: {stop.received}: checkpoint saved at step {step}; rerun the same command to resume")
    elif config.checkpoint.every_steps == 0 or step % config.checkpoint.every_steps:
      checkpointer.save(step, state, data_state=run.stream.get_state(),
                        meta={"policy_version": int(state.policy_version)})
  checkpointer.close()
  accuracy_after = evaluate(run, run.sync.latest()[0])
  run.pool.close()
  return {"steps": step, "eval_accuracy_before": accuracy_before,
          "eval_accuracy_after": accuracy_after, "metrics": str(sink.jsonl_path),
          "checkpoints": str(checkpointer.directory), "stopped": stop.requested}

