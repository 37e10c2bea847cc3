"""An OpenAI-compatible endpoint on the rollout engine.

    endpoint = Endpoint(engine, tokenizer, params, version=3).start()
    endpoint.base_url                      # http://127.0.0.1:PORT/v1, for any OpenAI client
    endpoint.batcher.serve(until=...)      # the engine runs the requests, in this thread

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, and
``POST /rlx/reward`` (an agent program's episode reward). FastAPI validates nothing by itself
here: each route reads the body (at most ``max_request_bytes``), validates it with
``serve.protocol`` and answers every problem with OpenAI's error JSON and a 4xx status, so
that no request can take the run down. Requests go to a ``Batcher``: whatever many clients
send at once shares the engine's continuous batching. Streaming is refused (a 400 that says
so); ``n`` samples, stop strings, ``seed``, ``logprobs`` (the behaviour log-probs the engine
recorded) with ``top_logprobs`` (one forward pass over the answer, at the temperature it was
sampled at) and ``tool_calls`` are served.

While a run trains, every request carries its episode's key, as the API key (``Authorization:
Bearer KEY``) or as ``X-Episode-Id``; a request for no open episode is refused (401). The
episode's requests are recorded and merged into trajectories (``serve.trajectories``), and
the run's sampling settings replace the request's (the learner computes its log-probs at
them). Served on its own (``python -m rlx.serve``), requests sample as they ask, and the
endpoint is open, or needs ``api_key`` as the bearer token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from rlx.envs.calls import Format, detect_format, turn_stop_ids
from rlx.envs.render import Renderer
from rlx.serve import protocol, streaming
from rlx.serve.batcher import Batcher, Generated, Request, ServingClosed
from rlx.serve.protocol import ApiError
from rlx.serve.trajectories import EpisodeLog

# An over-limit body is drained up to this many bytes so its client reads the 413.


def _fastapi():
  try:
    import fastapi  # noqa: PLC0415 - an optional dependency
    import uvicorn  # noqa: PLC0415
  except ImportError:
    raise ImportError("the OpenAI-compatible endpoint needs FastAPI and uvicorn: "
                      "pip install 'rlx[serve]'") from None
  return fastapi, uvicorn


@functools.partial(jax.jit, static_argnums=0)
def _top_logprobs(transformer, params, tokens, mask, temperature):
  hidden, _ = transformer.hidden_states(params, tokens, mask)
  logprobs = jax.nn.log_softmax(transformer.logits(params, hidden) / temperature, axis=-1)
  return jax.lax.top_k(logprobs, 20)


def seed_key(seed: int) -> jax.Array:
  """The PRNG key of a request's ``seed`` (any 64-bit integer, signed or not)."""
  seed %= 1 << 64
  return jax.random.fold_in(jax.random.key(seed & 0xFFFFFFFF), seed >> 32)


def is_loopback(host: str) -> bool:
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


@dataclasses.dataclass(frozen=True)
class Forced:
  """Sampling settings that replace a request's (a training run's)."""

  temperature: float
  top_p: float
  top_k: int
  max_tokens: int


class Endpoint:
  """The HTTP server, its batcher, and the episodes open on it (see the module docstring).

  Args:
    engine, tokenizer, params, version: what samples.
    host, port: where to listen (port 0: a free one). A host that is not a loopback address
      needs ``api_key`` unless ``episodes`` (each episode's key is then its secret).
    api_key: the bearer token every request must carry (standalone serving).
    model_name: the ``model`` requests must name.
    tool_format: how the model writes tool calls (None: from the tokenizer).
    max_tokens: the most tokens one choice may sample (larger requests are capped).
    max_n: the most choices one request may ask for.
    max_request_bytes: larger bodies get 413.
    forced: sampling settings that replace the requests' (training); None: as they ask.
    episodes: record requests per episode key (training); requests for another key get 401.
    seed: the PRNG seed of requests that name none.
  """

  def __init__(self, engine, tokenizer, params, *, version: int = 0, host: str = "127.0.0.1",
               port: int = 0, api_key: str | None = None, model_name: str = "policy",
               tool_format: Format | None = None, max_tokens: int | None = None,
               max_n: int = 16, max_request_bytes: int = 4 << 20, forced: Forced | None = None,
               episodes: bool = False, seed: int = 0):
    if not is_loopback(host) and not api_key and not episodes:
      raise ValueError(f"serving on {host}, which other machines can reach, needs an API key "
                       "(--api-key); or bind to 127.0.0.1")
    self.engine, self.tokenizer = engine, tokenizer
    self.batcher = Batcher(engine, params, version=version, decode=self._decode_all)
    self.host, self.port, self.api_key, self.model_name = host, port, api_key, model_name
    self.format = tool_format or detect_format(tokenizer)
    self.stop_ids = turn_stop_ids(tokenizer, self.format)
    self.max_tokens = max_tokens or engine.max_len - 1
    self.max_n, self.max_request_bytes, self.forced = max_n, max_request_bytes, forced
    self.recording = episodes
    self.episodes: dict[str, EpisodeLog] = {}
    self.lock = threading.Lock()
    self.in_use = threading.Lock()
    """Held by whoever runs the batcher (``Batcher.serve`` runs in one thread at a time)."""
    self.base_key = jax.random.key(seed)
    self.counter = 0
    self.counts = {"requests": 0, "errors": 0, "history_rewrites": 0, "disconnected": 0}
    self.server = None
    self.thread: threading.Thread | None = None

  # --- lifecycle -------------------------------------------------------------------------------

  def start(self, timeout_s: float = 30.0) -> Endpoint:
    fastapi, uvicorn = _fastapi()
    del fastapi
    family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((self.host, self.port))
    self.port = sock.getsockname()[1]
    config = uvicorn.Config(self.app(), log_level="warning", access_log=False, lifespan="off",
                            timeout_keep_alive=30)
    self.server = uvicorn.Server(config)
    self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                   name="rlx-endpoint", daemon=True)
    self.thread.start()
    deadline = time.monotonic() + timeout_s
    while not self.server.started:
      if not self.thread.is_alive() or time.monotonic() > deadline:
        raise RuntimeError(f"the endpoint did not start on {self.host}:{self.port}")
      time.sleep(0.01)
    return self

  @property
  def base_url(self) -> str:
    host = f"[{self.host}]" if ":" in self.host else self.host
    return f"http://{host}:{self.port}/v1"

  def stop(self) -> None:
    self.batcher.close()
    if self.server is not None:
      self.server.should_exit = True
      self.thread.join(timeout=10)
      self.server = None

  def open(self, logs: Sequence[EpisodeLog]) -> None:
    with self.lock:
      self.episodes.update({log.key: log for log in logs})

  def close(self, logs: Sequence[EpisodeLog]) -> None:
    with self.lock:
      for log in logs:
        self.episodes.pop(log.key, None)

  # --- helpers ---------------------------------------------------------------------------------

  def _decode_all(self, ids) -> str:
    return self.tokenizer.decode(ids)

  def _episode(self, headers) -> EpisodeLog | None:
    """The request's episode (training), after checking its key; None when not recording."""
    auth = headers.get("authorization", "")
    bearer = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
    if not self.recording:
      if self.api_key and bearer != self.api_key:
        raise ApiError(401, "invalid API key: pass the endpoint's key as the bearer token",
                       kind="authentication_error", code="invalid_api_key")
      return None
    key = headers.get("x-episode-id") or bearer
    with self.lock:
      log = self.episodes.get(key)
    if log is None:
      raise ApiError(401, "no open episode has this key (the client's api_key, or the "
                     "X-Episode-Id header); its episode may have ended or timed out",
                     kind="authentication_error", code="invalid_api_key")
    return log

  def _check_model(self, request) -> None:
    if request.model != self.model_name:
      raise ApiError(404, f"the model {request.model!r} does not exist; this endpoint serves "
                     f"{self.model_name!r}", param="model", code="model_not_found")
    if request.n > self.max_n:
      raise ApiError(400, f"n={request.n} is more than this endpoint's {self.max_n}", param="n")

  def _requests(self, request, prompt: list[int], max_tokens: int | None,
                log: EpisodeLog | None) -> list[Request]:
    if len(prompt) > self.engine.max_prompt_len:
      raise ApiError(400, f"the prompt is {len(prompt)} tokens; this endpoint takes at most "
                     f"{self.engine.max_prompt_len}", param="messages",
                     code="context_length_exceeded")
    limit = min(self.max_tokens, self.engine.max_len - len(prompt))
    if self.forced is not None:
      f = self.forced
      temperature, top_p, top_k, limit = f.temperature, f.top_p, f.top_k, min(limit, f.max_tokens)
    else:
      temperature = 1.0 if request.temperature is None else request.temperature
      top_p = 1.0 if request.top_p is None else request.top_p
      top_k = request.top_k or 0
      top_k = 0 if top_k < 0 or top_k >= self.engine.transformer.arch.vocab_size else top_k
    if log is not None and log.seed_key is not None:
      with self.lock:  # requests an agent sends at once draw apart
        log.asked += 1
        base = jax.random.fold_in(log.seed_key, log.asked - 1)
    elif request.seed is not None:
      base = seed_key(request.seed)
    else:
      with self.lock:
        self.counter += 1
        base = jax.random.fold_in(self.base_key, self.counter)
    # stop strings are matched on the text (a stop "n" ends "and" too), never as token ids
    wanted = limit if max_tokens is None else min(max_tokens, limit)
    return [Request(prompt=prompt, max_tokens=max(wanted, 1), key=jax.random.fold_in(base, c),
                    temperature=temperature, top_p=top_p, top_k=top_k,
                    stop_ids=tuple(self.stop_ids), stop_texts=tuple(request.stop or ()))
            for c in range(request.n)]

  async def _run(self, requests: list[Request]) -> list[Generated]:
    try:
      futures = [self.batcher.submit(r) for r in requests]
    except ValueError as error:
      raise ApiError(400, str(error)) from None
    except ServingClosed as error:
      raise ApiError(503, f"not serving: {error}", kind="server_error") from None
    try:
      return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
    except ServingClosed as error:
      raise ApiError(503, f"not serving: {error}", kind="server_error") from None
    except asyncio.CancelledError:  # the client went away: its slots go to other requests
      for future in futures:
        self.batcher.abandon(future)
      raise

  def _text(self, generated: Generated) -> str:
    text = self.tokenizer.decode(generated.tokens)
    if generated.stop_text is not None:
      text = text.split(generated.stop_text, 1)[0]
    return text

  def _decode_one(self, token: int) -> str:
    return self.tokenizer.decode([token], skip_special_tokens=False)

  def _alternatives(self, prompt: list[int], tokens: list[int], temperature: float):
    """The most likely tokens (log-probs [L, 20] and ids) at each sampled position, under the
    distribution it was drawn from (temperature 0: the policy's): one forward pass over the
    prompt and the answer."""
    sequence = list(prompt) + list(tokens)
    length = 16
    while length < len(sequence):
      length *= 2
    ids = np.zeros((1, length), np.int32)
    ids[0, :len(sequence)] = sequence
    mask = np.arange(length)[None] < len(sequence)
    values, top = _top_logprobs(self.engine.transformer, self.batcher.params, ids, mask,
                                np.float32(temperature or 1.0))
    rows = slice(len(prompt) - 1, len(sequence) - 1)
    return np.asarray(values[0, rows]), np.asarray(top[0, rows])

  # --- routes ----------------------------------------------------------------------------------

  def _renderer(self, tools) -> Renderer:
    return Renderer(self.tokenizer, self.format, [t for t in tools or ()])

  def _render_whole(self, renderer: Renderer, messages: list[dict]) -> list[int]:
    if renderer.templated:
      kwargs = {"tools": renderer.tools} if renderer.tools else {}
      text = self.tokenizer.render_chat(protocol.template_messages(messages), True, **kwargs)
      return self.tokenizer.encode(text, add_special_tokens=False)
    return self.tokenizer.encode(protocol.builtin_text(messages, self.tokenizer.eos_token or ""))

  async def chat(self, body, headers) -> dict:
    request = protocol.validate(protocol.ChatRequest, body)
    self._check_model(request)
    if request.top_logprobs and not request.logprobs:
      raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    log = self._episode(headers)
    messages = request.plain_messages()
    tools = request.plain_tools()
    renderer = self._renderer(tools if request.tool_choice != "none" else [])
    try:
      if log is not None:
        with self.lock:
          prompt, parent = log.prompt(messages, renderer.increment,
                                      lambda m: self._render_whole(renderer, m))
      else:
        prompt, parent = self._render_whole(renderer, messages), None
    except (ValueError, TypeError) as error:  # the template refused these messages
      raise ApiError(400, f"cannot render these messages: {error}", param="messages") from None
    requests_made = self._requests(request, prompt,
                                   request.max_completion_tokens or request.max_tokens, log)
    generated = await self._run(requests_made)
    choices, answers = [], []
    for index, g in enumerate(generated):
      text = self._text(g)
      calls = (protocol.tool_calls_in(text, self.format, tools)
               if tools and request.tool_choice != "none" else None)
      message = {"role": "assistant", "content": text}
      finish = g.finish_reason
      if calls is not None:
        message = {"role": "assistant", "content": calls[0], "tool_calls": calls[1]}
        finish = "tool_calls"
      if log is not None and tools:
        if calls is not None:
          log.tool_calls += len(calls[1])
        elif protocol.opens_call(text, self.format):
          log.malformed_calls += 1
      choice = {"index": index, "message": message, "finish_reason": finish, "logprobs": None}
      if request.logprobs:
        content = protocol.token_logprobs(self._decode_one, g.tokens, g.logprobs)
        if request.top_logprobs:
          values, ids = await asyncio.to_thread(self._alternatives, prompt, g.tokens,
                                                requests_made[index].temperature)
          for entry, row_values, row_ids in zip(content, values, ids):
            entry["top_logprobs"] = [
                {"token": (text := self._decode_one(int(t))), "logprob": float(v),
                 "bytes": list(text.encode())}
                for v, t in zip(row_values[:request.top_logprobs], row_ids)]
        choice["logprobs"] = {"content": content}
      choices.append(choice)
      answers.append((g, message, text))
    if log is not None:
      with self.lock:
        if parent is None and log.segments:
          self.counts["history_rewrites"] += 1
        log.record(messages, prompt, parent, answers)
    response = protocol.response("chat.completion", self.model_name, choices, len(prompt),
                                 sum(len(g.tokens) for g in generated))
    if not request.stream:
      return response
    return streaming.chat(response, answers, request, self._decode_all)

  async def completions(self, body, headers) -> dict:
    request = protocol.validate(protocol.CompletionRequest, body)
    self._check_model(request)
    if request.logprobs:
      raise ApiError(400, "logprobs (top alternatives) is not supported; pass "
                     "return_token_ids=true for the ids, or use chat with logprobs=true",
                     param="logprobs")
    log = self._episode(headers)
    if isinstance(request.prompt, str):
      prompt = self.tokenizer.encode(request.prompt)
    else:
      # the model's vocabulary, which may be larger than the tokenizer's (padded): every id
      # the engine samples can be sent back
      vocab = self.engine.transformer.arch.vocab_size
      if any(not 0 <= t < vocab for t in request.prompt):
        raise ApiError(400, f"prompt ids must be in 0..{vocab - 1}", param="prompt")
      prompt = list(request.prompt)
    generated = await self._run(self._requests(request, prompt, request.max_tokens or 16, log))
    choices = []
    for index, g in enumerate(generated):
      text = self._text(g)
      choice = {"index": index, "text": (self.tokenizer.decode(prompt) if request.echo else "")
                + text, "finish_reason": g.finish_reason, "logprobs": None}
      if request.return_token_ids:
        choice["token_ids"], choice["token_logprobs"] = list(g.tokens), list(g.logprobs)
      choices.append(choice)
    if log is not None:  # token in, token out: a trajectory of raw ids
      with self.lock:
        parent = next((n for n in sorted(log.nodes, key=lambda n: -len(n.ids))
                       if len(prompt) > len(n.ids) and prompt[:len(n.ids)] == n.ids), None)
        if parent is None and log.segments:
          self.counts["history_rewrites"] += 1
        log.record([], prompt, parent, [(g, {"role": "assistant", "content": c["text"]},
                                         c["text"]) for g, c in zip(generated, choices)])
    response = protocol.response("text_completion", self.model_name, choices, len(prompt),
                                            sum(len(g.tokens) for g in generated))
    if request.return_token_ids:
      response["prompt_token_ids"] = prompt
    if not request.stream:
      return response
    return streaming.completion(response, generated, [self._text(g) for g in generated],
                                request, self._decode_all,
                                self.tokenizer.decode(prompt) if request.echo else "")

  def reward(self, body, headers) -> dict:
    log = self._episode(headers)
    if log is None:
      raise ApiError(404, "rewards are posted to a training run's endpoint")
    if not isinstance(body, dict) or not isinstance(body.get("reward"), (int, float)) or (
        isinstance(body.get("reward"), bool)):
      raise ApiError(400, 'post {"reward": <number>} (and optionally "correct": true/false)',
                     param="reward")
    with self.lock:
      log.posted = {"reward": float(body["reward"]), "correct": body.get("correct")}
    return {"ok": True}

  def models(self, body, headers) -> dict:
    del body
    self._episode(headers)
    return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                        "owned_by": "rlx"}]}

  def app(self):
    """The FastAPI application."""
    fastapi, _ = _fastapi()
    from fastapi.responses import JSONResponse, Response, StreamingResponse  # noqa: PLC0415

    app = fastapi.FastAPI(title="rlx", docs_url=None, redoc_url=None, openapi_url=None)
    endpoint = self

    def answer(handler: Callable, body: bool = True):
      async def route(request):
        endpoint.counts["requests"] += 1
        try:
          result = handler(await protocol.read_body(request, endpoint.max_request_bytes)
                           if body else None, request.headers)
          if asyncio.iscoroutine(result):
            # a client that hangs up while its answer is sampled frees the engine's slots
            result = await protocol.unless_gone(result, request)
            if result is protocol.GONE:
              endpoint.counts["disconnected"] += 1
              return Response(status_code=499)  # nobody reads it
          if isinstance(result, streaming.Stream):
            return StreamingResponse(streaming.events(result), media_type="text/event-stream")
          return JSONResponse(result)
        except ApiError as error:
          endpoint.counts["errors"] += 1
          return JSONResponse(error.body(), status_code=error.status)
        except Exception as error:  # noqa: BLE001 - a request never takes the server down
          endpoint.counts["errors"] += 1
          logging.getLogger("rlx.serve").exception("request failed")
          return JSONResponse(ApiError(500, f"internal error: {type(error).__name__}: {error}",
                                       kind="server_error").body(), status_code=500)
      # the annotation FastAPI reads to pass the raw request
      route.__signature__ = inspect.Signature([inspect.Parameter(
          "request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=fastapi.Request)])
      return route

    app.add_api_route("/v1/chat/completions", answer(self.chat), methods=["POST"])
    app.add_api_route("/v1/completions", answer(self.completions), methods=["POST"])
    app.add_api_route("/rlx/reward", answer(self.reward), methods=["POST"])

    app.add_api_route("/v1/models", answer(self.models, body=False), methods=["GET"])

    @app.exception_handler(404)
    async def not_found(request, exc):
      del exc
      return JSONResponse(ApiError(404, f"no route {request.method} {request.url.path}").body(),
                          status_code=404)

    @app.exception_handler(405)
    async def not_allowed(request, exc):
      del exc
      return JSONResponse(ApiError(405, f"{request.method} is not allowed on "
                                   f"{request.url.path}").body(), status_code=405)

    return app
