"""Continuous admission: split mode's producer as one stream of groups, with no batch barrier.

    stream_produce(run, gate, weights, sink, first=index)      # mesh.admission='continuous'

``produce`` (``rlx.trainer.produce.loop``) works batch by batch: a batch is done when its slowest
sample is, and the slots that free meanwhile idle until the next one starts. Here the engine
runs one stream (``rollout.generate(..., supply=)``): between decode chunks it asks for more
prompts, and a new group takes the slots that finished or parked samples leave. Groups are
handed over as they complete, ``data.prompts_per_step`` at a time, each batch to the sink as
``produce`` hands it (same ``Produced``, same gate and sink), so the learner loop cannot tell
the two apart.

**Order and age.** Prompts are admitted in the data stream's order, and the engine gives
slots first come, first served: a group's samples start before any later group's. A batch is
the first ``prompts_per_step`` groups to *complete* (all samples scored), so a slow group does
not hold a batch back; it goes in a later one. It cannot starve: it holds its slots from
admission, and every sample ends within ``rollout.max_new_tokens`` (an episode: its
``env.max_tokens``, each environment step within ``env.step_timeout_s``), so it completes
within a bounded time. Its age is judged where every batch's is: its oldest token's version
against ``mesh.max_staleness`` (``control.Controller.verdict``), and past that bound the
learner drops it, counted.

**Gate and bound.** A group is admitted only for a batch the gate has opened
(``control.may_start``): the batch it would complete, counting the groups in flight and
ready ahead of it; and at most ``mesh.groups_in_flight`` groups (admitted, not yet handed
over) at once, which keeps the slots full without running far ahead of the learner.

**Resuming.** A batch's data position (what a checkpoint after it keeps) counts every row
not handed over yet as not drawn: rows drawn and waiting, groups in flight and groups complete
but waiting for a batch (``PromptStream.get_state(pending=...)``). A run resumed from it
starts those groups again and skips the rows handed over (or dropped) past the oldest of them,
so no group is lost or trained twice across a restart, though groups complete out of order.

**Weights.** New versions reach the stream between decode chunks (in-flight updates; the
admission needs ``mesh.inflight_updates``): a prompt admitted later is prefilled by the
version of its time, and every token keeps the version that sampled it.

**Dynamic sampling.** A completed group whose rewards are all equal is dropped (counted) when
``algorithm.dynamic``, and the stream simply admits another: there are no redraws. Once it
has dropped ``algorithm.dynamic_sampling_max_draws`` batches' worth of groups without
handing a batch over, it stops with the cause, as batch admission does.

**Temperature.** One stream samples at one temperature. When the entropy controller changes
it, admission stops, the groups in flight finish and are handed over, a partial batch left
at the old temperature is dropped (counted), and a new stream starts at the new one.

Multi-turn episodes (``env.name``) stream the same way: a group's episodes start when it is
admitted, a parked episode keeps its slot while its environment works (or with
``env.release_slots`` leaves it, to be prefilled again when the reply comes) and the free
slots take new groups, and a group completes when its last episode ends.

A generator job (``mesh.role=generator``) streams the same way, its gate the learner's
progress in the workdir and its weights the newest Orbax version, read between decode chunks;
one of ``mesh.generators`` jobs hands over every ``stride``-th batch.

What it cannot do: several processes in one job (each would admit by its own clock, and their
programs would diverge), and agent programs through the endpoint (``env.agent``: each request
is its own); the config refuses both.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from rlx import rollout
from rlx.envs.calls import turn_stop_ids
from rlx.rewards import Scored
from rlx.rollout import Completion
from rlx.trainer.episodes import Episodes, tool_format
from rlx.trainer.produce.agents import episode_sums, given_reward, write_samples
from rlx.trainer.produce.collect import _Scorer, exhausted
from rlx.trainer.produce.tally import Tally, slot_metrics
from rlx.trainer import control
from rlx.trainer.draw import Draw
from rlx.trainer.produce.loop import Produced, measure_mismatch
from rlx.trainer.setup.run import Run

POLL_S = 0.02
"""How often an idle stream looks at its gate and its scorer."""


@dataclasses.dataclass
class _Group:
  row: dict
  index: int
  """Its prompt's index in the stream (the completions' ``prompt_index``)."""
  serial: int
  """Its row's serial in the data stream (``PromptStream.take``)."""
  setting: int
  born: float
  completions: list
  rewards: np.ndarray
  correct: np.ndarray
  components: dict = dataclasses.field(default_factory=dict)
  scored: int = 0


class Streamer:
  """The producer loop with continuous admission (see the module docstring)."""

  def __init__(self, run: Run, gate, weights, sink, *, first: int = 0, stride: int = 1,
               mismatch=None, mismatch_every: int = 0):
    self.run, self.gate, self.weights, self.sink = run, gate, weights, sink
    self.stride = stride
    """Batches ``first``, ``first + stride``, ...: one of ``stride`` generator jobs."""
    self.config = config = run.config
    self.size, self.per_batch = config.rollout.group_size, config.data.prompts_per_step
    self.bound = control.groups_in_flight(config)
    self.index = self.first = first
    """The next batch to hand over."""
    self.mismatch, self.mismatch_every = mismatch, mismatch_every
    self.rows: list[tuple[int, dict]] = []  # (serial, row) drawn from the data, not admitted
    self.flight: dict[int, _Group] = {}  # admitted, not complete
    self.ready: list[_Group] = []  # complete and kept, in completion order
    self.tally = Tally(self.size)  # the groups completed since the last hand-over
    self.halted = False
    self.temperature = config.rollout.temperature
    self.retemper: float | None = None  # the temperature the next stream runs at
    self.slots: dict = {}  # the engine's running totals of its slots' use
    self.slots_then: dict = {}  # ... at the last hand-over
    self.since = time.perf_counter()  # the last hand-over
    self.waited = 0.0  # seconds at the gate since then
    self.synced, self.swaps = weights.seconds, weights.swaps
    self.admitted = 0  # prompts admitted over the run (they seed the draws)

  def run_stream(self) -> int:
    """Streams until the gate says stop; returns the next batch index."""
    config, r = self.config, self.config.rollout
    while not self.halted:
      self.weights.refresh(force=True)
      # a generator job holds no weights until the learner's first version lands: its gate
      # opens once it does
      if self.weights.params is None and self.gate.wait(self.index) is None:
        break
      self.group_rows: list[dict] = []
      self.seen = 0
      self.offset = self.admitted  # prompt indices of this stream count from 0
      common = dict(params=self.weights.params, n=self.size, temperature=self.temperature,
                    top_p=r.top_p, top_k=r.top_k, seed=config.trainer.seed * 1_000_003 + self.first,
                    first_prompt_index=self.offset, policy_version=self.weights.version,
                    weights=self.weights, supply=self._supply, on_finished=self._finished,
                    stats=self.slots)
      # every episode admitted may be waiting for its environment, and a group's resets
      self.episodes = (Episodes(config, self.run.tokenizer, [], self.size, tools=self.run.tools,
                                episodes=(self.bound + 1) * self.size,
                                errors=self.run.env_errors)
                       if config.env.name else None)
      self.scorer = _Scorer(self.run, self.group_rows, *self._judges())
      try:
        if self.episodes is None:
          rollout.generate(self.run.engine, [], max_new_tokens=r.max_new_tokens,
                           stop_token_ids=self.run.tokenizer.eos_ids, **common)
        else:
          env = config.env
          rollout.generate_episodes(
              self.run.engine, [], self.episodes.respond,
              max_new_tokens=env.turn_max_new_tokens or r.max_new_tokens,
              max_tokens=env.max_tokens, step_timeout_s=env.step_timeout_s,
              release=env.release_slots,
              stop_token_ids=turn_stop_ids(self.run.tokenizer,
                                           tool_format(config, self.run.tokenizer)), **common)
      finally:
        try:
          parts = self.scorer.finish()
        finally:
          if self.episodes is not None:
            self.episodes.close()
      self._take(parts)  # what completed while the stream drained
      self._hand_over_ready()
      if self.retemper is not None:
        dropped = len(self.ready)
        self.ready.clear()  # a partial batch at the old temperature
        self.tally.dropped += dropped
        self.temperature, self.retemper = self.retemper, None
    return self.index

  def _judges(self):
    """What the scorer hands the reward function for an episode (its final turn, the row with
    the episode's messages), and the reward its environment gave, when it gave one."""
    if self.episodes is None:
      return None, None
    episodes = self.episodes.episodes

    def describe(c: Completion):
      episode = episodes[(c.prompt_index, c.sample_index)]
      return episode.final_text, dict(self.group_rows[c.prompt_index], messages=episode.messages)

    def direct(c: Completion):
      return given_reward(episodes[(c.prompt_index, c.sample_index)])

    return describe, direct

  # --- the engine's side: called between decode chunks -------------------------------------

  def _finished(self, completion: Completion) -> None:
    if self.episodes is None:  # a single answer ends at a stop string; a turn already did
      completion.cut_at_stop_strings(self.config.rollout.stop_strings,
                                     self.run.tokenizer.decode)
    self.scorer.submit(completion)

  def _supply(self, idle: bool) -> list[list[int]] | None:
    while True:
      if self.scorer.error is not None:  # its groups would never complete
        raise self.scorer.error
      self._take(self.scorer.parts)
      self._hand_over_ready()
      if self.halted or self.retemper is not None:
        return None
      admitted = self._admit()
      if admitted is None:
        return None
      if admitted or not idle:
        return admitted
      began = time.perf_counter()  # nothing in flight, nothing admissible: wait a little
      time.sleep(POLL_S)
      self.waited += time.perf_counter() - began

  def _admit(self) -> list[list[int]] | None:
    """The prompts of the groups the gate and the bound let in now; None: stop."""
    prompts = []
    while len(self.flight) + len(self.ready) < self.bound:
      target = self.index + (len(self.flight) + len(self.ready)) // self.per_batch * self.stride
      opened = self.gate.wait(target, timeout=0.0)
      if opened is False:
        break
      if opened is None:
        self.halted = True
        return None
      temperature = self.config.rollout.temperature if opened.temperature is None \
          else opened.temperature
      if temperature != self.temperature:
        self.retemper = temperature
        return None if not prompts else prompts
      if not self.rows:
        self.rows = self.run.stream.take(self.per_batch)
      serial, row = self.rows.pop(0)
      local = self.admitted - self.offset
      if self.episodes is None:
        prompt = row["prompt_tokens"]
      else:
        started = self.episodes.add([row])
        if not started:  # its environment's reset failed: skipped, counted
          self.tally.count({"agent:env_errors": 1})
          continue
        prompt = started[0]
      self.flight[local] = _Group(
          row, local, serial, opened.setting, time.time(), [None] * self.size,
          np.zeros(self.size, np.float32), np.zeros(self.size, bool))
      self.group_rows.append(row)
      self.admitted += 1
      prompts.append(prompt)
    return prompts

  # --- groups complete, batches go out -----------------------------------------------------

  def _take(self, parts: list) -> None:
    """Files the scores the scorer produced since the last look into their groups."""
    count = len(parts)  # the scorer thread appends meanwhile: take what is there now
    fresh, self.seen = parts[self.seen:count], count
    for batch, scored in fresh:
      for i, completion in enumerate(batch):
        group = self.flight[completion.prompt_index]
        s = completion.sample_index
        group.completions[s] = completion
        group.rewards[s], group.correct[s] = scored.rewards[i], scored.correct[i]
        for name, values in scored.components.items():
          group.components.setdefault(name, np.full(self.size, np.nan, np.float32))[s] = values[i]
        group.scored += 1
        if group.scored == self.size:
          self._complete(self.flight.pop(completion.prompt_index))
      self.tally.count(scored.counts)

  def _complete(self, group: _Group) -> None:
    tally = self.tally
    if self.episodes is not None:  # its statistics, and its environments let go
      replies = [self.episodes.replies.get((group.index, s)) for s in range(self.size)]
      episodes = self.episodes.forget(group.index)
      sums = episode_sums(episodes, group.completions)
      # an environment step still running once its episode ended: it ran past its timeout
      sums["step_timeouts"] = sum(r is not None and not r.done() for r in replies)
      tally.count({f"agent:{key}": value for key, value in sums.items()})
      tally.latencies += [call for e in episodes for call in e.tool_seconds]
    kept = tally.add(Scored(group.rewards, group.correct, {}, group.components),
                     dynamic=self.config.algorithm.dynamic).all()
    if not kept:
      limit = self.config.algorithm.dynamic_sampling_max_draws * self.per_batch
      if tally.dropped >= limit:  # as many groups as that many draws of a batch, all alike
        raise exhausted(self.run, tally.groups // self.per_batch, len(self.ready), tally)
      return
    self.ready.append(group)
    self._hand_over_ready()

  def _hand_over_ready(self) -> None:
    while len(self.ready) >= self.per_batch and not self.halted:
      groups, self.ready = self.ready[:self.per_batch], self.ready[self.per_batch:]
      self.sink.put(self._produced(groups))
      self.index += self.stride

  def _produced(self, groups: list[_Group]) -> Produced:
    tally, self.tally = self.tally, Tally(self.size)
    completions = [c for g in groups for c in g.completions]
    spans = [c.newest_version - c.policy_version for c in completions]
    slots = {key: value - self.slots_then.get(key, 0) for key, value in self.slots.items()}
    if slots.get("slot_steps", 0):
      self.slots_then = dict(self.slots)
    else:  # its groups were all decoded before the last hand-over: the stream's so far
      slots = dict(self.slots)
    counts = tally.metrics(tally.sums(), draws=1, slots=slots)
    counts.update({
        "rollout/mixed_version_frac": float(np.mean([s > 0 for s in spans])),
        "rollout/version_span_max": int(max(spans)),
        "rollout/version_span_mean": float(np.mean(spans)),
        "rollout/groups_in_flight": len(self.flight),
        **slot_metrics(slots),
    })
    rewards = np.concatenate([g.rewards for g in groups])
    if self.episodes is not None and self.temperature > 0:
      write_samples(self.run, completions, rewards)
    now = time.perf_counter()
    busy, self.since = now - self.since - self.waited, now
    draw = Draw(completions=completions, rewards=rewards,
                correct=np.concatenate([g.correct for g in groups]), counts=counts,
                generate_seconds=busy, data_state=self._data_state(),
                temperature=self.temperature, born=min(g.born for g in groups))
    measure_mismatch(self.mismatch, self.mismatch_every, self.index // self.stride,
                     self.weights, draw)
    produced = Produced(self.index, draw, min(g.setting for g in groups),
                        sync_seconds=self.weights.seconds - self.synced,
                        waited_seconds=self.waited, busy_seconds=busy,
                        weight_swaps=self.weights.swaps - self.swaps)
    self.synced, self.swaps, self.waited = self.weights.seconds, self.weights.swaps, 0.0
    return produced


  def _data_state(self) -> dict:
    """Where a run resumed after this batch continues: every row not handed over yet (drawn
    and waiting, in flight, complete and waiting for a batch) comes again, each once, and no
    row handed over or dropped comes twice."""
    pending = [serial for serial, _ in self.rows]
    pending += [group.serial for group in (*self.flight.values(), *self.ready)]
    return self.run.stream.get_state(pending=pending)


def stream_produce(run: Run, gate, weights, sink, *, first: int = 0, stride: int = 1,
                   mismatch=None, mismatch_every: int = 0) -> int:
  """``produce`` with continuous admission (the module docstring); returns the next index."""
  return Streamer(run, gate, weights, sink, first=first, stride=stride, mismatch=mismatch,
                  mismatch_every=mismatch_every).run_stream()
