"""``rlx.unroll``: inside ``unrolled()`` the scans over layers, log-prob chunks and mini-batches
are traced unrolled (no loop left for XLA's cost analysis to count once), with the same values."""

import jax
import jax.numpy as jnp
import numpy as np

from rlx import update
from rlx.config import ArchConfig
from rlx.models import Transformer
from rlx.unroll import factor, unrolled

ARCH = ArchConfig(num_layers=4, vocab_size=2048, hidden_size=32, intermediate_size=64, num_heads=4,
                  num_kv_heads=2, head_dim=8)


def _loops(fn, *args) -> int:
  """While loops in the program as lowered for XLA (before XLA's own optimisations). Every loop
  here runs at least twice (4 layers, 4 chunks of tokens, 2 slices of the vocabulary): a loop of
  one trip stays a loop even unrolled."""
  # a fresh function each time: jit's trace cache does not know of unrolled()
  return jax.jit(lambda *a: fn(*a)).lower(*args).as_text().count("stablehlo.while")


def test_unrolled_layers_compute_the_same_without_a_loop():
  transformer = Transformer(ARCH, jnp.float32, "fused", "full")
  params = transformer.init(jax.random.key(0), jnp.float32)
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, ARCH.vocab_size)
  mask = jnp.ones((2, 16), bool)

  def loss(p):  # the layers' forward and backward, and the chunked log-prob's
    logprobs, entropy = update.sequence_logprobs(transformer, p, tokens, mask, mask,
                                                 impl="xla", chunk=8)
    return jnp.sum(logprobs) + jnp.sum(entropy)

  grad = jax.value_and_grad(loss)
  assert factor() == 1 and _loops(grad, params) >= 3
  with unrolled():
    assert factor() is True and _loops(grad, params) == 0
    flat = jax.jit(lambda p: grad(p))(params)
  assert factor() == 1
  looped = jax.jit(lambda p: grad(p))(params)
  np.testing.assert_allclose(flat[0], looped[0], atol=1e-4)  # a sum of terms of ~8 that cancel
  for a, b in zip(jax.tree.leaves(flat[1]), jax.tree.leaves(looped[1])):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
