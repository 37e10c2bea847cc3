"""The XLA chunked fused log-prob/entropy against the full-logits reference: values and
gradients, odd shapes, bf16, temperature; dispatch and shape errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx.kernels import fused_logprobs


def _inputs(seed, T, D, V, dtype=jnp.float32, scale=1.0):
  k = jax.random.split(jax.random.key(seed), 5)
  hidden = (scale * jax.random.normal(k[0], (T, D))).astype(dtype)
  unembed = (scale * jax.random.normal(k[1], (D, V)) / np.sqrt(D)).astype(dtype)
  targets = jax.random.randint(k[2], (T,), 0, V)
  g_lp, g_h = jax.random.normal(k[3], (T,)), jax.random.normal(k[4], (T,))
  return hidden, unembed, targets, g_lp, g_h


def _assert_relative_error(ours, theirs, tolerance):
  """max |ours - theirs| <= tolerance * max |theirs| (elementwise rtol fails on near-zero entries
  that only differ by summation order)."""
  ours, theirs = np.asarray(ours, np.float32), np.asarray(theirs, np.float32)
  error = np.abs(ours - theirs).max() / np.abs(theirs).max()
  assert error <= tolerance, f"relative error {error:.2e} > {tolerance:.0e}"


def _value_and_grads(impl, hidden, unembed, targets, g_lp, g_h, **kw):
  def loss(hidden, unembed):
    lp, ent = fused_logprobs(hidden, unembed, targets, impl=impl, **kw)
    return jnp.sum(lp * g_lp) + jnp.sum(ent * g_h), (lp, ent)

  (_, (lp, ent)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(hidden, unembed)
  return lp, ent, grads


@pytest.mark.parametrize("T, D, V, chunk", [(37, 16, 50, 8), (64, 32, 257, 16), (5, 8, 11, 128)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_xla_equals_reference_fp32(T, D, V, chunk, temperature):
  inputs = _inputs(T + V, T, D, V, scale=2.0)
  ref = _value_and_grads("reference", *inputs, temperature=temperature)
  xla = _value_and_grads("xla", *inputs, temperature=temperature, chunk=chunk)
  for ours, theirs in zip(jax.tree.leaves(xla), jax.tree.leaves(ref)):
    _assert_relative_error(ours, theirs, 1e-5)


def test_xla_equals_reference_bf16():
  inputs = _inputs(3, 48, 32, 300, dtype=jnp.bfloat16)
  ref = _value_and_grads("reference", *inputs)
  xla = _value_and_grads("xla", *inputs, chunk=16)
  assert xla[0].dtype == jnp.float32 and xla[2][0].dtype == jnp.bfloat16
  for ours, theirs in zip(jax.tree.leaves(xla), jax.tree.leaves(ref)):
    _assert_relative_error(ours, theirs, 1e-2)


def test_reference_by_hand():
  # Two tokens, vocab 2, identity unembedding: logits are the hidden states.
  hidden, unembed = jnp.array([[0.0, 0.0], [np.log(3.0), 0.0]]), jnp.eye(2)
  lp, ent = fused_logprobs(hidden, unembed, jnp.array([0, 0]), impl="reference")
  np.testing.assert_allclose(lp, np.log([0.5, 0.75]), rtol=1e-6)
  np.testing.assert_allclose(ent, [np.log(2.0), -(0.75 * np.log(0.75) + 0.25 * np.log(0.25))], rtol=1e-6)


def test_chunked_path_never_holds_token_by_vocab_logits():
  T, D, V = 512, 64, 16384  # slices of 1024 vocab entries: [T, V] is 16x a slice
  args = (jax.ShapeDtypeStruct((T, D), jnp.float32), jax.ShapeDtypeStruct((D, V), jnp.float32),
          jax.ShapeDtypeStruct((T,), jnp.int32))

  def temp_bytes(impl):
    def loss(h, u, t):
      lp, ent = fused_logprobs(h, u, t, impl=impl, chunk=64)
      return lp.sum() + ent.sum()
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  full_logits = T * V * 4
  assert temp_bytes("reference") >= full_logits
  assert temp_bytes("xla") < full_logits / 2


def test_dispatch_and_errors():
  hidden, unembed, targets, *_ = _inputs(0, 4, 8, 16)
  auto = fused_logprobs(hidden, unembed, targets)
  np.testing.assert_allclose(auto[0], fused_logprobs(hidden, unembed, targets, impl="xla")[0])
  with pytest.raises(ValueError, match="runs on GPU or TPU"):
    fused_logprobs(hidden, unembed, targets, impl="pallas")
  with pytest.raises(ValueError, match="unknown impl"):
    fused_logprobs(hidden, unembed, targets, impl="triton")
  with pytest.raises(ValueError, match="shapes disagree"):
    fused_logprobs(hidden, unembed[:4], targets)
