"""Messages to token ids for an episode: the first messages as the prompt, and each
observation as the *increment* after the assistant's sampled tokens, so that the sampled
tokens are never decoded and encoded again.

With a chat template, the increment is what the template adds after an assistant turn: its
rendering of ``[user, assistant, *new]`` (with the generation prompt) minus that of
``[user, assistant]``, plus whatever the template writes after the assistant's end-of-turn
token (the newline after ``<|im_end|>``), which the model did not sample. The built-in model
has no template: a tool result is ``<result>text</result>``, other messages their text.

``tokenizer`` is any object with ``encode(text, add_special_tokens=)``, ``render_chat`` (or
``chat_template = None``) and ``eos_token`` (an ``rlx.models.Tokenizer``).
"""

from __future__ import annotations

from collections.abc import Sequence

from rlx.envs.calls import BUILTIN_RESULT, Format, ToolCall, stop_strings, write

_PLACEHOLDER = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]


class Renderer:
  """Token ids of an episode's prompt and of each observation's messages."""

  def __init__(self, tokenizer, format: Format, tools: Sequence[dict] = ()):
    self.tokenizer, self.format, self.tools = tokenizer, format, list(tools)
    self.templated = getattr(tokenizer, "chat_template", None) is not None

  def _render(self, messages, generation_prompt: bool) -> str:
    kwargs = {"tools": self.tools} if self.tools else {}
    return self.tokenizer.render_chat(messages, generation_prompt, **kwargs)

  def prompt(self, messages: Sequence[dict]) -> list[int]:
    """The first messages, ready for the first assistant turn."""
    if self.templated:
      return self.tokenizer.encode(self._render(list(messages), True), add_special_tokens=False)
    return self.tokenizer.encode("\n".join(str(m.get("content", "")) for m in messages))

  def increment(self, messages: Sequence[dict], closed: bool = True) -> list[int]:
    """The ids after an assistant turn that show ``messages`` and open the next turn.
    ``closed=False``: the turn did not end on its end-of-turn token (it hit its length limit),
    so the ids start with the template's end of turn, which the model did not sample: the
    sequence is then what the template renders for that conversation."""
    if not messages:
      return []
    if not self.templated:
      text = "".join(f"{BUILTIN_RESULT[0]}{m.get('content', '')}{BUILTIN_RESULT[1]}"
                     if m.get("role") == "tool" else f"\n{m.get('content', '')}\n"
                     for m in messages)
      return self.tokenizer.encode(text, add_special_tokens=False)
    before = self._render(_PLACEHOLDER, False)
    after = self._render(_PLACEHOLDER + list(messages), True)
    if not after.startswith(before):
      raise ValueError("the chat template renders earlier turns differently once more messages "
                       "follow, so an observation cannot be appended as tokens")
    # what the template writes after the assistant's end of turn, which was not sampled
    eos = getattr(self.tokenizer, "eos_token", None) or ""
    start = before.rindex(eos) + (len(eos) if closed else 0) if eos and eos in before else None
    closing = before[start:] if start is not None else ""
    return self.tokenizer.encode(closing + after[len(before):], add_special_tokens=False)

  def scripted(self, turns: Sequence[dict]) -> list[tuple[list[int], bool]]:
    """A written continuation of the prompt, as an episode would produce it: ``[(ids,
    trained)]`` where each assistant turn (``content``, then its ``tool_calls`` in this
    format, then the end of turn) is trained, and the messages between them (tool results,
    the environment's turns) are the template's increments, not trained. The supervised
    warm-up of a multi-turn run trains on these (a row's ``sft_turns``). A tool call is
    ``{"name": ..., "arguments": {...}}``; the script ends on an assistant turn."""
    segments: list[tuple[list[int], bool]] = []
    waiting: list[dict] = []
    for turn in turns:
      if turn.get("role") != "assistant":
        waiting.append(dict(turn))
        continue
      if waiting:
        segments.append((self.increment(waiting), False))
        waiting = []
      calls = [ToolCall(c["name"], dict(c.get("arguments", {}))) for c in turn.get("tool_calls", ())]
      text = str(turn.get("content", "")) + "".join(write(call, self.format) for call in calls)
      ids = self.tokenizer.encode(text, add_special_tokens=False)
      if not (calls and stop_strings(self.format)):  # else the call's closing token ends it
        ids.append(self.tokenizer.eos_id)
      segments.append((ids, True))
    if waiting or not segments:
      raise ValueError("a scripted conversation (sft_turns) must end on an assistant turn")
    return segments
