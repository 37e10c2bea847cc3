"""Token sampling with temperature, top-k and top-p, and the behaviour log-prob of each draw.

For logits ``z`` [S, V] of S slots, each with its own temperature ``tau``, ``k`` and
``p``:

1. ``z / tau``;
2. top-k: keep logits ``>=`` the k-th largest (ties at the boundary are all kept);
   ``k = 0`` keeps all;
3. top-p (nucleus): of what is left, keep the most likely tokens, in order,
   until their probability reaches ``p`` (the token that crosses ``p`` is kept;
   ties at the boundary are all kept); ``p = 1`` keeps all;
4. draw from the softmax of the kept logits (``categorical``: by the inverse of its
   cumulative distribution, one uniform number per slot, not a Gumbel per vocabulary entry).

``behaviour_logprob`` is the log-prob of the drawn token under exactly that
distribution (step 4): the probability with which it was sampled, which the
learner's importance ratios need. ``policy_logprob`` is its log-prob under the
untruncated policy at temperature 1, ``log_softmax(z)``. A slot with
``tau = 0`` is greedy: it takes the argmax, and its behaviour log-prob is 0
(a point mass).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


FAST_TOP_K = 64
"""Largest k that the top-k-only path finds with ``lax.top_k`` instead of sorting the vocabulary."""


def truncate_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                    top_p: jax.Array) -> jax.Array:
  """Temperature-scaled logits [S, V] with the tokens outside top-k / top-p set to -inf.

  Sorting the vocabulary is done only when some slot needs it: with top-k and top-p off
  everywhere the scaled logits are returned as they are, and with only top-k on (k <=
  ``FAST_TOP_K``) its threshold comes from ``lax.top_k``. All three paths give the same
  result (``sorted_truncation`` is the reference).

  Args:
    logits: [S, V]; temperature, top_p: float [S]; top_k: int [S].
  """
  V = logits.shape[-1]
  scaled = _scaled(logits, temperature)
  k_on = (top_k > 0) & (top_k < V)
  fast_k = min(FAST_TOP_K, V)

  def top_k_only():
    largest = jax.lax.top_k(scaled, fast_k)[0]
    kth = jnp.take_along_axis(largest, (jnp.clip(top_k, 1, fast_k) - 1)[:, None], axis=-1)
    return jnp.where(~k_on[:, None] | (scaled >= kth), scaled, -jnp.inf)

  needs_sort = jnp.any(top_p < 1) | jnp.any(k_on & (top_k > fast_k))
  branch = jnp.where(needs_sort, 2, jnp.where(jnp.any(k_on), 1, 0))
  return jax.lax.switch(branch, [lambda: scaled, top_k_only,
                                 lambda: _sorted_truncation(scaled, top_k, top_p)])


def sorted_truncation(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                      top_p: jax.Array) -> jax.Array:
  """The reference of ``truncate_logits``: sorts the whole vocabulary of every slot."""
  return _sorted_truncation(_scaled(logits, temperature), top_k, top_p)


def _scaled(logits: jax.Array, temperature: jax.Array) -> jax.Array:
  """Float32 logits [S, V] divided by each slot's temperature (greedy slots: by 1)."""
  return logits.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1.0)[:, None]


def _sorted_truncation(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  V = scaled.shape[-1]
  ordered = jnp.sort(scaled, axis=-1)[:, ::-1]  # descending
  k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
  kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)
  ordered = jnp.where(ordered >= kth, ordered, -jnp.inf)
  probs = jax.nn.softmax(ordered, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs  # probability of strictly more likely tokens
  # p = 1 keeps everything, even tokens whose mass rounds the running sum to 1.
  keep_sorted = ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1)) & (ordered > -jnp.inf)
  threshold = jnp.min(jnp.where(keep_sorted, ordered, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(scaled >= jnp.maximum(threshold, kth), scaled, -jnp.inf)


CATEGORICAL_BLOCK = 256
"""Vocabulary entries per block of ``categorical``'s two-level search."""


def categorical(keys: jax.Array, logits: jax.Array, block: int = CATEGORICAL_BLOCK) -> jax.Array:
  """One draw per row from ``softmax(logits)`` [S, V] (``-inf`` entries never drawn): the
  distribution of ``jax.random.categorical``, by inverting the cumulative distribution.

  ``jax.random.categorical`` draws a Gumbel variate for every vocabulary entry of every slot
  (49,152 random numbers per slot and token at SmolLM2's vocabulary: 85 ms of a 32-slot decode
  step on a CPU). Here each slot draws one uniform ``u`` in [0, total mass), finds the block of
  ``block`` entries whose cumulative mass first exceeds it, then the entry inside that block:
  an exponential, a sum per block and two short cumulative sums (3 ms). In float32 a ``u``
  rounded onto the very end of the mass (about 1e-7 of draws) would land on no entry: the
  draw is then the most likely token.

  Args:
    keys: [S] PRNG keys; logits: float [S, V].
  Returns:
    int32 [S] token ids.
  """
  S, V = logits.shape
  blocks = -(-V // block)
  x = logits.astype(jnp.float32)
  weights = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
  weights = jnp.pad(weights, ((0, 0), (0, blocks * block - V))).reshape(S, blocks, block)
  block_mass = weights.sum(-1)  # [S, blocks]
  block_end = jnp.cumsum(block_mass, axis=-1)
  u = jax.vmap(jax.random.uniform)(keys) * block_end[:, -1]
  chosen = jnp.minimum(jnp.sum(block_end <= u[:, None], axis=-1), blocks - 1)  # [S]
  take = lambda a, i: jnp.take_along_axis(a, i[:, None], axis=1)[:, 0]
  inside = u - (take(block_end, chosen) - take(block_mass, chosen))
  in_block = jnp.take_along_axis(weights, chosen[:, None, None], axis=1)[:, 0]  # [S, block]
  entry = jnp.minimum(jnp.sum(jnp.cumsum(in_block, axis=-1) <= inside[:, None], axis=-1),
                      block - 1)
  token = chosen * block + entry
  valid = (token < V) & (take(in_block, entry) > 0)
  return jnp.where(valid, token, jnp.argmax(x, axis=-1)).astype(jnp.int32)


def sample(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array,
           top_p: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Draws one token per slot.

  Args:
    logits: [S, V]; keys: [S] PRNG keys (one per slot and step);
    temperature, top_p: float [S]; top_k: int [S].
  Returns:
    (tokens int32 [S], behaviour_logprobs [S], policy_logprobs [S]).
  """
  truncated = truncate_logits(logits, temperature, top_k, top_p)
  drawn = categorical(keys, truncated)
  greedy = jnp.argmax(logits, axis=-1)
  is_greedy = temperature <= 0
  tokens = jnp.where(is_greedy, greedy, drawn).astype(jnp.int32)
  # log_softmax(x)[token] as x[token] - logsumexp(x): the [S, V] log-softmax arrays are never
  # written (compiled for TPU v5e, a decode step at Qwen2.5-0.5B shapes moved 10% fewer bytes).
  token_logprob = lambda x: (jnp.take_along_axis(x, tokens[:, None], -1)[:, 0]
                             - jax.nn.logsumexp(x, axis=-1))
  behaviour = token_logprob(truncated)
  policy = token_logprob(logits.astype(jnp.float32))
  return tokens, jnp.where(is_greedy, 0.0, behaviour), policy
