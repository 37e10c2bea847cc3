"""Policy versions on shared storage as whole or delta files, for a learner job and generator
jobs (``mesh.weight_sync=delta``).

An update at an RL learning rate leaves most of a version's bits as they were: in bfloat16
98-99 % of the elements do not change at all from one step to the next, and in float32 the
changed ones keep their sign, exponent and leading mantissa bits. So a version is written as
the XOR of its bits with the version before it, compressed (zstd): the unchanged bits are zeros
and cost next to nothing. Every ``whole_every``-th version, and whenever a delta would not be
smaller, the version is written whole.

    DIR/<version>/index.json   {"format", "version", "base", "digest", "arrays": {path: {
                                 "dtype", "shape", "codec" ("raw" | "xor-zstd"), "offset",
                                 "bytes"}}}
    DIR/<version>/data         the arrays' payloads, one after the other

``base`` is the version a delta applies to (None: whole). A version is written under a hidden
name and renamed into place, so a reader never sees a partial one. A reader keeps the bits of
the version it read last: a generator that follows the learner reads one delta per version; one
that joins late, or missed a delta that was since deleted, reads the newest whole version at or
below the one it wants and the deltas after it. The writer keeps every version a reader may
still want (the newest ``keep`` and the chain back to their whole version).

The learner's part of a publish is starting a copy of the params on their devices; reading
the copy to host memory, the digest, the XOR, the compression and the write run on a thread
of their own, and the next publish (or ``flush`` or ``close``) waits for them and raises what
they raised. Each version carries its digest (``rlx.digest``); a reader checks the weights it
will sample with against it, and a version it cannot read (a write cut short, files removed)
stops it with one line (``rlx.sync.SyncMismatch``).

With several learner processes, each gathers a whole copy (``distributed.local_replica``) and
process 0 writes; every process of a generator job reads the files and keeps its own part.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import shutil
import threading
import time
from typing import Any, Callable

import jax
import numpy as np
import zstandard

from rlx import digest, distributed
from rlx.models import lora
from rlx.sync import Params, Published, SyncMismatch, _as_is, check_landed

FORMAT = 1
_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_ALIGN = 64


def _bits(array: np.ndarray) -> np.ndarray:
  """``array``'s elements as unsigned integers of their width (a view, no copy)."""
  return np.ascontiguousarray(array).reshape(-1).view(_BITS[array.dtype.itemsize])


def _dtype(name: str) -> np.dtype:
  return np.dtype(jax.numpy.dtype(name))


def _paths(tree: Any) -> list[tuple[str, Any]]:
  return [(jax.tree_util.keystr(path, simple=True, separator="/"), leaf)
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _listed(directory: pathlib.Path) -> list[int]:
  """The complete versions under ``directory``, oldest first."""
  try:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())
  except FileNotFoundError:
    return []


def write_version(directory: pathlib.Path, version: int, bits: dict[str, np.ndarray],
                  arrays: dict[str, np.ndarray], taken: digest.Digest,
                  base: tuple[int, dict[str, np.ndarray]] | None) -> dict:
  """Writes ``version`` (``arrays``, their ``bits``) whole, or as its XOR with ``base``'s
  bits when that is smaller; returns its index."""
  payloads, entries, offset = [], {}, 0
  whole_bytes = sum(x.nbytes for x in arrays.values())
  if base is not None:
    def compressed(job):
      name, start, stop = job
      xor = np.bitwise_xor(bits[name][start:stop], base[1][name][start:stop])
      return zstandard.ZstdCompressor(level=1).compress(xor.data)

    jobs = [(name, start, stop) for name in arrays for start, stop in _frames(bits[name])]
    with _pool() as pool:
      frames = dict(zip(jobs, pool.map(compressed, jobs)))
    delta = {name: [frames[job] for job in jobs if job[0] == name] for name in arrays}
    if sum(len(f) for parts in delta.values() for f in parts) >= whole_bytes // 2:
      base = None  # most bits moved: whole is as small, and reads without a chain
  for name, array in arrays.items():
    parts = delta[name] if base is not None else [memoryview(bits[name]).cast("B")]
    size = sum(len(part) for part in parts)
    entries[name] = {"dtype": str(array.dtype), "shape": list(array.shape),
                     "codec": "raw" if base is None else "xor-zstd", "offset": offset,
                     "bytes": size}
    if base is not None:
      entries[name]["frames"] = [len(part) for part in parts]
    payloads.extend(parts)
    offset += size
  index = {"format": FORMAT, "version": version, "base": None if base is None else base[0],
           "digest": digest.to_json(taken), "arrays": entries}
  partial = directory / f".{version}.partial"
  shutil.rmtree(partial, ignore_errors=True)
  partial.mkdir(parents=True)
  with open(partial / "data", "wb") as out:
    for payload in payloads:
      out.write(payload)
  (partial / "index.json").write_text(json.dumps(index))
  final = directory / str(version)
  if final.exists():  # written again after a resume: the new one replaces it
    shutil.rmtree(final)
  partial.rename(final)
  return index


FRAME_BYTES = 16 << 20
"""A delta is compressed in frames of this many bytes of bits, which threads compress and
apply side by side."""


def _frames(bits: np.ndarray) -> list[tuple[int, int]]:
  step = max(1, FRAME_BYTES // bits.itemsize)
  return [(start, min(start + step, bits.size)) for start in range(0, bits.size, step)]


def _pool() -> concurrent.futures.ThreadPoolExecutor:
  return concurrent.futures.ThreadPoolExecutor(min(4, os.cpu_count() or 1),
                                               thread_name_prefix="rlx-versions-frames")


def _fresh(count: int, dtype) -> np.ndarray:
  """An empty array whose buffer starts on a 64-byte boundary: JAX's CPU client places such a
  buffer on the device without a copy (it aliases it)."""
  dtype = np.dtype(dtype)
  raw = np.empty(count * dtype.itemsize + _ALIGN, np.uint8)
  start = -raw.ctypes.data % _ALIGN
  return raw[start:start + count * dtype.itemsize].view(dtype)


def read_version(path: pathlib.Path, held: tuple[int, dict[str, np.ndarray]] | None
                 ) -> tuple[dict, dict[str, np.ndarray]]:
  """(index, bits) of the version at ``path``; a delta applies to ``held`` (its base's
  bits). The bits are new arrays, never written again: the device may alias them."""
  index = json.loads((path / "index.json").read_text())
  if index.get("format") != FORMAT:
    raise ValueError(f"{path} is in version format {index.get('format')}, not {FORMAT}")
  base = index["base"]
  if base is not None and (held is None or held[0] != base):
    raise ValueError(f"{path} is a delta from version {base}, which this reader does not hold")
  bits, jobs = {}, []
  with open(path / "data", "rb", buffering=0) as data:
    for name, entry in index["arrays"].items():
      dtype, shape = _dtype(entry["dtype"]), tuple(entry["shape"])
      count = int(np.prod(shape))
      data.seek(entry["offset"])
      if entry["codec"] == "raw":  # straight into an array of its own
        if entry["bytes"] != count * dtype.itemsize:
          raise ValueError(f"{name} in {path} holds {entry['bytes']} bytes, not "
                           f"{count * dtype.itemsize}")
        bits[name] = _fresh(count, _BITS[dtype.itemsize])
        if data.readinto(memoryview(bits[name]).cast("B")) != entry["bytes"]:
          raise ValueError(f"{path / 'data'} ends before {name} (the write was cut short)")
        continue
      payload = memoryview(data.read(entry["bytes"]))
      if len(payload) != entry["bytes"]:
        raise ValueError(f"{path / 'data'} ends before {name} (the write was cut short)")
      bits[name] = _fresh(count, _BITS[dtype.itemsize])
      at = 0
      frames = entry["frames"]
      spans = _frames(bits[name])
      if len(frames) != len(spans):
        raise ValueError(f"{name}'s delta in {path} has {len(frames)} frames, not {len(spans)}")
      for (start, stop), size in zip(spans, frames):
        jobs.append((name, start, stop, payload, at, size, held[1][name]))
        at += size

  def apply(job):
    name, start, stop, payload, at, size, base_bits = job
    target = bits[name][start:stop]
    raw = zstandard.ZstdDecompressor().decompress(payload[at:at + size],
                                                  max_output_size=target.nbytes)
    if len(raw) != target.nbytes:
      raise ValueError(f"a frame of {name}'s delta in {path} is {len(raw)} bytes, not "
                       f"{target.nbytes}")
    np.bitwise_xor(base_bits[start:stop], np.frombuffer(raw, target.dtype), out=target)

  if jobs:
    with _pool() as pool:
      list(pool.map(apply, jobs))
  return index, bits


class DeltaSync:
  """Policy versions as whole or delta files under ``directory`` (see the module docstring);
  the ``WeightSync`` protocol of ``rlx.sync``. ``like``: the params' tree of shapes and dtypes,
  read into ``generation_shardings`` and kept as ``prepare`` makes them (handed a copy of their
  own, see ``rlx.sync.ReshardSync``). ``keep``: the newest versions a reader may still ask
  for. ``whole_every``: a whole version at least this often.

  Memory: the writer keeps the last version's bits (one copy of the params, in host memory),
  and so does a reader: on one CPU device these are the very buffers its weights were placed
  from (JAX aliases them), elsewhere a host copy beside the device's."""

  def __init__(self, directory: str | pathlib.Path, generation_shardings: Any, *, like: Params,
               keep: int = 2, whole_every: int = 10,
               prepare: Callable[[Params], Params] = _as_is):
    if whole_every < 1:
      raise ValueError(f"whole_every={whole_every} must be >= 1")
    self.directory = pathlib.Path(directory).absolute()
    self.generation_shardings, self.prepare = generation_shardings, prepare
    self.keep, self.whole_every = max(1, keep), whole_every
    self._like = like
    self._published = Published()
    self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rlx-versions")
    self._pending: concurrent.futures.Future | None = None
    self._previous: tuple[int, dict[str, np.ndarray], Any] | None = None  # written last
    self._since_whole = 0
    self._held: tuple[int, dict[str, np.ndarray]] | None = None  # read last
    self._lock = threading.Lock()
    self.last_seconds = self.write_seconds = 0.0
    self.last_bytes = self.written_bytes = 0
    self.verified = 0
    self.last_chain: list[int] = []  # the versions the last ``latest`` read
    if distributed.lead():
      self.directory.mkdir(parents=True, exist_ok=True)

  # --- the learner's side --------------------------------------------------------------------

  def publish(self, params: Params, version: int, changed: bool | None = None) -> float:
    """Starts writing ``version``; returns the seconds the learner spent (waiting for the
    previous write, and starting a copy of the params that the next update cannot touch)."""
    started = time.perf_counter()
    self._written(agreed=True)
    self.last_bytes = lora.nbytes(params)
    if jax.process_count() > 1:
      params = distributed.local_replica(params)
    if distributed.lead():
      # may_alias=False: the learner donates its params to the next step
      copy = jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False), params)
      self._pending = self._writer.submit(self._write, copy, version, changed)
    self.last_seconds = time.perf_counter() - started
    return self.last_seconds

  def _write(self, copy: Params, version: int, changed: bool | None) -> None:
    started = time.perf_counter()
    arrays = {name: np.asarray(x) for name, x in _paths(copy)}
    taken = self._published.digest(jax.tree.map(np.asarray, copy), version, changed)
    bits = {name: _bits(x) for name, x in arrays.items()}
    base = None
    if (self._previous is not None and self._previous[0] < version
        and self._since_whole + 1 < self.whole_every):
      base = self._previous[:2]
    index = write_version(self.directory, version, bits, arrays, taken, base)
    self._since_whole = 0 if index["base"] is None else self._since_whole + 1
    self._previous = (version, bits, copy)  # ``copy`` keeps the bits' buffers alive
    self._forget(version)
    self.written_bytes = sum(entry["bytes"] for entry in index["arrays"].values())
    self.write_seconds = time.perf_counter() - started

  def _forget(self, newest: int) -> None:
    """Deletes the versions no reader may still need: older than the newest ``keep``, and
    than the whole version their chain starts from."""
    versions = _listed(self.directory)
    oldest_wanted = newest - self.keep + 1
    start = oldest_wanted
    for version in reversed([v for v in versions if v <= oldest_wanted]):
      if self._index(version).get("base") is None:
        start = version
        break
    for version in versions:
      if version < start:
        shutil.rmtree(self.directory / str(version), ignore_errors=True)

  def _index(self, version: int) -> dict:
    try:
      return json.loads((self.directory / str(version) / "index.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
      return {}

  def _written(self, agreed: bool = False) -> None:
    """Waits for the write in the background, raising what it raised. ``agreed`` (every
    process calls it at the same point, as ``publish``): the lead process alone writes, so its
    failure is told to every process, which stops at once instead of waiting at the next
    collective until XLA's timeout."""
    pending, self._pending = self._pending, None
    error = None
    if pending is not None:
      try:
        pending.result()
      except Exception as failed:  # noqa: BLE001 - raised below, on every process
        error = failed
    if agreed and distributed.any_process(error is not None):
      raise error or SyncMismatch("writing a policy version failed on the lead process "
                                  "(process 0): its log says why")
    if error is not None:
      raise error

  def flush(self) -> None:
    self._written()

  def discard_from(self, version: int) -> int:
    """Moves versions ``version`` and newer aside, into ``DIRECTORY.discarded/``; the next
    version is written whole."""
    self._written()
    moved = 0
    if distributed.lead():
      aside = self.directory.with_name(self.directory.name + ".discarded")
      for step in _listed(self.directory):
        if step >= version:
          aside.mkdir(exist_ok=True)
          (self.directory / str(step)).rename(aside / f"{step}.{time.time_ns()}")
          moved += 1
    self._previous, self._since_whole = None, 0
    return distributed.agree(moved)

  def versions(self) -> list[int]:
    self._written()
    return _listed(self.directory)

  # --- the generator's side ------------------------------------------------------------------

  def latest(self, newer_than: int = -1) -> tuple[Params, int] | None:
    """The newest version above ``newer_than``, read (through the deltas after the version
    this reader holds, or after the newest whole version below it) and checked. A writer
    (the learner evaluating its own version) waits for its write first."""
    self._written()
    with self._lock:
      for attempt in range(50):
        versions = _listed(self.directory)
        if not versions or versions[-1] <= newer_than:
          return None
        target = versions[-1]
        chain = self._chain(versions, target)
        if chain is None:  # a version being deleted or written: list again
          time.sleep(0.05)
          continue
        started = time.perf_counter()
        self.last_chain = chain
        try:
          index, bits = self._read(chain)
        except FileNotFoundError:
          if attempt == 49:
            raise
          time.sleep(0.05)  # deleted while read: the chain from the listing again
          continue
        params = self._placed(index, bits, target)
        self.last_seconds = time.perf_counter() - started
        return params, target
      raise SyncMismatch(f"no readable chain of versions up to {versions[-1]} in "
                         f"{self.directory} after 50 listings")

  def _chain(self, versions: list[int], target: int) -> list[int] | None:
    """The versions to read, in order, to reach ``target``: back through each delta's base to
    the version this reader holds or to a whole version (None: a link is missing)."""
    held = None if self._held is None else self._held[0]
    chain, version = [], target
    while True:
      index = self._index(version)
      if not index:
        return None
      chain.append(version)
      base = index["base"]
      if base is None or base == held:
        return chain[::-1]
      if base not in versions:
        return None
      version = base

  def _read(self, chain: list[int]) -> tuple[dict, dict[str, np.ndarray]]:
    held, index = self._held, None
    try:
      for version in chain:
        path = self.directory / str(version)
        try:
          index, bits = read_version(path, held)
        except FileNotFoundError:
          raise
        except (ValueError, OSError, zstandard.ZstdError) as error:
          raise SyncMismatch(f"policy version {version} could not be read from {path} (a "
                             f"write cut short, or files removed from it): {error}") from error
        held = (version, bits)
    except BaseException:
      self._held = None  # the chain is broken: the next read starts from a whole version
      raise
    self._held = held
    return index, held[1]

  def _placed(self, index: dict, bits: dict[str, np.ndarray], version: int) -> Params:
    leaves = []
    for (name, like), sharding in zip(_paths(self._like),
                                      jax.tree.leaves(self.generation_shardings)):
      entry = index["arrays"].get(name)
      if entry is None or tuple(entry["shape"]) != tuple(like.shape):
        raise SyncMismatch(f"policy version {version} in {self.directory} has no {name} of "
                           f"shape {tuple(like.shape)}: written by another model")
      host = bits[name].view(_dtype(entry["dtype"])).reshape(like.shape)
      # a version's bits are never written once read (a delta makes new ones), so the device
      # may keep them as its buffer: no copy, and no second copy of the weights on the host
      leaves.append(jax.device_put(host, sharding, may_alias=True))
    params = self.prepare(jax.tree.unflatten(jax.tree.structure(self._like), leaves))
    expected = digest.from_json(index["digest"])
    self.verified += check_landed(version, expected, params,
                                  f"read from {self.directory / str(version)}")
    return params

  def release(self) -> None:
    pass  # a reader reads each version into its own copy

  def close(self) -> None:
    try:
      self._written()
    finally:
      self._writer.shutdown(wait=True)
