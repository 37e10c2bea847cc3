"""Log-probs and entropy of a sequence's target tokens, through the fused kernels (never the
``[tokens, vocab]`` logits), at the temperature the data was sampled at."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from rlx.config import RunConfig
from rlx.kernels import fused_logprobs
from rlx.models.transformer import Params, Transformer
from rlx.update import packing as packing_lib
from rlx.update.packing import Packing


def sequence_logprobs(transformer: Transformer, params: Params, tokens: jax.Array,
                      attention_mask: jax.Array, response_mask: jax.Array | None = None, *,
                      impl: str = "auto", temperature: float | jax.Array = 1.0,
                      chunk: int = 128, rows: NamedSharding | None = None,
                      packing: Packing | None = None) -> tuple[jax.Array, jax.Array]:
  """Log-prob and entropy [B, T] of every target token (position 0 gets 0), via the fused path.

  Args:
    tokens: int [B, T]; attention_mask: bool [B, T].
    response_mask: bool [B, T] the targets that are needed (others get 0, and
      the Pallas kernels skip whole blocks of them); None computes all.
    temperature: the sampling temperature, so that these match the behaviour log-probs: a
      Python float (a constant of the compiled program), or float32 [B], one per sequence
      (traced: any temperature runs the same program). An array scales the hidden states,
      ``(h / t) @ W == (h @ W) / t``, so the kernels see temperature 1.
    rows: how the sequences are split over the mesh (the learner's batch sharding): the
      Pallas kernels then run per device on its own rows (``fused_logprobs``), when the
      sequences split evenly.
    packing: where each row's sequence goes in packed rows (``rlx.update.packing``): the
      transformer and the kernels run on the packed rows, and the results come back in the
      rows' own layout, equal to the unpacked ones.
  """
  if packing is not None:
    if response_mask is None:  # a packed row's first token of each sequence is no target
      raise ValueError("packed log-probs need the response mask (the targets that count)")
    return _packed_logprobs(transformer, params, tokens, attention_mask, response_mask,
                            temperature, packing, impl=impl, chunk=chunk, rows=rows)
  return _logprobs(transformer, params, tokens, attention_mask, response_mask, temperature,
                   impl=impl, chunk=chunk, rows=rows)


def _packed_logprobs(transformer: Transformer, params: Params, tokens: jax.Array,
                     attention_mask: jax.Array, response_mask: jax.Array,
                     temperature: float | jax.Array, packing: Packing, *, impl: str, chunk: int,
                     rows: NamedSharding | None) -> tuple[jax.Array, jax.Array]:
  """``sequence_logprobs`` on packed rows: the transformer runs on them, each placed target
  token's log-prob comes from the hidden state of the token before it in its own sequence
  (``packing.sources``: a shared prefix's last for an answer's first token), and the results
  go back to the rows' own layout."""
  dest = packing_lib.destinations(packing, attention_mask)
  place = packing_lib.placements(packing, attention_mask, dest)
  segment_ids, positions = packing_lib.segments(packing, attention_mask, place)
  group_ids, shared = packing_lib.groups(packing, attention_mask, place)
  W = packing_lib.width(packing, attention_mask)
  put = lambda x: _constrain(packing_lib.pack(x, place, packing.rows, width=W), rows)
  constrain = lambda x: None if x is None else _constrain(x, rows)
  packed_tokens = put(tokens)
  hidden, _ = transformer.hidden_states(
      params, packed_tokens, segment_ids=constrain(segment_ids), positions=constrain(positions),
      group_ids=constrain(group_ids), shared=constrain(shared))
  R, _, D = hidden.shape
  before = hidden.reshape(R * W, D)[packing_lib.sources(packing, attention_mask, dest, place)]
  if not isinstance(temperature, (int, float)):  # one per sequence: the target's
    temperature = jnp.asarray(temperature, hidden.dtype)[jnp.maximum(segment_ids, 0)]
    before = before / temperature.reshape(-1, 1)
    temperature = 1.0
  if rows is not None and R % row_ways(rows):
    rows = NamedSharding(rows.mesh, PartitionSpec())
  logprobs, entropy = fused_logprobs(
      before, transformer.unembedding(params), packed_tokens.reshape(-1),
      put(response_mask).reshape(-1), impl=impl, temperature=temperature, chunk=chunk,
      rows=rows)
  back = lambda x: packing_lib.unpack(x.reshape(R, W), dest)
  return back(logprobs), back(entropy)


def _constrain(x: jax.Array, rows: NamedSharding | None) -> jax.Array:
  """Packed rows split over the mesh like the batch's rows (when they split evenly)."""
  if rows is None or x.shape[0] % row_ways(rows):
    return x
  return jax.lax.with_sharding_constraint(x, rows)


def _logprobs(transformer: Transformer, params: Params, tokens: jax.Array,
              attention_mask: jax.Array | None, response_mask: jax.Array | None,
              temperature: float | jax.Array, *, impl: str, chunk: int,
              rows: NamedSharding | None) -> tuple[jax.Array, jax.Array]:
  """``sequence_logprobs`` of plain rows; ``temperature`` a float or an array of [B]."""
  hidden, _ = transformer.hidden_states(params, tokens, attention_mask)
  B, T, D = hidden.shape
  if not isinstance(temperature, (int, float)):
    hidden = hidden / jnp.asarray(temperature, hidden.dtype)[:, None, None]
    temperature = 1.0
  if rows is not None and B % row_ways(rows):  # not split after all: every device has every row
    rows = NamedSharding(rows.mesh, PartitionSpec())
  mask = None if response_mask is None else response_mask[:, 1:].reshape(-1)
  logprobs, entropy = fused_logprobs(
      hidden[:, :-1].reshape(B * (T - 1), D), transformer.unembedding(params),
      tokens[:, 1:].reshape(-1), mask, impl=impl, temperature=temperature, chunk=chunk,
      rows=rows)
  pad = lambda x: jnp.pad(x.reshape(B, T - 1), ((0, 0), (1, 0)))
  return pad(logprobs), pad(entropy)


def row_ways(sharding: NamedSharding) -> int:
  """Into how many parts ``sharding`` splits dimension 0."""
  axes = sharding.spec[0] if sharding.spec else None
  axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
  return int(math.prod(sharding.mesh.shape[a] for a in axes))


def sampling_temperature(temperature: float) -> float:
  """The temperature the learner takes log-probs at for data sampled at ``temperature``: itself,
  or 1 for greedy data (0). The engine records a greedy token's behaviour log-prob as 0 (a
  point mass), so greedy data is off-policy for any learner temperature; 1 is the untruncated
  policy."""
  return temperature if temperature > 0 else 1.0


def config_temperature(config: RunConfig) -> float:
  return sampling_temperature(config.rollout.temperature)


def policy_logprobs(config: RunConfig, transformer: Transformer, params: Params,
                    tokens: jax.Array, attention_mask: jax.Array,
                    response_mask: jax.Array | None = None,
                    temperature: jax.Array | None = None, *,
                    rows: NamedSharding | None = None,
                    packing: Packing | None = None) -> jax.Array:
  """Log-probs [B, T] of the target tokens under ``params`` at the sampling temperature (float32
  [B] per sequence, or None: the config's), through the same fused path as the loss (old and
  reference log-probs)."""
  temperature = config_temperature(config) if temperature is None else temperature
  return sequence_logprobs(transformer, params, tokens, attention_mask, response_mask,
                           impl=config.model.logprob_impl, temperature=temperature,
                           chunk=config.model.logprob_chunk, rows=rows, packing=packing)[0]


def make_logprobs_fn(config: RunConfig, transformer: Transformer):
  """Jitted ``(params, tokens, attention_mask, response_mask=None) -> logprobs [B, T]``."""
  return jax.jit(functools.partial(policy_logprobs, config, transformer))
