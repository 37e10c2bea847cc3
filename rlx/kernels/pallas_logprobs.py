"""The Pallas implementation of ``fused_logprobs``: padding, block sizes and the custom VJP
around the GPU (Triton) and TPU (Mosaic) kernels.

Autodiff does not go through ``pallas_call``; ``jax.custom_vjp`` wires the
backward kernels in. The forward pass saves ``lse`` and the entropy per token;
the backward kernels recompute each logit tile from them.

Tokens that do not fill a block are padded with zeros (masked out, so they cost
nothing). The vocabulary: on TPU the last block is ragged (no copy of the
unembedding); on GPU it is padded with zero columns that the kernels mask to
``-inf``. Blocks of tokens whose mask is all False are skipped.

Block sizes: the caller's, or per variant; on TPU shrunk (vocabulary first) until
the kernels' VMEM need fits ``TPU_VMEM_BUDGET``, under the 16 MiB that Mosaic
scopes by default on v5e (32 MiB on v6e), whatever the model width.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp

from rlx.kernels import pallas_gpu, pallas_tpu

Variant = Literal["gpu", "tpu"]
# (tokens per block, vocab entries per block): Triton tiles sized for a GPU SM's
# registers/shared memory; TPU tiles sized for VMEM and the 128-wide MXU.
DEFAULT_BLOCKS = {"gpu": (64, 128), "tpu": (256, 512)}
TPU_VMEM_BUDGET = 14 * 2**20
GPU_BLOCK_D = 64  # GPU: chunk of the model width; shared memory per program is independent of D
_KERNELS = {"gpu": pallas_gpu, "tpu": pallas_tpu}


def _fit(block: int, size: int, smallest: int) -> int:
  """The block, shrunk (by powers of two) for arrays smaller than one block."""
  while block // 2 >= max(size, smallest):
    block //= 2
  return block


def _pad_to(x: jax.Array, multiple: int, axis: int) -> jax.Array:
  extra = -x.shape[axis] % multiple
  if not extra:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _fused(hidden, unembed, targets, mask, variant, vocab_size, blocks, options):
  return _fused_forward(hidden, unembed, targets, mask, variant, vocab_size, blocks, options)[0]


def _fused_forward(hidden, unembed, targets, mask, variant, vocab_size, blocks, options):
  logprob, entropy, lse = _KERNELS[variant].forward(
      hidden, unembed, targets, mask, vocab_size=vocab_size, **dict(blocks), **dict(options))
  return (logprob, entropy), (hidden, unembed, targets, mask, lse, entropy)


def _fused_backward(variant, vocab_size, blocks, options, residuals, cotangents):
  hidden, unembed, targets, mask, lse, entropy = residuals
  # Masked tokens' outputs are constant 0: whatever their cotangents, they add no gradient.
  g_logprob, g_entropy = (jnp.where(mask != 0, g, 0.0) for g in cotangents)
  d_hidden, d_unembed = _KERNELS[variant].backward(
      hidden, unembed, targets, mask, lse, entropy, g_logprob, g_entropy, vocab_size=vocab_size,
      **dict(blocks), **dict(options))
  return d_hidden, d_unembed, None, None


_fused.defvjp(_fused_forward, _fused_backward)


def pallas_logprobs(hidden: jax.Array, unembed: jax.Array, targets: jax.Array,
                    mask: jax.Array | None = None, *, variant: Variant, temperature: float = 1.0,
                    block_t: int | None = None, block_v: int | None = None,
                    block_d: int | None = None,
                    interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """Target log-probs [T] and entropy [T] (float32) with the Pallas kernels.

  Args:
    hidden: [T, D] (bf16 or fp32); unembed: [D, V]; targets: int [T].
    mask: bool [T], False for tokens that need no log-prob (they get 0 and no
      gradient, and whole masked blocks are skipped); None computes every token.
    variant: 'gpu' (Triton lowering) or 'tpu' (Mosaic).
    block_t, block_v: tokens and vocab entries per block (defaults per variant).
    block_d: GPU: the chunk of the model width a logit tile is accumulated over.
    interpret: run the kernels in Pallas' interpreter (CPU tests).
  """
  T, D = hidden.shape
  V = unembed.shape[1]
  default_t, default_v = DEFAULT_BLOCKS[variant]
  chosen = block_t is not None or block_v is not None
  block_t = _fit(block_t or default_t, T, 8)
  block_v = _fit(block_v or default_v, V, 16)
  if variant == "tpu" and not chosen:
    itemsize = max(hidden.dtype.itemsize, unembed.dtype.itemsize)
    while pallas_tpu.vmem_bytes(block_t, block_v, D, itemsize) > TPU_VMEM_BUDGET:
      if block_v > 128:
        block_v //= 2
      elif block_t > 8:
        block_t //= 2
      else:
        break
  blocks = {"block_t": block_t, "block_v": block_v}
  if variant == "gpu":
    # Triton tiles have power-of-two sides (matmul sides >= 16); the width is read in chunks
    # of block_d, so it is padded (with zeros, which add nothing) only when it is not a
    # multiple of one
    block_d = _fit(block_d or GPU_BLOCK_D, D, 16)
    if any(b & (b - 1) for b in (block_t, block_v, block_d)):
      raise ValueError(f"GPU blocks must be powers of two, got block_t={block_t}, "
                       f"block_v={block_v}, block_d={block_d}")
    hidden, unembed = _pad_to(hidden, block_d, 1), _pad_to(unembed, block_d, 0)
    blocks["block_d"] = block_d
  mask = jnp.ones((T,), bool) if mask is None else mask.astype(bool)
  column = lambda x: _pad_to(x.astype(jnp.int32)[:, None], block_t, 0)
  if variant == "gpu":
    unembed = _pad_to(unembed, block_v, 1)
  options = {"temperature": float(temperature), "interpret": interpret}
  logprob, entropy = _fused(_pad_to(hidden, block_t, 0), unembed, column(targets), column(mask),
                            variant, V, tuple(blocks.items()), tuple(options.items()))
  return logprob[:T, 0], entropy[:T, 0]
