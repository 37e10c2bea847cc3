"""Multi-turn episodes for the trainer: an environment per episode (``config.env``), its tool
calls in the run's tool workers, and the episode's reward.

    completions, scored = run_episodes(run, params, rows, n=8, temperature=1.0, seed=0, version=3)

Each group's ``n`` episodes start from the same prompt, rendered from the first messages of
its environment with the tools' schemas. Environments answer on a thread pool, so that the
engine keeps decoding the other slots meanwhile. The reward of an episode is what its
environment gave (summed over turns), or, when it gave none, the run's reward function on the
final assistant turn, with the row and the episode's ``messages``.

The scored counts carry the episodes' statistics as sums (``agent:<name>``); ``agent_metrics``
turns the sums of a step into the logged ``agent/*`` metrics.
"""

from __future__ import annotations

import concurrent.futures
import json
import pathlib
import queue
import threading
import time
from collections.abc import Sequence

import jax
import numpy as np

from rlx import rollout
from rlx.config import RunConfig
from rlx.envs import COUNTS, Episode, Renderer, Toolbox, check_env, load_factory, tools_of
from rlx.envs.episode import EnvError
from rlx.envs.calls import Format, detect_format, turn_stop_ids
from rlx.rewards import Scored
from rlx.rollout import Completion

AGENT_SUMS = ("episodes", "turns", "truncated", "env_s", "tool_wait_s", "step_timeouts",
              "slot_steps", "busy_steps", "held_steps", "parked_s", "life_s", "away_s", *COUNTS)


def tool_format(config: RunConfig, tokenizer) -> Format:
  """The run's tool-call format ('auto': builtin without a chat template, else by the
  template's own markers)."""
  chosen = config.env.tool_format
  return detect_format(tokenizer) if chosen == "auto" else chosen


class _DaemonPool:
  """``submit(fn, *args) -> Future`` on up to ``workers`` daemon threads, started as work comes
  (a thread per call waiting at once, so a quick call never queues behind slow ones while
  the bound allows). An environment's call that never returns then holds one thread and no
  more: it can keep neither a batch nor the process alive (``ThreadPoolExecutor`` joins its
  threads at exit, so a hung ``step`` kept a finished run from exiting)."""

  def __init__(self, workers: int, name: str):
    self._tasks: queue.SimpleQueue = queue.SimpleQueue()
    self._closed, self._workers, self._name = False, workers, name
    self._lock = threading.Lock()
    self._started = self._idle = 0

  def submit(self, fn, *args) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    if self._closed:
      future.cancel()
      return future
    with self._lock:
      if self._idle:
        self._idle -= 1  # that thread takes this task
      elif self._started < self._workers:
        threading.Thread(target=self._work, name=f"{self._name}-{self._started}",
                         daemon=True).start()
        self._started += 1
    self._tasks.put((future, fn, args))
    return future

  @property
  def threads(self) -> int:
    """Threads started so far."""
    return self._started

  def _work(self) -> None:
    while True:
      task = self._tasks.get()
      if task is None:
        return
      future, fn, args = task
      if future.set_running_or_notify_cancel():
        try:
          future.set_result(fn(*args))
        except BaseException as error:  # noqa: BLE001 - the caller reads it from the future
          future.set_exception(error)
      with self._lock:
        self._idle += 1

  def shutdown(self) -> None:
    """Stops taking work; idle threads end, busy ones end with their call (or the process)."""
    self._closed = True
    while True:
      try:
        future, _, _ = self._tasks.get_nowait()
      except queue.Empty:
        break
      future.cancel()
    with self._lock:
      started = self._started
    for _ in range(started):
      self._tasks.put(None)


class _Episodes:
  """The environments of one ``run_episodes`` call, and the thread pool that answers turns."""

  def __init__(self, run, rows: Sequence[dict], n: int, episodes: int = 0):
    """``episodes``: the most that may be under way at once (default: ``rows``'s); each gets a
    thread for its environment step, so a step that ends an episode never waits for another
    episode's slow tool call (the tools have their own bound, ``env.tool_workers``)."""
    config = run.config
    self.run, self.rows, self.n = run, [], n
    self.factory = load_factory(config.env.name)
    self.format = tool_format(config, run.tokenizer)
    self.episodes: dict[tuple[int, int], Episode] = {}
    self.prompts: list[list[int]] = []
    self.toolboxes: dict[tuple, Toolbox | None] = {}
    self.pool = _DaemonPool(max(4, 2 * config.env.tool_workers, episodes or len(rows) * n),
                            "rlx-env")
    self.replies: dict[tuple[int, int], concurrent.futures.Future] = {}
    self.failed_rows = 0
    """Rows skipped because an environment's ``reset`` failed (counted as env errors)."""
    self.add(rows)

  def add(self, rows: Sequence[dict]) -> list[list[int]]:
    """Starts the episodes of more rows (prompt indices counting on); returns their prompts."""
    config, start = self.run.config, len(self.prompts)
    for row in rows:
      try:
        self._start(row, len(self.prompts))
      except EnvError as error:  # this row only: skipped and counted, as a bad data row is
        self.failed_rows += 1
        if getattr(self.run, "env_error", None) is None:
          self.run.env_error = f"{row.get('where', 'a row')}: {error}"
          if jax.process_index() == 0:
            print(f"rlx: warning: environment {config.env.name!r}: {self.run.env_error}; the "
                  "row is skipped (agent/env_errors counts such rows)", flush=True)
        continue
    return self.prompts[start:]

  def _start(self, row: dict, p: int) -> None:
    """Starts the ``n`` episodes of ``row`` as prompt ``p``."""
    config = self.run.config
    first = None
    for s in range(self.n):
      env = check_env(self.factory(dict(row)), config.env.name)
      tools = tools_of(env)
      names = tuple(getattr(t, "__name__", getattr(getattr(t, "func", None), "__name__", ""))
                    for t in tools)
      signature = (names, repr([getattr(t, "keywords", None) for t in tools]))
      if signature not in self.toolboxes:
        self.toolboxes[signature] = Toolbox.of(tools) if tools else None
      toolbox = self.toolboxes[signature]
      renderer = Renderer(self.run.tokenizer, self.format, toolbox.schemas if toolbox else ())
      episode = Episode(env, renderer, self.run.tools, toolbox, format=self.format,
                        max_turns=config.env.max_turns,
                        max_observation_chars=config.env.max_observation_chars,
                        system=config.data.system_prompt)
      try:
        prompt = self._started(episode)
      except EnvError:
        for earlier in range(s):  # the row's episodes started so far go with it
          self.episodes.pop((p, earlier))
        raise
      if first is None:
        first = prompt
      elif prompt != first:
        raise ValueError(f"environment {config.env.name!r} starts the episodes of one row "
                         "differently; a group's episodes must share their first messages")
      self.episodes[(p, s)] = episode
    if len(first) > config.rollout.max_prompt_len:
      raise ValueError(f"{row.get('where', 'a row')}: the first messages with the tools' schemas "
                       f"are {len(first)} tokens, more than rollout.max_prompt_len="
                       f"{config.rollout.max_prompt_len}; raise it")
    self.rows.append(row)
    self.prompts.append(first)

  def _started(self, episode: Episode) -> list[int]:
    """``episode.start()`` on the pool, within ``env.step_timeout_s``: a reset that never
    returns skips its row (its thread is left to it) instead of hanging the run."""
    timeout = self.run.config.env.step_timeout_s
    future = self.pool.submit(episode.start)
    try:
      return future.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
      raise EnvError(f"reset() did not return within env.step_timeout_s={timeout:g}s") from None

  def forget(self, p: int) -> list[Episode]:
    """The episodes of prompt ``p``, no longer kept (a stream's finished group)."""
    for s in range(self.n):
      self.replies.pop((p, s), None)
    return [self.episodes.pop((p, s)) for s in range(self.n)]

  def respond(self, p: int, s: int, tokens: list[int], reason: str) -> concurrent.futures.Future:
    episode = self.episodes[(p, s)]
    text = self.run.tokenizer.decode(tokens)  # for the environment to read; ids stay as sampled
    self.replies[(p, s)] = future = self.pool.submit(episode.respond, text, reason)
    return future

  def step_timeouts(self) -> int:
    """Environment steps still running after their episode was ended for taking too long."""
    return sum(not future.done() for future in self.replies.values())

  def close(self) -> None:
    self.pool.shutdown()


def run_episodes(run, params, rows: list[dict], *, n: int, temperature: float, seed: int,
                 version: int, first_prompt_index: int = 0,
                 inflight=None) -> tuple[list[Completion], Scored]:
  """``n`` episodes of each row, and their rewards, verdicts and statistics (``inflight``:
  newer weights between decode chunks, as in ``collect.generate_and_score``)."""
  config = run.config
  episodes = _Episodes(run, rows, n)
  r = config.rollout
  slots: dict = {}
  try:
    completions = rollout.generate_episodes(
        run.engine, episodes.prompts, episodes.respond, params=params, n=n,
        max_new_tokens=config.env.turn_max_new_tokens or r.max_new_tokens,
        max_tokens=config.env.max_tokens, temperature=temperature, top_p=r.top_p, top_k=r.top_k,
        stop_token_ids=turn_stop_ids(run.tokenizer, tool_format(config, run.tokenizer)),
        seed=seed, policy_version=version,
        first_prompt_index=first_prompt_index, step_timeout_s=config.env.step_timeout_s,
        stats=slots, weights=inflight, release=config.env.release_slots)
  finally:
    episodes.close()
  ordered = [episodes.episodes[(c.prompt_index, c.sample_index)] for c in completions]
  unrewarded = [i for i, e in enumerate(ordered) if not e.rewarded]
  scored = run.pool.score([ordered[i].final_text for i in unrewarded],
                          [dict(episodes.rows[completions[i].prompt_index],
                                messages=ordered[i].messages)
                           for i in unrewarded])
  rewards = np.zeros(len(completions), np.float32)
  correct = np.zeros(len(completions), bool)
  rewards[unrewarded], correct[unrewarded] = scored.rewards, scored.correct
  for i, episode in enumerate(ordered):
    if episode.rewarded:
      rewards[i] = episode.reward
      correct[i] = episode.info.get("correct", float(episode.reward >= 1.0)) >= 1
  counts = dict(scored.counts)
  sums = episode_sums(ordered, completions)
  sums["step_timeouts"] = episodes.step_timeouts()
  sums["env_errors"] += episodes.failed_rows  # rows whose reset failed, skipped
  sums.update(slots)
  counts.update({f"agent:{key}": value for key, value in sums.items()})
  components = {name: np.full(len(completions), np.nan, np.float32) for name in scored.components}
  for name, values in scored.components.items():
    components[name][unrewarded] = values
  run.tool_latencies.extend(call for e in ordered for call in e.tool_seconds)
  if jax.process_index() == 0 and temperature > 0:  # training episodes, not greedy evals
    write_samples(run, completions, rewards)
  return completions, Scored(rewards, correct, counts, components)


SAMPLES_FILE = "episodes.jsonl"
_SAMPLE_EVERY_S = 30.0


def segments(tokenizer, completion: Completion) -> list[list]:
  """An episode as [text, sampled] runs: the prompt (False), then the sampled turns (True) and
  the environment's tokens (False), each decoded on its own."""
  runs = [[tokenizer.decode(completion.prompt_tokens, skip_special_tokens=False), False]]
  mask = completion.sampled_mask or [True] * len(completion.response_tokens)
  start = 0
  for i in range(1, len(mask) + 1):
    if i == len(mask) or mask[i] != mask[start]:
      runs.append([tokenizer.decode(completion.response_tokens[start:i],
                                    skip_special_tokens=False), bool(mask[start])])
      start = i
  return runs


def write_samples(run, completions: Sequence[Completion], rewards: np.ndarray,
                  count: int = 2) -> None:
  """Appends ``count`` episodes (the best and the worst of the call) to the workdir's
  ``episodes.jsonl``, at most every 30 s: what the report shows as sample trajectories."""
  now = time.time()
  if now - getattr(run, "samples_written", 0.0) < _SAMPLE_EVERY_S or not completions:
    return
  run.samples_written = now
  order = np.argsort(rewards)
  chosen = sorted({int(order[-1]), int(order[0])})[:count]
  with open(pathlib.Path(run.workdir) / SAMPLES_FILE, "a") as f:
    for i in chosen:
      c = completions[i]
      f.write(json.dumps({"time": now, "policy_version": c.policy_version,
                          "reward": float(rewards[i]), "turns": c.turns,
                          "finish_reason": c.finish_reason,
                          "segments": segments(run.tokenizer, c)}) + "\n")


def episode_sums(episodes: Sequence[Episode], completions: Sequence[Completion]) -> dict[str, float]:
  """The statistics of some episodes, as sums (``agent_metrics`` makes them means)."""
  sums = dict.fromkeys(AGENT_SUMS, 0.0)
  for episode, completion in zip(episodes, completions):
    sums["episodes"] += 1
    sums["turns"] += completion.turns
    sums["truncated"] += completion.finish_reason == "length"
    sums["env_s"] += episode.env_seconds
    sums["tool_wait_s"] += episode.tool_wait_seconds
    for key in COUNTS:
      sums[key] += episode.counts[key]
  return sums


def slot_metrics(sums: dict[str, float]) -> dict[str, float]:
  """The decode slots' use from ``_Run``'s counts: of the slot steps the chunks computed, those
  that produced a token (occupancy) and those that held a decoding sample when their chunk
  began (free and parked slots hold none)."""
  computed = max(sums.get("slot_steps", 0), 1)
  return {"rollout/slot_occupancy": sums.get("busy_steps", 0) / computed,
          "rollout/slots_held_frac": sums.get("held_steps", 0) / computed}


def agent_metrics(sums: dict[str, float],
                  latencies: Sequence[tuple[str, float]]) -> dict[str, float]:
  """``agent/*`` metrics of a step from its summed statistics and its tool calls' (tool name,
  seconds): latency percentiles over every call, and per tool when there are several."""
  episodes = max(sums.get("episodes", 0), 1)
  metrics = {
      "agent/turns_mean": sums.get("turns", 0) / episodes,
      "agent/tool_calls_mean": sums.get("tool_calls", 0) / episodes,
      "agent/malformed_calls": sums.get("malformed_calls", 0),
      "agent/truncated_frac": sums.get("truncated", 0) / episodes,
      **slot_metrics(sums),
  }
  if "requests" in sums:  # an agent program's episodes (config.env.agent): it runs its tools
    failures = (sums.get("program_errors", 0) + sums.get("program_timeouts", 0)
                + sums.get("silent_episodes", 0))
    metrics.update({
        "agent/requests_mean": sums["requests"] / episodes,
        "agent/program_errors": sums.get("program_errors", 0),
        "agent/program_timeouts": sums.get("program_timeouts", 0),
        "agent/silent_episodes": sums.get("silent_episodes", 0),
        "agent/failed_groups": sums.get("failed_groups", 0),
        # of every episode run: the kept ones, those dropped with a failed group, the failed
        "agent/failed_frac": failures / max(sums.get("episodes", 0)
                                            + sums.get("dropped_episodes", 0) + failures, 1),
        "agent/history_rewrites": sums.get("history_rewrites", 0),
        # sampled tokens left out of training: other segments, unchosen choices of n > 1
        "agent/dropped_token_frac": (sums.get("dropped_tokens", 0)
                                     / max(sums.get("sampled_tokens", 0), 1)),
    })
  else:
    metrics.update({
        "agent/tool_errors": sums.get("tool_errors", 0),
        "agent/tool_timeouts": sums.get("tool_timeouts", 0),
        "agent/env_errors": sums.get("env_errors", 0),
        "agent/env_timeouts": sums.get("step_timeouts", 0),
        "time/env_s": sums.get("env_s", 0.0),
        # a call's wait for a free tool worker, before it runs (the latencies leave it out)
        "agent/tool_wait_mean_s": sums.get("tool_wait_s", 0.0) / max(sums.get("tool_calls", 0), 1),
        "time/all_slots_parked_s": sums.get("parked_s", 0.0),
        # the share of an episode's life in a decode slot (released episodes leave theirs
        # while their environment works): mesh.groups_in_flight needs slots / this episodes
        "agent/in_slot_frac": (1.0 - sums.get("away_s", 0.0) / sums["life_s"]
                               if sums.get("life_s", 0.0) > 0 else 1.0),
    })
  tools = sorted({name for name, _ in latencies})
  for tool in [None, *tools] if len(tools) > 1 else [None] * bool(tools):
    seconds = np.asarray([s for name, s in latencies if tool is None or name == tool])
    suffix = "" if tool is None else f"/{tool}"
    for q, value in zip((50, 90, 99), np.percentile(seconds, [50, 90, 99])):
      metrics[f"agent/tool_latency_p{q}_s{suffix}"] = float(value)
  return metrics
