"""Streamed answers (``stream: true``) of the OpenAI-compatible endpoint: a whole sampled
answer as the chunks the OpenAI API streams, sent as server-sent events.

    return streaming.chat(response, answers, request, decode)    # a Stream of chunks
    StreamingResponse(streaming.events(chunks), media_type="text/event-stream")

Each sampled token is a chunk of its own (its text as decoding one more token reveals it, its
log-prob or id); the chunks go out once the answer is sampled.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence


class Stream(list):
  """The chunks of a streamed response (``stream_chunks``), sent as server-sent events."""


def stream_chunks(response: dict, pieces: Sequence[Sequence[dict]], include_usage: bool
                  ) -> Stream:
  """A whole ``response`` as the chunks the OpenAI API streams: each choice's sampled tokens
  one chunk each (``pieces[c][t]``: the fields of token t's chunk of choice c, ``delta`` for a
  chat, ``text`` for a completion, and its ``logprobs`` / ``token_ids``), a chat's first chunk
  with the role, the finish reason in a last chunk per choice, and the usage in a chunk of no
  choices when ``include_usage``."""
  chat = response["object"] == "chat.completion"
  head = {"id": response["id"], "object": "chat.completion.chunk" if chat else "text_completion",
          "created": response["created"], "model": response["model"]}
  chunk = lambda choices: {**head, "choices": choices, **({"usage": None} if include_usage else {})}
  empty = {"delta": {}} if chat else {"text": ""}
  out = Stream()
  for choice, tokens in zip(response["choices"], pieces, strict=True):
    index = choice["index"]
    if chat:
      out.append(chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}]))
    for piece in tokens:
      out.append(chunk([{"index": index, "logprobs": None, "finish_reason": None, **piece}]))
    out.append(chunk([{"index": index, **empty, "logprobs": None,
                       "finish_reason": choice["finish_reason"]}]))
  if include_usage:
    out.append({**head, "choices": [], "usage": response["usage"]})
  return out


def pieces(decode: Callable[[list[int]], str], tokens: Sequence[int], text: str) -> list[str]:
  """``text`` (the answer of ``tokens``, cut at a stop string) split into one piece per
  token, as decoding the tokens one more at a time reveals it: a token that ends inside a
  character, or after the stop string, gets an empty piece; the pieces add up to ``text``."""
  out, emitted = [], 0
  for t in range(1, len(tokens) + 1):
    decoded = decode(list(tokens[:t]))
    agree = next((i for i, (a, b) in enumerate(zip(decoded, text)) if a != b),
                 min(len(decoded), len(text)))
    out.append(text[emitted:agree] if agree > emitted else "")
    emitted = max(emitted, agree)
  if out:
    out[-1] += text[emitted:]
  return out


def include_usage(request) -> bool:
  """Whether a streamed response ends with the usage (``stream_options.include_usage``)."""
  options = (request.model_extra or {}).get("stream_options")
  return isinstance(options, dict) and options.get("include_usage") is True


def chat(response: dict, answers: Sequence[tuple], request, decode) -> Stream:
  """A chat ``response`` streamed: ``answers`` (generated, message, text) of each choice; an
  answer with tool calls goes out whole, in one chunk."""
  per_choice = []
  for choice, (generated, message, text) in zip(response["choices"], answers, strict=True):
    entries = (choice["logprobs"] or {}).get("content")
    if message.get("tool_calls"):
      calls = [dict(call, index=i) for i, call in enumerate(message["tool_calls"])]
      per_choice.append([{"delta": {"content": message["content"], "tool_calls": calls},
                          "logprobs": {"content": entries} if entries else None}])
      continue
    per_choice.append([{"delta": {"content": piece},
                        "logprobs": {"content": [entries[t]]} if entries else None}
                       for t, piece in enumerate(pieces(decode, generated.tokens, text))])
  return stream_chunks(response, per_choice, include_usage(request))


def completion(response: dict, generated: Sequence, texts: Sequence[str], request, decode,
               echo: str) -> Stream:
  """A text-completion ``response`` streamed: each token's text (and id, with
  ``return_token_ids``); ``echo``, the prompt's text, before the first token's."""
  per_choice = []
  for g, text in zip(generated, texts, strict=True):
    chunks = [{"text": piece, **({"token_ids": [token]} if request.return_token_ids else {})}
              for token, piece in zip(g.tokens, pieces(decode, g.tokens, text))]
    if echo and chunks:
      chunks[0]["text"] = echo + chunks[0]["text"]
    per_choice.append(chunks)
  return stream_chunks(response, per_choice, include_usage(request))


async def events(chunks: Stream):
  """Server-sent events: one ``data:`` line per chunk, then ``data: [DONE]``."""
  for chunk in chunks:
    yield f"data: {json.dumps(chunk)}\n\n"
  yield "data: [DONE]\n\n"
