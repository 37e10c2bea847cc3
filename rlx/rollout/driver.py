"""``generate``: many prompts through the engine with continuous batching.

    completions = rlx.rollout.generate(model, prompts, n=8, max_new_tokens=256, temperature=1.0)

As soon as a slot finishes (a stop token or the length limit), the next request
is inserted into it; nobody waits for the longest sequence. The n samples of a
prompt share one prefill. Completions come back in prompt order, the n samples
of a prompt next to each other, whatever order they finished in.

In-flight weight updates (``weights=``): before every decode chunk the driver asks for
newer weights and, when there are, swaps them in without draining. Sequences in flight
continue under the new version; the KV cache they already built stays (computed by the
version that was current then), and every token keeps the version that sampled it
(``Completion.token_versions``) beside its behaviour log-prob, which is exactly the
distribution it was drawn from. ``Completion.policy_version`` is the oldest of them, the
version of the first token: what the staleness bound judges.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Literal

import jax
import numpy as np

from rlx import progress
from rlx.models.model import Model
from rlx.models.transformer import Params
from rlx.rollout.engine import DecodeState, Engine, Prefix, SamplingParams, np_stop_ids
from rlx.rollout.state import swap_slots

Weights = Callable[[], "tuple[Params, int] | None"]
"""Newer weights for an in-flight update: (params, version), or None to keep those in use."""

Supply = Callable[[bool], "Sequence[Sequence[int]] | None"]
"""More prompts for a stream (``stream``): called between decode chunks with whether nothing
is in flight (then it must block until it has a prompt, or close); returns the prompts to
admit (maybe none), or None: no more will come."""


@dataclasses.dataclass
class Completion:
  """One sampled response.

  Attributes:
    prompt_tokens: the prompt's ids.
    response_tokens: the sampled ids (the stop token included when it ended the response).
    logprobs: one behaviour log-prob per response token: its log-prob under the
      distribution it was drawn from, after temperature, top-k and top-p (0 for greedy).
    policy_logprobs: its log-prob under the untruncated policy at temperature 1.
    finish_reason: 'stop' (a stop token) or 'length' (max_new_tokens or the cache is full).
    policy_version: version of the params that sampled its first token: the oldest of its
      tokens (with in-flight updates, later tokens may come from newer versions).
    prompt_index, sample_index: where it belongs in the request.
    sampled_mask: for a multi-turn episode, one flag per response token: True on the tokens
      the policy sampled, False on the environment's (their log-probs are 0). None: every
      response token was sampled.
    turns: assistant turns of the episode (1 for a single answer).
    token_versions: the policy version of each response token, when they differ (an
      in-flight weight update reached the sequence); None: every token is
      ``policy_version``'s. Environment tokens carry the version current when they came.
  """

  prompt_tokens: list[int]
  response_tokens: list[int]
  logprobs: list[float]
  policy_logprobs: list[float]
  finish_reason: Literal["stop", "length"]
  policy_version: int
  prompt_index: int
  sample_index: int
  sampled_mask: list[bool] | None = None
  turns: int = 1
  token_versions: list[int] | None = None

  @property
  def newest_version(self) -> int:
    """The newest policy version among its tokens (``policy_version`` is the oldest)."""
    return self.policy_version if self.token_versions is None else max(self.token_versions)

  def versions(self) -> list[int]:
    """The policy version of every response token."""
    if self.token_versions is None:
      return [self.policy_version] * len(self.response_tokens)
    return self.token_versions

  def stamp(self, count: int, version: int) -> None:
    """Records that the next ``count`` response tokens come from ``version`` (call before
    appending them)."""
    if self.token_versions is None:
      if version == self.policy_version:
        return
      self.token_versions = [self.policy_version] * len(self.response_tokens)
    self.token_versions.extend([version] * count)

  @property
  def sampled_tokens(self) -> int:
    """How many response tokens the policy sampled (an episode's environment tokens aside)."""
    return len(self.response_tokens) if self.sampled_mask is None else sum(self.sampled_mask)

  def cut_at_stop_strings(self, stop_strings: Sequence[str],
                          decode: Callable[[list[int]], str]) -> bool:
    """Ends the response at the token that completes the first of ``stop_strings`` in its
    text (that token kept, everything sampled after it dropped with its log-probs;
    ``finish_reason`` becomes 'stop'); returns whether it cut. The tokens kept are exactly
    those sampled, so the learner's log-probs still match the engine's. The shortest prefix
    whose text holds a stop string is found by bisection (holding one only grows with the
    prefix): a few decodes per response."""
    if not stop_strings or not any(s in decode(self.response_tokens) for s in stop_strings):
      return False
    low, high = 1, len(self.response_tokens)  # the answer is in [low, high]
    while low < high:
      middle = (low + high) // 2
      if any(s in decode(self.response_tokens[:middle]) for s in stop_strings):
        high = middle
      else:
        low = middle + 1
    if low < len(self.response_tokens):
      del self.response_tokens[low:], self.logprobs[low:], self.policy_logprobs[low:]
      if self.sampled_mask is not None:
        del self.sampled_mask[low:]
      if self.token_versions is not None:
        del self.token_versions[low:]
    self.finish_reason = "stop"
    return True


def _power_of_two(value: int, smallest: int = 1) -> int:
  size = smallest
  while size < value:
    size *= 2
  return size


@functools.lru_cache(maxsize=16)
def _engine_for(transformer, max_slots: int, max_len: int, max_prompt_len: int,
                slot_adapters: bool = False) -> Engine:
  return Engine(transformer, max_slots=max_slots, max_len=max_len, max_prompt_len=max_prompt_len,
                slot_adapters=slot_adapters)


def generate(model_or_engine: Model | Engine, prompts: Sequence[Sequence[int]], *, n: int = 1,
             max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
             stop_token_ids: Sequence[int] | None = None, seed: int = 0,
             params: Params | None = None, policy_version: int = 0, max_slots: int | None = None,
             batching: Literal["continuous", "static"] = "continuous",
             first_prompt_index: int = 0,
             on_finished: Callable[[Completion], None] | None = None,
             weights: Weights | None = None, supply: Supply | None = None,
             stats: dict | None = None,
             adapters: Sequence[int] | None = None) -> list[Completion]:
  """Samples ``n`` responses to each prompt.

  Args:
    model_or_engine: a ``Model`` (an engine sized to the request is built and
      cached), or an ``Engine`` (then pass ``params``).
    prompts: token ids of each prompt.
    n: samples per prompt.
    max_new_tokens: longest response.
    temperature: 0 is greedy. top_p: 1 disables it. top_k: 0 disables it.
    stop_token_ids: ids that end a response; None means the model's eos ids, [] none.
    seed: fixes every draw (whatever the slot scheduling): sample j of prompt i draws from
      ``fold_in(fold_in(key(seed), first_prompt_index + i), j)``.
    params: the weights to use (default: the model's); swapping them never recompiles.
    policy_version: the version of ``params``, stamped on the tokens they sample.
    max_slots: decode slots of the engine built for a Model (default min(64, requests)).
    batching: 'continuous' refills a slot as soon as it frees; 'static' waits for
      the whole batch of slots to finish first (for comparison only).
    first_prompt_index: the index of ``prompts[0]`` in a larger batch that several processes
      share, so that every prompt draws the same samples whichever process generates it.
    on_finished: called with each completion as soon as it finishes (e.g. to score it while
      the others are still decoding).
    weights: asked before every decode chunk; a (params, version) it returns whose version
      differs from the one in use replaces it from that chunk on (an in-flight update, see
      the module docstring). None from it: keep the current ones.
    supply: makes the call a stream (continuous admission): asked between decode chunks for
      more prompts (see ``Supply``), which take the slots that free; it runs until ``supply``
      closes and every request is done. Completions then go only to ``on_finished`` (the
      call returns []); prompt indices count on from ``prompts`` across what it admits.
    stats: a dict to which the slots' use is added as it runs (``_Run.stats``).
    adapters: each prompt's LoRA adapter in ``params``' bank (``rlx.models.lora.bank``; -1:
      none), its samples decoding beside the others' in the same chunks: an engine with
      ``slot_adapters`` (built so for a Model).
  """
  prompts = [list(map(int, p)) for p in prompts]
  if not prompts and supply is None:
    return []
  if any(len(p) == 0 for p in prompts):
    raise ValueError("every prompt needs at least one token")
  if max_new_tokens < 1 or n < 1:
    raise ValueError("max_new_tokens and n must be >= 1")
  if adapters is not None:
    if supply is not None or len(adapters) != len(prompts):
      raise ValueError(f"adapters= names one adapter per prompt ({len(prompts)}), and only "
                       "without supply=")
    if isinstance(model_or_engine, Engine) and not model_or_engine.slot_adapters:
      raise ValueError("generate(engine, adapters=...) needs an Engine(..., slot_adapters=True)")
  if isinstance(model_or_engine, Engine):
    engine = model_or_engine
    if params is None:
      raise ValueError("generate(engine, ...) needs params=")
  else:
    if supply is not None:
      raise ValueError("a stream (supply=) needs an Engine, sized for what it will admit")
    slots = max_slots or min(64, _power_of_two(len(prompts) * n))
    prompt_len = _power_of_two(max(map(len, prompts)), 8)
    engine = _engine_for(model_or_engine.transformer, slots, prompt_len + max_new_tokens,
                         prompt_len, adapters is not None)
    params = model_or_engine.params if params is None else params
  arch = engine.transformer.arch
  stop = arch.eos_token_ids if stop_token_ids is None else tuple(stop_token_ids)
  for p in prompts:
    engine.prompt_bucket(len(p))  # refuses prompts that are too long
  # once per call, not per decode chunk (stacked weights on a per-layer cache: a copy each)
  params = engine.decode_params(params)
  return _Run(engine, params, prompts, n, max_new_tokens, temperature, top_p, top_k, stop, seed,
              policy_version, batching, first_prompt_index, on_finished, weights, supply=supply,
              stats=stats, adapters=adapters).run()


@jax.jit
def _request_keys(base: jax.Array, prompts: jax.Array, samples: jax.Array) -> jax.Array:
  """The key of each request: sample ``samples[i]`` of prompt ``prompts[i]``."""
  return jax.vmap(lambda p, s: jax.random.fold_in(jax.random.fold_in(base, p), s))(
      prompts, samples)


@jax.jit
def _first_tokens(state: DecodeState, slots: jax.Array):
  """Token, log-probs and finish flags that ``insert`` sampled in ``slots`` (a copy: the
  state is donated to the next step)."""
  return tuple(x[slots] for x in (state.last_token, state.last_logprob, state.last_policy_logprob,
                                  state.finished, state.stopped))


class _Run:
  """The host-side bookkeeping of one ``generate`` call."""

  compacts = True
  """Whether a chunk first moves the decoding slots above the narrowest width that holds them
  into the holes below it (free slots, or slots parked on an environment, which go up in
  exchange), so that it computes that width and no idle slot inside it."""

  def __init__(self, engine: Engine, params, prompts, n, max_new_tokens, temperature, top_p, top_k,
               stop, seed, policy_version, batching, first_prompt_index=0, on_finished=None,
               weights=None, supply: Supply | None = None, stats: dict | None = None,
               adapters: Sequence[int] | None = None):
    self.engine, self.params, self.prompts, self.n = engine, params, list(prompts), n
    self.adapters = None if adapters is None else [int(a) for a in adapters]
    self.on_finished, self.weights, self.supply = on_finished, weights, supply
    self.closed = supply is None
    """Whether no more prompts will come (always, without ``supply``)."""
    self.done = 0  # requests finished
    self.policy_version, self.batching = policy_version, batching
    """The version of ``params``: the one in use now."""
    self.swaps = 0  # in-flight weight updates taken
    self.max_new_tokens = max_new_tokens
    self.sampling_row = (float(temperature), int(top_k), float(top_p), int(max_new_tokens),
                         np_stop_ids(stop, engine.max_stop_tokens))
    self.base_key, self.first_prompt_index = jax.random.key(seed), first_prompt_index
    self.pending = collections.deque(range(len(prompts)))  # prompts not yet prefilled
    # [prefix, row, prompt_index, next sample index, the version that computed the prefix]
    self.prefixes = collections.deque()
    self.owner: list[tuple[int, int] | None] = [None] * engine.max_slots
    self.partial: dict[tuple[int, int], Completion] = {}  # being generated
    self.results: dict[tuple[int, int], Completion] = {}  # finished
    self.index = np.zeros((engine.max_slots,), np.int64)  # each slot's cache index (host copy)
    self.firsts: list = []  # (slots, first tokens sampled at insert, their version), not read
    # While requests wait, a chunk ends once this many slots have freed, to refill them.
    self.refill_at = max(1, engine.max_slots // 16)
    self.stats = {} if stats is None else stats
    """The slots' use, added to as it runs (a caller's dict, which it reads meanwhile):
    ``slot_steps`` (decode steps x the slots they computed: the chunk's width), ``busy_steps`` (the steps of those that
    produced a token: the occupancy is their ratio), ``held_steps`` (the steps of those that
    held a decoding sample when the chunk began: the rest were free or parked; between held
    and busy are the steps after a sample's turn ended inside the chunk) and ``parked_s``
    (seconds every slot waited on an environment)."""
    for key in ("slot_steps", "busy_steps", "held_steps", "parked_s"):
      self.stats.setdefault(key, 0)

  def run(self) -> list[Completion]:
    """Runs until every request is done (and, with ``supply``, it closed); returns the
    completions in prompt order (none with ``supply``: they went to ``on_finished``)."""
    state = self.engine.init_decode_state()
    while self._more():
      state = self._step(state)
    if self.supply is not None:
      return []
    return [self.results[(p, s)] for p in range(len(self.prompts)) for s in range(self.n)]

  def _more(self) -> bool:
    """Asks ``supply`` for more prompts (blocking it when nothing is in flight); whether any
    request is left to run."""
    if not self.closed:
      more = self.supply(not self._in_flight())
      if more is None:
        self.closed = True
      else:
        more = [list(map(int, p)) for p in more]
        for prompt in more:
          self._admissible(prompt)
        start = len(self.prompts)
        self.prompts.extend(more)
        self.pending.extend(range(start, len(self.prompts)))
    return self.done < len(self.prompts) * self.n

  def _in_flight(self) -> bool:
    """Whether some request is admitted and not done."""
    return any(o is not None for o in self.owner) or bool(self.pending or self.prefixes)

  def _admissible(self, prompt: list[int]) -> None:
    """Refuses a streamed prompt this engine cannot run."""
    if not prompt:
      raise ValueError("every prompt needs at least one token")
    self.engine.prompt_bucket(len(prompt))

  def _step(self, state):
    """Fills the free slots, then decodes one chunk."""
    free = [s for s, o in enumerate(self.owner) if o is None]
    if free and (self.batching == "continuous" or len(free) == self.engine.max_slots):
      state = self._fill(state, free)
    owned = [s for s, o in enumerate(self.owner) if o is not None]
    if owned:
      # a chunk ends early to refill only for requests already waiting: cutting every chunk
      # of a stream short would trade decode steps for host round trips
      waiting = self.batching == "continuous" and bool(self.pending or self.prefixes)
      state, _ = self._decode(state, owned, waiting)
    return state

  def _keys(self, requests: list[tuple[int, int]]) -> jax.Array:
    """The PRNG keys of requests (prompt index, sample index)."""
    prompts = np.array([self.first_prompt_index + p for p, _ in requests], np.int32)
    return _request_keys(self.base_key, prompts, np.array([s for _, s in requests], np.int32))

  def _complete(self, key: tuple[int, int], slot: int | None, completion: Completion) -> None:
    """A request is done: its slot frees and it goes to ``on_finished``."""
    self.done += 1
    if self.supply is None:  # a stream keeps nothing: its consumer has it
      self.results[key] = completion
    if slot is not None:  # None: an episode that ended away from the slots
      self.owner[slot] = None
    if self.on_finished is not None:
      self.on_finished(completion)

  def _decode(self, state, slots: list[int], waiting: bool):
    """One ``generate`` chunk over the decoding ``slots`` (ending early to refill when requests
    are ``waiting``), with the newest weights, its tokens recorded; returns the state and the
    chunk (host arrays)."""
    self._refresh()
    if self.compacts:
      state, slots = self._compact(state, slots)
    attend_len = self.engine.attend_bucket(int(self.index[slots].max()))
    # only the leading slots that hold the decoding ones (new work takes the lowest free slot,
    # and the compaction moves the others down)
    width = self.engine.decode_width(max(slots) + 1)
    state, chunk = self.engine.generate(self.params, state, attend_len,
                                        self.refill_at if waiting else None, width)
    # One host round trip per chunk: the first tokens of the slots filled before it, then
    # the chunk's tokens.
    firsts, chunk = jax.device_get((self.firsts, chunk))
    progress.tick()
    self.firsts = []
    steps = int(chunk.emitted.any(axis=1).sum())
    self.stats["slot_steps"] += steps * width  # slots computed
    self.stats["held_steps"] += steps * len(slots)
    self.stats["busy_steps"] += int(chunk.emitted.sum())
    for placed, first, version in firsts:
      for i, slot in enumerate(placed):
        self._append(slot, *(x[i:i + 1] for x in first[:3]), first[3][i], first[4][i], version)
    self._record(chunk)
    return state, chunk

  def _compact(self, state, slots: list[int]):
    """Exchanges each decoding slot at or above the narrowest width that holds ``len(slots)``
    with the lowest hole below it; returns the state and where the decoding slots are now."""
    narrow = self.engine.decode_width(len(slots))
    movers = [s for s in slots if s >= narrow]
    if not movers:
      return state, slots
    decoding = set(slots)
    holes = [s for s in range(narrow) if s not in decoding][:len(movers)]
    count = self.engine.batch_bucket(len(movers))
    pad = [self.engine.max_slots] * (count - len(movers))
    state = swap_slots(state, np.array(movers + pad, np.int32), np.array(holes + pad, np.int32))
    moved = {**dict(zip(movers, holes)), **dict(zip(holes, movers))}
    self._moved(moved)
    return state, sorted(moved.get(s, s) for s in slots)

  def _moved(self, moved: dict[int, int]) -> None:
    """The host's records follow slots the device exchanged (``moved``: old slot -> new)."""
    owner, index = list(self.owner), self.index.copy()
    for old, new in moved.items():
      self.owner[new], self.index[new] = owner[old], index[old]
    for placed, _, _ in self.firsts:  # first tokens not read yet belong to requests, not slots
      placed[:] = [moved.get(s, s) for s in placed]

  def _refresh(self) -> None:
    """Takes newer weights between chunks, when ``weights`` has them."""
    if self.weights is None:
      return
    newer = self.weights()
    if newer is not None and newer[1] != self.policy_version:
      self.params, self.policy_version = self.engine.decode_params(newer[0]), newer[1]
      self.swaps += 1

  def _prefill_next(self, free_slots: int) -> None:
    count = min(len(self.pending), max(1, -(-free_slots // self.n)))
    chosen = [self.pending.popleft() for _ in range(count)]
    rows = self.engine.batch_bucket(count)
    length = self.engine.prompt_bucket(max(len(self.prompts[p]) for p in chosen))
    tokens = np.zeros((rows, length), np.int32)
    true_length = np.ones((rows,), np.int32)
    for row, p in enumerate(chosen):
      tokens[row, :len(self.prompts[p])] = self.prompts[p]
      true_length[row] = len(self.prompts[p])
    adapter = None  # the engine's default for a slot_adapters engine: -1, the base alone
    if self.adapters is not None:
      adapter = np.full((rows,), -1, np.int32)
      adapter[:count] = [self.adapters[p] for p in chosen]
    prefix = self.engine.prefill(self.params, tokens, true_length, adapter)
    for row, p in enumerate(chosen):
      self.prefixes.append([prefix, row, p, 0, self.policy_version])

  def _fill(self, state, free: list[int]):
    self._refresh()  # new prompts start from the newest weights
    by_prefix: dict[int, tuple[Prefix, list]] = {}
    while free and (self.prefixes or self.pending):
      if not self.prefixes:
        self._prefill_next(len(free))
      entry = self.prefixes[0]
      prefix, row, p, sample, version = entry
      slot = free.pop(0)
      self.owner[slot] = (p, sample)
      by_prefix.setdefault(id(prefix), (prefix, version, []))[2].append(
          (slot, row, p * self.n + sample))
      entry[3] += 1
      if entry[3] == self.n:
        self.prefixes.popleft()
    for prefix, version, inserts in by_prefix.values():
      state = self._insert(state, prefix, inserts, version)
    return state

  def _insert(self, state, prefix: Prefix, inserts, version: int):
    """Inserts requests into slots from ``prefix`` (computed by policy ``version``, which
    samples their first tokens)."""
    count = self.engine.batch_bucket(len(inserts))
    pad = count - len(inserts)
    slots = np.array([s for s, _, _ in inserts] + [self.engine.max_slots] * pad, np.int32)
    rows = np.array([r for _, r, _ in inserts] + [0] * pad, np.int32)
    keys = self._keys([divmod(k, self.n) for _, _, k in inserts] + [(0, 0)] * pad)
    temperature, top_k, top_p, max_new, stop_ids = self.sampling_row
    sampling = SamplingParams(
        temperature=np.full((count,), temperature, np.float32), top_k=np.full((count,), top_k, np.int32),
        top_p=np.full((count,), top_p, np.float32), max_new_tokens=np.full((count,), max_new, np.int32),
        stop_ids=np.tile(stop_ids, (count, 1)))
    state = self.engine.insert(prefix, state, slots, rows, keys, sampling)
    placed = slots[:len(inserts)]
    # Read with the next chunk's results rather than now (no extra host round trip).
    self.firsts.append((placed.tolist(), _first_tokens(state, slots), version))
    self.index[placed] = [len(self.prompts[key // self.n]) for _, _, key in inserts]
    return state

  def _record(self, chunk) -> None:
    """Appends a chunk's tokens ([steps, S] arrays) to their completions."""
    for slot in np.flatnonzero(chunk.emitted.any(axis=0)):
      emitted = chunk.emitted[:, slot]
      last = np.flatnonzero(emitted)[-1]
      self.index[slot] += int(emitted.sum())
      self._append(int(slot), chunk.tokens[emitted, slot], chunk.logprobs[emitted, slot],
                   chunk.policy_logprobs[emitted, slot], chunk.finished[last, slot],
                   chunk.stopped[last, slot], self.policy_version)

  def _append(self, slot: int, tokens, logprobs, policy_logprobs, finished, stopped,
              version: int) -> None:
    p, sample = self.owner[slot]
    completion = self.partial.get((p, sample))
    if completion is None:
      completion = Completion(prompt_tokens=self.prompts[p], response_tokens=[], logprobs=[],
                              policy_logprobs=[], finish_reason="length",
                              policy_version=version, prompt_index=p, sample_index=sample)
      self.partial[(p, sample)] = completion
    completion.stamp(len(tokens), version)
    completion.response_tokens.extend(tokens.tolist())
    completion.logprobs.extend(logprobs.tolist())
    completion.policy_logprobs.extend(policy_logprobs.tolist())
    if finished:
      completion.finish_reason = "stop" if stopped else "length"
      self._complete((p, sample), slot, self.partial.pop((p, sample)))
