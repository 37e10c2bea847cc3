"""An agent program's episode, as the endpoint saw it: every request's ids, and the trajectories
they make.

A request whose messages start with an earlier request's messages plus the assistant message
the endpoint answered it with *extends* that conversation: its prompt is the earlier prompt,
the ids the policy sampled, and the new messages rendered as an increment
(``envs.Renderer.increment``). When that answer was cut at its token limit (finish reason
'length'), the increment starts with the template's end-of-turn token, outside the loss mask
like every increment: the trajectory is the conversation as the chat template renders it. The sampled ids are never decoded and encoded again, so a
trajectory is exactly what the model conditioned on. A request whose messages extend nothing
(the agent rewrote or summarised its history) is rendered whole; when those ids still start
with an earlier trajectory's ids it continues that one, else it starts a new *segment*.

Every answered choice is a node: its ids are the prompt and the whole response, with a
per-token mask of the sampled ids. A node a later request extended is interior; the others
are the episode's trajectories (the leaves), one per segment plus the unchosen choices of
``n > 1``. ``EpisodeLog.trajectory(choose)`` picks the one that is trained on:

- ``last``: the trajectory of the episode's last request (its final answer, with every earlier
  turn of the same segment as context). The default.
- ``longest``: the leaf with the most sampled tokens.

Either way one sequence per episode is trained on, and the other leaves' sampled tokens are
counted as dropped (``agent/dropped_token_frac``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any, Literal

Choose = Literal["last", "longest"]


def text_of(content: Any) -> str:
  """A message's content as text (OpenAI allows a list of parts)."""
  if content is None:
    return ""
  if isinstance(content, str):
    return content
  if isinstance(content, list):
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))
  return str(content)


def arguments_of(call: dict) -> dict:
  """A tool call's arguments as a dict (OpenAI sends them as a JSON string)."""
  arguments = call.get("function", call).get("arguments", {})
  if isinstance(arguments, str):
    try:
      arguments = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
      return {"_raw": arguments}
  return arguments if isinstance(arguments, dict) else {"_raw": arguments}


def normalize(message: dict) -> tuple:
  """What identifies a message when requests are compared (ids of tool calls aside)."""
  calls = tuple((call.get("function", call).get("name", ""),
                 json.dumps(arguments_of(call), sort_keys=True))
                for call in message.get("tool_calls") or ())
  return (message.get("role", ""), text_of(message.get("content")).strip(), calls)


@dataclasses.dataclass
class Node:
  """One answered choice: a whole trajectory up to its last sampled token."""

  prompt_tokens: list[int]
  response_tokens: list[int]
  logprobs: list[float]
  policy_logprobs: list[float]
  sampled_mask: list[bool]
  turns: int
  finish_reason: str
  policy_version: int
  messages: tuple
  """The normalized conversation, the answer included: what a next request extends."""
  conversation: list[dict]
  """The same as the agent sent it, the answer appended (for a reward over the messages)."""
  text: str
  """The answer's text."""
  order: int
  extended: bool = False

  @property
  def ids(self) -> list[int]:
    return self.prompt_tokens + self.response_tokens

  @property
  def sampled(self) -> int:
    return sum(self.sampled_mask)


class EpisodeLog:
  """Requests and trajectories of one episode (see the module docstring)."""

  def __init__(self, key: str, row: dict | None = None, seed_key=None):
    self.key, self.row, self.seed_key = key, row, seed_key
    self.nodes: list[Node] = []
    self.requests: list[dict] = []
    """Per request: its prompt ids, and per choice the sampled ids, log-probs and version."""
    self.segments = 0
    self.asked = 0
    """Requests received (answered or not): each draws with its own key."""
    self.posted: dict | None = None
    """What the agent posted to the reward route."""
    self.tool_calls = 0
    """Tool calls the endpoint read in the answers."""
    self.malformed_calls = 0
    """Answers that began a tool call the endpoint could not read (returned as text)."""

  def prompt(self, messages: Sequence[dict], increment: Callable[[Sequence[dict]], list[int]],
             render: Callable[[Sequence[dict]], list[int]]) -> tuple[list[int], Node | None]:
    """The prompt ids of a request, and the node it continues (None: a new segment).
    ``increment(new_messages)`` renders what follows an assistant turn, ``render(messages)`` a
    whole conversation."""
    wanted = [normalize(m) for m in messages]
    best = None
    for node in self.nodes:
      size = len(node.messages)
      if size < len(wanted) and tuple(wanted[:size]) == node.messages and (
          best is None or size >= len(best.messages)):
        best = node
    if best is not None:  # a turn cut at its length limit is closed by the template's end of turn
      new = list(messages[len(best.messages):])
      return best.ids + list(increment(new, closed=best.finish_reason != "length")), best
    ids = list(render(list(messages)))
    for node in sorted(self.nodes, key=lambda n: -len(n.ids)):
      if len(ids) > len(node.ids) and ids[:len(node.ids)] == node.ids:
        return ids, node
    return ids, None

  def record(self, messages: Sequence[dict], ids: list[int], parent: Node | None,
             choices: Sequence[tuple[Any, dict, str]]) -> list[Node]:
    """Adds a request's answers: per choice (a ``Generated``, the assistant message returned,
    its text). Returns the new nodes."""
    if parent is None:
      self.segments += 1
    base = [normalize(m) for m in messages]
    order = len(self.requests)
    self.requests.append({"prompt_ids": list(ids), "choices": [
        {"ids": list(g.tokens), "logprobs": list(g.logprobs), "policy_version": g.policy_version,
         "finish_reason": g.finish_reason} for g, _, _ in choices]})
    added = []
    for generated, answer, text in choices:
      if parent is None:
        prompt, response, logprobs, policy, mask, turns = list(ids), [], [], [], [], 1
      else:
        parent.extended = True
        between = ids[len(parent.ids):]
        prompt = parent.prompt_tokens
        response = parent.response_tokens + between
        logprobs = parent.logprobs + [0.0] * len(between)
        policy = parent.policy_logprobs + [0.0] * len(between)
        mask = parent.sampled_mask + [False] * len(between)
        turns = parent.turns + 1
      version = generated.policy_version if parent is None else min(parent.policy_version,
                                                                   generated.policy_version)
      node = Node(prompt, response + list(generated.tokens), logprobs + list(generated.logprobs),
                  policy + list(generated.policy_logprobs),
                  mask + [True] * len(generated.tokens), turns, generated.finish_reason,
                  version, tuple(base + [normalize(answer)]), [*messages, answer], text, order)
      self.nodes.append(node)
      added.append(node)
    return added

  def leaves(self) -> list[Node]:
    return [node for node in self.nodes if not node.extended]

  def trajectory(self, choose: Choose = "last") -> Node | None:
    """The trajectory trained on (None when the agent never called the endpoint)."""
    leaves = self.leaves()
    if not leaves:
      return None
    if choose == "last":
      return max(leaves, key=lambda n: (n.order, -self.nodes.index(n)))
    if choose == "longest":
      return max(leaves, key=lambda n: (n.sampled, n.order))
    raise ValueError(f"unknown trajectory choice {choose!r}; choose 'last' or 'longest'")

  def dropped_tokens(self, chosen: Node | None) -> tuple[int, int]:
    """(sampled tokens outside the chosen trajectory, sampled tokens of the episode)."""
    total = sum(len(c["ids"]) for r in self.requests for c in r["choices"])
    return total - (chosen.sampled if chosen is not None else 0), total
