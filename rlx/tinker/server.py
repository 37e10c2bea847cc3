"""The HTTP service the ``tinker`` SDK talks to: sessions, LoRA training clients, sampling
clients, and every call's future.

    service = Service({"HuggingFaceTB/SmolLM2-135M-Instruct": Base.load(...)}, workdir)
    api = rlx.tinker.routes.app(service)   # FastAPI; ``python -m rlx.tinker`` serves it

Every call that computes (``create_model``, ``forward_backward``, ``optim_step``, the weight
saves and loads, ``asample``) is queued and answered at once with a future id; a worker
thread runs the queue in order, so a client's ``forward_backward`` calls land before the
``optim_step`` that follows them, as the SDK expects. Split (``Service(..., split=True)``, where
there are two devices or more): sampling runs beside training, on a device of its own with a
copy of each base's weights, in a lane of the queue with its own worker; training keeps the
first device. Sampling calls are the exception that
keeps the order's meaning: a sampler's weights never change, so the worker takes every queued
sampling call on the same weights with the same settings together and decodes them in one
engine batch (a loop that samples each of a group's responses with its own call, as
tinker-cookbook's environments do, fills the engine's slots instead of decoding one at a time).
``retrieve_future`` waits up to ``queue.POLL_S`` for the result, then asks the SDK to try again
(the queue: ``queue.py``). A failed call's future carries the reason (category ``user`` for bad
input); no adapter changes on a failed call, and the service keeps serving.
"""


import dataclasses
import logging
import pathlib
import secrets
import time
import uuid
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from rlx.config import LoraConfig
from rlx.models import lora
from rlx.tinker import wire
from rlx.tinker.queue import WorkQueue
from rlx.tinker.runs import Runs, check_ttl
from rlx.tinker.training import ATTENTION, LORA_ALPHA, MLP, AdamHyper, Adapter, BadInput, Base

log = logging.getLogger(__name__)

HEARTBEAT_TIMEOUT_S = 600.0
"""A session whose heartbeat stops this long releases its adapters."""
BANK_SIZE = 8
"""Most samplers one decode batch serves together, each slot with its own adapter (a bank's
decode computes every row's product with every adapter's A: the cost grows with the count)."""


@dataclasses.dataclass
class _Session:
  id: str
  beat: float
  adapters: list[str] = dataclasses.field(default_factory=list)
  samplers: list[str] = dataclasses.field(default_factory=list)
  """The sampling sessions created in it."""
  user_metadata: dict | None = None


class Service(WorkQueue):
  """The served base models, the sessions and their adapters; the queue of their calls
  (``WorkQueue``)."""

  def __init__(self, bases: dict[str, Base], workdir: str | pathlib.Path, api_key: str | None = None,
               heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S, split: bool = False):
    self.bases, self.workdir, self.api_key = bases, pathlib.Path(workdir), api_key
    self.heartbeat_timeout_s = heartbeat_timeout_s
    self.sessions: dict[str, _Session] = {}
    self.adapters: dict[str, Adapter] = {}
    self.samplers: dict[str, tuple] = {}  # path -> (base, adapters, their scale)
    self.sampling_sessions: dict[str, str | None] = {}  # id -> sampler path (None: the base)
    self.runs = Runs(self.workdir)  # the training runs and checkpoints, on disk
    self._last_merged: tuple = (None, None)
    self._last_bank: tuple = (None, None)
    if split and len(jax.local_devices()) < 2:
      raise ValueError(f"split sampling needs two devices; this process has "
                       f"{len(jax.local_devices())}")
    self.sample_device = jax.local_devices()[-1] if split else None
    """Where sampling runs (None: where training does, one call at a time)."""
    self._sample_bases: dict[str, object] = {}  # base name -> its params on sample_device
    super().__init__(split=split)

  def submit(self, fn: Callable[[], dict | bytes] | None, model_id: str | None = None,
             samples: int = 0, **batch) -> dict:
    if model_id in self.adapters:
      self.runs.requested[model_id] = time.time()
    return super().submit(fn, model_id, samples, **batch)

  # -- sessions --------------------------------------------------------------------------------

  def create_session(self, user_metadata: dict | None = None) -> str:
    session = _Session(f"session-{uuid.uuid4().hex[:12]}", time.monotonic(),
                       user_metadata={str(k): str(v) for k, v in user_metadata.items()}
                       if user_metadata else None)
    self.sessions[session.id] = session
    self.release_idle()
    return session.id

  def heartbeat(self, session_id: str) -> None:
    self._session(session_id).beat = time.monotonic()
    self.release_idle()

  def _session(self, session_id: str) -> _Session:
    if session_id not in self.sessions:
      raise BadInput(f"session {session_id!r} is unknown (or released after "
                     f"{self.heartbeat_timeout_s:g} s without a heartbeat)")
    return self.sessions[session_id]

  def finish(self, session_id: str) -> list[str]:
    """Ends a session (the SDK's client closing): releases its training clients' adapters
    (what they saved stays loadable); returns their ids."""
    session = self.sessions.pop(session_id, None)
    if session is None:
      return []
    for model_id in session.adapters:
      self.adapters.pop(model_id, None)
    return session.adapters

  def release_idle(self) -> list[str]:
    """Releases the adapters of sessions whose heartbeat stopped; returns their ids."""
    now, released = time.monotonic(), []
    for session in list(self.sessions.values()):
      if now - session.beat > self.heartbeat_timeout_s:
        for model_id in session.adapters:
          self.adapters.pop(model_id, None)
        released += session.adapters
        del self.sessions[session.id]
    return released

  # -- training clients ------------------------------------------------------------------------

  def base(self, name: str | None) -> Base:
    if name not in self.bases:
      raise BadInput(f"base_model {name!r} is not served here; this service serves "
                     f"{sorted(self.bases)}")
    return self.bases[name]

  def adapter(self, model_id: str) -> Adapter:
    if model_id not in self.adapters:
      raise BadInput(f"model_id {model_id!r} is unknown (never created, or released with its "
                     "session)")
    return self.adapters[model_id]

  def create_model(self, request: dict) -> dict:
    session = self._session(request["session_id"])
    base = self.base(request.get("base_model"))
    config = request.get("lora_config") or {"rank": 32}
    optimizer = (request.get("optimizer_config") or {}).get("type", "adamw")
    if optimizer != "adamw":
      raise BadInput(f"optimizer_config type {optimizer!r} is not served; this service "
                     "trains with adamw")
    model_id = f"{session.id}:train:{request.get('model_seq_id', 0)}"

    def create():
      adapter = Adapter(base, rank=int(config["rank"]), seed=config.get("seed"),
                        train_attn=config.get("train_attn", True),
                        train_mlp=config.get("train_mlp", True))
      if config.get("train_unembed", True):
        log.info("tinker: %s: train_unembed is served as off (the unembedding keeps the "
                 "base's weights)", model_id)
      self.adapters[model_id] = adapter
      session.adapters.append(model_id)
      self.runs.created(model_id, base.name, adapter.config.rank, config.get("train_attn", True),
                        config.get("train_mlp", True), request.get("user_metadata"))
      return {"model_id": model_id, "type": "create_model"}

    return self.submit(create, model_id)

  def get_info(self, model_id: str) -> dict:
    adapter = self.adapter(model_id)
    return {"type": "get_info", "model_id": model_id, "model_name": adapter.base.name,
            "is_lora": True, "lora_rank": adapter.config.rank,
            "model_data": {"arch": adapter.base.model.arch.family, "model_name": adapter.base.name,
                           "tokenizer_id": adapter.base.name}}

  def forward_backward(self, body: bytes, forward_only: bool = False) -> dict:
    model_id, datums, loss_fn, config, proto_forward_only = wire.read_forward_backward(body)
    adapter = self.adapter(model_id)

    def run():
      outputs, metrics = adapter.forward_backward(datums, loss_fn, config,
                                                  forward_only or proto_forward_only)
      return wire.forward_backward_output(outputs, metrics)

    return self.submit(run, model_id)

  def optim_step(self, request: dict) -> dict:
    model_id = request["model_id"]
    adapter = self.adapter(model_id)
    params = dict(request.get("optim_params") or request.get("adam_params") or {})
    if params.pop("type", "adam") not in ("adam", "adamw"):
      raise BadInput("optim_step: only Adam's parameters (AdamParams) are served")
    hyper = AdamHyper(**params)
    return self.submit(lambda: {"type": "optim_step", "metrics": adapter.optim_step(hyper)},
                       model_id)

  # -- weights ---------------------------------------------------------------------------------

  def _path(self, model_id: str, kind: str, name: str | None) -> str:
    name = name or f"{kind}-{next(self._ids):06d}"
    if "/" in name or name.startswith("."):
      raise BadInput(f"checkpoint name {name!r}: a plain name, without '/'")
    return f"tinker://{model_id}/{kind}/{name}"

  def _directory(self, path: str) -> pathlib.Path:
    if not path.startswith("tinker://"):
      raise BadInput(f"path {path!r} is not a tinker:// path this service wrote")
    return self.workdir / "checkpoints" / path.removeprefix("tinker://").replace(":", "_")

  def expire(self, model_id: str | None = None) -> None:
    """Deletes the checkpoints past their time to live (of one run, or all), and forgets the
    sampler weights any of them held."""
    for path in self.runs.expire(model_id):
      self.samplers.pop(path, None)

  def save_weights(self, request: dict, for_sampler: bool = False) -> dict:
    model_id = request["model_id"]
    check_ttl(request.get("ttl_seconds"))
    adapter = self.adapter(model_id)
    path = self._path(model_id, "sampler_weights" if for_sampler else "weights",
                      request.get("path"))

    def save():
      snapshot = adapter.adapters  # immutable arrays: a step replaces them, never writes them
      directory = self._directory(path)
      # the base's served name in the PEFT config: a restarted service finds the base again
      lora.save_peft(snapshot, adapter.base.model.arch, adapter.config, directory,
                     adapter.base.name)
      if request.get("ttl_seconds") is not None:  # the checkpoint expires (runs.set_ttl)
        self.runs.set_ttl(model_id, path.removeprefix(f"tinker://{model_id}/"),
                          request["ttl_seconds"])
      if for_sampler:
        self.samplers[path] = (adapter.base, snapshot, adapter.config.scale)
        if request.get("path") is None:  # an unnamed snapshot: a sampling session on it
          session_id = f"sampling-{uuid.uuid4().hex[:12]}"
          self.sampling_sessions[session_id] = path
          return {"type": "save_weights_for_sampler", "sampling_session_id": session_id}
        return {"type": "save_weights_for_sampler", "path": path}
      leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(adapter.opt_state)]
      np.savez(directory / "optimizer.npz", *leaves)
      return {"type": "save_weights", "path": path}

    return self.submit(save, model_id)

  def load_weights(self, request: dict) -> dict:
    """Loads a saved state into a training client; without a ``model_id``, into a new one of
    the request's session, shaped as the checkpoint (``create_training_client_from_state``)."""
    path, with_optimizer = request["path"], bool(request.get("optimizer"))
    if request.get("model_id") is None:
      session = self._session(request.get("session_id"))
      base, config, directory = self._checkpoint(path, request.get("base_model"))
      model_id = f"{session.id}:train:{request.get('model_seq_id', 0)}"

      def create_and_load():
        adapter = Adapter(base, rank=config.rank,
                          train_attn=any(t in config.targets for t in ATTENTION),
                          train_mlp=any(t in config.targets for t in MLP))
        if adapter.config.targets != config.targets or config.alpha != LORA_ALPHA:
          raise BadInput(f"{path!r} adapts {list(config.targets)} with alpha {config.alpha:g}; "
                         f"this service's adapters are the attention's, the MLP's or both, "
                         f"alpha {LORA_ALPHA:g}")
        self._load_into(adapter, directory, path, with_optimizer)
        self.adapters[model_id] = adapter
        session.adapters.append(model_id)
        self.runs.created(model_id, base.name, config.rank,
                          any(t in config.targets for t in ATTENTION),
                          any(t in config.targets for t in MLP), request.get("user_metadata"))
        return {"type": "load_weights", "path": path}

      return self.submit(create_and_load, request.get("model_id") or model_id)
    model_id = request["model_id"]
    adapter = self.adapter(model_id)
    directory = self._directory(path)

    def load():
      self._load_into(adapter, directory, path, with_optimizer)
      return {"type": "load_weights", "path": path}

    return self.submit(load, model_id)

  def _load_into(self, adapter: Adapter, directory: pathlib.Path, path: str,
                 with_optimizer: bool) -> None:
    """``path``'s adapters (and Adam state) into ``adapter``, all or nothing."""
    if not directory.is_dir():
      raise BadInput(f"no checkpoint at {path!r}")
    adapters = lora.load_peft(directory, adapter.base.model.arch, adapter.config)
    state = None
    if with_optimizer:
      saved = directory / "optimizer.npz"
      if not saved.is_file():
        raise BadInput(f"{path!r} holds no optimizer state (a sampler checkpoint)")
      with np.load(saved) as arrays:
        leaves = [jnp.asarray(arrays[f"arr_{i}"]) for i in range(len(arrays.files))]
      state = jax.tree.unflatten(jax.tree.structure(adapter.opt_state), leaves)
    adapter.adapters, adapter.pending = adapters, None
    if state is not None:
      adapter.opt_state = state

  def _checkpoint(self, path: str, base_model: str | None = None
                  ) -> tuple[Base, LoraConfig, pathlib.Path]:
    """The base, adapter shape and directory of a checkpoint this service wrote (its PEFT
    config names the base; ``base_model`` overrides it); one past its time to live is gone."""
    self.expire()
    directory = self._directory(path)
    if not (directory / lora.PEFT_CONFIG).is_file():
      raise BadInput(f"{path!r} is not a checkpoint of this service (save_weights and "
                     "save_weights_for_sampler make them)")
    found = lora.read_peft_config(directory)
    name = base_model or found.get("base_model_name_or_path") or (
        next(iter(self.bases)) if len(self.bases) == 1 else None)
    targets = tuple(t for t, module in lora.HF_MODULES.items()
                    if module.split(".")[1] in found["target_modules"])
    config = LoraConfig(rank=int(found["r"]), alpha=float(found["lora_alpha"]), targets=targets)
    return self.base(name), config, directory

  # -- sampling --------------------------------------------------------------------------------

  def sampler(self, path: str) -> tuple:
    """(base, adapters, scale) of the sampler checkpoint ``path``: saved by this process, or
    read from its directory (a checkpoint an earlier run of the service saved)."""
    self.expire(path.removeprefix("tinker://").split("/", 1)[0])  # its run only: a hot path
    if path in self.samplers:
      return self.samplers[path]
    base, config, directory = self._checkpoint(path)
    self.samplers[path] = (base, lora.load_peft(directory, base.model.arch, config), config.scale)
    return self.samplers[path]

  def sampler_info(self, sampling_session_id: str) -> dict:
    """The SDK's ``GetSamplerResponse`` of a sampling session."""
    where = self.sampling_sessions.get(sampling_session_id)
    if where is None:
      raise BadInput(f"sampling session {sampling_session_id!r} is unknown")
    if where.startswith("base:"):
      return {"sampler_id": sampling_session_id, "base_model": where.removeprefix("base:")}
    return {"sampler_id": sampling_session_id, "base_model": self.sampler(where)[0].name,
            "model_path": where}

  def create_sampling_session(self, request: dict) -> str:
    session = self._session(request["session_id"])
    path = request.get("model_path")
    if path is None:
      self.base(request.get("base_model"))
    else:
      self.sampler(path)
    session_id = f"sampling-{uuid.uuid4().hex[:12]}"
    self.sampling_sessions[session_id] = path if path is not None else f"base:{request['base_model']}"
    session.samplers.append(session_id)
    return session_id

  def _placed(self, tree):
    """``tree`` on the sampling device (split), or as it is."""
    return tree if self.sample_device is None else jax.device_put(tree, self.sample_device)

  def _base_params(self, base: Base):
    """The base's params where sampling runs (split: a copy on the sampling device, made once)."""
    if self.sample_device is None:
      return base.model.params
    if base.name not in self._sample_bases:
      self._sample_bases[base.name] = self._placed(base.model.params)
    return self._sample_bases[base.name]

  def _merged(self, path: str, base: Base, snapshot, scale: float):
    """The base with ``path``'s adapters folded in, kept for the next call on the same path
    (a sampling client samples many times from one snapshot)."""
    if self._last_merged[0] != path:
      self._last_merged = (path, lora.merge(self._base_params(base), self._placed(snapshot),
                                            scale))
    return self._last_merged[1]

  def _weights(self, base: Base, wheres: list[str]):
    """The params that decode the calls on ``wheres`` (distinct, all on ``base``) and each
    one's adapter id: the base alone or one sampler's adapters merged into it (the fastest
    decode); several samplers as a bank (``lora.bank``), each slot with its own adapter, the
    bank kept for the next batch on the same samplers."""
    paths = [w for w in wheres if not w.startswith("base:")]
    if not paths:
      return self._base_params(base), None
    if len(wheres) == 1:
      _, snapshot, scale = self.sampler(paths[0])
      return self._merged(paths[0], base, snapshot, scale), None
    if self._last_bank[0] != tuple(paths):
      # the bank padded to a power of two: a few shapes to compile, whatever the count
      bank = lora.bank(self._base_params(base),
                       [(self._placed(adapters), scale)
                        for _, adapters, scale in map(self.sampler, paths)],
                       size=1 << (len(paths) - 1).bit_length())
      self._last_bank = (tuple(paths), bank)
    return self._last_bank[1], {w: paths.index(w) if w in paths else -1 for w in wheres}

  def sample(self, request: dict) -> dict:
    where = self.sampling_sessions.get(request.get("sampling_session_id")) or (
        request.get("model_path") or f"base:{request.get('base_model')}")
    base = (self.base(where.removeprefix("base:")) if where.startswith("base:")
            else self.sampler(where)[0])
    prompt = np.concatenate([np.asarray(chunk["tokens"], np.int32)
                             for chunk in request["prompt"]["chunks"]])
    base.check_tokens(prompt, "the prompt")
    settings = request.get("sampling_params") or {}
    stops = []
    for stop in settings.get("stop") or []:
      if isinstance(stop, int):
        stops.append(stop)
        continue
      if base.tokenizer is None:
        raise BadInput(f"stop string {stop!r}: {base.name!r} has no tokenizer here; give token ids")
      ids = base.tokenizer.encode(stop)
      if len(ids) != 1:
        raise BadInput(f"stop string {stop!r} is {len(ids)} tokens; this service stops on "
                       "single tokens: give token ids or one-token strings")
      stops.append(ids[0])
    n = int(request.get("num_samples", 1))
    max_tokens = int(settings.get("max_tokens") or 16)
    if len(prompt) + max_tokens > base.max_length:
      raise BadInput(f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceed this "
                     f"service's {base.max_length} for {base.name!r}")
    options = dict(n=n, max_tokens=max_tokens,
                   temperature=float(settings.get("temperature", 1.0)),
                   top_p=float(settings.get("top_p", 1.0)),
                   top_k=max(int(settings.get("top_k", -1)), 0), stop_token_ids=tuple(stops))
    seed = settings.get("seed")

    def run_batch(payloads: list[tuple[str, list[int], bool]]) -> list[bytes]:
      """The calls of one batch, on the weights of up to ``BANK_SIZE`` samplers at a time,
      decoded together (each slot with its call's adapter)."""
      # what the engine makes for itself lands where sampling runs too (None: the default)
      with jax.default_device(self.sample_device):
        return decode(payloads)

    def decode(payloads: list[tuple[str, list[int], bool]]) -> list[bytes]:
      wheres = list(dict.fromkeys(where for where, _, _ in payloads))
      answers = {}
      for first in range(0, len(wheres), BANK_SIZE):
        chunk = wheres[first:first + BANK_SIZE]
        params, ids = self._weights(base, chunk)
        mine = [i for i, (where, _, _) in enumerate(payloads) if where in chunk]
        started = time.perf_counter()
        # no seed: a fresh draw (calls that give none must not repeat each other's samples)
        drawn = base.sample(params, [payloads[i][1] for i in mine], **options,
                            seed=secrets.randbits(31) if seed is None else int(seed),
                            adapters=None if ids is None else [ids[payloads[i][0]] for i in mine])
        log.info("tinker: sampled %d call(s) x %d on %d sampler(s), %d tokens, %.2fs", len(mine),
                 n, len(chunk), sum(len(c.response_tokens) for group in drawn for c in group),
                 time.perf_counter() - started)
        for i, completions in zip(mine, drawn, strict=True):
          where, prompt, with_prompt_logprobs = payloads[i]
          answers[i] = wire.sample_response(
              [(c.response_tokens, c.logprobs, "length" if c.finish_reason == "length" else "stop")
               for c in completions],
              base.prompt_logprobs(self._weights(base, [where])[0], prompt)
              if with_prompt_logprobs else None)
      return [answers[i] for i in range(len(payloads))]

    # calls with a seed run alone: their samples are those of that seed whatever else is queued;
    # the others batch with every queued call on the same base with the same settings
    batch = None if seed is not None else (base.name, *sorted(options.items()))
    return self.submit(None, samples=n, batch=batch, run_batch=run_batch,
                       payload=(where, prompt.tolist(), bool(request.get("prompt_logprobs"))))
