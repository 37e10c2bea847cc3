"""What the engine's programs pass between them: prefilled prompts, per-slot sampling settings,
the decode state of the slots, and what a decode chunk produced (``rlx.rollout.engine`` uses
them; they are pytrees, so the programs take and return them whole); and the programs that
rearrange a decode state without the model: exchanging slots, resizing the KV cache."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from rlx.models.transformer import POSITION_AXIS, Cache, cache_layout

NO_STOP = -1


@struct.dataclass
class Prefix:
  """Prefilled prompts: their KV cache (for P rows of B positions, laid out as the model's),
  last-token logits [P, V] and lengths [P]."""

  cache: Cache
  logits: jax.Array
  true_length: jax.Array


@struct.dataclass
class SamplingParams:
  """Per-slot sampling settings (arrays, so changing them never recompiles)."""

  temperature: jax.Array  # float [n]
  top_k: jax.Array  # int [n]
  top_p: jax.Array  # float [n]
  max_new_tokens: jax.Array  # int [n]
  stop_ids: jax.Array  # int [n, max_stop_tokens], NO_STOP-padded


@struct.dataclass
class DecodeState:
  """Everything about the S decode slots."""

  cache: Cache
  last_token: jax.Array  # int [S]: the token sampled last (input of the next step)
  last_logprob: jax.Array  # [S] its behaviour log-prob
  last_policy_logprob: jax.Array  # [S] its log-prob under the untruncated policy
  generated: jax.Array  # int [S] response tokens so far
  active: jax.Array  # bool [S] slot holds an unfinished request
  finished: jax.Array  # bool [S] the last token ended the request
  stopped: jax.Array  # bool [S] it ended on a stop token (else on the length limit)
  keys: jax.Array  # [S] PRNG key of each slot's request
  sampling: SamplingParams


@struct.dataclass
class StepResult:
  """What one ``generate`` call produced, per decode step and slot: [decode_steps, S]."""

  tokens: jax.Array  # int
  logprobs: jax.Array  # behaviour log-probs
  policy_logprobs: jax.Array
  emitted: jax.Array  # bool: the slot produced a token at this step
  finished: jax.Array  # bool: that token ended its request
  stopped: jax.Array  # bool: ... on a stop token


@functools.partial(jax.jit, donate_argnums=0)
def swap_slots(state: DecodeState, a: jax.Array, b: jax.Array) -> DecodeState:
  """``state`` with slots ``a[i]`` and ``b[i]`` exchanged: their caches, last tokens, keys and
  sampling settings, everything a slot holds (in place: ``state`` is donated). Pairs whose
  indices are ``>= S`` are padding and change nothing."""
  src, dst = jnp.concatenate([a, b]), jnp.concatenate([b, a])

  def move(x, axis=0):
    rows = jnp.take(x, src, axis=axis, mode="clip")
    return x.at[(slice(None),) * axis + (dst,)].set(rows, mode="drop")

  cache = dict(state.cache)
  slot_axis = 1 if cache_layout(cache) == "stacked" else 0
  for name in ("k", "v"):
    cache[name] = jax.tree.map(lambda x: move(x, slot_axis), cache[name])
  rest = jax.tree.map(move, state.replace(cache={}))
  return rest.replace(cache={name: x if name in ("k", "v") else move(x)
                             for name, x in cache.items()})


def cache_len(state: DecodeState) -> int:
  """The KV cache length (positions per slot) of a decode state."""
  return state.cache["valid"].shape[1]


@functools.partial(jax.jit, static_argnums=1)
def resize_cache(state: DecodeState, length: int) -> DecodeState:
  """``state`` with a KV cache of ``length`` positions: cut, or padded with empty ones."""
  cache = dict(state.cache)
  old = cache_len(state)

  def fit(x, axis):
    if length <= old:
      return jax.lax.slice_in_dim(x, 0, length, axis=axis)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, length - old)
    return jnp.pad(x, pad)

  layout = cache_layout(cache)
  for name in ("k", "v"):
    cache[name] = jax.tree.map(lambda x, axis=POSITION_AXIS[layout, name]: fit(x, axis),
                               cache[name])
  cache["valid"] = fit(cache["valid"], 1)
  return state.replace(cache=cache)


def slot_axes(state: DecodeState) -> DecodeState:
  """The slot axis of every array of a decode state (a stacked cache's keys and values hold
  it second, after the layers)."""
  axes = jax.tree.map(lambda _: 0, state)
  if cache_layout(state.cache) == "stacked":
    axes = axes.replace(cache=dict(axes.cache, k=1, v=1))
  return axes


def np_stop_ids(stop_token_ids, width: int) -> np.ndarray:
  """Stop ids padded with NO_STOP to ``width``."""
  ids = list(stop_token_ids)
  if len(ids) > width:
    raise ValueError(f"{len(ids)} stop tokens exceed the engine's max_stop_tokens={width}")
  return np.array(ids + [NO_STOP] * (width - len(ids)), np.int32)
