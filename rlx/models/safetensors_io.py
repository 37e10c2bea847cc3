"""Reading and writing Hugging Face safetensors files, tensor by tensor.

Reading memory-maps each file and hands out numpy views, so a caller can copy
just the block of a tensor that one device shard needs. Writing cuts the
tensors into files of at most ``max_shard_bytes`` with a
``model.safetensors.index.json``, as ``transformers`` does, and never holds more
than one file's worth of tensors.
"""

from __future__ import annotations

import json
import pathlib
import struct
from collections.abc import Callable, Iterable

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}


class CheckpointError(ValueError):
  """A checkpoint directory is missing, incomplete or of an unsupported kind."""


_DAMAGED = "the download is incomplete or the file was damaged: fetch the model again"


def read_json(file: pathlib.Path):
  """A JSON file of a model directory; ``CheckpointError`` naming it when it does not parse."""
  try:
    return json.loads(file.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as error:
    raise CheckpointError(f"{file} is not valid JSON ({error}); {_DAMAGED}") from None


class SafetensorsReader:
  """Lazily maps tensor names to memory-mapped numpy arrays over one model directory."""

  def __init__(self, directory: str | pathlib.Path, weights: str = SINGLE_FILE):
    """``weights``: the single file's name (a PEFT adapter's is adapter_model.safetensors)."""
    self.directory = pathlib.Path(directory)
    index = self.directory / INDEX_FILE
    if weights == SINGLE_FILE and index.is_file():
      weight_map = read_json(index).get("weight_map")
      if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index} has no weight_map; {_DAMAGED}")
      self._file_of = {name: self.directory / file for name, file in weight_map.items()}
    elif (self.directory / weights).is_file():
      self._file_of = None
    else:
      raise CheckpointError(
          f"{self.directory} holds neither {weights} nor {INDEX_FILE}; "
          "point at a Hugging Face model directory saved with safetensors")
    self._headers: dict[pathlib.Path, tuple[dict, int]] = {}
    if self._file_of is None:
      self._file_of = {name: self.directory / weights
                       for name in self._header(self.directory / weights)[0]}

  def _header(self, file: pathlib.Path) -> tuple[dict, int]:
    if file not in self._headers:
      if not file.is_file():
        raise CheckpointError(f"{file} is listed in {INDEX_FILE} but does not exist")
      try:
        with open(file, "rb") as f:
          (length,) = struct.unpack("<Q", f.read(8))
          header = json.loads(f.read(length))
        if not isinstance(header, dict):
          raise ValueError("its header is not a JSON object")
      except (struct.error, ValueError) as error:  # JSONDecodeError and UnicodeDecodeError too
        raise CheckpointError(f"{file} is not a readable safetensors file ({error}); "
                              f"{_DAMAGED}") from None
      header.pop("__metadata__", None)
      self._headers[file] = (header, 8 + length)
    return self._headers[file]

  def names(self) -> set[str]:
    return set(self._file_of)

  def __contains__(self, name: str) -> bool:
    return name in self._file_of

  def get(self, name: str) -> np.ndarray:
    """A read-only memory-mapped view of one tensor (no bytes are read until sliced)."""
    if name not in self._file_of:
      raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.directory}")
    file = self._file_of[name]
    header, data_start = self._header(file)
    info = header[name]
    if info["dtype"] not in _DTYPES:
      raise CheckpointError(f"tensor {name!r} in {file} has unsupported dtype {info['dtype']}")
    start, end = info["data_offsets"]
    dtype = np.dtype(_DTYPES[info["dtype"]])
    if end - start == 0:
      return np.zeros(info["shape"], dtype)
    if data_start + end > file.stat().st_size:
      raise CheckpointError(f"{file} is truncated: tensor {name!r} ends at byte "
                            f"{data_start + end}, the file has {file.stat().st_size}; {_DAMAGED}")
    return np.memmap(file, dtype=dtype, mode="r", offset=data_start + start,
                     shape=tuple(info["shape"]))


def write_safetensors(directory: pathlib.Path, tensors: Iterable[tuple[str, Callable[[], np.ndarray], int]],
                      max_shard_bytes: int, write: bool = True) -> list[str]:
  """Writes ``(name, produce, nbytes)`` tensors into one file or several plus an index.

  ``produce()`` is called only when the tensor's file is written, so at most one
  file's worth of tensors is in host memory. With ``write=False`` every tensor
  is still produced (for collective gathers across processes) but nothing is
  written. Returns the file names.
  """
  shards: list[list[tuple[str, Callable[[], np.ndarray]]]] = [[]]
  size = 0
  for name, produce, nbytes in tensors:
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append((name, produce))
    size += nbytes
  if len(shards) == 1:
    names = [SINGLE_FILE]
  else:
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  weight_map, total = {}, 0
  for file, shard in zip(names, shards):
    arrays = {name: np.ascontiguousarray(produce()) for name, produce in shard}
    total += sum(a.nbytes for a in arrays.values())
    if write:
      save_file(arrays, str(directory / file), metadata={"format": "pt"})
    weight_map.update({name: file for name in arrays})
    del arrays
  if write and len(shards) > 1:
    (directory / INDEX_FILE).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
  return names
