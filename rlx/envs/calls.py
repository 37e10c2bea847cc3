"""Tool calls in a model's text, one parser per format, and how each format shows results.

- ``builtin``: ``<call>name("arg", key=2)</call>``: a Python call with literal arguments
  (the built-in model's; ``<call>``, ``</call>``, ``<result>``, ``</result>`` are single
  tokens of its tokenizer, and ``</call>`` ends the turn).
- ``qwen``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call
  (Qwen2.5, Qwen3 and other Hermes-style templates).
- ``llama``: a JSON object ``{"name": ..., "parameters": {...}}`` as the whole turn (Llama
  3.1+ JSON tool calling; ``<|python_tag|>`` in front is allowed), several separated by ``;``.

``parse(text, format)`` gives the calls, or raises ``MalformedCall`` with what is wrong (the
model reads that message as the call's answer); ``write(call, format)`` is the text of a call.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import threading
import warnings
from typing import Any, Literal

Format = Literal["builtin", "qwen", "llama"]
FORMATS: tuple[Format, ...] = ("builtin", "qwen", "llama")

BUILTIN_CALL = ("<call>", "</call>")
BUILTIN_RESULT = ("<result>", "</result>")


class MalformedCall(ValueError):
  """A tool call that cannot be read (bad JSON, unknown syntax, an unclosed tag)."""


@dataclasses.dataclass(frozen=True)
class ToolCall:
  name: str
  arguments: dict[str, Any]


def _json_call(text: str, arguments_key: str) -> ToolCall:
  try:
    value = json.loads(text)
  except json.JSONDecodeError as error:
    raise MalformedCall(f"the tool call is not valid JSON ({error.msg} at character "
                        f"{error.pos})") from None
  if not isinstance(value, dict) or not isinstance(value.get("name"), str):
    raise MalformedCall('a tool call is a JSON object with a "name"')
  arguments = value.get(arguments_key, value.get("arguments", {}))
  if isinstance(arguments, str):  # some models write the arguments as a JSON string
    try:
      arguments = json.loads(arguments)
    except json.JSONDecodeError:
      raise MalformedCall(f'the "{arguments_key}" of a tool call are not a JSON object') from None
  if not isinstance(arguments, dict):
    raise MalformedCall(f'the "{arguments_key}" of a tool call must be a JSON object')
  return ToolCall(value["name"], arguments)


_PARSING = threading.Lock()
"""Episodes parse their turns on worker threads. CPython 3.11's parser keeps its recursion depth
in state that threads share (a parse beside another one raised ``SystemError: AST constructor
recursion depth mismatch`` in an agent run at RL step 86), and ``warnings.catch_warnings``
changes process-wide filters: one parse at a time."""


def _builtin_call(text: str) -> ToolCall:
  try:
    with _PARSING, warnings.catch_warnings():  # a model's text ("12abc") must not print warnings
      warnings.simplefilter("ignore", SyntaxWarning)
      node = ast.parse(text.strip(), mode="eval").body
  except (SyntaxError, ValueError, RecursionError, MemoryError, SystemError):
    # ValueError: a NUL byte; the others: nesting deeper than the parser takes
    raise MalformedCall(f"cannot read the call {text.strip()[:80]!r}; write name(\"argument\")") from None
  if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
    raise MalformedCall(f"cannot read the call {text.strip()[:80]!r}; write name(\"argument\")")
  try:
    positional = [ast.literal_eval(a) for a in node.args]
    keywords = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
  except (ValueError, SyntaxError, TypeError):
    raise MalformedCall("the arguments of a call must be literals (\"text\", 12, [1, 2])") from None
  return ToolCall(node.func.id, {"*": positional, **keywords} if positional else keywords)


def parse(text: str, format: Format) -> list[ToolCall]:
  """The tool calls in one assistant turn (empty: the turn calls no tool)."""
  if format == "builtin":
    opened, closed = BUILTIN_CALL
    if opened not in text:
      return []
    calls = []
    for part in text.split(opened)[1:]:
      if closed not in part:
        raise MalformedCall(f"a call opened with {opened} was never closed with {closed}")
      calls.append(_builtin_call(part.split(closed, 1)[0]))
    return calls
  if format == "qwen":
    blocks = re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text, re.S)
    if "<tool_call>" in text and text.count("<tool_call>") != text.count("</tool_call>"):
      raise MalformedCall("a <tool_call> was never closed with </tool_call>")
    return [_json_call(block.strip(), "arguments") for block in blocks]
  if format == "llama":
    body = text.replace("<|python_tag|>", "").strip()
    for end in ("<|eom_id|>", "<|eot_id|>"):
      body = body.removesuffix(end).strip()
    if not body.startswith("{"):
      return []
    return [_json_call(part.strip(), "parameters") for part in body.split(";") if part.strip()]
  raise ValueError(f"unknown tool-call format {format!r}; choose one of {', '.join(FORMATS)}")


def write(call: ToolCall, format: Format) -> str:
  """The text of ``call`` as a model writes it in ``format`` (``parse`` reads it back): the
  supervised warm-up's tool calls. 'builtin' writes a one-argument call positionally
  (``calculator("347*582")``), others by keyword."""
  if format == "builtin":
    literal = lambda value: json.dumps(value) if isinstance(value, str) else repr(value)
    values = list(call.arguments.values())
    inside = (literal(values[0]) if len(values) == 1 else
              ", ".join(f"{key}={literal(value)}" for key, value in call.arguments.items()))
    return f"{BUILTIN_CALL[0]}{call.name}({inside}){BUILTIN_CALL[1]}"
  if format == "qwen":
    return f'<tool_call>\n{json.dumps({"name": call.name, "arguments": call.arguments})}\n</tool_call>'
  if format == "llama":
    return json.dumps({"name": call.name, "parameters": call.arguments})
  raise ValueError(f"unknown tool-call format {format!r}; choose one of {', '.join(FORMATS)}")


def bind(call: ToolCall, parameters: list[str]) -> dict[str, Any]:
  """Keyword arguments of ``call`` for a tool with ``parameters`` (positional ones of the
  builtin format matched by position). Raises MalformedCall on a mismatch."""
  arguments = dict(call.arguments)
  positional = arguments.pop("*", [])
  if len(positional) > len(parameters):
    raise MalformedCall(f"{call.name} takes {len(parameters)} argument(s), "
                        f"{len(positional)} were given")
  for name, value in zip(parameters, positional):
    if name in arguments:
      raise MalformedCall(f"{call.name} got {name!r} twice")
    arguments[name] = value
  unknown = set(arguments) - set(parameters)
  if unknown:
    raise MalformedCall(f"{call.name} has no parameter {sorted(unknown)[0]!r}; it takes "
                        f"{', '.join(parameters) or 'none'}")
  return arguments


def stop_strings(format: Format) -> tuple[str, ...]:
  """Token texts that end an assistant turn in ``format``, besides the tokenizer's eos."""
  return (BUILTIN_CALL[1],) if format == "builtin" else ()


def detect_format(tokenizer) -> Format:
  """The tool-call format a tokenizer's chat template uses: 'builtin' without a template, else
  by the template's own markers."""
  template = getattr(tokenizer, "chat_template", None)
  if template is None:
    return "builtin"
  return "qwen" if "<tool_call>" in template else "llama"


def turn_stop_ids(tokenizer, format: Format) -> tuple[int, ...]:
  """Token ids that end an assistant turn: eos, and the format's own end of a call."""
  extra = []
  for text in stop_strings(format):
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
      raise ValueError(f"{text!r} is not one token of this tokenizer; choose env.tool_format")
    extra += ids
  return tuple(dict.fromkeys([*tokenizer.eos_ids, *extra]))
