"""Supervised warm-up: whether a run warms up, the saved warm-up it reuses (``warmed_up``), and
the warm-up itself: next-token cross-entropy on (prompt, reference answer) pairs, so that a
freshly initialised model learns the answer format before RL improves its answers.

The response a row is trained on is its ``sft_target`` (the built-in tasks give one), else
``<answer>{answer}</answer>``, followed by eos. A multi-turn run trains on a row's ``sft_turns``
when it has them: the assistant's turns and the messages between them (tool results), rendered
as the run's episodes render them (``Renderer.scripted``: its tool-call format, its chat
template's increments), the environment's parts context and not trained on; or on its
``sft_segments``, a list of ``[text, trained]`` pairs written out by hand.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rlx import cli, distributed, progress
from rlx.config import RunConfig
from rlx.data import TASKS, DataError, PromptStream
from rlx.envs import Renderer
from rlx.mesh import Meshes
from rlx.models import Model, Tokenizer, build_model
from rlx.rollout import Completion
from rlx.trainer.common import NonFiniteError, Say
from rlx.trainer.draw import layout
from rlx.trainer.episodes import tool_format
from rlx.trainer.setup.policy_files import save_hf
from rlx.trainer.setup.prompts import episode_prompted, prompt_encoder
from rlx.update import all_finite, batch_sharding, sequence_logprobs


def target_text(row: dict) -> str:
  """What the warm-up teaches the model to write for a row."""
  if row.get("sft_target"):
    return str(row["sft_target"])
  if not row.get("answer"):
    raise DataError(f"{row.get('where', 'a row')}: the supervised warm-up needs an "
                    "'sft_target' or an answer to train on; set config.trainer.warmup_sft=never")
  return f"<answer>{row['answer']}</answer>"


def _response(row: dict, tokenizer: Tokenizer, renderer) -> tuple[list[int], list[bool]]:
  """A row's target response and which of its tokens are trained (``renderer``: a multi-turn
  run's, else None)."""
  if renderer is not None and row.get("sft_turns"):
    segments = renderer.scripted(row["sft_turns"])  # each assistant turn ends itself
  else:
    texts = (renderer is not None and row.get("sft_segments")) or [[target_text(row), True]]
    segments = [(tokenizer.encode(text, add_special_tokens=False), bool(trained))
                for text, trained in texts] + [([tokenizer.eos_id], True)]
  response, trained = [], []
  for ids, sampled in segments:
    response += ids
    trained += [sampled] * len(ids)
  return response, trained


def sft_batches(rows: Iterator[list[dict]], tokenizer: Tokenizer,
                renderer=None) -> Iterator[dict[str, np.ndarray]]:
  """Token arrays of prompt + target response (the response is what the loss sees). With
  the ``renderer`` of a multi-turn run (``rlx.envs.Renderer``), a row's ``sft_turns`` or
  ``sft_segments`` are its target when it has them."""
  for batch in rows:
    completions = []
    for row in batch:
      response, trained = _response(row, tokenizer, renderer)
      completions.append(Completion(prompt_tokens=row["prompt_tokens"], response_tokens=response,
                                    logprobs=[0.0] * len(response), policy_logprobs=[],
                                    finish_reason="stop", policy_version=0, prompt_index=0,
                                    sample_index=0, sampled_mask=trained))
    yield layout(completions, tokenizer.pad_id)


def exact_share(transformer, params, tokens: jax.Array, attention_mask: jax.Array,
                response_mask: jax.Array) -> jax.Array:
  """The share of rows whose every response token is the model's most likely one after the
  tokens before it: the rows greedy decoding answers exactly with their target. Logits are
  made one row at a time, so a large vocabulary costs one row's worth."""
  hidden, _ = transformer.hidden_states(params, tokens, attention_mask)

  def exact(row):
    h, t, m = row
    predicted = jnp.argmax(transformer.logits(params, h[:-1]), axis=-1)
    return jnp.all((predicted == t[1:]) | ~m[1:])

  return jnp.mean(jax.lax.map(exact, (hidden, tokens, response_mask.astype(bool))))


def sft_optimizer(learning_rate: float, steps: int) -> optax.GradientTransformation:
  return optax.adamw(optax.warmup_cosine_decay_schedule(
      0.0, learning_rate, max(steps // 10, 1), max(steps, 2)), weight_decay=0.0)


def sft_step(transformer, optimizer: optax.GradientTransformation, rows=None):
  """The warm-up's jitted step: (params, opt_state, tokens, attention_mask, response_mask) ->
  (params, opt_state, loss), the loss token-mean cross-entropy on the responses."""

  @jax.jit
  def step(params, opt_state, tokens, attention_mask, response_mask):
    def loss_fn(params):
      logprobs, _ = sequence_logprobs(transformer, params, tokens, attention_mask, response_mask,
                                      rows=rows)
      return -jnp.sum(logprobs) / jnp.maximum(response_mask.sum(), 1)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def warm_up(model: Model, rows: Iterator[list[dict]], tokenizer: Tokenizer, *, steps: int,
            learning_rate: float, renderer=None, say=None,
            every_s: float = 15.0, until: float = 0.0, probe: dict | None = None,
            check_every: int = 2, row_sharding=None) -> tuple[Model, list[float]]:
  """Up to ``steps`` AdamW steps of token-mean cross-entropy on the responses; returns the
  model and the loss of every step. ``say``: told where it is at most every ``every_s`` seconds.
  ``renderer``: a multi-turn run's (rows' ``sft_turns`` / ``sft_segments``), see ``sft_batches``.

  ``until`` > 0 with ``probe`` (``sft_batches`` arrays of a fixed sample of rows): stops once
  that share of the probe's rows is answered exactly (``exact_share``), checked every
  ``check_every`` steps; where a fixed number of steps leaves a fresh model anywhere on the
  steep part of its learning curve, this starts RL from the same skill whatever the seed.
  ``row_sharding``: how a batch's rows lie on the model's mesh (``rlx.update.batch_sharding``), so the
  log-prob kernel runs per device on its rows (``rlx.kernels.fused_logprobs``)."""
  optimizer = sft_optimizer(learning_rate, steps)
  transformer = model.transformer
  step = sft_step(transformer, optimizer, row_sharding)
  params = model.params
  opt_state = optimizer.init(params)
  losses = []
  batches = sft_batches(rows, tokenizer, renderer)
  progress.doing("the supervised warm-up")
  started = told = time.perf_counter()
  compiled = None  # when the first step (which compiles) was done: the rate counts from it
  probing = until > 0 and probe is not None
  if probing:
    share = jax.jit(functools.partial(exact_share, transformer))
    probe = {key: probe[key] for key in ("tokens", "attention_mask", "response_mask")}
  for done in range(1, steps + 1):
    arrays = next(batches)
    with progress.running("the warm-up step"):
      params, opt_state, loss = step(params, opt_state, arrays["tokens"],
                                     arrays["attention_mask"], arrays["response_mask"])
      losses.append(float(loss))
    progress.tick()
    if distributed.any_process(cli.stopped_at_start()):  # a signal its exception missed
      cli.end_start_up()
    if probing and done % check_every == 0 and done < steps:
      reached = float(share(params, **probe))
      # one decision for every process: they would otherwise train different models
      if distributed.agree(reached >= until):
        if say is not None:
          say(f"rlx: supervised warm-up: {reached:.0%} of the probe's prompts answered exactly "
              f"(the target: {until:.0%}) after {done} steps; stopping there")
        break
    now = time.perf_counter()
    compiled = now if compiled is None else compiled
    if say is not None and now - told >= every_s and 1 < done < steps:
      told = now
      left = (now - compiled) / (done - 1) * (steps - done)
      say(f"rlx: supervised warm-up: step {done}/{steps}, loss per token {losses[-1]:.3f} "
          f"({now - started:.0f}s, about {left:.0f}s left)")
  return model.replace(params=params), losses


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


def warmed_up(config: RunConfig, model: Model, source, tokenizer: Tokenizer, meshes: Meshes,
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
  rows = episode_prompted(config, tokenizer, stream) if config.env.name else stream
  renderer = None
  if config.env.enabled:  # the targets' tool calls and results as the episodes write them
    renderer = Renderer(tokenizer, tool_format(config, tokenizer))
  probe = None
  if trainer.warmup_sft_until:  # a fixed sample of the prompts, in another order
    sample = PromptStream(source, batch_size=PROBE_ROWS, seed=config.data.shuffle_seed + 2,
                          encode=prompt_encoder(config, tokenizer),
                          max_prompt_tokens=config.rollout.max_prompt_len, on_bad_row="skip")
    probe = next(sft_batches(episode_prompted(config, tokenizer, sample) if config.env.name
                             else sample, tokenizer, renderer))
  model, losses = warm_up(model, rows, tokenizer, steps=trainer.warmup_sft_steps,
                          learning_rate=trainer.warmup_sft_learning_rate,
                          renderer=renderer, say=say,
                          until=trainer.warmup_sft_until, probe=probe,
                          row_sharding=batch_sharding(meshes.learning,
                                                      config.mesh.logical_axis_rules,
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
