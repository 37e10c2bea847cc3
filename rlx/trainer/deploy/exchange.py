"""Rollouts as files between a generator job and a learner job, in ``WORKDIR/rollouts/``.

    files = RolloutFiles(workdir / "rollouts")
    files.write(index, draw)          # generator: temporary name, fsync, rename
    draw = files.read(index)          # learner: complete files only
    files.finish(index, done=index + 1, data_state=draw.data_state)   # learner: trained or dropped

Batch ``index`` is the file ``{index:08d}.rollout``: msgpack of the completions'
tokens, behaviour log-probs and policy versions (flat arrays with offsets), the
rewards and verdicts, the counts, the data-stream position after the batch, the
seed, the sampling temperature and start time, and the generator's timings. A file
is written under a name that starts with ``.`` and renamed when complete, so a reader
never sees half a file; a writer killed mid-write leaves only a hidden name, removed at
the next start.

``progress.json`` is the learner's side: how many batches it has finished
(trained or dropped), and the data position after the last one (and, with several
generator jobs, after the last one of each). A generator gates on it (staleness),
and resumes from it, or from its newest file. Generator job g of n writes batches
g, g + n, g + 2n, ... (``RolloutFiles.mine``), from its own share of the prompts.
``control.json`` holds the learner's controller settings (the effective staleness k,
the sampling temperature) that the generator follows.
"""

from __future__ import annotations

import json
import os
import pathlib
import time

from rlx.trainer.draw import Draw, decode, encode

SUFFIX = ".rollout"
DONE = "DONE"


class RolloutFiles:
  """The rollout files of one run (see the module docstring)."""

  def __init__(self, directory: str | pathlib.Path, generators: int = 1):
    self.directory = pathlib.Path(directory)
    self.directory.mkdir(parents=True, exist_ok=True)
    self.generators = generators

  def mine(self, index: int, generator: int) -> bool:
    """Whether batch ``index`` is generator job ``generator``'s to write."""
    return index % self.generators == generator

  def path(self, index: int) -> pathlib.Path:
    return self.directory / f"{index:08d}{SUFFIX}"

  def write(self, index: int, draw: Draw, extra: dict | None = None) -> pathlib.Path:
    """Writes batch ``index`` under a hidden name, fsyncs it and renames it into place."""
    final = self.path(index)
    partial = self.directory / f".{final.name}.{os.getpid()}.partial"
    with open(partial, "wb") as f:
      f.write(encode(draw, extra))
      f.flush()
      os.fsync(f.fileno())
    os.rename(partial, final)
    _fsync_directory(self.directory)
    return final

  def pending(self) -> list[int]:
    """Indices of the complete files not yet finished by the learner, in order."""
    return sorted(int(p.name.removesuffix(SUFFIX)) for p in self.directory.glob(f"*{SUFFIX}")
                  if not p.name.startswith("."))

  def read(self, index: int) -> tuple[Draw, dict]:
    return decode(self.path(index).read_bytes())

  def remove_partial(self, generator: int = 0) -> int:
    """Deletes the files a killed writer (generator job ``generator``) left under hidden
    names; returns how many. Other generator jobs' files are theirs."""
    leftovers = [p for p in self.directory.glob(f".*{SUFFIX}.*.partial")
                 if self.mine(int(p.name[1:].split(".")[0]), generator)]
    for p in leftovers:
      p.unlink(missing_ok=True)
    return len(leftovers)

  # --- the learner's side ----------------------------------------------------------------------

  def progress(self) -> dict:
    """``{"done": batches finished, "data_state": position after the last, "data_states":
    {generator: position after its last}}`` (0 / None / {} at first)."""
    path = self.directory / "progress.json"
    record = json.loads(path.read_text()) if path.is_file() else {"done": 0, "data_state": None}
    return {"data_states": {}, **record}

  def resume_state(self, generator: int) -> dict | None:
    """The data position after generator job ``generator``'s last finished batch."""
    progress = self.progress()
    if self.generators == 1:
      return progress["data_state"]
    return progress["data_states"].get(str(generator))

  def finish(self, index: int, data_state: dict | None, version: int | None = None) -> None:
    """Marks batch ``index`` (and all before it) finished: records it (and ``version``, the
    learner's policy version after it: a generator samples the next batches with that
    version or a newer one, once shared storage shows it), then deletes its file."""
    states = dict(self.progress()["data_states"])
    if self.generators > 1:
      states[str(index % self.generators)] = data_state
    record = {"done": index + 1, "data_state": data_state, "data_states": states}
    if version is not None:
      record["version"] = version
    self._write_progress(record)
    self.path(index).unlink(missing_ok=True)

  def restart_at(self, version: int) -> None:
    """A learner resumed at policy ``version``: generators wait for no newer one (a stopped
    run may have recorded it)."""
    record = self.progress()
    if record.get("version", -1) > version:
      self._write_progress(dict(record, version=version))

  def _write_progress(self, record: dict) -> None:
    partial = self.directory / ".progress.json.partial"
    partial.write_text(json.dumps(record))
    os.replace(partial, self.directory / "progress.json")

  def write_control(self, settings: dict) -> None:
    """The learner's controller settings for the generator job (``control.json``)."""
    partial = self.directory / ".control.json.partial"
    partial.write_text(json.dumps(settings))
    os.replace(partial, self.directory / "control.json")

  def control(self) -> dict | None:
    """The newest controller settings the learner wrote, or None."""
    path = self.directory / "control.json"
    return json.loads(path.read_text()) if path.is_file() else None

  def expire_below(self, index: int) -> int:
    """Deletes complete files below ``index`` (consumed before a restart); returns how many."""
    stale = [i for i in self.pending() if i < index]
    for i in stale:
      self.path(i).unlink(missing_ok=True)
    return len(stale)

  def mark_done(self) -> None:
    (self.directory / DONE).write_text(time.strftime("%Y-%m-%dT%H:%M:%S"))

  def done(self) -> bool:
    return (self.directory / DONE).is_file()

  def clear_done(self) -> None:
    (self.directory / DONE).unlink(missing_ok=True)


def _fsync_directory(directory: pathlib.Path) -> None:
  fd = os.open(directory, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)
