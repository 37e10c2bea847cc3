"""The episode harness: tool turns answered by the tools, other turns by the environment,
failures as observations, limits, and observations rendered as token increments (built-in
format and a chat template)."""

import random
import re

import pytest

from rlx.envs import Episode, Observation, Renderer, ToolRunner, Toolbox, load_factory
from rlx.envs.builtin import calculator, make_calc
from rlx.models import builtin_tokenizer
from rlx.models.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer():
  return builtin_tokenizer()


def _episode(tokenizer, env, max_turns=3):
  return Episode(env, Renderer(tokenizer, "builtin"), ToolRunner(num_workers=0),
                 Toolbox.of(getattr(env, "tools", ())) if getattr(env, "tools", ()) else None,
                 format="builtin", max_turns=max_turns)


def test_a_tool_turn_is_answered_with_the_result_and_the_answer_ends_it(tokenizer):
  episode = _episode(tokenizer, make_calc({"prompt": "What is 12*34?", "answer": "408"}))
  assert tokenizer.decode(episode.start()) == "What is 12*34?"
  reply = episode.respond('<call>calculator("12*34")</call>', "stop")
  assert not reply.done
  assert tokenizer.decode(reply.tokens, skip_special_tokens=False) == "<result>408</result>"
  assert episode.respond("<answer>408</answer>", "stop").done
  assert episode.counts["tool_calls"] == 1 and episode.turns == 2 and not episode.rewarded
  assert episode.final_text == "<answer>408</answer>"


@pytest.mark.parametrize("text, counted, seen", [
    ('<call>calculator("12**34")</call>', "tool_errors", "error: ValueError"),
    ('<call>search("x")</call>', "tool_errors", "no tool 'search'"),
    ("<call>calculator(12 34)</call>", "malformed_calls", "error: cannot read the call"),
    ('<call>calculator("1", "2")</call>', "malformed_calls", "takes 1 argument"),
])
def test_failed_calls_are_observations_the_model_reads(tokenizer, text, counted, seen):
  episode = _episode(tokenizer, make_calc({"prompt": "q", "answer": "1"}))
  episode.start()
  reply = episode.respond(text, "stop")
  assert not reply.done and episode.counts[counted] == 1
  assert seen in tokenizer.decode(reply.tokens, skip_special_tokens=False)


class Broken:
  def reset(self):
    return [{"role": "user", "content": "hi"}]

  def step(self, text):
    raise KeyError("state")


class Talker:
  def reset(self):
    return [{"role": "user", "content": "hi"}]

  def step(self, text):
    return Observation(messages=[{"role": "user", "content": "more"}], reward=0.5)


def test_limits_and_a_failing_environment_end_episodes_truncated(tokenizer):
  broken = _episode(tokenizer, Broken())
  broken.start()
  reply = broken.respond("x", "stop")
  assert reply.done and reply.truncated and broken.counts["env_errors"] == 1
  assert "KeyError" in broken.error
  talker = _episode(tokenizer, Talker(), max_turns=2)
  talker.start()
  assert not talker.respond("a", "stop").done
  reply = talker.respond("b", "stop")
  assert reply.done and reply.truncated and talker.reward == 1.0 and talker.rewarded
  cut = _episode(tokenizer, Talker())
  cut.start()
  assert cut.respond("a very long turn", "length").truncated


QWEN_LIKE = (
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m.content }}\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_chat_template_increment_continues_after_the_sampled_end_of_turn():
  import tokenizers
  base = builtin_tokenizer()
  base.backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
  templated = Tokenizer(base.backend, eos_token="<|im_end|>", pad_token="<|pad|>",
                        chat_template=QWEN_LIKE)
  del tokenizers
  renderer = Renderer(templated, "qwen")
  messages = [{"role": "user", "content": "q"}]
  prompt = renderer.prompt(messages)
  turn = templated.encode('<tool_call>{"name": "f"}</tool_call><|im_end|>', add_special_tokens=False)
  tool = [{"role": "tool", "content": "42"}]
  increment = renderer.increment(tool)
  full = templated.render_chat(messages + [{"role": "assistant", "content":
                                            '<tool_call>{"name": "f"}</tool_call>'}] + tool, True)
  assert templated.decode(prompt + turn + increment, skip_special_tokens=False) == full
  # a turn cut at its length limit (no <|im_end|> sampled): the increment closes it, so the
  # sequence is again exactly what the template renders
  cut = templated.encode('<tool_call>{"name": "f"}</tool_call>', add_special_tokens=False)
  closing = renderer.increment(tool, closed=False)
  assert templated.decode(prompt + cut + closing, skip_special_tokens=False) == full
  assert closing[:len(turn) - len(cut)] == turn[len(cut):]  # <|im_end|> first


def test_environment_names_are_checked():
  assert load_factory("calc") is make_calc
  with pytest.raises(ValueError, match="unknown environment"):
    load_factory("chess")
  with pytest.raises(ValueError, match="has no function"):
    load_factory("rlx.envs.builtin:nothing")
  assert calculator("2*(3+4)") == "14"


class Says:
  """An environment whose reset and step return what it was given."""

  def __init__(self, first=None, observation=None, raises=None):
    self.first = first if first is not None else [{"role": "user", "content": "hi"}]
    self.observation, self.raises = observation, raises

  def reset(self):
    if self.raises:
      raise self.raises
    return self.first

  def step(self, text):
    return self.observation


@pytest.mark.parametrize("observation, named", [
    (Observation(messages=["not a dict"]), "message 0 as a str"),
    (Observation(messages=[{"role": "user"}]), "without a string role and content"),
    (Observation(messages=[{"role": "user", "content": 3}]), "without a string role"),
    (Observation(messages="hello"), "a str, not a list of messages"),
    (Observation(reward=float("nan"), done=True), "reward is nan, not a finite number"),
    (Observation(reward=float("inf"), done=True), "reward is inf"),
    (Observation(reward="1", done=True), "reward is '1'"),
])
def test_bad_environment_output_ends_its_episode_named_and_counted(tokenizer, observation,
                                                                   named):
  # each once ended the run: an AttributeError in the renderer, or NaN rewards that made every
  # update skip in silence
  episode = _episode(tokenizer, Says(observation=observation))
  episode.start()
  reply = episode.respond("x", "stop")
  assert reply.done and reply.truncated and episode.counts["env_errors"] == 1
  assert named in episode.error and not episode.rewarded


def test_reset_failures_are_named_and_a_huge_observation_is_cut(tokenizer):
  from rlx.envs.episode import EnvError

  for env, named in ((Says(raises=KeyError("row")), "reset() raised KeyError"),
                     (Says(first=[{"role": "user"}]), "reset() returned message 0 without"),
                     (Says(first="hi"), "reset() returned a str")):
    with pytest.raises(EnvError, match=re.escape(named)):
      _episode(tokenizer, env).start()
  huge = Observation(messages=[{"role": "user", "content": "7" * 10_000_000}])
  episode = Episode(Says(observation=huge), Renderer(tokenizer, "builtin"),
                    ToolRunner(num_workers=0), None, format="builtin", max_turns=3,
                    max_observation_chars=100)
  episode.start()
  reply = episode.respond("x", "stop")
  assert not reply.done and len(reply.tokens) < 200
  assert "[cut: 9999900 more characters]" in episode.messages[-1]["content"]


def _templated():
  base = builtin_tokenizer()
  base.backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
  return Tokenizer(base.backend, eos_token="<|im_end|>", pad_token="<|pad|>",
                   chat_template=QWEN_LIKE)


@pytest.mark.parametrize("format", ["builtin", "qwen", "llama"])
def test_a_scripted_warm_up_target_is_what_an_episode_of_the_same_turns_produces(format):
  """The warm-up's ``sft_turns`` (rendered by ``Renderer.scripted``) are token for token the
  sequence an episode produces when the model writes those turns: the call in the run's
  format, the tool's result as the template's increment, untrained."""
  from rlx.data import tasks
  from rlx.envs.calls import ToolCall, bind, parse, write
  tokenizer = builtin_tokenizer() if format == "builtin" else _templated()
  renderer = Renderer(tokenizer, format, Toolbox.of([calculator]).schemas)
  row = next(row for row in map(tasks.TASKS["calc"], map(random.Random, range(50)))
             if "sft_turns" in row)
  script = renderer.scripted(row["sft_turns"])
  assert [trained for _, trained in script] == [True, False, True]
  call = ToolCall("calculator", {"expression": row["prompt"][8:-1]})
  [read] = parse(write(call, format), format)
  assert read.name == call.name and bind(read, ["expression"]) == call.arguments
  episode = Episode(make_calc(row), renderer, ToolRunner(num_workers=0),
                    Toolbox.of([calculator]), format=format, max_turns=3)
  episode.start()
  first = tokenizer.decode([t for t in script[0][0] if t != tokenizer.eos_id])
  reply = episode.respond(first, "stop")
  assert reply.tokens == script[1][0]
  assert row["answer"] in tokenizer.decode(reply.tokens)
  assert script[2][0][-1] == tokenizer.eos_id
  assert episode.respond(tokenizer.decode(script[2][0][:-1]), "stop").done
  assert episode.counts["tool_calls"] == 1 and episode.counts["tool_errors"] == 0
  if format == "builtin":  # the built-in model's warm-up text, as it was written by hand
    a, b = row["prompt"][8:-1].split("*")
    written = [(f'<call>calculator("{a}*{b}")</call>', True),
               (f"<result>{row['answer']}</result>", False),
               (f"<answer>{row['answer']}</answer>", True)]
    expected = [(tokenizer.encode(text, add_special_tokens=False), trained)
                for text, trained in written]
    expected[-1][0].append(tokenizer.eos_id)
    assert script == expected


def test_a_system_prompt_goes_first_in_episodes_that_start_without_one():
  templated = _templated()
  renderer = Renderer(templated, "qwen")
  row = {"prompt": "What is 2*3?", "answer": "6"}
  with_system = Episode(make_calc(row), renderer, ToolRunner(num_workers=0), None, format="qwen",
                        max_turns=2, system="Use the calculator.")
  assert templated.decode(with_system.start(), skip_special_tokens=False) == \
      templated.render_chat([{"role": "system", "content": "Use the calculator."},
                             {"role": "user", "content": "What is 2*3?"}], True)
  assert with_system.messages[0]["role"] == "system"


def test_a_script_must_end_on_the_assistant_s_turn():
  with pytest.raises(ValueError, match="must end on an assistant turn"):
    Renderer(builtin_tokenizer(), "builtin").scripted([{"role": "tool", "content": "1"}])


def test_builtin_calls_parse_on_many_threads_and_odd_text_is_a_malformed_call():
  """Episodes parse turns on worker threads: many at once give each its own call (CPython
  3.11's parser raised SystemError when two parsed at once), and text the parser cannot take
  (a NUL byte, nesting past its depth) is a malformed call, not an error of the run."""
  import concurrent.futures
  from rlx.envs.calls import BUILTIN_CALL, MalformedCall, parse
  opened, closed = BUILTIN_CALL

  def read(i):
    depth = i % 9 * 20  # nested in the parser, not in a string
    text = f"{opened}calculator({'[' * depth}{i}{']' * depth}){closed}"
    value = parse(text, "builtin")[0].arguments["*"][0]
    for _ in range(depth):
      [value] = value
    return value

  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    assert list(pool.map(read, range(3000))) == list(range(3000))
  for odd in ("calculator('1\x00')", "f(" * 500 + ")" * 500, "-" * 100000 + "1",
              "calculator(" + "not " * 100000 + "1)"):
    with pytest.raises(MalformedCall):
      parse(f"{opened}{odd}{closed}", "builtin")
