"""The generation engine, after JetStream's engine contract: ``prefill``, ``insert``, ``generate``
over a fixed number of decode slots, with static shapes.

- ``prefill(params, tokens, true_length) -> Prefix``: runs prompts (a batch of P,
  right-padded to a length bucket) and returns their KV cache and the logits of
  their last real token.
- ``insert(prefix, decode_state, slots, rows, keys, sampling) -> decode_state``:
  copies prefix row ``rows[i]`` into decode slot ``slots[i]`` and samples its
  first token there. The first token is drawn at insert rather than at prefill
  so that the n samples of one prompt (a GRPO group) share one prefill yet draw
  independent first tokens.
- ``extend(params, decode_state, slots, tokens, ...) -> decode_state``: appends tokens to
  parked slots' caches (a multi-turn episode's environment turn) and samples their next token:
  the context already in the cache is never computed again.
- ``generate(params, decode_state) -> (decode_state, StepResult)``: up to
  ``decode_steps`` tokens for every active slot in one dispatch (a jitted while loop that
  samples on device and stops early once every slot has finished), attending only to
  the filled part of the cache, rounded up to a power of two.

The KV cache is laid out for the engine's platform (see ``rlx.models.transformer``):
``stacked`` on TPU, ``per_layer`` on GPU and CPU. In the ``per_layer`` layout the decode
state's cache is as long as the attention bucket, not ``max_len``: it is grown (or shrunk)
by one copy when the bucket changes, so that a step reads whole buffers and never copies a
slice of them, and the chunk slices each layer's weights once. (XLA:GPU and XLA:CPU copy a
layer's slice of a stacked array before a matmul reads it: compiled for H100, a 16-token
chunk at Qwen2.5-0.5B shapes, 64 slots, 1088 cached positions moves 6.1 GB per token
stacked and 3.5 GB per layer, by ``rlx.hlo_traffic``. XLA:TPU reads the stacked cache in
place, and converting the per-layer one's tiling would cost it more.)

All three are jitted once per shape bucket; params are arguments, so new
weights are used without recompiling. Every random draw of a request uses
``fold_in(request_key, token_index)``: samples do not depend on which slot a
request lands in or on what else is running.

Shapes: S slots, M ``max_len`` (prompt + response), L layers, K kv heads,
E head_dim, V vocab, P prompts in one prefill, B a prompt length bucket.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlx import mesh as mesh_lib
from rlx.models.transformer import (CacheLayout, Params, Transformer, cache_layout,
                                    logical_axes, param_shapes, unstack_layers)
from rlx.rollout.sampling import sample
from rlx.rollout.state import (  # noqa: F401 - part of the engine's interface
    NO_STOP, DecodeState, Prefix, SamplingParams, StepResult, cache_len, np_stop_ids,
    resize_cache, slot_axes)


def _buckets(limit: int, smallest: int) -> tuple[int, ...]:
  sizes, size = [], smallest
  while size < limit:
    sizes.append(size)
    size *= 2
  return tuple(sizes) + (limit,)


@dataclasses.dataclass(frozen=True)
class Engine:
  """Slots, buckets and the jitted contract functions for one transformer.

  Attributes:
    transformer: the model (static).
    max_slots: number of decode slots S.
    max_len: cache length per slot (prompt + response).
    max_prompt_len: longest prompt; prompt lengths are bucketed by powers of two up to it.
    mesh: where the engine runs; params and the KV cache are sharded over its
      ``tensor`` axis (kv heads) and slots over ``data``. None: one device.
    max_stop_tokens: room for stop ids per request.
    decode_steps: tokens per ``generate`` dispatch (1 is the single-step reference path).
    platform: the platform the engine compiles for ('cpu', 'gpu', 'tpu'); None: the mesh's,
      else JAX's default backend. It chooses the KV-cache layout.
    layout: the KV-cache layout, 'stacked' or 'per_layer'; None: by the platform (stacked on
      TPU, per-layer elsewhere). Per-layer decodes with a per-layer copy of the weights, made
      once per chunk: on a GPU far less traffic per token, the weights' size again in memory.
    min_decode_width: the narrowest chunk (``decode_widths``); 0: an eighth of the slots.
    slot_adapters: each slot decodes with its own LoRA adapter out of a bank in the params
      (``rlx.models.lora.bank``): ``prefill`` takes each prompt's adapter (-1: the base's
      weights alone), which its slots keep (the decode state's cache holds the ids).
  """

  transformer: Transformer
  max_slots: int
  max_len: int
  max_prompt_len: int
  mesh: Mesh | None = None
  max_stop_tokens: int = 8
  decode_steps: int = 16
  platform: str | None = None
  layout: CacheLayout | None = None
  min_decode_width: int = 0
  slot_adapters: bool = False

  def __post_init__(self):
    if self.layout not in (None, "stacked", "per_layer"):
      raise ValueError(f"layout={self.layout!r}: 'stacked', 'per_layer' or None (by platform)")
    if self.decode_steps < 1:
      raise ValueError(f"decode_steps={self.decode_steps} must be >= 1")
    if not 0 <= self.min_decode_width <= self.max_slots:
      raise ValueError(f"min_decode_width={self.min_decode_width} must be 0 .. max_slots")
    if self.max_prompt_len >= self.max_len:
      raise ValueError(f"max_prompt_len={self.max_prompt_len} leaves no room to generate in "
                       f"max_len={self.max_len}")

  @property
  def cache_layout(self) -> CacheLayout:
    if self.layout is not None:
      return self.layout
    platform = self.platform
    if platform is None:
      platform = (self.mesh.devices.flat[0].platform if self.mesh is not None
                  else jax.default_backend())
    return "stacked" if platform == "tpu" else "per_layer"

  @property
  def prompt_buckets(self) -> tuple[int, ...]:
    return _buckets(self.max_prompt_len, 8)

  @property
  def batch_buckets(self) -> tuple[int, ...]:
    return _buckets(self.max_slots, 1)

  def prompt_bucket(self, length: int) -> int:
    if length > self.max_prompt_len:
      raise ValueError(f"prompt of {length} tokens is longer than max_prompt_len={self.max_prompt_len}; "
                       "raise config.rollout.max_prompt_len or shorten the prompt")
    return next(b for b in self.prompt_buckets if b >= length)

  def batch_bucket(self, count: int) -> int:
    return next(b for b in self.batch_buckets if b >= count)

  @property
  def attend_buckets(self) -> tuple[int, ...]:
    return _buckets(self.max_len, 64)

  def attend_bucket(self, filled: int) -> int:
    """The attention length for a chunk when the fullest active slot holds ``filled`` tokens
    (its cache index): room for ``decode_steps`` more, rounded up to a power of two."""
    return self.length_bucket(filled + self.decode_steps)

  def length_bucket(self, length: int) -> int:
    """The smallest attention bucket of at least ``length`` positions (at most ``max_len``)."""
    return next((b for b in self.attend_buckets if b >= length), self.max_len)

  # --- state ---------------------------------------------------------------------------------

  def _sharding(self, *spec) -> NamedSharding | None:
    if self.mesh is None:
      return None
    usable = []
    for axis, size in spec:
      usable.append(axis if axis and size % self.mesh.shape[axis] == 0 else None)
    return NamedSharding(self.mesh, PartitionSpec(*usable))

  def init_decode_state(self) -> DecodeState:
    """Empty slots (on the engine's mesh, KV cache sharded by kv heads and slots)."""
    S = self.max_slots
    cache = self.transformer.init_cache(S, self.max_len, self.cache_layout)
    if self.mesh is not None:
      kv = self._kv_sharding()
      cache = dict(cache, k=jax.device_put(cache["k"], kv), v=jax.device_put(cache["v"], kv))
    if self.slot_adapters:
      cache["adapter"] = jnp.full((S,), -1, jnp.int32)
    # Distinct buffers for every field: the state is donated to each step.
    zeros_f = lambda: jnp.zeros((S,), jnp.float32)
    zeros_i = lambda: jnp.zeros((S,), jnp.int32)
    falses = lambda: jnp.zeros((S,), bool)
    return DecodeState(
        cache=cache, last_token=zeros_i(), last_logprob=zeros_f(), last_policy_logprob=zeros_f(),
        generated=zeros_i(), active=falses(), finished=falses(), stopped=falses(),
        keys=jax.random.split(jax.random.key(0), S),
        sampling=SamplingParams(temperature=zeros_f(), top_k=zeros_i(), top_p=jnp.ones((S,)),
                                max_new_tokens=zeros_i(),
                                stop_ids=jnp.full((S, self.max_stop_tokens), NO_STOP, jnp.int32)))

  def abstract_decode_state(self) -> DecodeState:
    """The decode state's shapes, dtypes and shardings, without memory (for compiling ahead of
    time): the KV cache as ``init_decode_state`` lays it out, the rest replicated."""
    shapes = jax.eval_shape(self.init_decode_state)
    if self.mesh is None:
      return shapes
    kv = self._kv_sharding()
    placed = lambda sharding: lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    state = jax.tree.map(placed(NamedSharding(self.mesh, PartitionSpec())), shapes)
    cache = dict(state.cache, **{name: jax.tree.map(placed(kv), shapes.cache[name])
                                 for name in ("k", "v")})
    return state.replace(cache=cache)

  def _kv_sharding(self) -> NamedSharding:
    """The key and value buffers: slots over ``data``, kv heads over ``tensor``."""
    slots_heads = (("data", self.max_slots), ("tensor", self.transformer.arch.num_kv_heads))
    layers = ((None, 0),) if self.cache_layout == "stacked" else ()
    return self._sharding(*layers, *slots_heads, (None, 0), (None, 0))

  def decode_params(self, params: Params, owned: bool = False) -> Params:
    """``params`` as this engine decodes fastest from them: per layer (``unstack_layers``) for
    a ``per_layer`` cache, else as they are. A chunk over stacked weights copies them into
    per-layer buffers first, the weights' size again in temporaries (SmolLM2-135M, 64 slots:
    502 MiB against 96); a generator that holds them per layer pays that copy once per
    version. Every contract function takes either form.

    ``owned``: ``params`` are the caller's to give up (a weight sync's own copy): each stacked
    array is deleted once its layers are sliced out, so that the two forms never both stand
    whole (one array more than a version, not two versions)."""
    if self.cache_layout != "per_layer" or isinstance(params["layers"], (list, tuple)):
      return params
    if not owned:
      return _unstack(params)
    leaves, tree = jax.tree.flatten(params["layers"])
    sliced = []
    for stacked in leaves:
      sliced.append(jax.block_until_ready(_split_layers(stacked)))
      stacked.delete()
    return dict(params, layers=[jax.tree.unflatten(tree, [parts[l] for parts in sliced])
                                for l in range(len(sliced[0]))])

  # --- the contract --------------------------------------------------------------------------

  def prefill(self, params: Params, tokens: jax.Array, true_length: jax.Array,
              adapter: jax.Array | None = None) -> Prefix:
    """KV cache and last logits of P prompts. tokens: int [P, B] right-padded; true_length: [P];
    adapter: int [P], each prompt's adapter in the params' bank (an engine with
    ``slot_adapters`` only; None: -1, the base alone)."""
    if adapter is not None and not self.slot_adapters:
      raise ValueError("prefill(adapter=...) needs an Engine(..., slot_adapters=True)")
    if self.slot_adapters:
      adapter = jnp.asarray(np.full(tokens.shape[0], -1) if adapter is None else adapter,
                            jnp.int32)
    return _prefill(self.transformer, params, jnp.asarray(tokens, jnp.int32),
                    jnp.asarray(true_length, jnp.int32), self.cache_layout, adapter)

  def insert(self, prefix: Prefix, state: DecodeState, slots: jax.Array, rows: jax.Array,
             keys: jax.Array, sampling: SamplingParams) -> DecodeState:
    """Puts prefix row ``rows[i]`` into slot ``slots[i]`` and samples its first token with
    ``keys[i]``. A slot index ``>= max_slots`` is ignored (padding of a bucketed insert)."""
    prefix_len = prefix.cache["valid"].shape[1]
    if cache_len(state) < prefix_len:
      state = self.resize(state, self.length_bucket(prefix_len))
    return _insert(prefix, state, jnp.asarray(slots, jnp.int32), jnp.asarray(rows, jnp.int32),
                   keys, sampling, self.max_len)

  def extend(self, params: Params, state: DecodeState, slots: jax.Array, tokens: jax.Array,
             true_length: jax.Array, keys: jax.Array, sampling: SamplingParams,
             filled: int | None = None) -> DecodeState:
    """Appends ``tokens`` [R, C] (right-padded; ``true_length`` [R] real ones) to the caches of
    the parked slots ``slots`` [R] at their indices (a multi-turn episode's next turn: the
    token the slot sampled last, then the environment's), and samples each slot's next token
    with ``keys[i]``, as ``insert`` does. Only these tokens are computed: the rest of the
    slot's context stays in its cache. A slot index ``>= max_slots`` is ignored (padding).
    The caller keeps every slot's ``index + true_length < max_len``. ``filled``: the slots'
    fullest cache once extended, when the caller knows it (else read from the device)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    if filled is None:
      filled = int(np.max(np.asarray(jax.device_get(state.cache["index"])))) + tokens.shape[1]
    if cache_len(state) < filled:
      state = self.resize(state, self.length_bucket(filled))
    return _extend(self.transformer, params, state, jnp.asarray(slots, jnp.int32), tokens,
                   jnp.asarray(true_length, jnp.int32), keys, sampling, self.max_len)

  def resize(self, state: DecodeState, length: int) -> DecodeState:
    """``state`` with a KV cache of ``length`` positions (a copy, or ``state`` when it has that
    length already). Slots that hold more than ``length`` tokens lose the rest: only idle
    slots may."""
    if not 0 < length <= self.max_len:
      raise ValueError(f"cache length {length} is outside 1..max_len={self.max_len}")
    return state if cache_len(state) == length else resize_cache(state, length)

  @property
  def decode_widths(self) -> tuple[int, ...]:
    """How many leading slots a chunk may decode (``generate``'s ``width``): powers of two from
    ``min_decode_width`` (0: an eighth of the slots) up, and all of them. Only all of them with
    fewer than 16 slots (each width is one more program to compile) or when the slots are split
    over the mesh's ``data`` axis (a prefix would not split evenly)."""
    if self.max_slots < 16 or (self.mesh is not None and self.mesh.shape.get("data", 1) > 1):
      return (self.max_slots,)
    return _buckets(self.max_slots, self.min_decode_width or max(1, self.max_slots // 8))

  def decode_width(self, slots: int) -> int:
    """The narrowest decode width that holds slots ``0 .. slots - 1``."""
    return next(w for w in self.decode_widths if w >= slots)

  def generate(self, params: Params, state: DecodeState, attend_len: int | None = None,
               refill_at: int | None = None, width: int | None = None
               ) -> tuple[DecodeState, StepResult]:
    """Advances every active slot by up to ``decode_steps`` tokens in one dispatch.

    The StepResult's fields are [decode_steps, S]. A slot that finishes inside the chunk
    emits nothing after; the chunk ends early once no slot is active, or once ``refill_at``
    slots have finished in it (so that the caller can refill them; None: never). ``attend_len`` (see
    ``attend_bucket``) limits attention to the filled part of the cache; every active slot
    must keep ``index + decode_steps <= attend_len``. A ``per_layer`` cache is resized to it
    (None: to ``max_len``). ``width`` (one of ``decode_widths``; None: every slot) decodes
    only the first ``width`` slots, which must hold every active one: a chunk then costs
    what ``width`` slots cost (the slots beyond emit nothing and are left as they are).
    """
    if cache_layout(state.cache) == "per_layer":
      state, attend_len = self.resize(state, attend_len or self.max_len), None
    if self.decode_steps == 1:
      return _generate_one(self.transformer, params, state, self.max_len, attend_len)
    refill_at = jnp.int32(self.max_slots + 1 if refill_at is None else refill_at)
    if width is not None and width < self.max_slots:
      if width not in self.decode_widths:
        raise ValueError(f"width={width} is not one of the engine's decode widths "
                         f"{self.decode_widths}")
      return _generate_prefix(self.transformer, params, state, self.decode_steps, self.max_len,
                              attend_len, refill_at, width)
    return _generate_chunk(self.transformer, params, state, self.decode_steps, self.max_len,
                           attend_len, refill_at)


_unstack = jax.jit(unstack_layers)


@jax.jit
def _split_layers(stacked: jax.Array) -> tuple[jax.Array, ...]:
  return tuple(stacked[l] for l in range(stacked.shape[0]))


@functools.partial(jax.jit, static_argnums=(0, 4))
def _prefill(transformer: Transformer, params: Params, tokens, true_length,
             layout: CacheLayout, adapter=None) -> Prefix:
  P, B = tokens.shape
  mask = jnp.arange(B)[None, :] < true_length[:, None]
  cache = transformer.init_cache(P, B, layout)
  if adapter is not None:
    cache["adapter"] = adapter
  hidden, cache = transformer.hidden_states(params, tokens, mask, cache)
  last = jnp.take_along_axis(hidden, (true_length - 1)[:, None, None], axis=1)[:, 0]
  return Prefix(cache=cache, logits=transformer.logits(params, last), true_length=true_length)


@functools.partial(jax.jit, static_argnums=6, donate_argnums=1)
def _insert(prefix: Prefix, state: DecodeState, slots, rows, keys, sampling: SamplingParams,
            max_len: int):
  M = cache_len(state)
  B = prefix.cache["valid"].shape[1]
  length = prefix.true_length[rows]
  put = lambda target, values: target.at[slots].set(values, mode="drop")
  cache = dict(state.cache)
  if cache_layout(cache) == "stacked":
    for name in ("k", "v"):
      cache[name] = cache[name].at[:, slots, :, :B].set(prefix.cache[name][:, rows], mode="drop")
  else:
    cache["k"] = tuple(k.at[slots, :, :, :B].set(new[rows], mode="drop")
                       for k, new in zip(cache["k"], prefix.cache["k"]))
    cache["v"] = tuple(v.at[slots, :, :B].set(new[rows], mode="drop")
                       for v, new in zip(cache["v"], prefix.cache["v"]))
  cache["valid"] = put(cache["valid"], jnp.arange(M)[None, :] < length[:, None])
  cache["index"] = put(cache["index"], length)
  if "adapter" in cache:
    cache["adapter"] = put(cache["adapter"], prefix.cache["adapter"][rows])
  return _start(state.replace(cache=cache), slots, prefix.logits[rows], length, keys, sampling,
                max_len)


def _start(state: DecodeState, slots, logits, length, keys, sampling: SamplingParams,
           max_len: int) -> DecodeState:
  """Slots ``slots`` (whose caches hold ``length`` tokens) sample a first token from ``logits``
  [R, V] with ``keys`` and become active with ``sampling`` (traced inside insert and extend)."""
  put = lambda target, values: target.at[slots].set(values, mode="drop")
  first_keys = jax.vmap(jax.random.fold_in)(keys, jnp.zeros_like(slots))
  tokens, logprobs, policy_logprobs = sample(logits, first_keys, sampling.temperature,
                                             sampling.top_k, sampling.top_p)
  stopped = jnp.any(tokens[:, None] == sampling.stop_ids, axis=-1)
  finished = stopped | (sampling.max_new_tokens <= 1) | (length >= max_len)
  return state.replace(
      last_token=put(state.last_token, tokens), last_logprob=put(state.last_logprob, logprobs),
      last_policy_logprob=put(state.last_policy_logprob, policy_logprobs),
      generated=put(state.generated, jnp.ones_like(slots)), active=put(state.active, ~finished),
      finished=put(state.finished, finished), stopped=put(state.stopped, stopped),
      keys=put(state.keys, keys),
      sampling=jax.tree.map(put, state.sampling, sampling))


@functools.partial(jax.jit, static_argnums=(0, 8), donate_argnums=2)
def _extend(transformer: Transformer, params: Params, state: DecodeState, slots, tokens,
            true_length, keys, sampling: SamplingParams, max_len: int):
  """Appends ``tokens`` [R, C] (right-padded to ``true_length``) to the caches of ``slots``
  [R] at their indices, then samples each slot's next token (see ``Engine.extend``)."""
  cache = dict(state.cache)
  stacked = cache_layout(cache) == "stacked"
  rows = jnp.minimum(slots, state.active.shape[0] - 1)  # padding rows read any slot, write none
  take = lambda x, axis: jnp.take(x, rows, axis=axis)
  sub = {name: take(cache[name], 0) for name in ("valid", "index", "adapter") if name in cache}
  for name in ("k", "v"):
    sub[name] = (take(cache[name], 1) if stacked else
                 tuple(take(x, 0) for x in cache[name]))
  C = tokens.shape[1]
  mask = jnp.arange(C)[None, :] < true_length[:, None]
  hidden, sub = transformer.hidden_states(params, tokens, mask, sub)
  index = take(cache["index"], 0) + true_length
  last = jnp.take_along_axis(hidden, (true_length - 1)[:, None, None], axis=1)[:, 0]
  put = lambda target, values, axis=0: (
      target.at[slots].set(values, mode="drop") if axis == 0 else
      target.at[:, slots].set(values, mode="drop"))
  cache["valid"] = put(cache["valid"], sub["valid"])
  cache["index"] = put(cache["index"], index)
  for name in ("k", "v"):
    cache[name] = (put(cache[name], sub[name], axis=1) if stacked else
                   tuple(put(x, new) for x, new in zip(cache[name], sub[name])))
  return _start(state.replace(cache=cache), slots, transformer.logits(params, last), index, keys,
                sampling, max_len)


def _decode_step(transformer: Transformer, params: Params, state: DecodeState, max_len: int,
                 attend_len: int | None) -> tuple[DecodeState, StepResult]:
  """One token for every active slot (traced inside the jitted single step and chunk). The
  cache may be shorter than ``max_len`` but must have room for the token."""
  active = state.active
  logits, cache = transformer(params, state.last_token[:, None], None, state.cache, attend_len)
  # Idle slots ran too (static shapes) but keep their bookkeeping unchanged.
  cache["index"] = jnp.where(active, cache["index"], state.cache["index"])
  cache["valid"] = jnp.where(active[:, None], cache["valid"], state.cache["valid"])
  step_keys = jax.vmap(jax.random.fold_in)(state.keys, state.generated)
  s = state.sampling
  tokens, logprobs, policy_logprobs = sample(logits[:, 0], step_keys, s.temperature, s.top_k, s.top_p)
  generated = state.generated + active
  stopped = active & jnp.any(tokens[:, None] == s.stop_ids, axis=-1)
  # The token just drawn is written to the cache by the next step: stop when there is no room.
  finished = active & (stopped | (generated >= s.max_new_tokens) | (cache["index"] >= max_len))
  keep = lambda new, old: jnp.where(active, new, old)
  state = state.replace(
      cache=cache, last_token=keep(tokens, state.last_token),
      last_logprob=keep(logprobs, state.last_logprob),
      last_policy_logprob=keep(policy_logprobs, state.last_policy_logprob),
      generated=generated, active=active & ~finished, finished=finished, stopped=stopped)
  return state, StepResult(tokens=tokens, logprobs=logprobs, policy_logprobs=policy_logprobs,
                           emitted=active, finished=finished, stopped=stopped)


@functools.partial(jax.jit, static_argnums=(0, 3, 4), donate_argnums=2)
def _generate_one(transformer: Transformer, params: Params, state: DecodeState, max_len: int,
                  attend_len: int | None):
  """The single-step path: one dispatch per token (the reference of ``_generate_chunk``)."""
  state, result = _decode_step(transformer, params, state, max_len, attend_len)
  return state, jax.tree.map(lambda x: x[None], result)


@functools.partial(jax.jit, static_argnums=(0, 3, 4, 5), donate_argnums=2)
def _generate_chunk(transformer: Transformer, params: Params, state: DecodeState, steps: int,
                    max_len: int, attend_len: int | None, refill_at: jax.Array | None = None):
  """Up to ``steps`` decode steps in one dispatch; stops early when no slot is active or when
  ``refill_at`` slots (a traced count; None: never) have finished in it. Step i of the result
  is [S]; steps that did not run emit nothing."""
  S = state.active.shape[0]
  started = state.active
  refill_at = S + 1 if refill_at is None else refill_at
  if cache_layout(state.cache) == "per_layer":
    params = unstack_layers(params)  # each layer's weights sliced once, not at every step
  out = StepResult(tokens=jnp.zeros((steps, S), jnp.int32),
                   logprobs=jnp.zeros((steps, S), jnp.float32),
                   policy_logprobs=jnp.zeros((steps, S), jnp.float32),
                   emitted=jnp.zeros((steps, S), bool), finished=jnp.zeros((steps, S), bool),
                   stopped=jnp.zeros((steps, S), bool))

  def running(carry):
    i, state, _ = carry
    freed = jnp.sum(started & ~state.active)
    return (i < steps) & jnp.any(state.active) & (freed < refill_at)

  def step(carry):
    i, state, out = carry
    state, result = _decode_step(transformer, params, state, max_len, attend_len)
    out = jax.tree.map(lambda o, x: jax.lax.dynamic_update_index_in_dim(o, x, i, 0), out, result)
    return i + 1, state, out

  _, state, out = jax.lax.while_loop(running, step, (0, state, out))
  return state, out


@functools.partial(jax.jit, static_argnums=(0, 3, 4, 5, 7), donate_argnums=2)
def _generate_prefix(transformer: Transformer, params: Params, state: DecodeState, steps: int,
                     max_len: int, attend_len: int | None, refill_at: jax.Array, width: int):
  """``_generate_chunk`` over the first ``width`` slots only (they hold every active one), the
  others untouched; the result padded to [steps, S] with slots that emitted nothing."""
  axes = slot_axes(state)
  sub = jax.tree.map(lambda x, axis: jax.lax.slice_in_dim(x, 0, width, axis=axis), state, axes)
  sub, out = _generate_chunk(transformer, params, sub, steps, max_len, attend_len, refill_at)
  state = jax.tree.map(lambda x, new, axis: jax.lax.dynamic_update_slice_in_dim(x, new, 0, axis),
                       state, sub, axes)
  S = state.active.shape[0]
  return state, jax.tree.map(lambda x: jnp.pad(x, ((0, 0), (0, S - width))), out)


def shard_params(params: Params, transformer: Transformer, mesh: Mesh, rules) -> Params:
  """Params in the generation layout of ``mesh`` (tensor-parallel, replicated over data)."""
  shardings = mesh_lib.logical_shardings(logical_axes(transformer.arch),
                                         param_shapes(transformer.arch), mesh, rules)
  return jax.device_put(params, shardings)
