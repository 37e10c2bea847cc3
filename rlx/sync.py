"""Weight transfer learner -> generator, with the time it takes measured.

The learner ``publish``es each new policy version; the generator asks for the
``latest`` version newer than the one it holds. Two ways:

- ``ReshardSync``: ``jax.device_put`` of the learner's params into the
  generation layout (another sub-mesh, or the same devices re-laid-out for
  decoding), in device memory. For learner and generator in one job.
- ``OrbaxSync``: the learner writes each version with Orbax (tensorstore) under
  a directory on local or shared storage; the generator restores the newest
  version straight into its own shardings. Old versions are deleted. For
  learner and generator running as separate jobs.

A resumed learner first discards the versions it is about to write again
(``discard_from``): a dead run's newer versions are moved aside, never silently kept
in place of the restored one.

Both return the generator's params in ``generation_shardings``, and share the
``WeightSync`` protocol: callers never know which one they hold. Every version is checked
where it lands: the learner's side takes a content digest of what it publishes
(``rlx.digest``: exact, whatever the layout), the generator's side the digest of the weights it
will sample with, before it samples; a difference, or a new version whose weights are bitwise
the last one's, stops the run (``SyncMismatch``) naming the version and the array. With LoRA, ``LoraSync`` wraps
either: only the adapters cross (a version is the adapters), and the generator's side merges
them into its own copy of the frozen base.
"""

from __future__ import annotations

import functools
import json
import pathlib
import threading
import time
from typing import Any, Callable, Protocol

import jax
import orbax.checkpoint as ocp

from rlx import digest, distributed
from rlx.models import lora

Params = Any


class WeightSync(Protocol):
  """How the learner's policy versions reach the generator."""

  last_seconds: float
  """The seconds the last ``publish`` or ``latest`` took."""
  last_bytes: int
  """The bytes the last ``publish`` shipped (the params, or with LoRA the adapters only)."""
  verified: int
  """How many versions this side has checked where they landed (``check_landed``)."""

  def publish(self, params: Params, version: int, changed: bool | None = None) -> float:
    """Makes ``params`` version ``version`` available to the generator; returns the seconds
    the learner spent on it. ``changed``: whether the update that made this version moved the
    parameters (None: not known); a changed version bitwise the last one is refused."""

  def latest(self, newer_than: int = -1) -> tuple[Params, int] | None:
    """The newest published (params in the generation layout, version), if its version is
    above ``newer_than``; else None."""

  def discard_from(self, version: int) -> int:
    """Removes published versions ``version`` and newer (a resumed run writes them again);
    returns how many."""

  def release(self) -> None:
    """Lets go of the generator's copy of the newest version until the next ``publish``: a
    colocated learner's update needs the memory, and nothing samples before the next
    version."""

  def close(self) -> None:
    """Waits for what is being published, then lets go of storage."""


def _as_is(params: Params) -> Params:
  return params


class SyncMismatch(RuntimeError):
  """A policy version's weights where they landed are not the ones the learner published."""


def check_landed(version: int, expected: digest.Digest | None, landed: Params,
                 where: str) -> bool:
  """Raises ``SyncMismatch`` unless ``landed`` (the weights the generator will sample with,
  stacked or per layer) has the ``expected`` digest; False (nothing checked) when there is
  none to check against."""
  if expected is None:  # a version written before digests were (an older run's)
    return False
  got = digest.tree_digest(landed)
  wrong = digest.differences(expected, got)
  if wrong:
    name = wrong[0]
    raise SyncMismatch(
        f"policy version {version} did not land as the learner published it ({where}): "
        f"{name} has digest {got.get(name)} where the learner's is {expected.get(name)} "
        f"({len(wrong)} of {len(expected)} arrays differ); the generator would sample from "
        "weights that are not that version")
  return True


class Published:
  """The learner's side of the check: the digest of each version it publishes, and a refusal
  of a new version whose weights are bitwise the last one's although the update that made it
  moved them (a sync that sends nothing new). An update may leave every parameter as it was
  (a batch whose advantages are all 0): that version is published as it is."""

  def __init__(self):
    self.last: tuple[int, digest.Digest] | None = None

  def digest(self, params: Params, version: int, changed: bool | None = None) -> digest.Digest:
    taken = digest.tree_digest(params)
    if (changed and self.last is not None and self.last[0] < version
        and self.last[1] == taken):
      raise SyncMismatch(
          f"policy version {version} is bitwise version {self.last[0]} although its update "
          "moved the parameters (every array's digest is the same): the generator would "
          "sample the old policy under a new version; the update is lost between the "
          "optimizer and the sync (or is below the parameters' precision, e.g. bfloat16 at "
          "a tiny optimizer.learning_rate)")
    self.last = (version, taken)
    return taken


class ReshardSync:
  """In-memory resharding to the generation layout. ``prepare``: what the generator keeps of
  each version instead of the resharded params (``Engine.decode_params``: per-layer weights);
  it is handed this sync's own copy and may delete its arrays as it goes (``owned``), so that
  the copy and the prepared form never both stand whole.

  ``publish`` is the learner's part alone: the version's digest, and a copy into the
  generation layout that it starts and does not wait for (XLA orders the learner's next update,
  which donates the params, after the copy's read). The generator's ``latest`` lands the
  newest copy: waits for it, prepares it and checks its digest, on the generator's time, which
  in split mode is the side that waits (SmolLM2-135M: 0.63 s of each learner step before)."""

  def __init__(self, generation_shardings: Any, prepare: Callable[[Params], Params] = _as_is):
    self.generation_shardings = generation_shardings
    self.prepare = prepare
    self._lock = threading.Lock()  # the fields below
    self._landing = threading.Lock()  # one landing at a time
    self._pending: tuple[Params, int, digest.Digest] | None = None  # published, not landed
    self._latest: tuple[Params, int] | None = None
    self._released: int | None = None  # the version ``release`` let go of
    self._published = Published()
    self.last_seconds = 0.0
    self.last_bytes = 0
    self.verified = 0

  def publish(self, params: Params, version: int, changed: bool | None = None) -> float:
    """Starts the copy of ``params`` into the generation layout; returns the seconds the
    learner spent (its digest, and starting the copy)."""
    started = time.perf_counter()
    self.last_bytes = lora.nbytes(params)
    # the generator's mesh is this process's devices
    local = distributed.local_replica(params) if jax.process_count() > 1 else params
    # may_alias=False: the learner donates its params to the next step, so the generator's
    # copy must not share buffers with them even when the layouts agree (one device)
    copy = jax.device_put(local, self.generation_shardings, may_alias=False)
    expected = self._published.digest(params, version, changed)  # while the copy runs
    with self._lock:
      dropped, self._pending = self._pending, (copy, version, expected)
    if dropped is not None:  # published again before the generator looked
      _delete(dropped[0])
    self.last_seconds = time.perf_counter() - started
    return self.last_seconds

  def latest(self, newer_than: int = -1) -> tuple[Params, int] | None:
    """The newest published (params, version) if its version is above ``newer_than``: a
    version published since the last call is landed (and checked) first."""
    with self._landing:
      with self._lock:
        pending, self._pending = self._pending, None
      if pending is not None:
        self._land(*pending)
      with self._lock:
        if self._released is not None and self._released > newer_than:
          raise RuntimeError(f"policy version {self._released} was released for the "
                             "learner's update: publish the next version before sampling again")
        if self._latest is None or self._latest[1] <= newer_than:
          return None
        return self._latest

  def _land(self, copy: Params, version: int, expected: digest.Digest) -> None:
    started = time.perf_counter()
    landed = self.prepare(jax.block_until_ready(copy))
    self.verified += check_landed(version, expected, landed, "resharded in memory")
    with self._lock:
      self._latest, self._released = (landed, version), None
    self.last_seconds = time.perf_counter() - started

  def discard_from(self, version: int) -> int:
    with self._lock:
      discarded = 0
      if self._pending is not None and self._pending[1] >= version:
        _delete(self._pending[0])
        self._pending, discarded = None, 1
      if self._latest is not None and self._latest[1] >= version:
        self._latest, discarded = None, 1
      return discarded

  def release(self) -> None:
    with self._landing, self._lock:
      if self._pending is not None:
        _delete(self._pending[0])
        self._pending, self._released = None, self._pending[1]
      if self._latest is not None:
        self._latest, self._released = None, max(self._latest[1], self._released or -1)

  def close(self) -> None:
    pass


def _first_line(error: Exception, limit: int = 300) -> str:
  text = str(error).strip().splitlines()
  return (text[0] if text else type(error).__name__)[:limit]


def _delete(params: Params) -> None:
  for x in jax.tree.leaves(params):
    if not x.is_deleted():
      x.delete()


class OrbaxSync:
  """Policy versions as Orbax checkpoints under ``directory`` (keeps the newest ``keep``).

  ``like``: the params' tree of shapes and dtypes (arrays or ``ShapeDtypeStruct``s), which a
  reader restores into, in ``generation_shardings``, then keeps as ``prepare`` makes it (see
  ``ReshardSync``). ``asynchronous``: ``publish`` returns once
  the version is copied to host memory and writes it in the background (a learner job: its next
  step overlaps the write; the next ``publish``, any read and ``close`` wait for it). A reader
  never sees a version before it is complete on storage either way.
  """

  def __init__(self, directory: str | pathlib.Path, generation_shardings: Any, *, like: Params,
               keep: int = 2, asynchronous: bool = False,
               prepare: Callable[[Params], Params] = _as_is):
    self.directory = pathlib.Path(directory).absolute()
    self.generation_shardings = generation_shardings
    self.prepare = prepare
    self._abstract = jax.tree.map(
        lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
        like, generation_shardings)
    self.asynchronous = asynchronous
    self._options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, enable_async_checkpointing=asynchronous, create=True)
    self._manager = self._open()
    self._lock = threading.Lock()  # the learner writes while the generator thread reads
    self._published = Published()
    self.last_seconds = 0.0
    self.last_bytes = 0
    self.verified = 0

  def _digest_file(self, version: int) -> pathlib.Path:
    return self.directory.with_name(self.directory.name + ".digests") / f"{version}.json"

  def _expected(self, version: int) -> digest.Digest | None:
    try:
      return digest.from_json(json.loads(self._digest_file(version).read_text()))
    except FileNotFoundError:
      return None

  def _open(self):
    # listing the versions reads each one's metadata: another job may move one away meanwhile
    return _retried(lambda: ocp.CheckpointManager(self.directory, options=self._options))

  def publish(self, params: Params, version: int, changed: bool | None = None) -> float:
    """Writes version ``version``; returns the seconds until it is on storage (asynchronous:
    until it is copied to host memory, after the previous version's write has finished)."""
    started = time.perf_counter()
    self.last_bytes = lora.nbytes(params)
    taken = self._published.digest(params, version, changed)
    if distributed.lead():  # before the version: a reader never sees one without its digest
      path = self._digest_file(version)
      path.parent.mkdir(parents=True, exist_ok=True)
      partial = path.with_suffix(".tmp")
      partial.write_text(json.dumps(digest.to_json(taken)))
      partial.replace(path)
      for old in path.parent.glob("*.json"):  # the versions storage no longer keeps
        if old.stem.isdigit() and int(old.stem) < version - 2 * self._options.max_to_keep:
          old.unlink(missing_ok=True)
    with self._lock:
      self._manager.save(version, args=ocp.args.StandardSave(params))
      if not self.asynchronous:
        self._manager.wait_until_finished()
    self.last_seconds = time.perf_counter() - started
    return self.last_seconds

  def _written(self) -> None:
    """Waits for a write in the background (the caller holds the lock)."""
    if self.asynchronous:
      self._manager.wait_until_finished()

  def flush(self) -> None:
    """Waits until the version written in the background is on storage."""
    with self._lock:
      self._written()

  def latest(self, newer_than: int = -1) -> tuple[Params, int] | None:
    """Restores the newest version above ``newer_than`` into the generation shardings. A
    version that a resumed learner moves aside between the listing and the read is not read:
    the versions are listed again."""
    for attempt in range(50):
      with self._lock:
        self._written()
        _retried(self._manager.reload)  # another job may have written or moved versions
        version = self._manager.latest_step()
      if version is None or version <= newer_than:
        return None
      started = time.perf_counter()
      try:
        with self._lock:
          params = self.prepare(
              self._manager.restore(version, args=ocp.args.StandardRestore(self._abstract)))
          self.verified += check_landed(version, self._expected(version), params,
                                        f"read from {self.directory / str(version)}")
      except SyncMismatch:
        raise
      except Exception as error:  # noqa: BLE001 - Orbax's error for a vanished step is no FileNotFoundError
        where = self.directory / str(version)
        if where.exists():  # there, and unreadable: a write cut short, or files lost since
          raise SyncMismatch(
              f"policy version {version} could not be read from {where} (a write cut short, "
              f"or files removed from it): {_first_line(error)}") from error
        if attempt == 49:
          raise
        # the manager keeps state from the failed read (the next one failed too): a new one
        with self._lock:
          self._manager.close()
          self._manager = self._open()
        time.sleep(0.1)
        continue
      self.last_seconds = time.perf_counter() - started
      return params, version

  def versions(self) -> list[int]:
    with self._lock:
      self._written()
      _retried(self._manager.reload)
      return list(self._manager.all_steps())

  def discard_from(self, version: int) -> int:
    """Moves versions ``version`` and newer aside, into ``DIRECTORY.discarded/`` (process 0;
    every process of the job then sees the same versions)."""
    moved = 0
    with self._lock:
      self._written()
      _retried(self._manager.reload)
      if distributed.lead():
        aside = self.directory.with_name(self.directory.name + ".discarded")
        for step in self._manager.all_steps():
          if step >= version:
            aside.mkdir(exist_ok=True)
            (self.directory / str(step)).rename(aside / f"{step}.{time.time_ns()}")
            moved += 1
      moved = distributed.agree(moved)  # every process waits until the versions are gone
      _retried(self._manager.reload)
    return moved

  def release(self) -> None:
    pass  # a reader restores each version into its own copy: the sync keeps none

  def close(self) -> None:
    with self._lock:
      self._written()
      self._manager.close()


class BaseMismatch(RuntimeError):
  """The generator's base model is not the one the learner's adapters were trained on."""


class LoraSync:
  """Adapter-only weight sync over ``inner`` (a ``ReshardSync`` or ``OrbaxSync`` whose layout
  is the adapters'): ``publish`` ships the adapters alone; ``latest`` merges the newest
  adapters into the generator's copy of the frozen base (``lora.merge``, one jitted program
  into the base's generation shardings), once per version.

  ``base``: the base in the generation layout, or a function that loads it on the first
  ``latest`` (a generator job whose learner warms the base up first). ``reference``: the
  base's ``{"path", "fingerprint"}``; the publishing side writes it to ``reference_file`` and
  the reading side refuses adapters made on another base (``BaseMismatch``)."""

  def __init__(self, inner: WeightSync, base: Params | Callable[[], Params], scale: float, *,
               reference: dict | None = None, reference_file: pathlib.Path | None = None,
               prepare: Callable[[Params], Params] = _as_is):
    self.inner, self.scale, self.prepare = inner, scale, prepare
    self._base = base
    self.reference, self.reference_file = reference, reference_file
    self._merged: tuple[Params, int] | None = None
    self._merge = None
    self._lock = threading.Lock()
    self._checked = False
    self.last_seconds = 0.0
    self.last_bytes = 0

  def publish(self, adapters: Params, version: int, changed: bool | None = None) -> float:
    if (self.reference_file is not None and self.reference is not None and distributed.lead()
        and not self.reference_file.is_file()):
      self.reference_file.write_text(json.dumps(dict(self.reference, scale=self.scale),
                                                indent=1))
    self.last_seconds = self.inner.publish(adapters, version, changed)
    self.last_bytes = self.inner.last_bytes
    return self.last_seconds

  @property
  def verified(self) -> int:
    return self.inner.verified

  def base(self) -> Params:
    if callable(self._base):
      self._base = self._base()
    return self._base

  def _check_reference(self) -> None:
    if self._checked or self.reference_file is None or self.reference is None:
      return
    try:
      theirs = json.loads(self.reference_file.read_text())
    except (OSError, ValueError):
      return  # written by the learner with its first version; one process's view is enough
    if theirs.get("fingerprint") != self.reference.get("fingerprint"):
      raise BaseMismatch(
          f"the learner's adapters were trained on the base {theirs.get('path')} (fingerprint "
          f"{theirs.get('fingerprint')}), this generator holds {self.reference.get('path')} "
          f"(fingerprint {self.reference.get('fingerprint')}): give both jobs the same "
          "model.path and warm-up settings")
    if theirs.get("scale", self.scale) != self.scale:
      raise SyncMismatch(
          f"the learner's adapters are scaled by {theirs['scale']} (lora alpha / rank), this "
          f"generator would merge them scaled by {self.scale}: give both jobs the same "
          "model.lora.rank and model.lora.alpha")
    self._checked = True

  def latest(self, newer_than: int = -1) -> tuple[Params, int] | None:
    got = self.inner.latest(newer_than)
    if got is None:
      return None
    adapters, version = got
    with self._lock:
      if self._merged is not None and self._merged[1] == version:
        return self._merged
      started = time.perf_counter()
      self._check_reference()
      base = self.base()
      if self._merge is None:
        shardings = jax.tree.map(lambda x: x.sharding, base)
        self._merge = jax.jit(functools.partial(lora.merge, scale=self.scale),
                              out_shardings=shardings)
      self._merged = None  # the last merge's memory goes before the next is made
      self._merged = (jax.block_until_ready(self.prepare(self._merge(base, adapters))), version)
      self.last_seconds = self.inner.last_seconds + time.perf_counter() - started
      return self._merged

  def discard_from(self, version: int) -> int:
    with self._lock:
      self._merged = None
    return self.inner.discard_from(version)

  def release(self) -> None:
    """Lets go of the merged copy; the adapters stay, and ``latest`` merges them again."""
    with self._lock:
      self._merged = None

  def versions(self) -> list[int]:
    return self.inner.versions()

  def close(self) -> None:
    self.inner.close()


def _retried(read, attempts: int = 50, pause_s: float = 0.1):
  """``read()``, again while a version it lists vanishes under it (moved aside or deleted by
  another job between the listing and the read of its metadata)."""
  for attempt in range(attempts):
    try:
      return read()
    except FileNotFoundError:
      if attempt == attempts - 1:
        raise
      time.sleep(pause_s)
