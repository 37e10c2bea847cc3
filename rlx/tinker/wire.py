"""The Tinker API's protobuf bodies, read and written with the SDK's own message classes.

The ``tinker`` SDK sends ``forward_backward`` as a ``ForwardBackwardRequest`` protobuf and
reads ``ForwardBackwardOutput`` and ``SampleResponse`` results as protobuf when it asks for
them (``Accept: application/x-protobuf``); everything else is JSON of its pydantic types. The
message classes come from the installed SDK (``tinker.proto.tinker_public_pb2``), so the
wire format is the SDK's by construction.

    datums, loss_fn, config, forward_only = read_forward_backward(body)
    body = forward_backward_output(per_datum_outputs, metrics)
    body = sample_response(sequences, prompt_logprobs)
"""

from __future__ import annotations

import dataclasses

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

PROTOBUF = "application/x-protobuf"

_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


class WireError(ValueError):
  """A request body the service cannot read; the message says what is wrong."""


@dataclasses.dataclass
class Datum:
  tokens: np.ndarray
  """int32 [T]: the model's input (its text chunks, concatenated)."""
  inputs: dict[str, np.ndarray]
  """The loss function's inputs by name (``target_tokens``, ``weights``, ``logprobs``,
  ``advantages``...), each [T] (dense)."""


def _tensor(message: pb.Tensor, name: str) -> np.ndarray:
  dtype = _DTYPES.get(message.dtype)
  if dtype is None:
    raise WireError(f"loss_fn_inputs[{name!r}] has a dtype this service does not read "
                    f"({pb.DType.Name(message.dtype)})")
  shape = list(message.shape)
  if message.HasField("sparse_csr"):
    csr = message.sparse_csr
    values = np.frombuffer(csr.values, dtype)
    crow = np.frombuffer(csr.crow_indices, np.int64)
    col = np.frombuffer(csr.col_indices, np.int64)
    if len(shape) == 1:  # a sparse vector is a 1-row matrix
      dense = np.zeros(shape[0], dtype)
      dense[col] = values
      return dense
    dense = np.zeros(shape, dtype)
    for row in range(len(crow) - 1):
      dense[row, col[crow[row]:crow[row + 1]]] = values[crow[row]:crow[row + 1]]
    return dense
  array = np.frombuffer(message.dense, dtype)
  return array.reshape(shape) if shape else array


def read_forward_backward(body: bytes) -> tuple[str, list[Datum], str, dict, bool]:
  """(model_id, datums, loss_fn, loss_fn_config, forward_only) of a forward_backward body."""
  message = pb.ForwardBackwardRequest()
  try:
    message.ParseFromString(body)
  except Exception as error:  # noqa: BLE001 - protobuf raises its own DecodeError
    raise WireError(f"the forward_backward body is not a ForwardBackwardRequest: {error}")
  datums = []
  for d, datum in enumerate(message.data):
    chunks = []
    for chunk in datum.model_input:
      if chunk.WhichOneof("chunk") != "encoded_text":
        raise WireError(f"datum {d}: a {chunk.WhichOneof('chunk')} chunk; this service takes "
                        "text (EncodedTextChunk) only")
      chunks.append(np.frombuffer(chunk.encoded_text.tokens, np.int32))
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, np.int32)
    inputs = {name: _tensor(tensor, name) for name, tensor in datum.loss_fn_inputs.items()}
    datums.append(Datum(tokens, inputs))
  config = {}
  for key, value in message.loss_fn_config_v2.items():
    config[key] = value.text if value.WhichOneof("value") == "text" else value.number
  for key, value in message.loss_fn_config.items():
    config.setdefault(key, value)
  return message.model_id, datums, message.loss_fn, config, message.forward_only


def forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
  """A ``ForwardBackwardOutput`` body: one batched record of each datum's float32 outputs."""
  message = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
  for key, value in metrics.items():
    message.metrics[key] = float(value)
  if outputs:
    record = message.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(outputs))
    for name in outputs[0]:
      arrays = [np.ascontiguousarray(o[name], np.float32).reshape(-1) for o in outputs]
      offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
      field = record.fields[name]
      field.dtype = pb.DTYPE_FLOAT32
      field.data = b"".join(a.tobytes() for a in arrays)
      field.offsets = offsets.tobytes()
  return message.SerializeToString()


def sample_response(sequences: list[tuple[list[int], list[float], str]],
                    prompt_logprobs: np.ndarray | None = None) -> bytes:
  """A ``SampleResponse`` body from (tokens, log-probs, stop reason 'stop' / 'length') each."""
  reasons = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
  message = pb.SampleResponse()
  for tokens, logprobs, reason in sequences:
    message.sequences.add(stop_reason=reasons[reason],
                          tokens=np.asarray(tokens, np.int32).tobytes(),
                          logprobs=np.asarray(logprobs, np.float32).tobytes())
  if prompt_logprobs is not None:
    message.prompt_logprobs = np.asarray(prompt_logprobs, np.float32).tobytes()
  return message.SerializeToString()
