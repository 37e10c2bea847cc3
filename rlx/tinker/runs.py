"""The service's training runs and their checkpoints, as the SDK's ``RestClient`` reads them:
``list_training_runs``, ``get_training_run`` (and ``..._by_tinker_path``), ``list_checkpoints``,
``get_weights_info_by_tinker_path``, ``delete_checkpoint``, publishing a checkpoint and
setting its time to live (tinker-cookbook asks a run for its renderer, deletes its rolling
checkpoints and gives its saves a TTL through them).

    runs = Runs(workdir)
    runs.created(model_id, base_model, lora_config, user_metadata)   # create_model, load_weights
    runs.training_run(model_id)                                      # {"training_run_id": ...}

A training run is a training client (its ``model_id``); it is on disk, not only in memory, so
a restarted service lists the runs and checkpoints an earlier one wrote:
``WORKDIR/checkpoints/<run>/training_run.json`` holds what the run was created with, and each
checkpoint is its directory, ``<run>/weights/<name>`` or ``<run>/sampler_weights/<name>``
(``Service._directory``), its time the directory's and its size its files';
``<run>/checkpoints.json`` holds which are public and when each expires.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import shutil
import time

from rlx.tinker.training import BadInput

RUN_FILE = "training_run.json"
FLAGS_FILE = "checkpoints.json"
"""Per run: each checkpoint's publication and expiry (``{id: {"public", "expires_at"}}``)."""
KINDS = {"weights": "training", "sampler_weights": "sampler"}
"""A checkpoint's directory under its run -> the SDK's ``checkpoint_type``."""
OWNER = "rlx"


def run_directory(root: pathlib.Path, model_id: str) -> pathlib.Path:
  """Where run ``model_id``'s checkpoints and record live (``Service._directory``'s rule)."""
  if not model_id or "/" in model_id or model_id.startswith("."):
    raise BadInput(f"training run id {model_id!r} is not one of this service's")
  return root / model_id.replace(":", "_")


def _iso(seconds: float) -> str:
  return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat()


def check_ttl(ttl_seconds) -> None:
  """Raises ``BadInput`` unless ``ttl_seconds`` is a number of seconds > 0 or None."""
  if ttl_seconds is not None and not (isinstance(ttl_seconds, (int, float))
                                      and not isinstance(ttl_seconds, bool) and ttl_seconds > 0):
    raise BadInput(f"ttl_seconds must be a number of seconds > 0, or null; got {ttl_seconds!r}")




class Runs:
  """The runs under ``workdir/checkpoints`` (see the module docstring)."""

  def __init__(self, workdir: str | pathlib.Path):
    self.root = pathlib.Path(workdir) / "checkpoints"
    self.requested: dict[str, float] = {}
    """When each run of this process was last asked to compute (``time.time()``)."""

  def created(self, model_id: str, base_model: str, rank: int, train_attn: bool,
              train_mlp: bool, user_metadata: dict | None = None) -> None:
    """Records a training run (a new training client), once: its base, adapter shape and the
    client's ``user_metadata`` (tinker-cookbook keeps the renderer's name there)."""
    directory = run_directory(self.root, model_id)
    directory.mkdir(parents=True, exist_ok=True)
    record = {"training_run_id": model_id, "base_model": base_model, "lora_rank": rank,
              "train_attn": train_attn, "train_mlp": train_mlp, "created": time.time(),
              "user_metadata": {str(k): str(v) for k, v in (user_metadata or {}).items()}}
    partial = directory / f".{RUN_FILE}.partial"
    partial.write_text(json.dumps(record, indent=1))
    partial.rename(directory / RUN_FILE)
    self.requested[model_id] = record["created"]

  def _record(self, model_id: str) -> dict:
    try:
      return json.loads((run_directory(self.root, model_id) / RUN_FILE).read_text())
    except (OSError, ValueError):
      raise BadInput(f"training run {model_id!r} is unknown here") from None

  # --- publication and expiry ---------------------------------------------------------------

  def _flags(self, model_id: str) -> dict[str, dict]:
    try:
      return json.loads((run_directory(self.root, model_id) / FLAGS_FILE).read_text())
    except (OSError, ValueError):
      return {}

  def _write_flags(self, model_id: str, flags: dict[str, dict]) -> None:
    directory = run_directory(self.root, model_id)
    partial = directory / f".{FLAGS_FILE}.partial"
    partial.write_text(json.dumps(flags, indent=1))
    partial.rename(directory / FLAGS_FILE)

  def _checkpoint_directory(self, model_id: str, checkpoint_id: str) -> pathlib.Path:
    kind, _, name = checkpoint_id.partition("/")
    if kind not in KINDS or not name or "/" in name or name.startswith("."):
      raise BadInput(f"checkpoint id {checkpoint_id!r}: weights/<name> or "
                     "sampler_weights/<name>")
    directory = run_directory(self.root, model_id) / kind / name
    if not directory.is_dir():
      raise BadInput(f"run {model_id!r} has no checkpoint {checkpoint_id!r}")
    return directory

  def publish(self, model_id: str, checkpoint_id: str, public: bool = True) -> None:
    """Marks a checkpoint public (or private again); doing what is already so is refused (the
    Tinker API answers 409, which the SDK retries for minutes: here a 400, said at once)."""
    self._checkpoint_directory(model_id, checkpoint_id)
    flags = self._flags(model_id)
    entry = flags.setdefault(checkpoint_id, {})
    if bool(entry.get("public")) == public:
      raise BadInput(f"checkpoint {checkpoint_id!r} of run {model_id!r} is already "
                     f"{'public' if public else 'private'}")
    entry["public"] = public
    self._write_flags(model_id, flags)

  def set_ttl(self, model_id: str, checkpoint_id: str, ttl_seconds: float | None) -> None:
    """The checkpoint expires ``ttl_seconds`` from now (None: never); an expired checkpoint
    is deleted the next time the service reads or writes the run's checkpoints."""
    self._checkpoint_directory(model_id, checkpoint_id)
    check_ttl(ttl_seconds)
    flags = self._flags(model_id)
    flags.setdefault(checkpoint_id, {})["expires_at"] = (
        None if ttl_seconds is None else time.time() + float(ttl_seconds))
    self._write_flags(model_id, flags)

  def expire(self, model_id: str | None = None) -> list[str]:
    """Deletes the checkpoints past their expiry (of one run, or of every run); returns
    their tinker paths."""
    ids = [model_id] if model_id is not None else [
        r["training_run_id"] for r in self._records()
        if (run_directory(self.root, r["training_run_id"]) / FLAGS_FILE).is_file()]
    now, gone = time.time(), []
    for run in ids:
      flags = self._flags(run)
      over = [c for c, f in flags.items() if f.get("expires_at") is not None
              and f["expires_at"] <= now]
      for checkpoint_id in over:
        shutil.rmtree(run_directory(self.root, run) / checkpoint_id, ignore_errors=True)
        del flags[checkpoint_id]
        gone.append(f"tinker://{run}/{checkpoint_id}")
      if over:
        self._write_flags(run, flags)
    return gone

  def checkpoints(self, model_id: str) -> list[dict]:
    """The run's checkpoints, oldest first, as the SDK's ``Checkpoint``s."""
    directory = run_directory(self.root, model_id)
    flags = self._flags(model_id)
    found = []
    for kind, checkpoint_type in KINDS.items():
      for saved in sorted((directory / kind).glob("*")) if (directory / kind).is_dir() else ():
        if not saved.is_dir() or saved.name.startswith("."):
          continue
        found.append({
            "checkpoint_id": f"{kind}/{saved.name}", "checkpoint_type": checkpoint_type,
            "time": saved.stat().st_mtime,
            "tinker_path": f"tinker://{model_id}/{kind}/{saved.name}",
            "size_bytes": sum(f.stat().st_size for f in saved.rglob("*") if f.is_file())})
    found.sort(key=lambda c: c["time"])
    out = []
    for c in found:
      entry = flags.get(c["checkpoint_id"], {})
      expires = entry.get("expires_at")
      out.append(dict(c, time=_iso(c["time"]), public=bool(entry.get("public")),
                      expires_at=None if expires is None else _iso(expires)))
    return out

  def training_run(self, model_id: str) -> dict:
    """The SDK's ``TrainingRun`` of ``model_id``."""
    record = self._record(model_id)
    checkpoints = self.checkpoints(model_id)
    last = lambda kind: next((c for c in reversed(checkpoints)  # noqa: E731
                              if c["checkpoint_type"] == kind), None)
    directory = run_directory(self.root, model_id)
    touched = max([record["created"], self.requested.get(model_id, 0.0)]
                  + [p.stat().st_mtime for p in directory.rglob("*")])
    return {"training_run_id": model_id, "base_model": record["base_model"],
            "model_owner": OWNER, "is_lora": True, "corrupted": False,
            "lora_rank": record["lora_rank"], "last_request_time": _iso(touched),
            "last_checkpoint": last("training"), "last_sampler_checkpoint": last("sampler"),
            "user_metadata": record.get("user_metadata") or None}

  def _records(self) -> list[dict]:
    """Every run's record (``training_run.json``) that can be read."""
    records = []
    for path in self.root.glob(f"*/{RUN_FILE}") if self.root.is_dir() else ():
      try:
        records.append(json.loads(path.read_text()))
      except (OSError, ValueError):
        continue
    return records

  def training_runs(self, limit: int = 20, offset: int = 0) -> dict:
    """The SDK's ``TrainingRunsResponse``: the runs, newest first, a page of them."""
    records = self._records()
    records.sort(key=lambda r: r["created"], reverse=True)
    page = records[offset:offset + limit]
    return {"training_runs": [self.training_run(r["training_run_id"]) for r in page],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(records)}}

  def delete(self, model_id: str, checkpoint_id: str) -> pathlib.Path:
    """Deletes one checkpoint of run ``model_id`` (``weights/<name>`` or
    ``sampler_weights/<name>``); returns the directory it was."""
    directory = self._checkpoint_directory(model_id, checkpoint_id)
    shutil.rmtree(directory)
    flags = self._flags(model_id)
    if flags.pop(checkpoint_id, None) is not None:
      self._write_flags(model_id, flags)
    return directory


def weights_info(base_model: str, rank: int, targets, attention, mlp) -> dict:
  """The SDK's ``WeightsInfoResponse`` of a checkpoint: its base and adapter shape (the
  unembedding is never trained here)."""
  return {"base_model": base_model, "is_lora": True, "lora_rank": rank,
          "train_unembed": False, "train_attn": any(t in targets for t in attention),
          "train_mlp": any(t in targets for t in mlp)}
