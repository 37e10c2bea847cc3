"""The prompt pipeline: a grain dataset over a source, shuffled by seed, repeated for epochs,
tokenized, in batches of ``prompts_per_step``, with a position that can be checkpointed.

    stream = PromptStream(open_source("train.jsonl"), batch_size=8, seed=0,
                          encode=tokenizer.encode_prompt)
    batch = next(stream)              # [{"prompt", "answer", "prompt_tokens"}, ...]
    state = stream.get_state()        # JSON-serialisable; set_state(state) resumes here
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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
    return next(self._iterator)

  def get_state(self) -> dict:
    """Where the stream is (JSON-serialisable), for checkpoints."""
    return self._iterator.get_state()

  def set_state(self, state: dict) -> None:
    """Continues from a state returned by ``get_state``."""
    self._iterator.set_state(state)
