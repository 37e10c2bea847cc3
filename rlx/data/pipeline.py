"""The prompt pipeline: a grain dataset over a source, shuffled by seed, repeated for epochs,
tokenized, in batches of ``prompts_per_step``, with a position that can be checkpointed.

    stream = PromptStream(open_source("train.jsonl"), batch_size=8, seed=0,
                          encode=tokenizer.encode_prompt)
    batch = next(stream)              # [{"prompt", "answer", "prompt_tokens"}, ...]
    state = stream.get_state()        # JSON-serialisable; set_state(state) resumes here
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable, Sequence

import grain

from rlx.data.sources import DataError


class PromptStream:
  """Batches of prompt rows. Each epoch is a fresh shuffle; ``num_epochs=None`` repeats forever.
  ``shard=(i, n)`` streams only every n-th row of the source, from row i.

  With ``max_prompt_tokens``, a prompt longer than that is a bad row, met when it is read:
  ``on_bad_row="error"`` raises ``DataError`` naming it, ``"skip"`` drops it and counts it in
  ``skipped`` (``first_skipped`` names the first).
  """

  def __init__(self, source: Sequence[dict], *, batch_size: int, seed: int = 0,
               num_epochs: int | None = None, encode: Callable[[str], list[int]] | None = None,
               max_prompt_tokens: int | None = None, on_bad_row: str = "error",
               shard: tuple[int, int] = (0, 1)):
    if batch_size < 1:
      raise ValueError("batch_size must be >= 1")
    index, count = shard
    if not 0 <= index < count:
      raise ValueError(f"shard {index} of {count} does not exist")
    self.max_prompt_tokens, self.on_bad_row = max_prompt_tokens, on_bad_row
    self._skipped_rows: set[str] = set()
    self.first_skipped = None
    # shard (i, n): rows i, i + n, ... of the source, before the shuffle, so that n streams
    # (one per generator job) never share a row
    dataset = grain.MapDataset.source(source)
    if count > 1:
      dataset = dataset[index::count]
    dataset = dataset.shuffle(seed=seed).repeat(num_epochs)
    if encode is not None:
      dataset = dataset.map(lambda row: self._encoded(row, encode))
    dataset = dataset.to_iter_dataset()
    if encode is not None and max_prompt_tokens is not None:
      dataset = dataset.filter(lambda row: row is not None)
    self._iterator = iter(dataset.batch(batch_size, drop_remainder=True, batch_fn=list))
    self.batch_size = batch_size
    # Rows are numbered in the order the dataset gives them (serials). A state is a position
    # in the dataset plus the serials after it already used (``get_state(pending=...)``):
    self._serial = 0  # the next row's serial
    self._marks: list[tuple[int, dict]] = [(0, self._iterator.get_state())]
    """(serial of the first row of a batch drawn from the dataset, its position), oldest
    first; the newest is where the dataset is now, its rows not yet drawn."""
    self._buffer: collections.deque[tuple[int, dict]] = collections.deque()  # drawn, not given
    self._skip: set[int] = set()  # serials a resumed state says were used already
    self._lock = threading.Lock()  # a producer thread takes while the learner's asks the state

  def _encoded(self, row: dict, encode) -> dict | None:
    """The row with its prompt tokens, or None for a prompt past ``max_prompt_tokens``."""
    limit = self.max_prompt_tokens
    prompt = row["prompt"]
    characters = (len(prompt) if isinstance(prompt, str)
                  else sum(len(message["content"]) for message in prompt))
    # no tokenizer spends 64 characters per token: a huge line is refused before tokenizing it
    too_long = limit is not None and characters > 64 * limit
    try:
      tokens = None if too_long else list(encode(prompt))
    except ValueError as error:
      raise DataError(f"{row.get('where', 'a row')}: {error}") from None
    if limit is not None and (too_long or len(tokens) > limit):
      where = row.get("where", "a row")
      size = f"{characters} characters" if too_long else f"{len(tokens)} tokens"
      if self.on_bad_row == "error":
        raise DataError(f"{where}: the prompt has {size}, more than "
                        f"config.rollout.max_prompt_len={limit}; raise it, shorten the prompt, "
                        "or set config.data.on_bad_row=skip")
      # a row read again (each epoch, read-ahead) counts once
      self._skipped_rows.add(row.get("where") or repr(prompt)[:1000])
      if self.first_skipped is None:
        self.first_skipped = f"{where}: prompt of {size} > max_prompt_len={limit}"
      return None
    return {**row, "prompt_tokens": tokens}

  @property
  def skipped(self) -> int:
    """How many distinct rows were skipped so far."""
    return len(self._skipped_rows)

  def __iter__(self):
    return self

  def __next__(self) -> list[dict]:
    return [row for _, row in self.take(self.batch_size)]

  def take(self, count: int) -> list[tuple[int, dict]]:
    """The next ``count`` rows with their serials (``get_state``'s ``pending`` names rows by
    them)."""
    with self._lock:
      while len(self._buffer) < count:
        batch = next(self._iterator)
        first = self._serial
        self._serial += len(batch)
        self._marks.append((self._serial, self._iterator.get_state()))
        del self._marks[:-MARKS_KEPT]
        self._buffer.extend((first + i, row) for i, row in enumerate(batch)
                            if first + i not in self._skip)
        self._skip.difference_update(range(first, self._serial))
      return [self._buffer.popleft() for _ in range(count)]

  def get_state(self, pending: Iterable[int] = ()) -> dict:
    """Where the stream is (JSON-serialisable), for checkpoints: a stream resumed from it gives
    every row not given yet, and the rows given whose serials are in ``pending`` (a consumer's
    rows still in flight: taken, not yet used), each once, in serial order. With nothing
    pending this is the dataset's own position. A consumer that passes ``pending`` passes,
    call after call, the rows it took and has not used: its oldest are the first to go."""
    with self._lock:
      waiting = set(pending) | {serial for serial, _ in self._buffer}
      oldest = min(waiting, default=self._serial)
      # the newest batch boundary at or before the oldest row still wanted
      at = max((i for i, (serial, _) in enumerate(self._marks) if serial <= oldest), default=None)
      if at is None:
        raise ValueError(f"row {oldest} is pending, but the stream kept positions only from row "
                         f"{self._marks[0][0]} on (a row used can not be pending again)")
      start, position = self._marks[at]
      if pending:  # a consumer's pending rows only lose their oldest: earlier marks are done with
        del self._marks[:at]
      used = sorted(serial - start for serial in range(start, self._serial)
                    if serial not in waiting)
      used += sorted(serial - start for serial in self._skip)  # skips not reached yet
      if not used:
        return position
      return {SKIP: used, POSITION: position}

  def set_state(self, state: dict) -> None:
    """Continues from a state returned by ``get_state``."""
    position, used = ((state[POSITION], state[SKIP]) if SKIP in state else (state, []))
    with self._lock:
      self._iterator.set_state(position)
      self._serial = 0
      self._marks = [(0, position)]
      self._buffer.clear()
      self._skip = set(used)


MARKS_KEPT = 4096
"""Batch boundaries a stream remembers: a consumer's oldest pending row must be within them
(continuous admission holds a bounded number of groups in flight: far fewer)."""

SKIP, POSITION = "rlx_used_after", "rlx_position"
"""A state with rows used past its position (``PromptStream.get_state``)."""


def prompts_drawn(state: dict) -> int:
  """How far into the dataset a stream's state is (``next_index``), -1 if it does not say."""
  return int(state.get(POSITION, state).get("next_index", -1))
