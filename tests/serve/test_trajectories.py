"""Merging an agent's requests into trajectories (``serve.trajectories.EpisodeLog``), on fake
renderings: continuing by messages, continuing by ids after a re-render, a rewrite starting a
new segment, n > 1 choices as leaves, and which trajectory 'last' and 'longest' choose."""

from rlx.serve.batcher import Generated
from rlx.serve.trajectories import EpisodeLog, normalize


def _render(messages):  # a fake whole rendering: 10 + one id per character of each content
  return [10] + [ord(c) for m in messages for c in (m.get("content") or "")]


def _increment(messages, closed=True):  # what follows an answer: 11, then the new contents
  # (an answer cut at its length limit: its end of turn, 12, first)
  return [11] * closed + [12, 11] * (not closed) + [ord(c) for m in messages
                                                     for c in (m.get("content") or "")]


def _answer(log, messages, *texts, finish="stop"):
  prompt, parent = log.prompt(messages, _increment, _render)
  choices = [(Generated([ord(c) for c in text], [-1.0] * len(text), [-2.0] * len(text), finish, 3),
              {"role": "assistant", "content": text}, text) for text in texts]
  return prompt, parent, log.record(messages, prompt, parent, choices)


def test_a_turn_cut_at_its_length_limit_is_closed_outside_the_loss():
  # once the next request's increment followed the cut turn directly: a conversation without
  # the end-of-turn token the chat template always writes
  log = EpisodeLog("k")
  user = [{"role": "user", "content": "ab"}]
  _, _, (first,) = _answer(log, user, "xy", finish="length")
  again = user + [{"role": "assistant", "content": "xy"}, {"role": "user", "content": "7"}]
  prompt, parent, (second,) = _answer(log, again, "z")
  assert parent is first and prompt == [10, 97, 98, 120, 121, 12, 11, 55]
  assert second.sampled_mask == [True, True, False, False, False, True]


def test_continuing_requests_make_one_trajectory_with_the_sampled_ids_as_they_were():
  log = EpisodeLog("k")
  user = [{"role": "user", "content": "ab"}]
  prompt, parent, (first,) = _answer(log, user, "xy")
  assert prompt == [10, 97, 98] and parent is None
  again = user + [{"role": "assistant", "content": "xy"}, {"role": "tool", "content": "7"}]
  prompt, parent, (second,) = _answer(log, again, "z")
  assert parent is first and prompt == [10, 97, 98, 120, 121, 11, 55]
  assert second.prompt_tokens == [10, 97, 98]
  assert second.response_tokens == [120, 121, 11, 55, 122]
  assert second.sampled_mask == [True, True, False, False, True]
  assert second.logprobs == [-1.0, -1.0, 0.0, 0.0, -1.0] and second.turns == 2
  assert log.segments == 1 and log.leaves() == [second] and log.trajectory("last") is second


def test_a_rewritten_history_starts_a_segment_and_the_choice_decides_what_is_trained():
  log = EpisodeLog("k")
  user = [{"role": "user", "content": "ab"}]
  _, _, (first, other) = _answer(log, user, "long answer", "s")  # n = 2
  # an assistant message the endpoint never gave: no merge by messages; the whole rendering
  # starts with no node's ids either
  _, parent, (summary,) = _answer(log, [{"role": "user", "content": "summary"}], "ok")
  assert parent is None and log.segments == 2
  assert set(map(id, log.leaves())) == {id(first), id(other), id(summary)}
  assert log.trajectory("last") is summary and log.trajectory("longest") is first
  assert log.dropped_tokens(summary) == (len("long answer") + 1, len("long answer") + 1 + 2)


def test_a_rerendered_prompt_that_extends_a_trajectory_continues_it():
  log = EpisodeLog("k")
  _, _, (first,) = _answer(log, [{"role": "user", "content": "ab"}], "c")
  # the agent re-sent the answer with a tool call the endpoint never gave: no match by
  # messages, but the whole rendering starts with the trajectory's ids
  messages = [{"role": "user", "content": "ab"},
              {"role": "assistant", "content": "c", "tool_calls": [
                  {"function": {"name": "f", "arguments": "{}"}}]},
              {"role": "user", "content": "d"}]
  prompt, parent, (second,) = _answer(log, messages, "e")
  assert normalize(messages[1]) != first.messages[-1]
  assert parent is first and prompt == [10, 97, 98, 99, 100]
  assert second.response_tokens == [99, 100, 101]
  assert second.sampled_mask == [True, False, True] and log.segments == 1


def test_an_episode_that_never_asked_has_no_trajectory():
  assert EpisodeLog("k").trajectory("last") is None
