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


class PromptStream:
  """Batches of prompt rows. Each epoch is a fresh shuffle; ``num_epochs=None`` repeats forever."""

  def __init__(self, source: Sequence[dict], *, batch_size: int, seed: int = 0,
               num_epochs: int | None = None, encode: Callable[[str], list[int]] | None = None):
    if batch_size < 1:
      raise ValueError("batch_size must be >= 1")
    dataset = grain.MapDataset.source(source).shuffle(seed=seed).repeat(num_epochs)
    if encode is not None:
      dataset = dataset.map(lambda row: {**row, "prompt_tokens": list(encode(row["prompt"]))})
    dataset = dataset.batch(batch_size, drop_remainder=True, batch_fn=list)
    self._iterator = iter(dataset.to_iter_dataset())

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
