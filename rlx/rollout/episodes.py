"""Multi-turn episodes inside continuous batching.

    completions = generate_episodes(engine, prompts, respond, n=8, params=params, ...)

Every episode holds a decode slot from its first token to its last. When a slot ends a turn
(a stop token, or its turn's length limit), it is *parked*: its KV cache stays, and
``respond(prompt_index, sample_index, turn_tokens, finish_reason)`` is called, which returns a
``concurrent.futures.Future`` of the environment's reply (an object with ``tokens``, ``done``
and ``truncated``); the environment works on the host while the other slots keep decoding.
When the reply comes, its tokens are appended to that slot's cache (``Engine.extend``: only
the new tokens are computed) and the next turn is sampled in the same slot.

A completion's ``response_tokens`` are the whole episode after the prompt, the sampled
tokens and the environment's in order; ``sampled_mask`` says which is which, and the
environment's tokens have log-prob 0. Sampled tokens are kept as ids: nothing is decoded and
encoded again. An episode ends when the environment says done, or truncated (finish reason
'length') when it would pass ``max_tokens`` after its prompt, or its environment does not
answer within ``step_timeout_s``. With ``weights=``, newer weights are swapped in between
decode chunks as in ``rollout.generate``: an episode may then span policy versions, each
token stamped with its own (``Completion.token_versions``).

``release=True`` parks an episode *off* the slots instead: the slot frees at the end of a
turn and takes other work while the environment runs (with slow tools most slots would
otherwise sit parked), and when the reply comes the episode's whole sequence so far (prompt,
turns, reply) is prefilled into the next free slot, ahead of new prompts, and its next turn
sampled there. The tokens are the same ids; the cache is computed again (by the weights in use
then, which is also what the learner recomputes the log-probs with), the behaviour log-probs
of the earlier turns stay those they were sampled with. The engine's ``max_prompt_len`` must
then hold a prompt and ``max_tokens``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from rlx.models.transformer import Params
from rlx.rollout.driver import Completion, Supply, Weights, _first_tokens, _Run
from rlx.rollout.engine import Engine, SamplingParams

Respond = Callable[[int, int, list[int], str], concurrent.futures.Future]


@dataclasses.dataclass
class _Parked:
  future: concurrent.futures.Future
  since: float


def generate_episodes(engine: Engine, prompts: Sequence[Sequence[int]], respond: Respond, *,
                      params: Params, n: int = 1, max_new_tokens: int, max_tokens: int,
                      temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                      stop_token_ids: Sequence[int], seed: int = 0, policy_version: int = 0,
                      first_prompt_index: int = 0, step_timeout_s: float = 30.0,
                      on_finished: Callable[[Completion], None] | None = None,
                      stats: dict | None = None, weights: Weights | None = None,
                      supply: Supply | None = None, release: bool = False) -> list[Completion]:
  """``n`` episodes from each prompt (see the module docstring).

  Args:
    max_new_tokens: the longest assistant turn.
    max_tokens: the most tokens an episode adds after its prompt (sampled and the
      environment's); at most the engine's ``max_len - max_prompt_len``.
    stop_token_ids: ids that end a turn.
    step_timeout_s: an environment reply that takes longer ends its episode, truncated (the
      caller's ``respond`` side counts it: the reply never arrives).
    stats: a dict to which the slots' use is added: ``slot_steps`` (decode steps x the
      slots they computed), ``busy_steps`` (of those, the ones that produced a token: the slot
      occupancy is their ratio), ``parked_s`` (seconds every slot waited for an environment
      while no slot decoded), ``life_s`` (the finished episodes' seconds from their first
      token to their end) and ``away_s`` (of those, the seconds released episodes spent out
      of the slots, waiting for their environment or for a free slot).
    release: an episode waiting for its environment leaves its slot (the module docstring).
    The rest as in ``rollout.generate``.
  """
  prompts = [list(map(int, p)) for p in prompts]
  if not prompts and supply is None:
    return []
  run = EpisodeRun(engine, params, prompts, n, max_new_tokens, temperature, top_p, top_k,
                   tuple(stop_token_ids), seed, policy_version, "continuous", first_prompt_index,
                   on_finished, weights, respond=respond, max_tokens=max_tokens,
                   step_timeout_s=step_timeout_s, supply=supply, stats=stats, release=release)
  for p in prompts:
    run._admissible(p)
  return run.run()


class EpisodeRun(_Run):
  """``_Run`` whose slots park at the end of a turn instead of freeing (with ``release``, whose
  episodes leave their slots and come back)."""

  def __init__(self, *args, respond: Respond, max_tokens: int, step_timeout_s: float,
               release: bool = False, **kwargs):
    super().__init__(*args, **kwargs)
    self.respond, self.max_tokens, self.step_timeout_s = respond, max_tokens, step_timeout_s
    self.parked: dict[int, _Parked] = {}  # slot -> its episode's environment step
    self.turn_start: dict[tuple[int, int], int] = {}
    self.release = release
    self.away: dict[tuple[int, int], _Parked] = {}  # released: episode -> its environment step
    self.returning: collections.deque = collections.deque()  # (episode, reply tokens)
    """Released episodes whose reply came, waiting for a free slot."""
    self.born: dict[tuple[int, int], float] = {}  # episode -> when its first turn began
    self.left: dict[tuple[int, int], float] = {}  # released episode -> when it left its slot
    self.away_for: dict[tuple[int, int], float] = {}  # episode -> seconds out of the slots
    for key in ("life_s", "away_s"):
      self.stats.setdefault(key, 0.0)

  def _in_flight(self) -> bool:
    return super()._in_flight() or bool(self.away or self.returning)

  def _admissible(self, prompt: list[int]) -> None:
    super()._admissible(prompt)
    if self.max_tokens > self.engine.max_len - len(prompt):
      raise ValueError(f"max_tokens={self.max_tokens} does not fit in the engine's max_len="
                       f"{self.engine.max_len} after a prompt of {len(prompt)} tokens")
    if self.release and len(prompt) + self.max_tokens - 1 > self.engine.max_prompt_len:
      raise ValueError(f"a released episode is prefilled again whole: a prompt of "
                       f"{len(prompt)} tokens and max_tokens={self.max_tokens} need an engine "
                       f"max_prompt_len of {len(prompt) + self.max_tokens - 1}, it has "
                       f"{self.engine.max_prompt_len}")

  def _step(self, state):
    """Resumes the slots whose environment answered, fills the free ones, then decodes one
    chunk; when every slot waits on its environment, waits for the first reply."""
    state = self._resume(state)
    free = [s for s, o in enumerate(self.owner) if o is None]
    if free and self.returning:  # released episodes first: they are older than new prompts
      state = self._reenter(state, free)
      free = [s for s, o in enumerate(self.owner) if o is None]
    if free:
      state = self._fill(state, free)
    decoding = [s for s, o in enumerate(self.owner) if o is not None and s not in self.parked]
    waiting = [*self.parked.values(), *self.away.values()]
    if decoding:
      state, _ = self._decode(state, decoding, bool(self.pending or self.prefixes or waiting
                                                    or self.returning))
    elif waiting:  # every episode waits for its environment
      oldest = min(p.since for p in waiting)
      began = time.monotonic()
      concurrent.futures.wait([p.future for p in waiting],
                              timeout=max(oldest + self.step_timeout_s - time.monotonic(), 0.01),
                              return_when=concurrent.futures.FIRST_COMPLETED)
      self.stats["parked_s"] += time.monotonic() - began
    return state

  def _append(self, slot: int, tokens, logprobs, policy_logprobs, finished, stopped,
              version: int) -> None:
    key = self.owner[slot]
    completion = self.partial.get(key)
    if completion is None:
      completion = Completion(prompt_tokens=self.prompts[key[0]], response_tokens=[], logprobs=[],
                              policy_logprobs=[], finish_reason="length",
                              policy_version=version, prompt_index=key[0],
                              sample_index=key[1], sampled_mask=[], turns=1)
      self.partial[key] = completion
      self.turn_start[key] = 0
      self.born[key] = time.monotonic()
    completion.stamp(len(tokens), version)
    completion.response_tokens.extend(tokens.tolist())
    completion.logprobs.extend(logprobs.tolist())
    completion.policy_logprobs.extend(policy_logprobs.tolist())
    completion.sampled_mask.extend([True] * len(tokens))
    if finished:
      turn = completion.response_tokens[self.turn_start[key]:]
      future = self.respond(key[0], key[1], turn, "stop" if stopped else "length")
      if self.release:  # the slot takes other work meanwhile
        self.away[key] = _Parked(future, time.monotonic())
        self.left[key] = self.away[key].since
        self.owner[slot] = None
      else:
        self.parked[slot] = _Parked(future, time.monotonic())

  def _moved(self, moved: dict[int, int]) -> None:
    super()._moved(moved)
    self.parked = {moved.get(s, s): parked for s, parked in self.parked.items()}

  def _finish(self, slot: int | None, truncated: bool, key: tuple[int, int] | None = None) -> None:
    key = self.owner[slot] if key is None else key
    completion = self.partial.pop(key)
    completion.finish_reason = "length" if truncated else "stop"
    self._lived(key)
    self._complete(key, slot, completion)

  def _resume(self, state):
    """Ends the episodes whose environment said done (or did not answer in time) and appends
    the replies of the others to their slots' caches, starting their next turn."""
    now, extend = time.monotonic(), []
    for slot, parked in list(self.parked.items()):
      if not parked.future.done():
        if now - parked.since > self.step_timeout_s:
          del self.parked[slot]
          self._finish(slot, truncated=True)
        continue
      del self.parked[slot]
      reply = parked.future.result()
      completion = self.partial[self.owner[slot]]
      used = len(completion.response_tokens) + len(reply.tokens)
      if reply.done or not reply.tokens or used >= self.max_tokens:
        self._finish(slot, truncated=reply.truncated or (not reply.done))
        continue
      extend.append((slot, list(reply.tokens)))
    if extend:
      state = self._extend(state, extend)
    for key, parked in list(self.away.items()):
      if not parked.future.done():
        if now - parked.since > self.step_timeout_s:
          del self.away[key]
          self._finish(None, truncated=True, key=key)
        continue
      del self.away[key]
      reply = parked.future.result()
      used = len(self.partial[key].response_tokens) + len(reply.tokens)
      if reply.done or not reply.tokens or used >= self.max_tokens:
        self._finish(None, truncated=reply.truncated or (not reply.done), key=key)
        continue
      self.returning.append((key, list(reply.tokens)))
    return state

  def _lived(self, key: tuple[int, int]) -> None:
    """Adds a finished episode's life, and its time away from the slots, to the stats."""
    now = time.monotonic()
    self.stats["life_s"] += now - self.born.pop(key)
    self.stats["away_s"] += self.away_for.pop(key, 0.0) + now - self.left.pop(key, now)

  def _reenter(self, state, free: list[int]):
    """Prefills released episodes whose reply came (their whole sequence so far) into free
    slots and samples their next turns' first tokens there."""
    entries = [self.returning.popleft() for _ in range(min(len(free), len(self.returning)))]
    count = self.engine.batch_bucket(len(entries))
    histories = []
    for key, appended in entries:
      completion = self.partial[key]
      self._append_reply(key, appended)
      histories.append(self.prompts[key[0]] + completion.response_tokens)
    length = self.engine.prompt_bucket(max(map(len, histories)))
    tokens = np.zeros((count, length), np.int32)
    true_length = np.ones((count,), np.int32)
    for row, history in enumerate(histories):
      tokens[row, :len(history)], true_length[row] = history, len(history)
    prefix = self.engine.prefill(self.params, tokens, true_length)
    slots = np.full((count,), self.engine.max_slots, np.int32)
    slots[:len(entries)] = free[:len(entries)]
    requests = self._keys([key for key, _ in entries])
    keys = [jax.random.fold_in(requests[i], 1_000_000 + self.partial[key].turns)
            for i, (key, _) in enumerate(entries)]
    keys += [keys[0]] * (count - len(entries))
    now = time.monotonic()
    for i, (key, _) in enumerate(entries):
      self.owner[int(slots[i])] = key
      self.index[slots[i]] = len(histories[i])
      self.away_for[key] = self.away_for.get(key, 0.0) + now - self.left.pop(key)
    state = self.engine.insert(prefix, state, slots, np.arange(count, dtype=np.int32),
                               jax.numpy.stack(keys), self._turn_sampling(
                                   count, [key for key, _ in entries]))
    placed = slots[:len(entries)]
    self.firsts.append((placed.tolist(), _first_tokens(state, slots), self.policy_version))
    return state

  def _append_reply(self, key: tuple[int, int], appended: list[int]) -> None:
    """The environment's reply joins the episode (log-prob 0, not sampled); a turn starts."""
    completion = self.partial[key]
    completion.stamp(len(appended), self.policy_version)
    completion.response_tokens.extend(appended)
    completion.logprobs.extend([0.0] * len(appended))
    completion.policy_logprobs.extend([0.0] * len(appended))
    completion.sampled_mask.extend([False] * len(appended))
    completion.turns += 1
    self.turn_start[key] = len(completion.response_tokens)

  def _turn_sampling(self, count: int, keys: list[tuple[int, int]]) -> SamplingParams:
    """The sampling of the next turns of ``keys`` (padded to ``count`` rows): each within the
    turn's limit and what its episode has left."""
    temperature, top_k, top_p, turn_max, stop_ids = self.sampling_row
    max_new = np.ones((count,), np.int32)
    for i, key in enumerate(keys):
      max_new[i] = min(turn_max, self.max_tokens - len(self.partial[key].response_tokens))
    return SamplingParams(
        temperature=np.full((count,), temperature, np.float32),
        top_k=np.full((count,), top_k, np.int32), top_p=np.full((count,), top_p, np.float32),
        max_new_tokens=max_new, stop_ids=np.tile(stop_ids, (count, 1)))

  def _extend(self, state, replies: list[tuple[int, list[int]]]):
    count = self.engine.batch_bucket(len(replies))
    width = 8
    while width < 1 + max(len(tokens) for _, tokens in replies):
      width *= 2
    slots = np.full((count,), self.engine.max_slots, np.int32)
    tokens = np.zeros((count, width), np.int32)
    lengths = np.ones((count,), np.int32)
    keys = []
    requests = self._keys([self.owner[slot] for slot, _ in replies])  # one dispatch for all
    for i, (slot, appended) in enumerate(replies):
      key = self.owner[slot]
      completion = self.partial[key]
      row = [completion.response_tokens[-1], *appended]  # the last sampled token is not cached yet
      slots[i], tokens[i, :len(row)], lengths[i] = slot, row, len(row)
      self._append_reply(key, appended)
      keys.append(jax.random.fold_in(requests[i], 1_000_000 + completion.turns))
      self.index[slot] += len(row)
    keys += [keys[0]] * (count - len(replies))
    sampling = self._turn_sampling(count, [self.owner[slot] for slot, _ in replies])
    state = self.engine.extend(self.params, state, slots, tokens, lengths,
                               jax.numpy.stack(keys), sampling,
                               filled=int(self.index[slots[:len(replies)]].max()))
    placed = slots[:len(replies)]
    self.firsts.append((placed.tolist(), _first_tokens(state, slots), self.policy_version))
    return state
