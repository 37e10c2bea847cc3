"""The endpoint driven by the official ``openai`` client: chat, n > 1, logprobs, stop strings,
seeds, completions with token ids in and out, tool calls, episode keys and trajectory merging;
and a suite of malformed requests that leave it answering."""

import concurrent.futures
import json
import socket
import threading
import time
import urllib.request

import jax
import openai
import pytest

from rlx.config import ArchConfig
from rlx.models import init_model
from rlx.models.tokenizer import builtin_tokenizer
from rlx.rollout.engine import Engine
from rlx.serve.batcher import Generated
from rlx.serve.endpoint import Endpoint, Forced
from rlx.serve.trajectories import EpisodeLog

TOKENIZER = builtin_tokenizer()
# a vocabulary padded past the tokenizer's, as real checkpoints' often are
ARCH = ArchConfig(num_layers=1, vocab_size=TOKENIZER.vocab_size + 24, hidden_size=32,
                  intermediate_size=48, num_heads=2, num_kv_heads=1, head_dim=16,
                  eos_token_ids=TOKENIZER.eos_ids)
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluates an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}


@pytest.fixture(scope="module")
def served():
  model = init_model(ARCH, jax.random.key(0))
  engine = Engine(model.transformer, max_slots=4, max_len=96, max_prompt_len=64, decode_steps=8)
  endpoint = Endpoint(engine, TOKENIZER, model.params, max_n=4, max_tokens=24,
                      max_request_bytes=1 << 20).start()
  stop = threading.Event()
  thread = threading.Thread(target=endpoint.batcher.serve, args=(stop.is_set,), daemon=True)
  thread.start()
  yield endpoint
  stop.set()
  thread.join()
  endpoint.stop()


def _client(endpoint, key="none"):
  return openai.OpenAI(base_url=endpoint.base_url, api_key=key, max_retries=0, timeout=60)


def test_chat_n_logprobs_seed_and_usage(served):
  client = _client(served)
  asked = dict(model="policy", messages=[{"role": "user", "content": "What is 2*3?"}],
               max_tokens=12, n=3, logprobs=True, seed=5, temperature=1.0)
  first, again = client.chat.completions.create(**asked), client.chat.completions.create(**asked)
  assert len(first.choices) == 3 and [c.index for c in first.choices] == [0, 1, 2]
  assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
  assert len({c.message.content for c in first.choices}) > 1  # the choices draw apart
  for choice in first.choices:
    assert choice.finish_reason in ("stop", "length")
    assert all(t.logprob <= 0 for t in choice.logprobs.content) and choice.logprobs.content
  assert first.usage.prompt_tokens == len(TOKENIZER.encode("What is 2*3?"))
  top = client.chat.completions.create(**dict(asked, n=1, top_logprobs=3)).choices[0]
  for token, sampled in zip(top.logprobs.content, first.choices[0].logprobs.content):
    # the alternatives come from a forward pass; the sampled token's log-prob from the engine
    assert len(token.top_logprobs) == 3 and token.logprob == sampled.logprob
    alternatives = [alt.logprob for alt in token.top_logprobs]
    assert alternatives == sorted(alternatives, reverse=True)
    assert alternatives[0] >= token.logprob - 1e-4
    if token.token in [alt.token for alt in token.top_logprobs]:
      match = next(a for a in token.top_logprobs if a.token == token.token)
      assert abs(match.logprob - token.logprob) < 1e-4
  assert first.usage.completion_tokens == sum(len(c.logprobs.content) for c in first.choices)
  assert client.models.list().data[0].id == "policy"


def test_streamed_answers_are_the_unstreamed_ones_token_by_token(served):
  client = _client(served)
  asked = dict(model="policy", messages=[{"role": "user", "content": "What is 2*3?"}],
               max_tokens=12, n=2, logprobs=True, seed=9, temperature=1.0)
  whole = client.chat.completions.create(**asked)
  chunks = list(client.chat.completions.create(**asked, stream=True,
                                               stream_options={"include_usage": True}))
  for choice in whole.choices:
    mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
    assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == choice.finish_reason
    tokens = [c for c in mine if c.logprobs is not None]  # one chunk per sampled token
    assert "".join(c.delta.content or "" for c in mine) == choice.message.content
    assert [e.logprob for c in tokens for e in c.logprobs.content] == [
        e.logprob for e in choice.logprobs.content]
  assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == (
      whole.usage.completion_tokens)
  # completions stream their token ids, the same as unstreamed
  plain = client.completions.create(model="policy", prompt=[9, 10], max_tokens=10, seed=4,
                                    extra_body={"return_token_ids": True})
  streamed = list(client.completions.create(model="policy", prompt=[9, 10], max_tokens=10,
                                            seed=4, stream=True,
                                            extra_body={"return_token_ids": True}))
  pieces = [c.choices[0] for c in streamed]
  assert "".join(p.text for p in pieces) == plain.choices[0].text
  assert [t for p in pieces for t in (p.model_extra or {}).get("token_ids") or []] == (
      plain.choices[0].model_extra["token_ids"])


def test_the_model_must_exist(served):
  client = _client(served)
  with pytest.raises(openai.NotFoundError, match="does not exist"):
    client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])


def test_completions_token_ids_in_and_out_and_stop_strings(served):
  client = _client(served)
  ids = TOKENIZER.encode("12+7=")
  out = client.completions.create(model="policy", prompt=ids, max_tokens=10, seed=1,
                                  extra_body={"return_token_ids": True})
  choice = out.choices[0].model_dump()
  assert TOKENIZER.decode(choice["token_ids"]) == out.choices[0].text
  assert out.model_dump()["prompt_token_ids"] == ids
  text = out.choices[0].text
  if len(text) >= 3:  # a stop string cut from the text; the same draws up to it
    stop = text[1:3]
    cut = client.completions.create(model="policy", prompt=ids, max_tokens=10, seed=1, stop=[stop])
    assert cut.choices[0].text == text.split(stop, 1)[0] and cut.choices[0].finish_reason == "stop"


def test_api_key_is_required_off_loopback():
  with pytest.raises(ValueError, match="needs an API key"):
    Endpoint(Engine(init_model(ARCH, jax.random.key(0)).transformer, max_slots=1, max_len=16,
                    max_prompt_len=8), TOKENIZER, None, host="0.0.0.0")


def _post(endpoint, route, data: bytes, headers=None):
  request = urllib.request.Request(endpoint.base_url.removesuffix("/v1") + route, data=data,
                                   headers={"Content-Type": "application/json", **(headers or {})})
  try:
    with urllib.request.urlopen(request, timeout=60) as response:
      return response.status, json.loads(response.read())
  except urllib.error.HTTPError as error:
    return error.code, json.loads(error.read())


def _chat(**fields):
  return json.dumps({"model": "policy", "messages": [{"role": "user", "content": "x"}],
                     **fields}).encode()


def _with(message: dict):
  return json.dumps({"model": "policy", "messages": [message]}).encode()


def _complete(**fields):
  return json.dumps({"model": "policy", "prompt": [9, 10], **fields}).encode()


def _tools(tools, **fields):
  return _chat(tools=tools, **fields)


USER = {"role": "user", "content": "x"}
NESTED = b"[" * 100_000 + b"]" * 100_000
MALFORMED = [
    # the body
    (b"{not json", 400), (b"[1, 2]", 400), (b'"hi"', 400), (b"null", 400), (b"", 400),
    (b'{"model": "policy", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
     400),
    (b'{"model": "policy", "messages": [{"role": "user", "content": "x"}], "top_p": Infinity}',
     400),
    (NESTED, 400),
    (b'{"model": "policy", "messages": [{"role": "user", "content": "x"}], "metadata": '
     + NESTED + b"}", 400),
    (b"\xff\xfe{}", 400),
    (json.dumps({"model": "policy", "messages": [{"role": "user", "content": "x" * (16 << 20)}]}
                ).encode(), 413),
    # the model and the messages
    (json.dumps({"messages": [USER]}).encode(), 400),
    (json.dumps({"model": 5, "messages": [USER]}).encode(), 400),
    (json.dumps({"model": "nobody", "messages": [USER]}).encode(), 404),
    (json.dumps({"model": "policy"}).encode(), 400),
    (json.dumps({"model": "policy", "messages": "hi"}).encode(), 400),
    (json.dumps({"model": "policy", "messages": []}).encode(), 400),
    (json.dumps({"model": "policy", "messages": [5]}).encode(), 400),
    (json.dumps({"model": "policy", "messages": [None]}).encode(), 400),
    (_with({"role": "wizard", "content": "x"}), 400),
    (_with({"content": "x"}), 400),
    (_with({"role": "user", "content": 5}), 400),
    (_with({"role": "user"}), 400),
    (_with({"role": "system", "content": None}), 400),
    (_with({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}), 400),
    (_with({"role": "user", "content": [{"type": "text", "text": 5}]}), 400),
    (_with({"role": "user", "content": ["x"]}), 400),
    (_with({"role": "tool", "content": "6"}), 400),
    (_with({"role": "assistant"}), 400),
    (_with({"role": "assistant", "tool_calls": "x"}), 400),
    (_with({"role": "assistant", "tool_calls": [5]}), 400),
    (_with({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}),
     400),
    (_with({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}), 400),
    (_with({"role": "user", "content": "x", "tool_calls": [
        {"function": {"name": "f", "arguments": "{}"}}]}), 400),
    (_with({"role": "user", "content": "x", "name": 5}), 400),
    (json.dumps({"model": "policy", "messages": [{"role": "user", "content": "x" * 300}]}).encode(),
     400),
    # sampling
    (_chat(temperature="hot"), 400), (_chat(temperature=3), 400), (_chat(temperature=-1), 400),
    (_chat(temperature=True), 400), (_chat(top_p=0), 400), (_chat(top_p=1.5), 400),
    (_chat(top_p="x"), 400), (_chat(top_k="abc"), 400), (_chat(top_k=-2), 400),
    (_chat(top_k=1.5), 400), (_chat(top_k=[3]), 400),
    (_chat(n=10 ** 6), 400), (_chat(n=0), 400), (_chat(n="2"), 400), (_chat(n=True), 400),
    (_chat(n=None), 400), (_chat(max_tokens=-3), 400), (_chat(max_tokens=0), 400),
    (_chat(max_tokens="10"), 400), (_chat(max_tokens=2.5), 400),
    (_chat(max_completion_tokens=0), 400), (_chat(seed=2 ** 70), 400), (_chat(seed=-(2 ** 64)), 400),
    (_chat(seed="1"), 400), (_chat(seed=1.5), 400), (_chat(stop=5), 400), (_chat(stop=[""]), 400),
    (_chat(stop=["a", "b", "c", "d", "e"]), 400), (_chat(stop=[1]), 400),
    (_chat(stream="yes"), 400), (_chat(logprobs="yes"), 400),
    (_chat(logprobs=True, top_logprobs=21), 400), (_chat(top_logprobs=2), 400),
    # tools
    (_tools("x"), 400), (_tools([5]), 400), (_tools([{"type": "function", "function": "calc"}]), 400),
    (_tools([{"type": "function", "function": {"name": "c", "parameters": "x"}}]), 400),
    (_tools([{"type": "function", "function": {"name": "c", "parameters": [1]}}]), 400),
    (_tools([{"type": "function", "function": {"name": ""}}]), 400),
    (_tools([{"type": "function", "function": {"name": 5}}]), 400),
    (_tools([{"type": "function", "function": {"name": "c", "description": 5}}]), 400),
    (_tools([{"type": "retrieval", "function": {"name": "c"}}]), 400),
    (_tools([{"type": "function"}]), 400),
    (_chat(tool_choice="sometimes"), 400),
    (_chat(tool_choice={"type": "function", "function": {"name": "nope"}}), 400),
    (_chat(tool_choice=5), 400),
    # token ids in
    (_complete(prompt=[10 ** 9]), 400), (_complete(prompt=[-1]), 400), (_complete(prompt=[]), 400),
    (_complete(prompt=""), 400), (_complete(prompt=5), 400), (_complete(prompt=["a"]), 400),
    (_complete(prompt=[1.5]), 400), (_complete(prompt=[True]), 400), (_complete(prompt=None), 400),
    (_complete(prompt=[2 ** 40]), 400), (_complete(logprobs=3), 400), (_complete(echo="yes"), 400),
    (_complete(return_token_ids=1), 400), (_complete(max_tokens=[1]), 400),
]


def _serves(endpoint):
  """One token sampled: the engine's thread still runs."""
  code, answer = _post(endpoint, "/v1/completions", _complete(max_tokens=1))
  return code == 200 and len(answer["choices"]) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_hangs_up_frees_its_request(stream):
  model = init_model(ARCH, jax.random.key(0))
  engine = Engine(model.transformer, max_slots=1, max_len=64, max_prompt_len=16, decode_steps=4)
  endpoint = Endpoint(engine, TOKENIZER, model.params, max_tokens=40).start()
  try:
    body = _complete(max_tokens=40, stream=stream)
    host, port = endpoint.base_url.removeprefix("http://").removesuffix("/v1").split(":")
    with socket.create_connection((host, int(port))) as connection:
      connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
      deadline = time.monotonic() + 30
      while endpoint.batcher.inbox.empty() and time.monotonic() < deadline:
        time.sleep(0.02)  # the request is queued (no engine thread serves yet)
    # hung up before an answer: the request is dropped from the queue, never decoded
    while endpoint.counts["disconnected"] == 0 and time.monotonic() < deadline:
      time.sleep(0.05)
    assert endpoint.counts["disconnected"] == 1 and endpoint.batcher.stats["abandoned"] == 1
    endpoint.batcher.serve(until=lambda: True)
    assert endpoint.batcher.stats["requests"] == 0
  finally:
    endpoint.stop()


def test_malformed_requests_get_openai_errors_and_the_server_keeps_answering(served):
  assert len(MALFORMED) >= 60
  for body, status in MALFORMED:
    route = "/v1/completions" if body.startswith(b'{"model": "policy", "prompt"') else (
        "/v1/chat/completions")
    code, answer = _post(served, route, body)
    assert code == status, (body[:120], answer)
    assert set(answer["error"]) >= {"message", "type", "param", "code"}
    assert answer["error"]["message"] and answer["error"]["type"] == "invalid_request_error"
    assert _serves(served), body[:120]
  assert served.batcher.closed is None
  code, answer = _post(served, "/v1/nowhere", b"{}")
  assert code == 404 and "error" in answer
  # a huge max_tokens is capped at the endpoint's limit, and it still answers
  huge = _client(served).chat.completions.create(
      model="policy", messages=[{"role": "user", "content": "x"}], max_tokens=10 ** 9)
  assert huge.usage.completion_tokens <= 24


def test_out_of_range_values_that_mean_something_are_served(served):
  # top_k past the vocabulary (or 2**31, which took the server down) samples from all of it;
  # any 64-bit seed draws, and the same seed draws the same
  def ids(**fields):
    code, answer = _post(served, "/v1/completions",
                         _complete(**{"max_tokens": 8, "seed": 3, "return_token_ids": True, **fields}))
    assert code == 200, answer
    return answer["choices"][0]["token_ids"]

  assert ids(top_k=2 ** 31) == ids(top_k=2 ** 62) == ids(top_k=-1) == ids(top_k=0) == ids()
  assert ids(seed=2 ** 64 - 1) == ids(seed=2 ** 64 - 1) and ids(seed=-(2 ** 63))
  tools = [{"type": "function", "function": {"name": "c", "parameters": {"type": "object"}}}]
  code, _ = _post(served, "/v1/chat/completions", _tools(tools, max_tokens=2, tool_choice={
      "type": "function", "function": {"name": "c"}}))
  assert code == 200
  assert _serves(served)


def test_ids_the_model_sampled_go_back_in_and_stop_strings_cut_inside_tokens(served):
  # the model's vocabulary is padded past the tokenizer's: ids it samples there are prompt ids
  # too (token-in/token-out continuation); a stop string ends an answer wherever its characters
  # fall, inside a token of several characters too
  padded, inside = False, False
  for seed in range(40):
    code, answer = _post(served, "/v1/completions",
                         _complete(max_tokens=16, seed=seed, return_token_ids=True))
    sampled = answer["choices"][0]["token_ids"]
    if any(t >= TOKENIZER.vocab_size for t in sampled):
      code, again = _post(served, "/v1/completions", _complete(prompt=[9, 10] + sampled,
                                                               max_tokens=2))
      assert code == 200, again
      padded = True
    long = [t for t in sampled if len(TOKENIZER.decode([t])) > 1]
    if long and not inside:
      piece = TOKENIZER.decode([long[0]])
      stop = piece[1]
      text = answer["choices"][0]["text"]
      code, cut = _post(served, "/v1/completions", _complete(max_tokens=16, seed=seed, stop=[stop]))
      assert code == 200 and cut["choices"][0]["finish_reason"] == "stop", cut
      assert cut["choices"][0]["text"] == text.split(stop, 1)[0]
      inside = True
    if padded and inside:
      break
  assert padded and inside


class _Scripted:
  """A batcher that answers with scripted texts (no model), recording the prompts it got."""

  def __init__(self, texts):
    self.texts, self.prompts = list(texts), []

  def submit(self, request):
    self.prompts.append(request.prompt)
    ids = TOKENIZER.encode(self.texts.pop(0), add_special_tokens=False)
    future = concurrent.futures.Future()
    future.set_result(Generated(ids, [-0.5] * len(ids), [-0.4] * len(ids), "stop", 7))
    return future

  def close(self):
    pass


@pytest.fixture
def scripted():
  model = init_model(ARCH, jax.random.key(0))
  engine = Engine(model.transformer, max_slots=2, max_len=96, max_prompt_len=64)
  endpoint = Endpoint(engine, TOKENIZER, model.params, episodes=True,
                      forced=Forced(temperature=1.0, top_p=1.0, top_k=0, max_tokens=32)).start()
  yield endpoint
  endpoint.stop()


def test_tool_calls_and_merged_trajectory(scripted):
  scripted.batcher = _Scripted(['<call>calculator("2*3")</call>', "<answer>6</answer><|eos|>",
                               "<answer>5</answer><|eos|>"])
  log = EpisodeLog("episode-1", row={}, seed_key=jax.random.key(0))
  scripted.open([log])
  client = _client(scripted, key="episode-1")
  messages = [{"role": "user", "content": "What is 2*3?"}]
  first = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
  choice = first.choices[0]
  assert choice.finish_reason == "tool_calls"
  call = choice.message.tool_calls[0]
  assert call.function.name == "calculator"
  assert json.loads(call.function.arguments) == {"expression": "2*3"}
  messages += [choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "6"}]
  second = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
  assert second.choices[0].message.content == "<answer>6</answer>"
  prompt = TOKENIZER.encode("What is 2*3?")
  call_ids = TOKENIZER.encode('<call>calculator("2*3")</call>', add_special_tokens=False)
  result_ids = TOKENIZER.encode("<result>6</result>", add_special_tokens=False)
  assert scripted.batcher.prompts == [prompt, prompt + call_ids + result_ids]
  node = log.trajectory("last")
  answer_ids = TOKENIZER.encode("<answer>6</answer><|eos|>", add_special_tokens=False)
  assert node.prompt_tokens == prompt and node.turns == 2 and log.segments == 1
  assert node.response_tokens == call_ids + result_ids + answer_ids
  assert node.sampled_mask == [True] * len(call_ids) + [False] * len(result_ids) + [True] * len(answer_ids)
  assert node.logprobs[:len(call_ids)] == [-0.5] * len(call_ids) and node.policy_version == 7
  # a rewritten history starts a new segment; another key is refused
  client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "2*3?"}])
  assert log.segments == 2 and len(log.leaves()) == 2
  with pytest.raises(openai.AuthenticationError, match="no open episode"):
    _client(scripted, key="someone-else").chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "x"}])
  assert _post(scripted, "/rlx/reward", b'{"reward": 0.5}',
               {"Authorization": "Bearer episode-1"})[0] == 200
  assert log.posted == {"reward": 0.5, "correct": None}
