"""Supervised warm-up: next-token cross-entropy on (prompt, reference answer) pairs, so that a
freshly initialised model learns the answer format before RL improves its answers.

The response a row is trained on is its ``sft_target`` (the built-in tasks give one), else
``<answer>{answer}</answer>``, followed by eos. A multi-turn run trains on a row's ``sft_turns``
when it has them: the assistant's turns and the messages between them (tool results), rendered
as the run's episodes render them (``Renderer.scripted``: its tool-call format, its chat
template's increments), the environment's parts context and not trained on; or on its
``sft_segments``, a list of ``[text, trained]`` pairs written out by hand.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rlx import cli, distributed, progress
from rlx.data import DataError
from rlx.models import Model, Tokenizer
from rlx.rollout import Completion
from rlx.trainer.draw import layout
from rlx.update import sequence_logprobs


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
