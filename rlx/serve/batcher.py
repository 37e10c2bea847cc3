"""Requests that arrive one by one (an HTTP endpoint's), in the engine's continuous batching.

    batcher = Batcher(engine, params, version=3, decode=tokenizer.decode)
    future = batcher.submit(Request(prompt=ids, max_tokens=64, key=key))  # from any thread
    batcher.serve(until=lambda: agents_done())                            # in the engine's thread

``serve`` runs the same slot scheduler as ``rollout.generate`` (prefill batches of waiting
prompts, insert them into free slots, decode chunks, refill a slot as soon as it frees) over
whatever has been submitted, until ``until()`` is true and nothing is in flight. Each request
has its own sampling settings and PRNG key, so that a request draws the same tokens whichever
others share the batch. A request's future gets a ``Generated`` (the sampled ids and their
behaviour log-probs, stamped with the policy version), or an exception.

Stop ids end a request on the device. A stop *string* of several tokens is checked on the host
after every chunk: the request finishes there, and its slot decodes on unread (a *zombie*)
until it is refilled or ends, so that the device program never changes shape.

A request whose caller went away (``abandon``: the endpoint's client hung up) is dropped from
the queue, or gives its slot up at the next chunk, the slot decoding on unread as a zombie.

A slot whose request ended on the device keeps its KV cache (it is *parked*) until a slot is
needed. A later request whose prompt starts with a parked slot's prompt and answer (an agent's
next turn) is appended to that cache (``Engine.extend``: only its new tokens are computed)
instead of being prefilled whole; parked slots are refilled oldest first.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import queue
import threading
from collections.abc import Callable, Sequence

import jax
import numpy as np

from rlx.models.transformer import Params
from rlx.rollout.driver import Completion, _first_tokens, _Run
from rlx.rollout.engine import Engine, SamplingParams, np_stop_ids


@dataclasses.dataclass
class Request:
  """One sequence to sample."""

  prompt: list[int]
  max_tokens: int
  key: jax.Array
  """The PRNG key of every draw of this sequence."""
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  stop_ids: tuple[int, ...] = ()
  stop_texts: tuple[str, ...] = ()
  """Strings that end the sequence, checked on the decoded text after every chunk."""


@dataclasses.dataclass
class Generated:
  """What a request sampled."""

  tokens: list[int]
  """The sampled ids (a stop token, and the tokens of a stop string, included)."""
  logprobs: list[float]
  """Behaviour log-probs: under the distribution each token was drawn from."""
  policy_logprobs: list[float]
  """Their log-probs under the untruncated policy at temperature 1."""
  finish_reason: str
  """'stop' (a stop id or string) or 'length'."""
  policy_version: int
  stop_text: str | None = None
  """The stop string that ended it, if one did."""


class ServingClosed(RuntimeError):
  """The batcher stopped before a request could run."""


class Batcher(_Run):
  """Continuous batching of submitted requests (see the module docstring)."""

  compacts = False  # its chunks also carry parked slots whose caches new requests may reuse

  def __init__(self, engine: Engine, params: Params, *, version: int = 0,
               decode: Callable[[Sequence[int]], str] | None = None, reuse: bool = True):
    # one sample per prompt; no request is known yet
    super().__init__(engine, params, [], 1, 1, 1.0, 1.0, 0, (), 0, version, "continuous",
                     stats={"requests": 0, "reused": 0, "reused_tokens": 0, "abandoned": 0})
    self.decode = decode
    self.inbox: queue.SimpleQueue[tuple[Request, concurrent.futures.Future]] = queue.SimpleQueue()
    self.requests: list[Request] = []
    self.futures: list[concurrent.futures.Future] = []
    self.zombies: set[int] = set()  # slots still decoding a request that ended on the host
    self.reuse = reuse
    self.parked: dict[int, list[int]] = {}  # slot -> the ids its cache holds (oldest first)
    self.closed: BaseException | None = None
    self.lock = threading.Lock()
    self.abandoned: set[concurrent.futures.Future] = set()  # by callers, not yet released

  # --- any thread ------------------------------------------------------------------------------

  def submit(self, request: Request) -> concurrent.futures.Future:
    """Queues ``request``; its future gets a ``Generated``. Raises ValueError when it cannot
    run on this engine (too long a prompt, too many stop ids)."""
    if not request.prompt:
      raise ValueError("the prompt has no tokens")
    # what the device arrays hold is checked here: one bad request never reaches the engine's
    # thread, where it would fail every request in flight
    if not (np.isfinite(request.temperature) and request.temperature >= 0):
      raise ValueError(f"temperature {request.temperature} is not a number >= 0")
    if not 0 < request.top_p <= 1:
      raise ValueError(f"top_p {request.top_p} is not in (0, 1]")
    if not 0 <= request.top_k < 2**31:
      raise ValueError(f"top_k {request.top_k} is not in 0..2**31-1")
    if any(not 0 <= t < 2**31 for t in (*request.prompt, *request.stop_ids)):
      raise ValueError("token ids must be in 0..2**31-1")
    self.engine.prompt_bucket(len(request.prompt))
    if len(request.stop_ids) > self.engine.max_stop_tokens:
      raise ValueError(f"{len(request.stop_ids)} stop tokens exceed the engine's "
                       f"{self.engine.max_stop_tokens}")
    room = self.engine.max_len - len(request.prompt)
    request = dataclasses.replace(request, max_tokens=max(1, min(request.max_tokens, room)))
    future: concurrent.futures.Future = concurrent.futures.Future()
    with self.lock:
      if self.closed is not None:
        raise ServingClosed(str(self.closed))
      self.inbox.put((request, future))
    return future

  def abandon(self, future: concurrent.futures.Future) -> None:
    """Its caller no longer wants this request's answer (the client went away): a queued
    request never starts; one already running gives up its slot at the next chunk (the slot
    decodes on unread, a zombie, until it is refilled) and its future is cancelled."""
    if future.cancel():
      with self.lock:
        self.stats["abandoned"] += 1
      return
    with self.lock:
      if not future.done():
        self.abandoned.add(future)

  def close(self, reason: str = "the endpoint stopped serving") -> None:
    """Fails every queued request and refuses new ones."""
    with self.lock:
      self.closed = ServingClosed(reason)
    self.fail_queued(reason)

  def fail_queued(self, reason: str) -> None:
    """Fails the requests that have not started (call it when no ``serve`` runs)."""
    self._admit()
    for p in list(self.pending):
      self._fail(p, ServingClosed(reason))
    self.pending.clear()

  # --- the engine's thread ----------------------------------------------------------------------

  def set_params(self, params: Params, version: int) -> None:
    """The policy later requests sample from (call between ``serve`` calls)."""
    self.params, self.policy_version = params, version

  def serve(self, until: Callable[[], bool], poll_s: float = 0.01) -> None:
    """Runs every submitted request until ``until()`` holds and none is in flight."""
    try:
      self._serve(until, poll_s)
    except BaseException as error:
      self.report_error(error)
      raise

  def _serve(self, until: Callable[[], bool], poll_s: float) -> None:
    state = self.engine.init_decode_state()
    self.zombies.clear()
    self.parked.clear()
    while True:
      self._admit()
      state = self._continue(state)
      owned = [s for s, o in enumerate(self.owner) if o is not None]
      if not owned and not self.pending and not self.prefixes:
        if until():
          return
        try:
          self._add(*self.inbox.get(timeout=poll_s))
        except queue.Empty:
          pass
        continue
      # empty slots first, then parked ones, oldest first
      free = [s for s, o in enumerate(self.owner) if o is None and s not in self.parked]
      free += [s for s in self.parked]
      if free and (self.pending or self.prefixes):
        self.zombies.difference_update(free[:len(self.pending) + len(self.prefixes)])
        state = self._fill(state, free)
      owned = [s for s, o in enumerate(self.owner) if o is not None]
      if owned:
        waiting = bool(self.pending or self.prefixes or not self.inbox.empty())
        # the attention (and a per_layer cache's) length covers the parked slots' caches too
        state, _ = self._decode(state, sorted({*owned, *self.zombies, *self.parked}), waiting)

  def _admit(self) -> None:
    self._release_abandoned()
    while True:
      try:
        request, future = self.inbox.get_nowait()
      except queue.Empty:
        return
      self._add(request, future)

  def _add(self, request: Request, future: concurrent.futures.Future) -> None:
    if not future.set_running_or_notify_cancel():
      return
    self.prompts.append(request.prompt)
    self.requests.append(request)
    self.futures.append(future)
    self.pending.append(len(self.prompts) - 1)
    self.stats["requests"] += 1

  def _release_abandoned(self) -> None:
    """Frees the slots and queue places of abandoned requests. One between its prefill and its
    slot stays marked until it has a slot."""
    with self.lock:
      if not self.abandoned:
        return
      self.abandoned = {f for f in self.abandoned if not f.done()}
      marked = set(self.abandoned)
    gone = []
    for slot, owner in enumerate(self.owner):
      if owner is not None and self.futures[owner[0]] in marked:
        self.partial.pop((owner[0], 0), None)
        self.owner[slot] = None
        self.zombies.add(slot)
        gone.append(owner[0])
    for p in list(self.pending):
      if self.futures[p] in marked:
        self.pending.remove(p)
        gone.append(p)
    for p in gone:
      self._fail(p, concurrent.futures.CancelledError("its caller abandoned it"))
    with self.lock:
      self.abandoned.difference_update(self.futures[p] for p in gone)
      self.stats["abandoned"] += len(gone)

  def _forget(self, p: int) -> None:
    self.prompts[p] = self.requests[p] = None  # the request is done: keep no ids around

  def _fail(self, p: int, error: BaseException) -> None:
    future = self.futures[p]
    if not future.done():
      future.set_exception(error)
    self._forget(p)

  def _sampling(self, rows: list[Request]) -> tuple[SamplingParams, jax.Array]:
    sampling = SamplingParams(
        temperature=np.array([r.temperature for r in rows], np.float32),
        top_k=np.array([r.top_k for r in rows], np.int32),
        top_p=np.array([r.top_p for r in rows], np.float32),
        max_new_tokens=np.array([r.max_tokens for r in rows], np.int32),
        stop_ids=np.stack([np_stop_ids(r.stop_ids, self.engine.max_stop_tokens) for r in rows]))
    return sampling, jax.numpy.stack([r.key for r in rows])

  def _continue(self, state):
    """Appends the waiting requests that continue a parked slot's ids to its cache."""
    if not self.reuse or not self.parked or not self.pending:
      return state
    matched = []
    for p in list(self.pending):
      prompt = self.prompts[p]
      best = None
      for slot, ids in self.parked.items():
        if (len(ids) < len(prompt) and self.index[slot] == len(ids) - 1
            and prompt[:len(ids)] == ids and (best is None or len(ids) > len(self.parked[best]))):
          best = slot
      if best is not None:
        del self.parked[best]
        self.pending.remove(p)
        matched.append((best, p))
    if not matched:
      return state
    count = self.engine.batch_bucket(len(matched))
    rows = [self.prompts[p][int(self.index[slot]):] for slot, p in matched]
    width = 8
    while width < max(map(len, rows)):
      width *= 2
    slots = np.full((count,), self.engine.max_slots, np.int32)
    tokens = np.zeros((count, width), np.int32)
    lengths = np.ones((count,), np.int32)
    for i, ((slot, p), row) in enumerate(zip(matched, rows)):
      slots[i], tokens[i, :len(row)], lengths[i] = slot, row, len(row)
      self.stats["reused_tokens"] += int(self.index[slot])
      self.index[slot] += len(row)
      self.owner[slot] = (p, 0)
    self.stats["reused"] += len(matched)
    chosen = [self.requests[p] for _, p in matched]
    sampling, keys = self._sampling(chosen + chosen[:1] * (count - len(matched)))
    state = self.engine.extend(self.params, state, slots, tokens, lengths, keys, sampling,
                               filled=int(self.index[slots[:len(matched)]].max()))
    self.firsts.append((slots[:len(matched)].tolist(), _first_tokens(state, slots),
                        self.policy_version))
    return state

  def _insert(self, state, prefix, inserts, version):
    count = self.engine.batch_bucket(len(inserts))
    pad = count - len(inserts)
    chosen = [self.requests[k] for _, _, k in inserts]
    slots = np.array([s for s, _, _ in inserts] + [self.engine.max_slots] * pad, np.int32)
    sampling, keys = self._sampling(chosen + chosen[:1] * pad)
    state = self.engine.insert(prefix, state, slots,
                               np.array([r for _, r, _ in inserts] + [0] * pad, np.int32),
                               keys, sampling)
    placed = slots[:len(inserts)]
    for slot in placed.tolist():
      self.parked.pop(slot, None)
    self.firsts.append((placed.tolist(), _first_tokens(state, slots), version))
    self.index[placed] = [len(r.prompt) for r in chosen]
    return state

  def _append(self, slot, tokens, logprobs, policy_logprobs, finished, stopped, version) -> None:
    if self.owner[slot] is None:  # a zombie: nobody reads it
      if finished:
        self.zombies.discard(slot)
      return
    p = self.owner[slot][0]
    completion = self.partial.get((p, 0))
    if completion is None:
      completion = Completion(prompt_tokens=[], response_tokens=[], logprobs=[],
                              policy_logprobs=[], finish_reason="length",
                              policy_version=version, prompt_index=p, sample_index=0)
      self.partial[(p, 0)] = completion
    completion.response_tokens.extend(tokens.tolist())
    completion.logprobs.extend(logprobs.tolist())
    completion.policy_logprobs.extend(policy_logprobs.tolist())
    request = self.requests[p]
    stop_text = None
    if request.stop_texts and self.decode is not None:
      text = self.decode(completion.response_tokens)
      stop_text = next((s for s in request.stop_texts if s in text), None)
      if stop_text is not None:
        # keep the tokens up to the one that completed the stop string
        end = next(i for i in range(1, len(completion.response_tokens) + 1)
                   if stop_text in self.decode(completion.response_tokens[:i]))
        del (completion.response_tokens[end:], completion.logprobs[end:],
             completion.policy_logprobs[end:])
    if not finished and stop_text is None:
      return
    del self.partial[(p, 0)]
    future = self.futures[p]
    if not future.done():
      future.set_result(Generated(
          completion.response_tokens, completion.logprobs, completion.policy_logprobs,
          "stop" if stopped or stop_text is not None else "length", completion.policy_version,
          stop_text))
    self.owner[slot] = None
    if not finished:
      self.zombies.add(slot)
    elif self.reuse and stop_text is None:  # its cache: the prompt and answer but the last token
      self.parked[slot] = list(request.prompt) + completion.response_tokens
    self._forget(p)

  def report_error(self, error: BaseException) -> None:
    """Fails every request in flight or queued (the engine raised)."""
    for slot, owner in enumerate(self.owner):
      if owner is not None:
        self._fail(owner[0], error)
        self.owner[slot] = None
    self.partial.clear()
    self.parked.clear()
    for p in list(self.pending):
      self._fail(p, error)
    self.pending.clear()
    self.prefixes.clear()

