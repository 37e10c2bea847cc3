"""Random-access prompt sources: JSONL and Parquet files, and the built-in tasks.

Every source yields ``{"prompt": str | list[dict], "answer": str, "where": str, ...}``
rows: the prompt is plain text or chat messages (a list of ``{"role", "content"}``, which
the tokenizer's chat template renders); the answer is the reference a verifier checks
(empty when ``answer_field`` is ""); ``where`` names the file and line, or Parquet row,
for error messages; every other column of the file is kept, for reward functions that
read it (test cases, metadata). The field names in the file are configurable. File sources check every row once when they
open: a malformed row either raises an error that names the file and line (or
Parquet row), or is skipped and counted in ``skipped`` (``first_skipped`` names
the first). ``fingerprint()`` identifies what a source holds, so that a resumed
run can tell that its data file changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
from typing import Literal

from rlx.data.tasks import TASKS, Split, in_eval, task_row

OnBadRow = Literal["error", "skip"]


class DataError(ValueError):
  """A data file is missing or has a malformed row; the message names the file and line."""


ANSWER_FORMATS = ("plain", "gsm8k")


def extract_answer(text: str, answer_format: str = "plain") -> str:
  """The reference answer a reward compares with: the field as it is (``plain``), or GSM8K's
  final answer, the text after the last ``####`` of its rationale without thousands commas
  (``gsm8k``: "... so she has 72 left.\n#### 1,072" -> "1072"). A GSM8K answer without
  ``####`` is kept whole."""
  if answer_format == "gsm8k" and "####" in text:
    return text.rsplit("####", 1)[1].strip().replace(",", "")
  return text


def _row(record, prompt_field: str, answer_field: str,
         answer_format: str = "plain") -> dict | str:
  """The row (every field kept; the prompt under "prompt", the answer under "answer", as
  ``extract_answer`` reads it), or why it is malformed."""
  if not isinstance(record, dict):
    return f"expected a JSON object, got {type(record).__name__}"
  missing = [f for f in (prompt_field, answer_field) if f and record.get(f) is None]
  if missing:
    hint = "" if prompt_field in missing else (
        "; rows without a reference answer (for a reward that reads other fields) need "
        "config.data.answer_field=''")
    return (f"missing field(s) {', '.join(map(repr, missing))} "
            f"(has {', '.join(map(repr, record))}){hint}")
  prompt = record[prompt_field]
  problem = _prompt_problem(prompt)
  if problem:
    return f"field {prompt_field!r} {problem}"
  return {**record, "prompt": prompt,
          "answer": extract_answer(str(record[answer_field]), answer_format)
          if answer_field else ""}


def _prompt_problem(prompt) -> str | None:
  """Why ``prompt`` is neither non-empty text nor a list of chat messages, or None."""
  if isinstance(prompt, str):
    return None if prompt.strip() else "must be a non-empty string or a list of chat messages"
  if isinstance(prompt, list) and prompt:
    for message in prompt:
      if not (isinstance(message, dict) and isinstance(message.get("role"), str)
              and isinstance(message.get("content"), str)):
        return ("holds a list, but not of chat messages: each must be "
                '{"role": str, "content": str}')
    return None
  return f"must be a non-empty string or a list of chat messages, got {type(prompt).__name__}"


def _refuse_or_count(source, where: str, problem: str, on_bad_row: OnBadRow) -> None:
  """A malformed row: raise naming where it is, or count it in ``source.skipped``."""
  if on_bad_row == "error":
    raise DataError(f"{where}: {problem}; fix the row or set config.data.on_bad_row=skip")
  source.skipped += 1
  if source.first_skipped is None:
    source.first_skipped = f"{where}: {problem}"


def _stamp(stat: os.stat_result) -> tuple[int, int]:
  return stat.st_size, stat.st_mtime_ns


def _file_fingerprint(path: pathlib.Path, rows: int) -> dict:
  stat = os.stat(path)
  return {"path": str(path.absolute()), "bytes": stat.st_size, "rows": rows}


class JsonlSource:
  """A JSONL file, indexed by byte offsets (rows are parsed again when read)."""

  def __init__(self, path: str | pathlib.Path, prompt_field: str = "prompt",
               answer_field: str = "answer", on_bad_row: OnBadRow = "error",
               answer_format: str = "plain"):
    self.path = pathlib.Path(path)
    self._fingerprint: dict | None = None
    if not self.path.is_file():
      raise DataError(f"data file {self.path} does not exist")
    self.prompt_field, self.answer_field = prompt_field, answer_field
    self.answer_format = answer_format
    self.offsets: list[int] = []
    self.lines: list[int] = []
    self.skipped, self.first_skipped = 0, None
    with open(self.path, "rb") as f:
      self._stamp = _stamp(os.fstat(f.fileno()))
      offset = 0
      for number, line in enumerate(f, start=1):
        start, offset = offset, offset + len(line)
        if not line.strip():
          continue
        try:
          problem = _row(json.loads(line), prompt_field, answer_field)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
          problem = f"not valid JSON ({error})"
        if isinstance(problem, str):
          if problem.startswith("missing field") and not self.offsets and not self.skipped:
            # the first row lacks it: the config names the wrong field, and skipping rows
            # without it would skip them all
            raise DataError(f"{self.path}:{number}: {problem}; the first row has no such "
                            "field, so set config.data.prompt_field (and answer_field) to "
                            "the fields that hold the prompt and the reference answer")
          _refuse_or_count(self, f"{self.path}:{number}", problem, on_bad_row)
          continue
        self.offsets.append(start)
        self.lines.append(number)
    if not self.offsets:
      raise DataError(f"{self.path} has no usable rows")
    self.fingerprint()  # now, while the file is there

  def __len__(self) -> int:
    return len(self.offsets)

  def __getitem__(self, index: int) -> dict:
    where = f"{self.path}:{self.lines[index]}"
    try:
      with open(self.path, "rb") as f:
        if _stamp(os.fstat(f.fileno())) != self._stamp:
          raise DataError(f"{where}: {self.path} changed while the run was reading it (its size "
                          "or modification time differs from when it was indexed); restore it, "
                          "or start a new run (another --workdir) on the new file")
        f.seek(self.offsets[index])
        line = f.readline()
    except OSError as error:
      raise DataError(f"{where}: cannot read the data file ({error.strerror}); it went away "
                      "while the run was reading it. Restore it and rerun the same command "
                      "to resume") from None
    try:
      row = _row(json.loads(line), self.prompt_field, self.answer_field,
                 self.answer_format)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
      row = f"not valid JSON ({error})"
    if isinstance(row, str):  # the file changed since it was indexed
      raise DataError(f"{where}: {row}; the file changed while the run was reading it")
    return dict(row, where=where)

  def fingerprint(self) -> dict:
    """The file as indexed (taken once: a checkpoint saved after the file went away still
    records it)."""
    if self._fingerprint is None:
      digest = hashlib.sha1(json.dumps(self.offsets).encode()).hexdigest()
      self._fingerprint = dict(_file_fingerprint(self.path, len(self)), index_sha1=digest)
    return self._fingerprint


class ParquetSource:
  """A Parquet file's rows, every column, held in memory (needs pyarrow)."""

  def __init__(self, path: str | pathlib.Path, prompt_field: str = "prompt",
               answer_field: str = "answer", on_bad_row: OnBadRow = "error",
               answer_format: str = "plain"):
    self.path = pathlib.Path(path)
    self._fingerprint: dict | None = None
    if not self.path.is_file():
      raise DataError(f"data file {self.path} does not exist")
    try:
      import pyarrow.parquet as pq
    except ImportError:
      raise DataError("reading Parquet needs pyarrow: pip install 'rlx[parquet]'") from None
    names = pq.read_schema(self.path).names
    missing = [f for f in (prompt_field, answer_field) if f and f not in names]
    if missing:
      raise DataError(f"{self.path}: no column(s) {', '.join(map(repr, missing))} "
                      f"(columns: {', '.join(names)}); set config.data.prompt_field / answer_field")
    table = pq.read_table(self.path).to_pylist()
    self.rows, self.skipped, self.first_skipped = [], 0, None
    for number, record in enumerate(table):
      row = _row(record, prompt_field, answer_field, answer_format)
      if isinstance(row, str):
        _refuse_or_count(self, f"{self.path}: row {number}", row, on_bad_row)
        continue
      self.rows.append(dict(row, where=f"{self.path}: row {number}"))
    if not self.rows:
      raise DataError(f"{self.path} has no usable rows")
    self.fingerprint()  # now, while the file is there

  def __len__(self) -> int:
    return len(self.rows)

  def __getitem__(self, index: int) -> dict:
    return self.rows[index]

  def fingerprint(self) -> dict:
    """The file as read (taken once, as ``JsonlSource.fingerprint``)."""
    if self._fingerprint is None:
      self._fingerprint = _file_fingerprint(self.path, len(self))
    return self._fingerprint


class TaskSource:
  """A built-in task as a random-access source of ``size`` rows."""

  def __init__(self, task: str, *, seed: int = 0, split: Split = "train",
               eval_fraction: float = 0.1, size: int = 1_000_000):
    self.task, self.seed, self.split, self.eval_fraction, self.size = (
        task, seed, split, eval_fraction, size)
    self.skipped, self.first_skipped = 0, None
    task_row(task, 0, seed=seed, split=split, eval_fraction=eval_fraction)  # validates

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, index: int) -> dict:
    row = task_row(self.task, index, seed=self.seed, split=self.split,
                   eval_fraction=self.eval_fraction)
    return dict(row, where=f"task {self.task}, {self.split} row {index}")

  def fingerprint(self) -> dict:
    return {"task": self.task, "seed": self.seed, "split": self.split,
            "eval_fraction": self.eval_fraction}


class Subset:
  """Some rows of a source (a held-out split of a data file), by index."""

  def __init__(self, source, indices: list[int], split: Split, eval_fraction: float):
    self.source, self.indices, self.split, self.eval_fraction = (
        source, indices, split, eval_fraction)
    self.skipped, self.first_skipped = source.skipped, source.first_skipped

  def __len__(self) -> int:
    return len(self.indices)

  def __getitem__(self, index: int) -> dict:
    return self.source[self.indices[index]]

  def fingerprint(self) -> dict:
    return dict(self.source.fingerprint(), split=self.split, eval_fraction=self.eval_fraction)


def hold_out(source, eval_fraction: float) -> tuple[Subset, Subset]:
  """(train, eval) rows of a file source: a row is held out when a hash of its prompt falls in
  ``eval_fraction``, so that a prompt that appears twice is never on both sides."""
  train, held = [], []
  for index in range(len(source)):
    prompt = source[index]["prompt"]
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)
    (held if in_eval(text, eval_fraction) else train).append(index)
  if not train or not held:
    raise DataError(f"holding out data.eval_fraction={eval_fraction} of the {len(source)} rows "
                    f"of {getattr(source, 'path', 'the source')} leaves "
                    f"{len(train)} to train on and {len(held)} to evaluate; change "
                    "data.eval_fraction, give data.eval_source, or set trainer.eval_prompts=0")
  return (Subset(source, train, "train", eval_fraction),
          Subset(source, held, "eval", eval_fraction))


def open_source(source: str, *, prompt_field: str = "prompt", answer_field: str = "answer",
                on_bad_row: OnBadRow = "error", split: Split = "train", seed: int = 0,
                eval_fraction: float = 0.1, answer_format: str = "plain"):
  """A built-in task by name, or a ``.jsonl`` / ``.parquet`` file by path."""
  if source in TASKS:
    return TaskSource(source, seed=seed, split=split, eval_fraction=eval_fraction)
  suffix = pathlib.Path(source).suffix.lower()
  if suffix in (".jsonl", ".json"):
    return JsonlSource(source, prompt_field, answer_field, on_bad_row, answer_format)
  if suffix in (".parquet", ".pq"):
    return ParquetSource(source, prompt_field, answer_field, on_bad_row, answer_format)
  raise DataError(f"config.data.source={source!r} is neither a built-in task "
                  f"({', '.join(TASKS)}) nor a .jsonl / .parquet file")
