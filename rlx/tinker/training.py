"""What the service computes: base models, and one LoRA adapter with its own Adam state per
training client.

    base = Base.load("HuggingFaceTB/SmolLM2-135M-Instruct", "models/SmolLM2-135M-Instruct")
    client = Adapter(base, rank=8, seed=0, train_attn=True, train_mlp=True)
    outputs, metrics = client.forward_backward(datums, "cross_entropy", {})   # accumulates
    metrics = client.optim_step(AdamHyper(learning_rate=1e-4))                # applies, clears
    completions = base.sample(client.sampler_weights(), [prompt], n=4, ...)

Every client's adapter sits beside the same base weights (``rlx.models.lora``: the base is an
argument of the loss, never of the gradient); gradients of ``forward_backward`` calls add up
until ``optim_step`` applies them with the step's Adam settings (``optax.inject_hyperparams``:
changing the learning rate compiles nothing).

A batch runs as the learner's does (``rlx.update.packing``): the datums' inputs packed several
to a row, and a run of datums that begin with the same tokens (a group's samples of one prompt)
forwards that prefix once. The host lays the batch out (``Layout``): the packed rows, and one
*entry* per datum token (the slot whose hidden state predicts it, its target and its loss
inputs), so that a token of a shared prefix keeps its own datum's target and inputs. The jitted
programs see only the packed rows' and the entries' counts, bucketed (powers of two and their
halfway points), so that a run of calls of varying lengths compiles a few shapes. Every
log-prob, loss and gradient equals a plain computation's, one datum at a time (test).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import pathlib
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rlx import rollout
from rlx.config import LoraConfig, ModelConfig
from rlx.kernels import fused_logprobs
from rlx.models import Model, build_model, load_tokenizer, lora
from rlx.tinker import losses
from rlx.tinker.wire import Datum
from rlx.update import packing, sequence_logprobs

log = logging.getLogger(__name__)

LORA_ALPHA = 32.0
"""The adapters' scale numerator (Tinker's): they add (32 / rank) x A B."""
ATTENTION, MLP = ("q", "k", "v", "o"), ("gate", "up", "down")
ADAM = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-4, b1=0.9, b2=0.95, eps=1e-12,
                                             weight_decay=0.0)
"""One optimizer for every adapter (its settings live in each adapter's state), so that its
jitted step compiles once per adapter shape."""


class BadInput(ValueError):
  """A request the service refuses; the message names what is wrong and what is allowed."""


def _bucket(n: int, smallest: int) -> int:
  """The least of ``smallest`` and the powers of two and their halfway points (16, 24, 32,
  48, 64, 96, ...) that holds ``n``: a third of padding at most, two shapes per octave."""
  size = max(smallest, 1 << max(n - 1, 0).bit_length())
  three_quarters = size // 4 * 3
  return three_quarters if n <= three_quarters and three_quarters >= smallest else size


@dataclasses.dataclass
class AdamHyper:
  learning_rate: float = 1e-4
  beta1: float = 0.9
  beta2: float = 0.95
  eps: float = 1e-12
  weight_decay: float = 0.0
  grad_clip_norm: float = 0.0


class Base:
  """A served base model: its weights, tokenizer and context length."""

  def __init__(self, name: str, model: Model, tokenizer, max_length: int):
    self.name, self.model, self.tokenizer, self.max_length = name, model, tokenizer, max_length

  @classmethod
  def load(cls, name: str, path: str, max_length: int = 4096) -> Base:
    """The model at ``path`` (a Hugging Face directory); its tokenizer when it has one (only
    stop strings need it)."""
    has_tokenizer = (pathlib.Path(path) / "tokenizer.json").is_file()
    return cls(name, build_model(ModelConfig(path=path)),
               load_tokenizer(path) if has_tokenizer else None, max_length)

  @property
  def vocab_size(self) -> int:
    return self.model.arch.vocab_size

  def check_tokens(self, tokens: np.ndarray, where: str) -> None:
    if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
      bad = int(tokens[(tokens < 0) | (tokens >= self.vocab_size)][0])
      raise BadInput(f"{where}: token id {bad} is outside the vocabulary of {self.name!r} "
                     f"(0..{self.vocab_size - 1})")
    if tokens.size > self.max_length:
      raise BadInput(f"{where}: {tokens.size} tokens, more than this service's "
                     f"{self.max_length} for {self.name!r}")

  def prompt_logprobs(self, params, prompt: Sequence[int]) -> np.ndarray:
    """float32 [len(prompt)]: each prompt token's log-prob after the ones before it (NaN for
    the first), with ``params`` (None: the base's)."""
    n = len(prompt)
    tokens = np.zeros((1, _bucket(n, 16)), np.int32)
    tokens[0, :n] = prompt
    logprobs = np.asarray(_prompt_logprobs(self.model.params if params is None else params,
                                           tokens, transformer=self.model.transformer))
    return np.concatenate([[np.nan], logprobs[0, 1:n]]).astype(np.float32)

  def sample(self, params, prompts: Sequence[Sequence[int]], *, n: int, max_tokens: int,
             temperature: float, top_p: float, top_k: int, stop_token_ids: Sequence[int],
             seed: int, adapters: Sequence[int] | None = None) -> list[list[rollout.Completion]]:
    """``n`` samples of each prompt with ``params`` (the base's, or an adapter's merged in, or
    a bank of adapters, ``adapters`` naming each prompt's: ``rlx.models.lora.bank``), decoded
    together; one list of ``n`` per prompt."""
    completions = rollout.generate(
        self.model, [list(p) for p in prompts], n=n, max_new_tokens=max_tokens,
        temperature=temperature, top_p=top_p, top_k=top_k, stop_token_ids=list(stop_token_ids),
        seed=seed, params=params, adapters=adapters,
        # slot counts of 8, 16, 32, 64: four engines at most, whatever the calls batch
        max_slots=min(64, max(8, 1 << (len(prompts) * n - 1).bit_length())))
    per_prompt = [[None] * n for _ in prompts]
    for completion in completions:
      per_prompt[completion.prompt_index][completion.sample_index] = completion
    return per_prompt


def _fine_bucket(n: int) -> int:
  """The least of 16 and the sizes 4 to an octave (64, 80, 96, 112, 128, 160, ...) that holds
  ``n``: the distinct target pairs go through the unembedding, the step's costliest product per
  token, so they pad by a fifth at most."""
  if n <= 64:
    return max(16, 1 << max(n - 1, 0).bit_length())
  octave = 1 << ((n - 1).bit_length() - 1)  # the power of two below n
  step = octave // 4
  return octave + -(-(n - octave) // step) * step


WIDTHS = tuple(int(base * step) for base in (128, 256, 512, 1024, 2048, 4096)
               for step in (1, 1.25, 1.5, 1.75)) + (8192,)
"""The packed rows' lengths tried: the one whose slots and placed tokens (each placed token
goes through the unembedding once) add up to the least wins; a wider row holds more of a
group behind one copy of its prompt."""


@dataclasses.dataclass
class Layout:
  """A batch of datums on packed rows, as the jitted programs take it."""

  rows: dict[str, np.ndarray]
  """[R, W] each: ``tokens``, ``segment_ids`` (the datum, -1 on padding), ``positions`` (in
  the datum), ``group_ids`` (the datum that placed the shared prefix) and ``shared`` (a token
  of a shared prefix): ``Transformer.hidden_states``' packed arguments."""
  entries: dict[str, np.ndarray]
  """[E] each: ``pair`` (the entry's (slot, target) pair), ``valid``, ``datum`` (its datum's
  index), and the loss's inputs."""
  pairs: dict[str, np.ndarray]
  """[P] each, the distinct (slot, target) pairs of the entries (a shared prefix's tokens and
  their targets, once for the group): ``source``, the slot of the flattened rows whose hidden
  state predicts ``target_tokens``; only these go through the unembedding."""
  spans: list[slice]
  """Each datum's entries."""


def shared_links(sequences: Sequence[np.ndarray]) -> np.ndarray:
  """int [B]: how many leading tokens each sequence shares with the one before it (0 for the
  first), leaving each at least one token of its own."""
  links = np.zeros(len(sequences), np.int64)
  for b in range(1, len(sequences)):
    previous, current = sequences[b - 1], sequences[b]
    n = min(len(previous), len(current)) - 1
    if n > 0:
      differs = np.flatnonzero(previous[:n] != current[:n])
      links[b] = differs[0] if differs.size else n
  return links


def layout(sequences: Sequence[np.ndarray], inputs: dict[str, list[np.ndarray]]) -> Layout:
  """``sequences`` (each datum's input tokens) packed with their groups' shared prefixes once,
  and their ``inputs`` (one value per input token each, ``target_tokens`` among them) as
  entries."""
  lengths = np.array([len(q) for q in sequences], np.int64)
  links = shared_links(sequences)
  best = None
  for width in (w for w in WIDTHS if w >= lengths.max()):
    placed = packing.place(lengths, width, links)
    R = _bucket(placed[-1], 1)
    followers = placed[2] != np.arange(len(lengths))
    cost = R * width + int(lengths.sum() - placed[3][followers].sum())
    if best is None or cost < best[0]:
      best = (cost, R, width, placed)
  if best is None:
    raise BadInput(f"a datum of {lengths.max()} tokens is longer than this service's longest "
                   f"row ({WIDTHS[-1]})")
  _, R, W, (row, offset, lead, prefix, _) = best
  rows = {"tokens": np.zeros(R * W, np.int32), "segment_ids": np.full(R * W, -1, np.int32),
          "positions": np.zeros(R * W, np.int32), "group_ids": np.full(R * W, -1, np.int32),
          "shared": np.zeros(R * W, bool)}
  E = _bucket(int(lengths.sum()), 16)
  entries = {"source": np.zeros(E, np.int64), "valid": np.zeros(E, bool),
             "datum": np.zeros(E, np.int32),
             **{name: np.zeros(E, np.int32 if name == "target_tokens" else np.float32)
                for name in inputs}}
  spans, start = [], 0
  for b, sequence in enumerate(sequences):
    n, l = len(sequence), int(lead[b])
    own = 0 if l == b else int(prefix[b])  # a follower places its tokens after the prefix
    slots = row[b] * W + offset[b] + np.arange(n) - own
    slots[:own] = row[l] * W + offset[l] + np.arange(own)
    rows["tokens"][slots[own:]] = sequence[own:]
    rows["segment_ids"][slots[own:]] = b
    rows["positions"][slots[own:]] = np.arange(own, n)
    rows["group_ids"][slots[own:]] = l
    rows["shared"][slots[own:]] = (l == b) & (np.arange(own, n) < prefix[b])
    span = slice(start, start + n)
    entries["source"][span], entries["valid"][span], entries["datum"][span] = slots, True, b
    for name, values in inputs.items():
      entries[name][span] = values[b]
    spans.append(span)
    start += n
  # the distinct (slot, target) pairs: a group's shared prefix, with its targets, counts once
  vocab = int(entries["target_tokens"].max()) + 1
  keys = entries.pop("source")[:start] * vocab + entries.pop("target_tokens")[:start]
  distinct, pair = np.unique(keys, return_inverse=True)
  entries["pair"] = np.zeros(E, np.int32)
  entries["pair"][:start] = pair
  P = _fine_bucket(len(distinct))
  pairs = {"source": np.zeros(P, np.int32), "target_tokens": np.zeros(P, np.int32)}
  pairs["source"][:len(distinct)] = distinct // vocab
  pairs["target_tokens"][:len(distinct)] = distinct % vocab
  return Layout({k: v.reshape(R, W) for k, v in rows.items()}, entries, pairs, spans)


def _loss(adapters, base_params, rows, entries, pairs, *, transformer, loss_fn, config):
  """The summed loss, and each entry's target log-prob and loss [E] (``Layout``)."""
  params = lora.combine(base_params, adapters)
  hidden, _ = transformer.hidden_states(params, rows["tokens"], **{
      name: rows[name] for name in ("segment_ids", "positions", "group_ids", "shared")})
  R, W, D = hidden.shape
  distinct, _ = fused_logprobs(hidden.reshape(R * W, D)[pairs["source"]],
                               transformer.unembedding(params), pairs["target_tokens"])
  logprobs = distinct[entries["pair"]]
  valid = entries["valid"]
  per_token = jnp.where(valid, losses.per_token(loss_fn, logprobs, entries, dict(config)), 0.0)
  return jnp.sum(per_token), (jnp.where(valid, logprobs, 0.0), per_token)


@functools.partial(jax.jit, static_argnames="transformer")
def _prompt_logprobs(params, tokens, *, transformer):
  """[1, T] log-probs of each token after the ones before it (0 for the first)."""
  return sequence_logprobs(transformer, params, tokens, jnp.ones(tokens.shape, bool))[0]


_STATIC = ("transformer", "loss_fn", "config")
_forward = jax.jit(_loss, static_argnames=_STATIC)
_forward_backward = jax.jit(jax.value_and_grad(_loss, has_aux=True), static_argnames=_STATIC)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=(2,))
def _apply(optimizer, grads, state, adapters, clip_norm):
  """One Adam step with the gradient clipped to ``clip_norm`` (0: never); the new adapters,
  state and the gradient's norm before clipping."""
  norm = optax.tree.norm(grads)
  scale = jnp.where((clip_norm > 0) & (norm > clip_norm), clip_norm / norm, 1.0)
  grads = jax.tree.map(lambda g: g * scale, grads)
  updates, state = optimizer.update(grads, state, adapters)
  return optax.apply_updates(adapters, updates), state, norm


class Adapter:
  """A training client's LoRA adapter on ``base``, its Adam state and its pending gradient."""

  def __init__(self, base: Base, *, rank: int, seed: int | None = None, train_attn: bool = True,
               train_mlp: bool = True):
    targets = (ATTENTION if train_attn else ()) + (MLP if train_mlp else ())
    if rank < 1 or not targets:
      raise BadInput(f"LoraConfig(rank={rank}, train_attn={train_attn}, train_mlp={train_mlp}) "
                     "adapts nothing: give a rank of 1 or more and train the attention or the MLP")
    self.base = base
    self.config = LoraConfig(rank=rank, alpha=LORA_ALPHA, targets=targets)
    self.transformer = dataclasses.replace(base.model.transformer, lora_scale=self.config.scale)
    self.adapters = lora.init_adapters(base.model.arch, self.config,
                                       jax.random.key(0 if seed is None else seed))
    self.optimizer = ADAM
    self.opt_state = self.optimizer.init(self.adapters)
    self.pending = None  # the gradients since the last optim_step, summed
    self.steps = 0

  def _check(self, datums: list[Datum], loss_fn: str) -> dict[str, list[np.ndarray]]:
    """Each datum's loss_fn inputs, one entry per input token; refuses what does not fit."""
    needed, optional = losses.INPUTS[loss_fn], losses.OPTIONAL.get(loss_fn, {})
    out = {name: [] for name in (*needed, *optional)}
    for b, datum in enumerate(datums):
      n = len(datum.tokens)
      self.base.check_tokens(datum.tokens, f"datum {b}'s model_input")
      missing = [name for name in needed if name not in datum.inputs]
      if missing:
        raise BadInput(f"datum {b}: loss_fn {loss_fn!r} needs loss_fn_inputs {list(needed)}; "
                       f"{missing} missing")
      for name in (*needed, *optional):
        value = (np.asarray(datum.inputs[name]).reshape(-1) if name in datum.inputs
                 else np.full(n, optional[name], np.float32))
        if value.size != n:
          raise BadInput(f"datum {b}: loss_fn_inputs[{name!r}] has {value.size} entries for "
                         f"{n} input tokens; each input takes one per token")
        out[name].append(value)
      self.base.check_tokens(out["target_tokens"][b], f"datum {b}'s target_tokens")
    return out

  def forward_backward(self, datums: list[Datum], loss_fn: str, config: dict | None,
                       forward_only: bool = False) -> tuple[list[dict], dict[str, float]]:
    """Each datum's target log-probs and per-token losses, and ``loss:sum``; unless
    ``forward_only``, the gradient is added to the pending one."""
    if not datums:
      raise BadInput("forward_backward with no datums")
    started = time.perf_counter()
    settings = losses.settings(loss_fn, config)
    batch = layout([d.tokens for d in datums], self._check(datums, loss_fn))
    static = dict(transformer=self.transformer, loss_fn=loss_fn,
                  config=tuple(sorted(settings.items())))
    args = (self.adapters, self.base.model.params, batch.rows, batch.entries, batch.pairs)
    if forward_only:
      loss, (logprobs, per_token) = _forward(*args, **static)
    else:
      (loss, (logprobs, per_token)), grads = _forward_backward(*args, **static)
      self.pending = grads if self.pending is None else jax.tree.map(jnp.add, self.pending, grads)
      jax.block_until_ready(self.pending)  # the call's time is its own, and so are its errors
    logprobs, per_token = np.asarray(logprobs), np.asarray(per_token)
    R, W = batch.rows["tokens"].shape
    log.info("tinker: %s of %d datums, %d tokens: %d on %d x %d slots, %d target slots, "
             "%.2fs", "forward" if forward_only else "forward_backward", len(datums),
             batch.spans[-1].stop, int((batch.rows["segment_ids"] >= 0).sum()), R, W,
             int(batch.pairs["source"].size), time.perf_counter() - started)
    outputs = [{"logprobs": logprobs[span], "elementwise_loss": per_token[span]}
               for span in batch.spans]
    return outputs, {"loss:sum": float(loss)}

  def optim_step(self, hyper: AdamHyper) -> dict[str, float]:
    """Applies the pending gradient with ``hyper``'s Adam settings; clears it."""
    if self.pending is None:
      raise BadInput("optim_step with no forward_backward since the last one: nothing to apply")
    for name in ("learning_rate", "eps"):
      if not (getattr(hyper, name) >= 0 and math.isfinite(getattr(hyper, name))):
        raise BadInput(f"AdamParams.{name}={getattr(hyper, name)} must be finite and >= 0")
    state = self.opt_state
    for name, value in (("learning_rate", hyper.learning_rate), ("b1", hyper.beta1),
                        ("b2", hyper.beta2), ("eps", hyper.eps),
                        ("weight_decay", hyper.weight_decay)):
      state.hyperparams[name] = jnp.asarray(value, state.hyperparams[name].dtype)
    self.adapters, self.opt_state, norm = _apply(self.optimizer, self.pending, state,
                                                 self.adapters, jnp.float32(hyper.grad_clip_norm))
    norm = float(norm)
    self.pending = None
    self.steps += 1
    return {"grad_norm": norm, "step": float(self.steps)}
