"""The decoder-only transformer of the Llama / Qwen2 / Qwen3 families, as pure functions.

Parameters are a plain nested dict of arrays, the decoder layers stacked on a
leading ``layers`` axis and run with ``lax.scan`` (compile time does not grow
with depth). A plain pytree, rather than module objects, keeps three things
one-to-one: Hugging Face tensor names <-> parameter paths (``rlx.models.hf``),
parameter paths <-> logical axes (for sharding), and params <-> what ``jit``,
``grad`` and ``device_put`` see.

Shapes: B batch, T new tokens, S cache length, D hidden, H query heads, K
key/value heads, E head_dim, F mlp width, V vocab, L layers.

Padding: a ``mask`` [B, T] marks real tokens (False = padding, left or right).
Positions count real tokens only, and padded keys are never attended to.

KV cache: ``{"k", "v", "valid": [B, S] bool, "index": [B]}`` in one of two layouts, both
heads-major (for every row and kv head, a head's keys are one contiguous block) so that
both attention matmuls take (B, K) as leading batch dims and read the cache in place:

- ``stacked``: ``k``, ``v`` [L, B, K, S, E], the scan's carry over the stacked layers. On
  TPU the compiled decode step writes one token per layer and copies nothing.
- ``per_layer``: ``k`` a tuple of L [B, K, E, S] (keys position-minor), ``v`` a tuple of L
  [B, K, S, E], the layers unrolled. For XLA:GPU and XLA:CPU, which copy a layer's slice of a
  stacked array before a matmul reads it: here each buffer is read whole and updated in place, and
  both matmuls get the standard ``[contracted, out]`` operand, ``q [G, E] @ k [E, S]`` and
  ``p [G, S] @ v [S, E]``. (On TPU this layout makes the decode loop convert the cache's
  tiling on entry and exit, so it is the CPU's.)

A call with a cache writes the T new keys of row b at slots ``index[b] ..
index[b] + T - 1`` and attends causally in slot order; prefill and one-token
decode are the same call. The caller keeps ``index + T <= S``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from rlx import unroll
from rlx.config import ArchConfig
from rlx.kernels import target_platform
from rlx.models.params import (  # noqa: F401 - the parameters' layout, named here too
    ParamSpec, Params, init_params, logical_axes, param_shapes, param_specs)

Cache = dict[str, jax.Array]

_REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def layer_list(params: Params) -> list[dict[str, jax.Array]]:
  """Each layer's parameters: ``params["layers"]`` itself when it is a list already (see
  ``unstack_layers``), else sliced out of the stacked arrays."""
  layers = params["layers"]
  if isinstance(layers, (list, tuple)):
    return list(layers)
  count = jax.tree.leaves(layers)[0].shape[0]
  return [jax.tree.map(lambda w, l=l: w[l], layers) for l in range(count)]


def unstack_layers(params: Params) -> Params:
  """``params`` with the stacked layers as a list of per-layer dicts, for the unrolled
  (``per_layer``) cached forward. Done before a decode loop, the slices are copied once per
  dispatch rather than at every step on XLA:CPU (once per version: ``Engine.decode_params``)."""
  return dict(params, layers=layer_list(params))


CacheLayout = Literal["stacked", "per_layer"]
POSITION_AXIS = {("stacked", "k"): 3, ("stacked", "v"): 3, ("per_layer", "k"): 3,
                 ("per_layer", "v"): 2}
"""The positions axis of the ``k`` / ``v`` arrays in each cache layout."""


def cache_layout(cache: Cache) -> CacheLayout:
  return "per_layer" if isinstance(cache["k"], (tuple, list)) else "stacked"


# LoRA (rlx.models.lora), per target: the einsum subscripts of its input (after b, t), its weight and its output
LORA_EQUATIONS = {"q": ("d", "dhe", "he"), "k": ("d", "dke", "ke"), "v": ("d", "dke", "ke"),
                  "o": ("he", "hed", "d"), "gate": ("d", "df", "f"), "up": ("d", "df", "f"),
                  "down": ("f", "fd", "d")}


def matmul(x: jax.Array, w: jax.Array, contract: int) -> jax.Array:
  """``x`` [B, T, in...] times ``w`` [in..., out...] over the ``contract`` input dims, as one
  2-D matmul: the einsum ``bt{in},{in}{out}->bt{out}``."""
  lead, inner = x.shape[:x.ndim - contract], x.shape[x.ndim - contract:]
  k = math.prod(inner)
  y = jnp.dot(x.reshape(-1, k), w.reshape(k, -1))
  return y.reshape(*lead, *w.shape[contract:])


def lora_adapted(x: jax.Array, p: dict, target: str, y: jax.Array, scale: float,
                 dropout: float = 0.0, adapter: jax.Array | None = None) -> jax.Array:
  """``y`` (the base projection of ``x`` [B, T, in...]) plus the adapter's low-rank path,
  when the layer ``p`` holds one for ``target``; with ``dropout`` and a ``lora_key`` in the
  layer, the adapter's input is dropped out (inverted dropout). A layer holding an adapter
  bank adds each row's own adapter (``bank_adapted``; ``adapter``: int [B])."""
  if f"{target}_bank_a" in p:
    y = bank_adapted(x, p, target, y, adapter)
  a = p.get(f"{target}_lora_a")
  if a is None:
    return y
  inputs, _, outputs = LORA_EQUATIONS[target]
  if dropout and "lora_key" in p:
    key = jax.random.fold_in(p["lora_key"], list(LORA_EQUATIONS).index(target))
    keep = jax.random.bernoulli(key, 1.0 - dropout, x.shape)
    x = jnp.where(keep, x / (1.0 - dropout), 0).astype(x.dtype)
  low = jnp.einsum(f"bt{inputs},{inputs}r->btr", x, a.astype(x.dtype))
  up = jnp.einsum(f"btr,r{outputs}->bt{outputs}", low, p[f"{target}_lora_b"].astype(x.dtype))
  return y + (scale * up).astype(y.dtype)


def bank_adapted(x: jax.Array, p: dict, target: str, y: jax.Array,
                 adapter: jax.Array | None) -> jax.Array:
  """``y`` plus, for each row b, the low-rank path of adapter ``adapter[b]`` of the layer's
  bank (``rlx.models.lora.bank``: ``{target}_bank_a`` [N, in..., r] and ``{target}_bank_b``
  [N, r, out...], each B already scaled by its adapter's alpha / r); a row whose id is outside
  0..N-1 (-1) gets none. Every row computes its input's product with all N adapters' A (N r
  columns, a small matmul beside the projection) and keeps its own; the masked products then
  go through every B in one matmul, so that a decode step serving many adapters costs two
  dense matmuls per projection and no gather of weights per row."""
  if adapter is None:
    raise ValueError(f"the layer holds an adapter bank ({target}_bank_a) but no row names its "
                     "adapter: a bank decodes through a cache that holds 'adapter' ids")
  inputs, _, outputs = LORA_EQUATIONS[target]
  a, b = p[f"{target}_bank_a"], p[f"{target}_bank_b"]
  low = jnp.einsum(f"bt{inputs},n{inputs}r->btnr", x, a.astype(x.dtype))
  low = low * jax.nn.one_hot(adapter, a.shape[0], dtype=x.dtype)[:, None, :, None]
  up = jnp.einsum(f"btnr,nr{outputs}->bt{outputs}", low, b.astype(x.dtype))
  return y + up.astype(y.dtype)



def rope_inv_freq(arch: ArchConfig) -> np.ndarray:
  """Inverse RoPE frequencies [E/2] in float32, with 'llama3' or 'linear' scaling."""
  E = arch.head_dim
  inv_freq = 1.0 / (arch.rope_theta ** (np.arange(0, E, 2, dtype=np.float64) / E))
  if arch.rope_scaling == "linear":
    inv_freq = inv_freq / arch.rope_factor
  elif arch.rope_scaling == "llama3":
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the
    # band between interpolated smoothly.
    low_wavelen = arch.rope_original_max_len / arch.rope_low_freq_factor
    high_wavelen = arch.rope_original_max_len / arch.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / arch.rope_factor, inv_freq)
    smooth = ((arch.rope_original_max_len / wavelen - arch.rope_low_freq_factor)
              / (arch.rope_high_freq_factor - arch.rope_low_freq_factor))
    smoothed = (1 - smooth) * scaled / arch.rope_factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    inv_freq = np.where(medium, smoothed, scaled)
  return inv_freq.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
  """Rotary embedding, half-split layout. x [B, T, N, E], positions [B, T]."""
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, E/2]
  cos = jnp.concatenate([jnp.cos(angles)] * 2, -1)[:, :, None, :].astype(x.dtype)
  sin = jnp.concatenate([jnp.sin(angles)] * 2, -1)[:, :, None, :].astype(x.dtype)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], -1)
  return x * cos + rotated * sin


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """RMSNorm computed in float32, scaled in the input dtype (as Hugging Face does)."""
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight.astype(x.dtype) * normed.astype(x.dtype)


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """Plain softmax attention in float32. q [B,T,H,E], k/v [B,S,K,E], mask [B,T,S] -> [B,T,H,E]."""
  B, T, H, E = q.shape
  K = k.shape[2]
  q = q.reshape(B, T, K, H // K, E).astype(jnp.float32)
  scores = jnp.einsum("btkge,bske->bkgts", q, k.astype(jnp.float32)) / math.sqrt(E)
  scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bkgts,bske->btkge", probs, v.astype(jnp.float32))
  return out.reshape(B, T, H, E).astype(v.dtype)


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                     keys_position_minor: bool = False) -> jax.Array:
  """Softmax attention over one layer's cache. q [B,T,H,E], v [B,K,S,E], mask [B,T,S], and
  k [B,K,S,E], or [B,K,E,S] with ``keys_position_minor``.

  Both matmuls take (B, K) as leading batch dims, so the cache is read in its own layout."""
  B, T, H, E = q.shape
  K = k.shape[1]
  q = q.reshape(B, T, K, H // K, E).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, E] (small)
  scores = jnp.einsum("bkgte,bkes->bkgts" if keys_position_minor else "bkgte,bkse->bkgts", q, k,
                      preferred_element_type=jnp.float32)
  scores = jnp.where(mask[:, None, None], scores / math.sqrt(E), -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgts,bkse->bkgte", probs, v, preferred_element_type=jnp.float32)
  return out.transpose(0, 3, 1, 2, 4).reshape(B, T, H, E).astype(v.dtype)


def fused_attention(q, k, v, mask: jax.Array | None) -> jax.Array:
  """``jax.nn.dot_product_attention``; with ``mask=None`` it is plain causal, which lets
  the GPU use cuDNN flash attention."""
  if mask is None:
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)
  return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None])


@dataclasses.dataclass(frozen=True)
class Transformer:
  """How to run one architecture: static (hashable), passed to jit as a closure.

  Attributes:
    arch: the architecture.
    dtype: compute dtype of activations and matmuls.
    attention: 'fused' (jax.nn.dot_product_attention) or 'reference' (einsum).
    remat: activation checkpointing per layer: 'none', 'full', 'dots', 'dots_no_batch'.
    lora_scale: alpha / rank of the LoRA adapters a layer may hold (``rlx.models.lora``).
    lora_dropout: dropout on the adapters' input, where a layer holds a ``lora_key``.
    row_sharding: how a batch's rows lie on the learning mesh (a ``NamedSharding`` whose
      first dim is the rows), or None. A forward pass without a cache keeps every layer's
      activations sharded so, wherever the rows divide evenly. Without it XLA's sharding
      propagation may follow the FSDP-sharded weights instead and replicate the activations:
      every device then computes the whole batch (seen: SmolLM2-135M over 8 CPU devices,
      7.5 GB of temporaries per device with remat off, against 1.0 GB with the rows kept).
  """

  arch: ArchConfig
  dtype: Any = jnp.float32
  attention: Literal["fused", "reference"] = "fused"
  remat: Literal["none", "full", "dots", "dots_no_batch"] = "none"
  lora_scale: float = 1.0
  lora_dropout: float = 0.0
  row_sharding: Any = None

  def constrain_rows(self, x: jax.Array) -> jax.Array:
    """``x`` [B, ...] pinned to ``row_sharding`` (when set and B divides over its devices)."""
    sharding = self.row_sharding
    if sharding is None:
      return x
    axes = sharding.spec[0] if len(sharding.spec) else None
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    shards = math.prod(sharding.mesh.shape[axis] for axis in axes)
    if shards <= 1 or x.shape[0] % shards:
      return x
    return jax.lax.with_sharding_constraint(x, sharding)

  def init(self, key: jax.Array, param_dtype: Any = jnp.float32) -> Params:
    return init_params(self.arch, key, param_dtype)

  def init_cache(self, batch: int, max_len: int, layout: CacheLayout = "stacked") -> Cache:
    """An empty KV cache of ``max_len`` slots for ``batch`` rows."""
    a = self.arch
    L, K, E = a.num_layers, a.num_kv_heads, a.head_dim
    zeros = lambda *shape: jnp.zeros(shape, self.dtype)
    if layout == "stacked":
      k, v = zeros(L, batch, K, max_len, E), zeros(L, batch, K, max_len, E)
    else:
      k = tuple(zeros(batch, K, E, max_len) for _ in range(L))
      v = tuple(zeros(batch, K, max_len, E) for _ in range(L))
    return {"k": k, "v": v, "valid": jnp.zeros((batch, max_len), bool),
            "index": jnp.zeros((batch,), jnp.int32)}

  def hidden_states(self, params: Params, tokens: jax.Array, mask: jax.Array | None = None,
                    cache: Cache | None = None, attend_len: int | None = None, *,
                    segment_ids: jax.Array | None = None,
                    positions: jax.Array | None = None,
                    group_ids: jax.Array | None = None,
                    shared: jax.Array | None = None) -> tuple[jax.Array, Cache | None]:
    """Final (normed) hidden states [B, T, D] and the updated cache.

    Args:
      params: the parameter tree.
      tokens: int [B, T].
      mask: bool [B, T], True on real tokens; None means no padding.
      cache: a KV cache to extend, or None for a plain forward pass.
      attend_len: with a cache, attend to its first ``attend_len`` slots only (static), so
        that a decode step costs what the filled part of the cache costs, not its length.
        Rows that matter must keep ``index + T <= attend_len``; other rows stay finite.
      segment_ids: int [B, T], without a cache: packed rows (``rlx.update.packing``), where a
        token attends only to earlier tokens of its own segment; negative ids are padding.
      positions: int [B, T], with ``segment_ids``: each token's position in its own sequence
        (the rotary positions restart at 0 with each segment).
      group_ids, shared: int and bool [B, T], with ``segment_ids``: a prefix shared by several
        segments (``rlx.update.packing``, a GRPO group's prompt placed once). A token also
        attends to the earlier ``shared`` tokens of its own group: the segments of one group
        continue one prefix, each after it as if it came right after it.
    """
    a = self.arch
    if tokens.ndim != 2:
      raise ValueError(f"tokens must be [batch, time], got shape {tokens.shape}")
    if (segment_ids is None) != (positions is None) or (segment_ids is not None and
                                                         cache is not None):
      raise ValueError("segment_ids and positions go together, and only without a cache")
    if (group_ids is None) != (shared is None) or (group_ids is not None and segment_ids is None):
      raise ValueError("group_ids and shared go together, and only with segment_ids")
    B, T = tokens.shape
    if segment_ids is not None:
      mask = segment_ids >= 0
    real = jnp.ones((B, T), bool) if mask is None else mask.astype(bool)
    count = jnp.cumsum(real, axis=1) - 1
    if cache is None:
      slots = jnp.arange(T)
      # [B, T, S]: causal, never a padded key; a padded query sees itself so no row is empty.
      attn_mask = (slots[None, :, None] >= slots[None, None, :]) & (
          real[:, None, :] | (slots[:, None] == slots[None, :])[None])
      if segment_ids is None:
        positions = jnp.maximum(count, 0)
      else:  # and never a key of another segment (but its group's shared prefix)
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        if group_ids is not None:
          same |= shared[:, None, :] & (group_ids[:, :, None] == group_ids[:, None, :])
        attn_mask &= same
      use_causal_only = mask is None
    else:
      positions = jnp.maximum(cache["valid"].sum(-1, keepdims=True) + count, 0)
      S = cache["valid"].shape[1]
      A = S if attend_len is None else min(attend_len, S)
      query_slots = cache["index"][:, None] + jnp.arange(T)[None]  # [B, T]
      # Writes past the end of the cache are dropped (the caller keeps index + T <= S).
      valid = cache["valid"].at[jnp.arange(B)[:, None], query_slots].set(real, mode="drop")
      key_slots = jnp.arange(A)
      # A query always sees its own slot (or the last attended one), so no row is empty.
      own_slot = jnp.minimum(query_slots, A - 1)[..., None]
      attn_mask = (key_slots[None, None, :] <= query_slots[..., None]) & (
          valid[:, None, :A] | (key_slots[None, None, :] == own_slot))
      use_causal_only = False
    x = params["embed"].astype(self.dtype)[tokens]
    inv_freq = rope_inv_freq(a)
    # each row's adapter in a bank (a multi-adapter decode), carried by the cache
    adapter = None if cache is None else cache.get("adapter")
    kept = {} if adapter is None else {"adapter": adapter}
    # XLA:CPU wraps the einsums' gradients in layout copies that 2-D matmuls do without (the
    # learner step 1.2x faster here); XLA:TPU's program moves 3-6% more bytes with them
    flat_matmuls = target_platform() == "cpu"

    def project(h, p, name, equation):
      """One projection, plus its LoRA adapter's low-rank path when the layer holds one."""
      if flat_matmuls:
        y = matmul(h, p[name].astype(self.dtype), len(LORA_EQUATIONS[name][0]))
      else:
        y = jnp.einsum(equation, h, p[name].astype(self.dtype))
      return lora_adapted(h, p, name, y, self.lora_scale, self.lora_dropout, adapter)

    def attention_block(x, p, write_kv, attend):
      """Pre-norm attention. ``write_kv(k, v) -> (keys, values, written)`` stores the new keys
      and values and gives what ``attend(q, keys, values)`` attends to; ``written`` is returned
      alongside the output."""
      h = rms_norm(x, p["attn_norm"], a.rms_norm_eps)
      q = project(h, p, "q", "btd,dhe->bthe")
      k = project(h, p, "k", "btd,dke->btke")
      v = project(h, p, "v", "btd,dke->btke")
      if a.qkv_bias:
        q, k, v = (q + p["q_bias"].astype(self.dtype), k + p["k_bias"].astype(self.dtype),
                   v + p["v_bias"].astype(self.dtype))
      if a.qk_norm:
        q, k = rms_norm(q, p["q_norm"], a.rms_norm_eps), rms_norm(k, p["k_norm"], a.rms_norm_eps)
      q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
      keys, values, written = write_kv(k, v)
      out = attend(q, keys, values)
      attn = project(out, p, "o", "bthe,hed->btd")
      if a.o_bias:
        attn = attn + p["o_bias"].astype(self.dtype)
      return x + attn, written

    def mlp_block(x, p):
      h = rms_norm(x, p["mlp_norm"], a.rms_norm_eps)
      gate = project(h, p, "gate", "btd,df->btf")
      up = project(h, p, "up", "btd,df->btf")
      return x + project(jax.nn.silu(gate) * up, p, "down", "btf,fd->btd")

    if cache is None:
      def attend(q, k, v):
        if self.attention == "reference":
          return reference_attention(q, k, v, attn_mask)
        return fused_attention(q, k, v, None if use_causal_only else attn_mask)

      def layer(x, p):
        x, _ = attention_block(self.constrain_rows(x), p, lambda k, v: (k, v, None), attend)
        return self.constrain_rows(mlp_block(x, p)), None

      if self.remat != "none":
        layer = jax.checkpoint(layer, policy=_REMAT_POLICIES[self.remat])
      if isinstance(params["layers"], (list, tuple)):  # a generator's per-layer weights
        for p in params["layers"]:
          x, _ = layer(x, p)
      else:
        x, _ = jax.lax.scan(layer, x, params["layers"], unroll=unroll.factor())
      return rms_norm(x, params["final_norm"], a.rms_norm_eps), None

    rows = jnp.arange(B)[:, None, None]
    heads = jnp.arange(a.num_kv_heads)[None, :, None]
    write_slots = query_slots[:, None, :]  # [B, 1, T]
    if cache_layout(cache) == "stacked":
      # The whole [L, B, K, S, E] cache is the scan's carry and each layer writes its new
      # keys and values into it in place.
      def cached_layer(carry, xs):
        x, cache_k, cache_v = carry
        p, l = xs

        def write_kv(k, v):
          # [B, T, K, E] -> [B, K, T, E], written at (l, b, head, index[b] + t).
          put = lambda cache, new: cache.at[l, rows, heads, write_slots].set(
              new.transpose(0, 2, 1, 3).astype(cache.dtype), mode="drop")
          k_all, v_all = put(cache_k, k), put(cache_v, v)
          return k_all[l, :, :, :A], v_all[l, :, :, :A], (k_all, v_all)

        attend = lambda q, k, v: cached_attention(q, k, v, attn_mask)
        x, (cache_k, cache_v) = attention_block(x, p, write_kv, attend)
        return (mlp_block(x, p), cache_k, cache_v), None

      (x, new_k, new_v), _ = jax.lax.scan(
          cached_layer, (x, cache["k"], cache["v"]),
          (params["layers"], jnp.arange(a.num_layers)), unroll=unroll.factor())
      x = rms_norm(x, params["final_norm"], a.rms_norm_eps)
      return x, {"k": new_k, "v": new_v, "valid": valid, "index": cache["index"] + T, **kept}

    # Per layer: unrolled, each layer writes its own buffers in place.
    def write_kv(l, k, v):
      # New [B, T, K, E] as [B, K, T, E]: keys at [b, head, :, index[b] + t], values at
      # [b, head, index[b] + t, :].
      k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
      keys = cache["k"][l].at[rows, heads, :, write_slots].set(
          k.astype(self.dtype), mode="drop")
      values = cache["v"][l].at[rows, heads, write_slots].set(v.astype(self.dtype), mode="drop")
      return keys[..., :A], values[:, :, :A], (keys, values)

    attend_minor = lambda q, k, v: cached_attention(q, k, v, attn_mask, keys_position_minor=True)
    new_k, new_v = [], []
    for l, p in enumerate(layer_list(params)):
      x, (keys, values) = attention_block(x, p, functools.partial(write_kv, l), attend_minor)
      x = mlp_block(x, p)
      new_k.append(keys)
      new_v.append(values)
    x = rms_norm(x, params["final_norm"], a.rms_norm_eps)
    return x, {"k": tuple(new_k), "v": tuple(new_v), "valid": valid, "index": cache["index"] + T,
               **kept}

  def unembedding(self, params: Params) -> jax.Array:
    """The unembedding matrix [D, V] (the fused log-prob loss takes it with the hidden states)."""
    if self.arch.tie_word_embeddings:
      return params["embed"].T
    return params["unembed"]

  def logits(self, params: Params, hidden: jax.Array) -> jax.Array:
    """Float32 logits [..., V] from hidden states [..., D]."""
    return jnp.einsum("...d,dv->...v", hidden, self.unembedding(params).astype(hidden.dtype),
                      preferred_element_type=jnp.float32)

  def __call__(self, params: Params, tokens: jax.Array, mask: jax.Array | None = None,
               cache: Cache | None = None,
               attend_len: int | None = None) -> tuple[jax.Array, Cache | None]:
    """Logits [B, T, V] (float32) and the updated cache."""
    hidden, cache = self.hidden_states(params, tokens, mask, cache, attend_len)
    return self.logits(params, hidden), cache
