"""Log-prob of the target token and entropy of the policy, from hidden states and the
unembedding matrix, without materialising the ``[T, V]`` logits.

    logprobs, entropy = fused_logprobs(hidden[T, D], unembed[D, V], targets[T])

For logits ``z = hidden @ unembed / temperature`` (accumulated in float32),
``lse = logsumexp(z)``, ``p = softmax(z)``:

    logprobs[t] = z[t, targets[t]] - lse[t]
    entropy[t]  = lse[t] - sum_v p[t, v] z[t, v]          (= -sum_v p log p)

Implementations, all equal to ``reference`` in values and gradients (tests):

- ``reference``: the plain version; holds ``[T, V]`` float32 logits (and more in
  the backward pass).
- ``xla``: the forward pass scans over chunks of tokens; a custom VJP's backward
  pass scans over slices of the vocabulary, recomputing each slice's logits
  from the saved ``lse``: ``dz = g_lp * (onehot - p) - g_H * p * (log p + H)``.
  Memory is a few ``[chunk, V]`` / ``[T, slice]`` tiles.
- ``pallas``: tiled Pallas kernels (``rlx.kernels.pallas_logprobs``): Triton on
  GPU, Mosaic on TPU; blocks of masked-out tokens are skipped.

``impl="auto"`` picks ``pallas`` on GPU and TPU and ``xla`` on CPU. An optional
``mask`` [T] marks the tokens whose log-probs are needed; the others get 0
(and no gradient) in every implementation.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from rlx import unroll
from rlx.kernels.pallas_logprobs import pallas_logprobs

log = logging.getLogger(__name__)

Impl = Literal["auto", "reference", "xla", "pallas"]
DEFAULT_CHUNK = 128  # forward: tokens per chunk, [128, V] float32 tiles (16 MiB at V=32k)
VOCAB_CHUNK = 1024  # backward: vocabulary entries per slice, [T, 1024] float32 tiles


def reference_logprobs(hidden: jax.Array, unembed: jax.Array, targets: jax.Array,
                       temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """Plain full-logits log-probs and entropy. hidden [T, D], unembed [D, V], targets [T]."""
  logits = jnp.einsum("td,dv->tv", hidden, unembed, preferred_element_type=jnp.float32)
  logits = logits / temperature
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  target_logprobs = jnp.take_along_axis(log_probs, targets[:, None], axis=-1)[:, 0]
  entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
  return target_logprobs, entropy


def _chunk_stats(hidden_chunk, unembed, target_chunk, temperature):
  """lse, target log-prob and entropy [C] of one chunk of tokens (its [C, V] logits are temporary)."""
  logits = jnp.einsum("cd,dv->cv", hidden_chunk, unembed,
                      preferred_element_type=jnp.float32) / temperature
  lse = jax.nn.logsumexp(logits, axis=-1)
  log_probs = logits - lse[:, None]
  target_logprob = jnp.take_along_axis(log_probs, target_chunk[:, None], axis=-1)[:, 0]
  # -sum p log p, not lse - sum p z: the latter cancels badly when the logits are large.
  entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
  return lse, target_logprob, entropy


def _to_chunks(x: jax.Array, chunk: int) -> jax.Array:
  return x.reshape(x.shape[0] // chunk, chunk, *x.shape[1:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _chunked(hidden, unembed, targets, chunk: int, temperature: float):
  return _chunked_forward(hidden, unembed, targets, chunk, temperature)[0]


def _chunked_forward(hidden, unembed, targets, chunk, temperature):
  def body(_, xs):
    hidden_chunk, target_chunk = xs
    lse, logprobs, entropy = _chunk_stats(hidden_chunk, unembed, target_chunk, temperature)
    return None, (logprobs, entropy, lse)

  _, (logprobs, entropy, lse) = jax.lax.scan(
      body, None, (_to_chunks(hidden, chunk), _to_chunks(targets, chunk)),
      unroll=unroll.factor())
  logprobs, entropy, lse = (x.reshape(-1) for x in (logprobs, entropy, lse))
  return (logprobs, entropy), (hidden, unembed, targets, lse, entropy)


def _chunked_backward(chunk, temperature, residuals, cotangents):
  """Recomputes the logits one vocabulary slice at a time, for all tokens at once:
  ``d_unembed[:, slice] = hidden.T @ dz`` is written in place, ``d_hidden`` accumulates
  ``dz @ unembed[:, slice].T`` in a small [T, D] carry. (Slicing the vocabulary
  rather than the tokens avoids re-reading and re-writing a [D, V] accumulator per chunk.)"""
  hidden, unembed, targets, lse, entropy = residuals
  g_logprobs, g_entropy = cotangents
  V = unembed.shape[1]
  width = min(VOCAB_CHUNK, V)

  def slice_grads(d_hidden, d_unembed, start, size):
    w = jax.lax.dynamic_slice_in_dim(unembed, start, size, axis=1)
    logits = jnp.einsum("td,dv->tv", hidden, w, preferred_element_type=jnp.float32) / temperature
    log_probs = logits - lse[:, None]
    probs = jnp.exp(log_probs)
    d_logits = -probs * (g_logprobs[:, None] + g_entropy[:, None] * (log_probs + entropy[:, None]))
    cols = targets - start  # the onehot term, for targets inside this slice
    inside = (cols >= 0) & (cols < size)
    d_logits = d_logits.at[jnp.arange(targets.shape[0]), jnp.clip(cols, 0, size - 1)].add(
        jnp.where(inside, g_logprobs, 0.0))
    d_logits = d_logits / temperature
    d_hidden = d_hidden + jnp.einsum("tv,dv->td", d_logits, w, preferred_element_type=jnp.float32)
    d_w = jnp.einsum("td,tv->dv", hidden, d_logits, preferred_element_type=jnp.float32)
    # Each slice of d_unembed is written once: store it in the output dtype straight away.
    return d_hidden, jax.lax.dynamic_update_slice_in_dim(d_unembed, d_w.astype(unembed.dtype),
                                                         start, axis=1)

  def body(carry, j):
    return slice_grads(*carry, j * width, width), None

  carry = (jnp.zeros(hidden.shape, jnp.float32), jnp.zeros(unembed.shape, unembed.dtype))
  carry, _ = jax.lax.scan(body, carry, jnp.arange(V // width), unroll=unroll.factor())
  if V % width:  # the last, narrower slice
    carry = slice_grads(*carry, V - V % width, V % width)
  d_hidden, d_unembed = carry
  return d_hidden.astype(hidden.dtype), d_unembed, None


_chunked.defvjp(_chunked_forward, _chunked_backward)


def xla_logprobs(hidden: jax.Array, unembed: jax.Array, targets: jax.Array,
                 temperature: float = 1.0, chunk: int = DEFAULT_CHUNK) -> tuple[jax.Array, jax.Array]:
  """Chunked over tokens with a recomputing custom VJP; never holds ``[T, V]``."""
  T = hidden.shape[0]
  chunk = min(chunk, T)
  padded = -(-T // chunk) * chunk
  if padded != T:
    hidden = jnp.pad(hidden, ((0, padded - T), (0, 0)))
    targets = jnp.pad(targets, (0, padded - T))
  logprobs, entropy = _chunked(hidden, unembed, targets, chunk, float(temperature))
  return logprobs[:T], entropy[:T]


def _masked_xla(hidden, unembed, targets, mask, *, temperature: float, chunk: int):
  return tuple(jnp.where(mask, x, 0.0)
               for x in xla_logprobs(hidden, unembed, targets, temperature, chunk))


def _over_rows(kernel, rows: NamedSharding, hidden, unembed, targets, mask):
  """``kernel`` under ``shard_map``: tokens split as ``rows`` says, the unembedding whole
  (gathered once, outside any loop): no collective runs inside the kernel's loops."""
  axis = rows.spec[0] if rows.spec else None  # None: every device takes every token
  split = PartitionSpec(axis)
  if mask is None:
    mask = jnp.ones(targets.shape, bool)
  mapped = jax.shard_map(kernel, mesh=rows.mesh,
                         in_specs=(PartitionSpec(axis, None), PartitionSpec(), split, split),
                         out_specs=(split, split), check_vma=False)
  return mapped(hidden, unembed, targets, mask)


_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("rlx_kernels_target",
                                                                     default=None)
_SAID: set[str] = set()


@contextlib.contextmanager
def compiling_for(platform: str):
  """Within it, ``fused_logprobs`` chooses and traces its kernels for ``platform`` ('tpu',
  'gpu' / 'cuda') instead of the backend this process runs on: for compiling ahead of time for
  a device that is not here (``benchmarks/aot_compile.py``)."""
  token = _TARGET.set(platform)
  try:
    yield
  finally:
    _TARGET.reset(token)


def target_platform() -> str:
  """The platform kernels are traced for: ``compiling_for``'s, else this process's backend."""
  return _TARGET.get() or jax.default_backend()


def _pallas_runs_on(backend: str) -> str | None:
  """Why the Pallas kernels cannot run on ``backend``, or None when they can."""
  if backend == "tpu":
    return None
  if backend not in ("gpu", "cuda"):
    return f"the Pallas kernels are written for NVIDIA GPUs and TPUs, not {backend!r}"
  if _TARGET.get() is None:  # a real GPU: Triton's bf16 matmuls need Ampere (sm_80) or newer
    capability = getattr(jax.devices()[0], "compute_capability", None)
    if capability is not None and float(capability) < 8.0:
      return f"the GPU's compute capability {capability} is older than Ampere's 8.0"
  return None


def choose_impl(impl: Impl, backend: str) -> str:
  """The implementation ``impl`` means on ``backend`` ('cpu', 'gpu' / 'cuda' / 'rocm', 'tpu'):
  'auto' picks Pallas where its kernels run, and XLA elsewhere (saying why, once)."""
  if impl != "auto":
    return impl
  if backend == "cpu":
    return "xla"
  reason = _pallas_runs_on(backend)
  if reason is None:
    return "pallas"
  if reason not in _SAID:
    _SAID.add(reason)
    log.warning("fused log-probs: %s; impl='auto' uses the XLA path", reason)
  return "xla"


def fused_logprobs(hidden: jax.Array, unembed: jax.Array, targets: jax.Array,
                   mask: jax.Array | None = None, *, impl: Impl = "auto", temperature: float = 1.0,
                   chunk: int = DEFAULT_CHUNK, interpret: bool = False,
                   rows: NamedSharding | None = None,
                   **block_sizes) -> tuple[jax.Array, jax.Array]:
  """Target log-probs [T] and entropy [T] (float32) of ``softmax(hidden @ unembed / temperature)``.

  Args:
    hidden: [T, D] final hidden states (any float dtype).
    unembed: [D, V] unembedding matrix.
    targets: int [T] token ids whose log-probs are wanted.
    mask: bool [T] tokens whose log-probs are needed (others get 0); None: all.
    impl: 'reference', 'xla' (chunked), 'pallas', or 'auto'.
    temperature: divides the logits (use the sampling temperature, so that
      learner log-probs match the behaviour log-probs of the sampler).
    chunk: tokens per chunk of the 'xla' implementation.
    interpret: run the Pallas kernels in the interpreter (tests on CPU).
    rows: how the tokens are split over a mesh (a ``NamedSharding`` of dimension 0, e.g.
      the learner's batch rows over ``(data, fsdp)``, or replicated). With ``rows`` on
      several devices, 'pallas' and 'xla' run under ``shard_map``: each device on its own
      tokens (all of them when replicated), with the whole unembedding (gathered once).
      XLA cannot partition a Pallas kernel; the 'xla' loops then hold no collective.
    **block_sizes: ``block_t`` / ``block_v`` of the Pallas kernels.
  """
  if hidden.ndim != 2 or unembed.ndim != 2 or targets.ndim != 1:
    raise ValueError(f"expected hidden [T, D], unembed [D, V], targets [T]; got {hidden.shape}, "
                     f"{unembed.shape}, {targets.shape}")
  if hidden.shape[1] != unembed.shape[0] or hidden.shape[0] != targets.shape[0]:
    raise ValueError(f"shapes disagree: hidden {hidden.shape}, unembed {unembed.shape}, "
                     f"targets {targets.shape}")
  backend = target_platform()
  impl = choose_impl(impl, backend)
  if impl == "reference":
    out = reference_logprobs(hidden, unembed, targets, temperature)
  elif impl == "xla":
    if rows is not None and rows.mesh.size > 1:
      # Per device too: left to XLA's partitioner, a model-sharded unembedding puts an
      # all-reduce of logits inside the chunk loop, beside the backward's independent one;
      # XLA:CPU's two device threads can then meet them in opposite orders and deadlock.
      return _over_rows(functools.partial(_masked_xla, temperature=temperature, chunk=chunk),
                        rows, hidden, unembed, targets, mask)
    out = xla_logprobs(hidden, unembed, targets, temperature, chunk)
  elif impl == "pallas":
    variant = "tpu" if backend == "tpu" else "gpu"
    if backend == "cpu" and not interpret:
      raise ValueError("impl='pallas' runs on GPU or TPU; on CPU use impl='xla' (or interpret=True "
                       "to run the kernels in Pallas' interpreter)")
    kernel = functools.partial(pallas_logprobs, variant=variant, temperature=temperature,
                               interpret=interpret, **block_sizes)
    # XLA cannot partition a Pallas kernel: on a mesh of several devices it always runs under
    # shard_map, on each device's rows (on every row, when the rows are replicated)
    if rows is None or rows.mesh.size == 1:
      return kernel(hidden, unembed, targets, mask)
    return _over_rows(kernel, rows, hidden, unembed, targets, mask)
  else:
    raise ValueError(f"unknown impl {impl!r}; choose auto, reference, xla or pallas")
  if mask is None:
    return out
  return tuple(jnp.where(mask, x, 0.0) for x in out)
