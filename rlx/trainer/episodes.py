"""Starting a run's multi-turn episodes: an environment per episode (``config.env``), each
row's first prompt (its environment's first messages with the tools' schemas), and the
thread pool that answers the episodes' turns.

    episodes = Episodes(config, tokenizer, rows, n, tools=run.tools, errors=run.env_errors)
    episodes.prompts[p]                        # prompt p's tokens, shared by its n episodes
    future = episodes.respond(p, s, tokens, reason)
    episodes.close()

The producer's episodes (``rlx.trainer.produce.agents``) and the run's start (the warm-up's
prompts, the check of the first rows' lengths) both start episodes this way, so it lies on
the trainer's floor, below both.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Sequence

import jax

from rlx.config import RunConfig
from rlx.envs import Episode, Renderer, Toolbox, check_env, load_factory, tools_of
from rlx.envs.calls import Format, detect_format
from rlx.envs.episode import EnvError


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


def _reset(future: concurrent.futures.Future, timeout: float) -> list[int]:
  """The first prompt a started episode's ``reset`` gave (``Episode.start``, on the pool);
  EnvError when it raised or has not returned by now (its thread is left to it)."""
  if not future.done():
    future.cancel()
    raise EnvError(f"reset() did not return within env.step_timeout_s={timeout:g}s")
  return future.result()


class EnvErrors:
  """The environment errors a run met while starting episodes: how many rows were skipped,
  and the first error, said once (``agent/env_errors`` counts them per batch)."""

  def __init__(self):
    self.first: str | None = None
    self.rows = 0

  def none_started(self, config: RunConfig, rows: int, when: str) -> str:
    """The line for ``rows`` rows none of whose environments started (``when``: "tried at
    start", "of 3 draws")."""
    return (f"environment {config.env.name!r} could not start: reset() failed on all {rows} "
            f"rows {when} (raised, returned no messages, or ran past env.step_timeout_s="
            f"{config.env.step_timeout_s:g}s); the first error: {self.first}")

  def add(self, env_name: str, row: dict, error: Exception) -> None:
    self.rows += 1
    if self.first is None:
      self.first = f"{row.get('where', 'a row')}: {error}"
      if jax.process_index() == 0:
        print(f"rlx: warning: environment {env_name!r}: {self.first}; the row is skipped "
              "(agent/env_errors counts such rows)", flush=True)


class Episodes:
  """The environments of one ``run_episodes`` call, and the thread pool that answers turns."""

  def __init__(self, config: RunConfig, tokenizer, rows: Sequence[dict], n: int, *,
               tools=None, episodes: int = 0, errors: EnvErrors | None = None):
    """``tools``: the run's tool workers (``ToolRunner``; None: tools run in the episode's
    thread); ``errors``: where skipped rows are told (default: a record of this call's own).
    ``episodes``: the most that may be under way at once (default: ``rows``'s); each gets a
    thread for its environment step, so a step that ends an episode never waits for another
    episode's slow tool call (the tools have their own bound, ``env.tool_workers``)."""
    self.config, self.tokenizer, self.tools = config, tokenizer, tools
    self.errors = EnvErrors() if errors is None else errors
    self.rows, self.n = [], n
    self.factory = load_factory(config.env.name)
    self.format = tool_format(config, tokenizer)
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
    """Starts the episodes of more rows (prompt indices counting on); returns their prompts.
    Every episode's ``reset`` runs at once, on the pool, within one ``env.step_timeout_s``:
    rows whose resets hang or raise are skipped and counted, never waited for in turn."""
    config, start = self.config, len(self.prompts)
    timeout = config.env.step_timeout_s
    made = []  # (row, [(episode, future)] or the row's EnvError)
    for row in rows:
      try:
        episodes = [self._episode(row) for _ in range(self.n)]
      except EnvError as error:
        made.append((row, error))
        continue
      made.append((row, [(episode, self.pool.submit(episode.start)) for episode in episodes]))
    futures = [future for _, started in made if not isinstance(started, EnvError)
               for _, future in started]
    concurrent.futures.wait(futures, timeout=timeout)
    for row, started in made:
      try:
        if isinstance(started, EnvError):
          raise started
        self._keep(row, [(episode, _reset(future, timeout)) for episode, future in started])
      except EnvError as error:  # this row only: skipped and counted, as a bad data row is
        self.failed_rows += 1
        self.errors.add(config.env.name, row, error)
    return self.prompts[start:]

  def _episode(self, row: dict) -> Episode:
    """One episode of ``row``: its environment, tools and renderer (not started)."""
    config = self.config
    env = check_env(self.factory(dict(row)), config.env.name)
    tools = tools_of(env)
    names = tuple(getattr(t, "__name__", getattr(getattr(t, "func", None), "__name__", ""))
                  for t in tools)
    signature = (names, repr([getattr(t, "keywords", None) for t in tools]))
    if signature not in self.toolboxes:
      self.toolboxes[signature] = Toolbox.of(tools) if tools else None
    toolbox = self.toolboxes[signature]
    renderer = Renderer(self.tokenizer, self.format, toolbox.schemas if toolbox else ())
    return Episode(env, renderer, self.tools, toolbox, format=self.format,
                   max_turns=config.env.max_turns,
                   max_observation_chars=config.env.max_observation_chars,
                   system=config.data.system_prompt)

  def _keep(self, row: dict, started: list[tuple[Episode, list[int]]]) -> None:
    """Keeps ``row``'s started episodes as the next prompt, once they agree on it."""
    config = self.config
    first = started[0][1]
    if any(prompt != first for _, prompt in started):
      raise ValueError(f"environment {config.env.name!r} starts the episodes of one row "
                       "differently; a group's episodes must share their first messages")
    if len(first) > config.rollout.max_prompt_len:
      raise ValueError(f"{row.get('where', 'a row')}: the first messages with the tools' schemas "
                       f"are {len(first)} tokens, more than rollout.max_prompt_len="
                       f"{config.rollout.max_prompt_len}; raise it")
    p = len(self.prompts)
    for s, (episode, _) in enumerate(started):
      self.episodes[(p, s)] = episode
    self.rows.append(row)
    self.prompts.append(first)

  def forget(self, p: int) -> list[Episode]:
    """The episodes of prompt ``p``, no longer kept (a stream's finished group)."""
    for s in range(self.n):
      self.replies.pop((p, s), None)
    return [self.episodes.pop((p, s)) for s in range(self.n)]

  def respond(self, p: int, s: int, tokens: list[int], reason: str) -> concurrent.futures.Future:
    episode = self.episodes[(p, s)]
    text = self.tokenizer.decode(tokens)  # for the environment to read; ids stay as sampled
    self.replies[(p, s)] = future = self.pool.submit(episode.respond, text, reason)
    return future

  def step_timeouts(self) -> int:
    """Environment steps still running after their episode was ended for taking too long."""
    return sum(not future.done() for future in self.replies.values())

  def close(self) -> None:
    self.pool.shutdown()
