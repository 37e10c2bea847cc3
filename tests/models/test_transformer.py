"""The transformer against its references: fused vs plain attention, KV-cache decode vs full
recompute, padding, remat policies, bfloat16."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx.config import ArchConfig
from rlx.models import transformer
from rlx.models.transformer import Transformer

ARCHS = {
    "llama": ArchConfig(family="llama", vocab_size=97, hidden_size=48, intermediate_size=64,
                        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=12,
                        tie_word_embeddings=False, rope_scaling="llama3", rope_factor=8.0,
                        rope_original_max_len=16),
    "qwen2": ArchConfig(family="qwen2", vocab_size=97, hidden_size=48, intermediate_size=64,
                        num_layers=2, num_heads=6, num_kv_heads=2, head_dim=8, qkv_bias=True),
    "qwen3": ArchConfig(family="qwen3", vocab_size=97, hidden_size=48, intermediate_size=64,
                        num_layers=3, num_heads=4, num_kv_heads=1, head_dim=20, qk_norm=True,
                        tie_word_embeddings=False),
}


def _params(arch, seed=0):
  params = transformer.init_params(arch, jax.random.key(seed))
  # Larger-than-init weights and non-trivial norms/biases, so mistakes show.
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  leaves = [p + 0.2 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)]
  return jax.tree.unflatten(treedef, leaves)


def _tokens(seed, batch, length, vocab=97):
  return jax.random.randint(jax.random.key(seed), (batch, length), 0, vocab)


def _left_pad_mask(lengths, total):
  return jnp.arange(total)[None, :] >= (total - jnp.asarray(lengths))[:, None]


@pytest.mark.parametrize("family", ARCHS)
def test_fused_attention_equals_reference(family):
  arch = ARCHS[family]
  params, tokens = _params(arch), _tokens(1, 3, 11)
  mask = _left_pad_mask([11, 7, 3], 11)
  for m in (None, mask):
    fused, _ = Transformer(arch, attention="fused")(params, tokens, m)
    reference, _ = Transformer(arch, attention="reference")(params, tokens, m)
    real = np.ones(tokens.shape, bool) if m is None else np.asarray(m)
    np.testing.assert_allclose(np.asarray(fused)[real], np.asarray(reference)[real], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("family", ARCHS)
def test_left_padding_does_not_change_real_tokens(family):
  arch = ARCHS[family]
  model, params = Transformer(arch), _params(arch)
  tokens = _tokens(2, 1, 6)
  alone, _ = model(params, tokens)
  padded_tokens = jnp.concatenate([jnp.full((1, 4), 5), tokens], axis=1)
  padded, _ = model(params, padded_tokens, _left_pad_mask([6], 10))
  np.testing.assert_allclose(padded[:, 4:], alone, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("layout", ["stacked", "per_layer"])
@pytest.mark.parametrize("family", ARCHS)
def test_kv_cache_decode_equals_full_recompute(family, layout):
  arch = ARCHS[family]
  model, params = Transformer(arch), _params(arch)
  total, prompt = 12, 5
  tokens = _tokens(3, 3, total)
  # Prompts of lengths 5, 3, 1, left-padded to 5; then one token at a time.
  lengths = [5, 3, 1]
  mask = jnp.concatenate([_left_pad_mask(lengths, prompt), jnp.ones((3, total - prompt), bool)], 1)
  full, _ = model(params, tokens, mask)
  step = jax.jit(model.__call__)
  cache = model.init_cache(3, 16, layout)
  logits, cache = step(params, tokens[:, :prompt], mask[:, :prompt], cache)
  pieces = [logits]
  for t in range(prompt, total):
    logits, cache = step(params, tokens[:, t:t + 1], None, cache)
    pieces.append(logits)
  decoded = jnp.concatenate(pieces, axis=1)
  real = np.asarray(mask)
  np.testing.assert_allclose(np.asarray(decoded)[real], np.asarray(full)[real], atol=2e-5, rtol=2e-5)
  chex.assert_trees_all_equal(cache["index"], jnp.full((3,), total))
  assert step._cache_size() == 2  # one trace for the prefill shape, one for decode


@pytest.mark.parametrize("layout", ["stacked", "per_layer"])
def test_cache_rows_can_be_at_different_offsets(layout):
  """Continuous batching: rows are filled at different times and decode together."""
  arch = ARCHS["qwen2"]
  model, params = Transformer(arch), _params(arch)
  a, b = _tokens(4, 1, 9), _tokens(5, 1, 6)
  cache = model.init_cache(2, 16, layout)
  # Row 0 prefills 7 tokens; row 1 prefills 4 (written with a padded batch, then advanced).
  first = jnp.concatenate([a[:, :7], jnp.pad(b[:, :4], ((0, 0), (3, 0)))], 0)
  mask = jnp.stack([jnp.ones(7, bool), jnp.arange(7) >= 3])
  _, cache = model(params, first, mask, cache)
  out0, cache = model(params, jnp.concatenate([a[:, 7:8], b[:, 4:5]]), None, cache)
  out1, cache = model(params, jnp.concatenate([a[:, 8:9], b[:, 5:6]]), None, cache)
  full_a, _ = model(params, a)
  full_b, _ = model(params, b)
  np.testing.assert_allclose(out0[0, 0], full_a[0, 7], atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(out1[0, 0], full_a[0, 8], atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(out0[1, 0], full_b[0, 4], atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(out1[1, 0], full_b[0, 5], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("remat", ["full", "dots", "dots_no_batch"])
def test_remat_policies_give_the_same_values_and_gradients(remat):
  arch = ARCHS["llama"]
  params, tokens = _params(arch), _tokens(6, 2, 8)

  def loss(params, model):
    hidden, _ = model.hidden_states(params, tokens)
    return jnp.mean(model.logits(params, hidden) ** 2)

  plain = jax.value_and_grad(loss)(params, Transformer(arch))
  checkpointed = jax.value_and_grad(loss)(params, Transformer(arch, remat=remat))
  chex.assert_trees_all_close(checkpointed, plain, atol=1e-6, rtol=1e-5)


def test_bfloat16_compute_is_close_to_float32():
  arch = ARCHS["qwen3"]
  params, tokens = _params(arch), _tokens(7, 2, 8)
  f32, _ = Transformer(arch)(params, tokens)
  bf16_params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
  bf16, _ = Transformer(arch, dtype=jnp.bfloat16)(bf16_params, tokens)
  assert bf16.dtype == jnp.float32
  np.testing.assert_allclose(bf16, f32, atol=0.15 * float(jnp.abs(f32).max()))


def test_llama3_rope_scaling_matches_the_formula():
  arch = ArchConfig(head_dim=16, rope_theta=10000.0, rope_scaling="llama3", rope_factor=8.0,
                    rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_len=64)
  base = 1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16)
  expected = []
  for f in base:
    wavelen = 2 * np.pi / f
    if wavelen < 64 / 4:
      expected.append(f)
    elif wavelen > 64 / 1:
      expected.append(f / 8)
    else:
      smooth = (64 / wavelen - 1) / (4 - 1)
      expected.append((1 - smooth) * f / 8 + smooth * f)
  np.testing.assert_allclose(transformer.rope_inv_freq(arch), expected, rtol=1e-6)
  # All three bands occur in this test.
  assert len({round(e / b, 6) for e, b in zip(expected, base)}) >= 3


def test_bad_token_shape_is_refused():
  arch = ARCHS["llama"]
  with pytest.raises(ValueError, match=r"\[batch, time\]"):
    Transformer(arch)(_params(arch), jnp.zeros((4,), jnp.int32))


@pytest.mark.parametrize("equation, contract", [
    ("btd,dhe->bthe", 1), ("btd,df->btf", 1), ("bthe,hed->btd", 2)])
def test_flat_matmul_equals_the_einsum(equation, contract):
  rng = np.random.default_rng(0)
  x_dims, w_dims = equation.split("->")[0].split(",")
  size = dict(b=3, t=5, d=8, h=4, e=6, f=7)
  x = rng.normal(size=[size[c] for c in x_dims]).astype(np.float32)
  w = rng.normal(size=[size[c] for c in w_dims]).astype(np.float32)
  np.testing.assert_allclose(transformer.matmul(x, w, contract), jnp.einsum(equation, x, w),
                             rtol=1e-5, atol=1e-5)


def test_the_cpu_s_flat_matmuls_give_the_accelerators_einsum_forward_and_gradients():
  """On CPU the projections are 2-D matmuls; traced for a TPU they stay einsums (XLA:TPU moves
  fewer bytes with them): both compute the same values and gradients."""
  from rlx.kernels import compiling_for

  arch = ARCHS["qwen2"]
  params, tokens = _params(arch), _tokens(2, 3, 9)
  model = Transformer(arch)
  loss = lambda p: jnp.sum(model.hidden_states(p, tokens, _left_pad_mask([9, 6, 4], 9))[0] ** 2)
  flat = jax.jit(jax.value_and_grad(loss)).lower(params)
  with compiling_for("tpu"):  # traced as for a TPU, run here
    einsum = jax.jit(jax.value_and_grad(loss)).lower(params)
  assert flat.as_text() != einsum.as_text()  # two programs
  chex.assert_trees_all_close(flat.compile()(params), einsum.compile()(params), rtol=1e-4,
                              atol=1e-4)
