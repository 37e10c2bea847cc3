"""The OpenAI chat- and text-completions schema: what a request may hold, the errors, and the
responses built from the ids the engine sampled.

A body is read as strict JSON (``parse_body``); requests are validated by pydantic models
(unknown fields are accepted and ignored, as the OpenAI API does for fields it does not know);
a request that does not validate, or asks for more than the endpoint allows, is an ``ApiError``
with OpenAI's error JSON and a 4xx status. Tool calls in a sampled answer are read with the
model's format (``envs.calls``) and returned as ``tool_calls`` (finish reason ``tool_calls``);
an answer whose call cannot be read is returned as plain text.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Sequence
from typing import Any, Literal

import pydantic

from rlx.envs.calls import BUILTIN_CALL, Format, MalformedCall, bind, parse
from rlx.serve.trajectories import arguments_of, text_of


class ApiError(Exception):
  """An error answered as ``{"error": {...}}`` with an HTTP status."""

  def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
               param: str | None = None, code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                      "code": self.code}}


def _no_constant(name: str):
  raise ValueError(f"{name} is not a JSON number")


DRAIN_BYTES = 64 << 20
"""A body up to this size is read to its end even when over the limit (see ``read_body``)."""
DISCONNECT_POLL_S = 0.2
"""How often a request being answered checks that its client is still there."""
GONE = object()
"""What ``unless_gone`` returns when the client hung up first."""


async def read_body(request, limit: int) -> object:
  """The request's JSON body, at most ``limit`` bytes (else a 413). A body over the limit is
  still read to its end (up to ``DRAIN_BYTES``) before the 413 goes out: a server that answers
  mid-upload closes the socket under a client still sending, which sees a broken pipe instead
  of the error."""
  declared = request.headers.get("content-length")
  too_large = ApiError(413, f"the request is {declared or 'more than ' + str(limit)} bytes; "
                       f"this endpoint takes at most {limit}", code="request_too_large")
  if declared is not None and declared.isdigit() and int(declared) > DRAIN_BYTES:
    raise too_large
  body, seen = bytearray(), 0
  async for chunk in request.stream():
    seen += len(chunk)
    if seen > DRAIN_BYTES:
      raise too_large
    if seen <= limit:
      body += chunk
  if seen > limit:
    raise too_large
  return parse_body(bytes(body))


async def unless_gone(work, request):
  """Awaits the coroutine ``work``, unless the client of ``request`` hangs up first: then
  ``work`` is cancelled (what it started is abandoned) and ``GONE`` is returned."""
  async def gone():
    while not await request.is_disconnected():
      await asyncio.sleep(DISCONNECT_POLL_S)

  task, watch = asyncio.ensure_future(work), asyncio.ensure_future(gone())
  await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
  watch.cancel()
  if not task.done():
    task.cancel()
    return GONE
  return task.result()


def parse_body(body: bytes) -> object:
  """A request body as JSON, or a 400: not JSON, NaN or Infinity (Python reads them, JSON has
  none), or nested past what the parser recurses into."""
  try:
    return json.loads(body, parse_constant=_no_constant)
  except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError is a ValueError
    raise ApiError(400, f"the body is not valid JSON: {error}") from None
  except RecursionError:
    raise ApiError(400, "the body is nested too deeply") from None


_STRICT = pydantic.ConfigDict(extra="allow", strict=True)
# JSON numbers only where numbers go: "2" is not an n, true is not a seed (strict), and
# fields the endpoint does not know are ignored, as OpenAI's API does (extra="allow")


class _Request(pydantic.BaseModel):
  model_config = _STRICT

  model: str
  temperature: float | None = pydantic.Field(None, ge=0, le=2, allow_inf_nan=False)
  top_p: float | None = pydantic.Field(None, gt=0, le=1, allow_inf_nan=False)
  top_k: int | None = pydantic.Field(None, ge=-1)
  """Not OpenAI's: the most likely tokens sampled from; 0 or -1 (vLLM's) or none: all of
  them. Larger than the vocabulary means all of them too."""
  max_tokens: int | None = pydantic.Field(None, ge=1)
  stop: str | list[str] | None = None
  n: int = pydantic.Field(1, ge=1)
  seed: int | None = pydantic.Field(None, ge=-(1 << 63), lt=1 << 64)
  stream: bool = False
  logprobs: Any = None
  top_logprobs: int | None = pydantic.Field(None, ge=0, le=20)

  @pydantic.field_validator("stop")
  @classmethod
  def _stops(cls, value):
    stops = [value] if isinstance(value, str) else list(value or [])
    if len(stops) > 4 or any(not s for s in stops):
      raise ValueError("up to 4 non-empty stop strings")
    return stops


class _Part(pydantic.BaseModel):
  model_config = _STRICT

  type: Literal["text"]
  """Only text: this endpoint serves a language model."""
  text: str


class _Function(pydantic.BaseModel):
  model_config = _STRICT

  name: str = pydantic.Field(min_length=1, max_length=256)
  description: str | None = None
  parameters: dict[str, Any] | None = None
  strict: bool | None = None


class Tool(pydantic.BaseModel):
  model_config = _STRICT

  type: Literal["function"] = "function"
  function: _Function


class _CalledFunction(pydantic.BaseModel):
  model_config = _STRICT

  name: str = pydantic.Field(min_length=1)
  arguments: str
  """JSON text, as OpenAI sends it."""


class _ToolCall(pydantic.BaseModel):
  model_config = _STRICT

  id: str | None = None
  type: Literal["function"] = "function"
  function: _CalledFunction


class _Message(pydantic.BaseModel):
  model_config = _STRICT

  role: Literal["system", "developer", "user", "assistant", "tool"]
  content: str | list[_Part] | None = None
  tool_calls: list[_ToolCall] | None = None
  tool_call_id: str | None = None
  name: str | None = None

  @pydantic.model_validator(mode="after")
  def _filled(self):
    if self.role == "assistant":
      if self.content is None and not self.tool_calls:
        raise ValueError("an assistant message needs content or tool_calls")
    elif self.content is None:
      raise ValueError(f"a {self.role} message needs content")
    elif self.tool_calls:
      raise ValueError(f"only assistant messages carry tool_calls, not {self.role}")
    if self.role == "tool" and not self.tool_call_id:
      raise ValueError("a tool message needs the tool_call_id it answers")
    return self


class _NamedChoice(pydantic.BaseModel):
  model_config = _STRICT

  name: str


class _ToolChoice(pydantic.BaseModel):
  model_config = _STRICT

  type: Literal["function"]
  function: _NamedChoice


class ChatRequest(_Request):
  messages: list[_Message] = pydantic.Field(min_length=1)
  tools: list[Tool] | None = None
  tool_choice: Literal["none", "auto", "required"] | _ToolChoice | None = None
  max_completion_tokens: int | None = pydantic.Field(None, ge=1)
  logprobs: bool = False

  @pydantic.model_validator(mode="after")
  def _offered(self):
    if isinstance(self.tool_choice, _ToolChoice) and self.tool_choice.function.name not in {
        t.function.name for t in self.tools or ()}:
      raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not "
                       "among the tools")
    return self

  def plain_messages(self) -> list[dict]:
    return [m.model_dump(exclude_none=True) for m in self.messages]

  def plain_tools(self) -> list[dict]:
    return [t.model_dump(exclude_none=True) for t in self.tools or ()]


class CompletionRequest(_Request):
  prompt: str | list[int] = pydantic.Field(min_length=1)
  """Text, or token ids (token-in: sent to the engine as they are)."""
  logprobs: int | None = pydantic.Field(None, ge=0, le=20)
  echo: bool = False
  return_token_ids: bool = False


def validate(model: type[_Request], body: Any) -> _Request:
  """``body`` as a request, or a 400 ``ApiError`` naming the first field that is wrong."""
  try:
    return model.model_validate(body)
  except pydantic.ValidationError as error:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or None
    raise ApiError(400, f"{where}: {first['msg']}" if where else first["msg"],
                   param=where) from None


def new_id(prefix: str) -> str:
  return f"{prefix}-{secrets.token_hex(12)}"


def tool_calls_in(text: str, format: Format,
                  tools: Sequence[dict]) -> tuple[str | None, list[dict]] | None:
  """(content before the calls, OpenAI ``tool_calls``) of a sampled answer; None when it calls
  no tool, or a call cannot be read or names a tool that was not offered."""
  try:
    calls = parse(text, format)
  except MalformedCall:
    return None
  if not calls:
    return None
  offered = {t.get("function", t).get("name"): t.get("function", t) for t in tools}
  out = []
  for call in calls:
    described = offered.get(call.name)
    if described is None:
      return None
    parameters = list((described.get("parameters") or {}).get("properties") or {})
    try:
      arguments = bind(call, parameters)
    except MalformedCall:
      return None
    out.append({"id": new_id("call"), "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(arguments)}})
  opener = {"builtin": BUILTIN_CALL[0], "qwen": "<tool_call>"}.get(format)
  content = text.split(opener, 1)[0].strip() if opener else ""
  return content or None, out


def opens_call(text: str, format: Format) -> bool:
  """Whether an answer begins a tool call (in ``format``), readable or not."""
  marker = {"builtin": BUILTIN_CALL[0], "qwen": "<tool_call>"}.get(format)
  if marker is not None:
    return marker in text
  return text.replace("<|python_tag|>", "").lstrip().startswith("{")


def token_logprobs(decode_one, tokens: Sequence[int], logprobs: Sequence[float]) -> list[dict]:
  """The chat ``logprobs.content`` list of one choice."""
  out = []
  for token, logprob in zip(tokens, logprobs):
    text = decode_one(token)
    out.append({"token": text, "logprob": float(logprob), "bytes": list(text.encode()),
                "top_logprobs": []})
  return out


def response(kind: str, model: str, choices: Sequence[dict], prompt_tokens: int,
             completion_tokens: int) -> dict:
  """A completion response: ``kind`` 'chat.completion' or 'text_completion'."""
  return {"id": new_id("chatcmpl" if kind == "chat.completion" else "cmpl"), "object": kind,
          "created": int(time.time()), "model": model, "choices": list(choices),
          "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens}}


def template_messages(messages: Sequence[dict]) -> list[dict]:
  """OpenAI messages as a Hugging Face chat template reads them: text content, tool-call
  arguments as dicts."""
  out = []
  for message in messages:
    m = {"role": message["role"], "content": text_of(message.get("content"))}
    if message.get("tool_calls"):
      m["tool_calls"] = [{"type": "function", "function": {
          "name": call.get("function", call).get("name", ""), "arguments": arguments_of(call)}}
          for call in message["tool_calls"]]
    for key in ("tool_call_id", "name"):
      if message.get(key):
        m[key] = message[key]
    out.append(m)
  return out


def builtin_text(messages: Sequence[dict], eos: str) -> str:
  """A whole conversation as the built-in model reads it (it has no chat template): the first
  messages' text, then each assistant turn with its calls as ``<call>name("arg")</call>``, each
  tool result as ``<result>text</result>``, each later user message on its own lines."""
  parts, started = [], False
  for message in messages:
    role, content = message["role"], text_of(message.get("content"))
    if not started and role != "assistant":
      parts.append(("\n" if parts else "") + content)
      continue
    started = True
    if role == "assistant":
      calls = message.get("tool_calls") or ()
      parts.append(content + "".join(
          f"{BUILTIN_CALL[0]}{call.get('function', call).get('name', '')}("
          + ", ".join(json.dumps(v) for v in arguments_of(call).values())
          + f"){BUILTIN_CALL[1]}" for call in calls) + ("" if calls else eos))
    elif role == "tool":
      parts.append(f"<result>{content}</result>")
    else:
      parts.append(f"\n{content}\n")
  return "".join(parts)
