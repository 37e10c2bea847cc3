"""The Pallas kernels (GPU: Triton lowering, TPU: Mosaic) in interpret mode on CPU, against the
full-logits reference: values and gradients, fp32 and bf16, odd T and V, masks; and dispatch."""

import jax
import jax.numpy as jnp
import pytest

from rlx.kernels import choose_impl, fused_logprobs, pallas_logprobs
from tests.kernels.test_fused_logprobs import _assert_relative_error, _inputs


def _run(fn, hidden, unembed, g_lp, g_h):
  def loss(hidden, unembed):
    lp, ent = fn(hidden, unembed)
    return jnp.sum(lp * g_lp) + jnp.sum(ent * g_h), (lp, ent)

  (_, (lp, ent)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(hidden, unembed)
  return lp, ent, grads


# Few, large blocks: the interpreter is slow. Odd T and V exercise padding and masking.
@pytest.mark.parametrize("variant", ["gpu", "tpu"])
@pytest.mark.parametrize("T, D, V, temperature", [(37, 16, 50, 1.0), (24, 24, 131, 0.7)])  # D=24: padded to 32 on GPU
def test_pallas_equals_reference_fp32(variant, T, D, V, temperature):
  hidden, unembed, targets, g_lp, g_h = _inputs(T * V, T, D, V, scale=2.0)
  pallas = _run(lambda h, u: pallas_logprobs(h, u, targets, variant=variant, block_t=16,
                                             block_v=32 if V < 100 else 64,
                                             temperature=temperature, interpret=True),
                hidden, unembed, g_lp, g_h)
  reference = _run(lambda h, u: fused_logprobs(h, u, targets, impl="reference",
                                               temperature=temperature),
                   hidden, unembed, g_lp, g_h)
  for ours, theirs in zip(jax.tree.leaves(pallas), jax.tree.leaves(reference)):
    _assert_relative_error(ours, theirs, 1e-5)


@pytest.mark.parametrize("variant", ["gpu", "tpu"])
def test_pallas_equals_reference_bf16(variant):
  hidden, unembed, targets, g_lp, g_h = _inputs(11, 40, 32, 96, dtype=jnp.bfloat16)
  pallas = _run(lambda h, u: pallas_logprobs(h, u, targets, variant=variant, block_t=32,
                                             block_v=64, interpret=True), hidden, unembed, g_lp, g_h)
  reference = _run(lambda h, u: fused_logprobs(h, u, targets, impl="reference"),
                   hidden, unembed, g_lp, g_h)
  assert pallas[2][0].dtype == jnp.bfloat16 and pallas[0].dtype == jnp.float32
  for ours, theirs in zip(jax.tree.leaves(pallas), jax.tree.leaves(reference)):
    _assert_relative_error(ours, theirs, 1e-2)


@pytest.mark.parametrize("variant", ["gpu", "tpu"])
def test_bf16_activations_against_fp32_weights(variant):
  """The learner's case: bf16 hidden states, fp32 unembedding (the params' dtype)."""
  hidden, unembed, targets, g_lp, g_h = _inputs(13, 24, 32, 80)
  hidden = hidden.astype(jnp.bfloat16)
  pallas = _run(lambda h, u: pallas_logprobs(h, u, targets, variant=variant, block_t=16,
                                             block_v=32, interpret=True), hidden, unembed, g_lp, g_h)
  reference = _run(lambda h, u: fused_logprobs(h, u, targets, impl="reference"),
                   hidden, unembed, g_lp, g_h)
  assert pallas[2][0].dtype == jnp.bfloat16 and pallas[2][1].dtype == jnp.float32
  for ours, theirs in zip(jax.tree.leaves(pallas), jax.tree.leaves(reference)):
    _assert_relative_error(ours, theirs, 2e-2)


@pytest.mark.parametrize("variant", ["gpu", "tpu"])
def test_masked_tokens_get_zero_and_no_gradient(variant):
  T, D, V = 48, 16, 64
  hidden, unembed, targets, g_lp, g_h = _inputs(5, T, D, V)
  mask = jnp.arange(T) < 20  # the last block of 16 is fully masked (skipped), one is partial
  pallas = _run(lambda h, u: pallas_logprobs(h, u, targets, mask, variant=variant, block_t=16,
                                             block_v=32, interpret=True), hidden, unembed, g_lp, g_h)
  xla = _run(lambda h, u: fused_logprobs(h, u, targets, mask, impl="xla", chunk=16),
             hidden, unembed, g_lp, g_h)
  lp, ent, (d_hidden, _) = pallas
  assert float(jnp.abs(lp[20:]).max()) == 0.0 and float(jnp.abs(ent[20:]).max()) == 0.0
  assert float(jnp.abs(d_hidden[20:]).max()) == 0.0
  for ours, theirs in zip(jax.tree.leaves(pallas), jax.tree.leaves(xla)):
    _assert_relative_error(ours, theirs, 1e-5)


def test_auto_dispatch_by_backend(caplog):
  assert choose_impl("auto", "cpu") == "xla"
  assert choose_impl("auto", "gpu") == "pallas"
  assert choose_impl("auto", "tpu") == "pallas"
  assert choose_impl("reference", "gpu") == "reference"
  with caplog.at_level("WARNING"):  # never a path that cannot run, said once
    assert choose_impl("auto", "rocm") == "xla" and choose_impl("auto", "rocm") == "xla"
  assert sum("not 'rocm'" in record.message for record in caplog.records) == 1


@pytest.mark.parametrize("platform, kernel", [("tpu", "rlx_logprobs_fwd"),
                                              ("cuda", "rlx_logprobs_fwd")])
def test_kernels_trace_for_a_target_platform_that_is_not_here(platform, kernel):
  """Ahead-of-time compilation traces the target's kernels on a CPU machine."""
  from rlx.kernels import compiling_for

  hidden, unembed, targets, *_ = _inputs(2, 16, 16, 40)
  with compiling_for(platform):
    jaxpr = jax.make_jaxpr(lambda h, u: fused_logprobs(h, u, targets))(hidden, unembed)
  assert "pallas_call" in str(jaxpr) and kernel in str(jaxpr)
  assert "pallas_call" not in str(jax.make_jaxpr(
      lambda h, u: fused_logprobs(h, u, targets))(hidden, unembed))  # on CPU: the XLA path


def test_fused_logprobs_runs_pallas_in_interpret_mode():
  hidden, unembed, targets, *_ = _inputs(2, 16, 16, 40)
  lp, ent = fused_logprobs(hidden, unembed, targets, impl="pallas", interpret=True, block_t=16,
                           block_v=32)
  ref_lp, ref_ent = fused_logprobs(hidden, unembed, targets, impl="reference")
  _assert_relative_error(lp, ref_lp, 1e-5)
  _assert_relative_error(ent, ref_ent, 1e-5)


@pytest.mark.parametrize("impl", ["pallas", "xla"])
@pytest.mark.parametrize("replicated", [False, True])
def test_kernels_under_shard_map_over_rows_equal_reference(replicated, impl):
  """On a mesh, the kernels run per device on its own rows (XLA cannot partition the Pallas
  ones; the XLA one's loops then hold no collective; a batch that does not split over the
  devices is replicated, and each device takes every row), the unembedding sharded over the
  model width as FSDP keeps it: values and gradients equal the reference, and the result
  keeps the rows' sharding."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  from rlx import mesh as mesh_lib
  from rlx.config import MeshConfig

  mesh = mesh_lib.make_mesh(MeshConfig(data=2, fsdp=-1), jax.devices()[:4])
  rows = NamedSharding(mesh, P() if replicated else P(("data", "fsdp")))
  T, D, V = 64, 16, 40
  hidden, unembed, targets, g_lp, g_h = _inputs(3, T, D, V, scale=2.0)
  mask = jnp.arange(T) % 16 < 11  # every device's block partly masked
  hidden, targets, mask = (jax.device_put(x, rows) for x in (hidden, targets, mask))
  unembed = jax.device_put(unembed, NamedSharding(mesh, P("fsdp", None)))
  extra = dict(interpret=True, block_t=16, block_v=32) if impl == "pallas" else dict(chunk=16)
  sharded = _run(jax.jit(lambda h, u: fused_logprobs(h, u, targets, mask, impl=impl, rows=rows,
                                                     **extra)), hidden, unembed, g_lp, g_h)
  reference = _run(lambda h, u: fused_logprobs(h, u, targets, mask, impl="reference"),
                   hidden, unembed, g_lp, g_h)
  assert sharded[0].sharding.is_equivalent_to(rows, 1)
  for ours, theirs in zip(jax.tree.leaves(sharded), jax.tree.leaves(reference)):
    _assert_relative_error(ours, theirs, 1e-5)


@pytest.mark.parametrize("variant, scale, temperature", [("gpu", 1e4, 1.0), ("tpu", 1e4, 1.0),
                                                          ("gpu", 30.0, 0.1)])
def test_masked_tokens_with_huge_logits_stay_finite_in_every_impl(variant, scale, temperature):
  """A masked token whose logits exceed exp's range (a large hidden state, a low temperature)
  inside an active block: its log-prob, entropy and gradients are exactly 0, nothing is NaN or
  inf, and the active tokens match the reference."""
  T, D, V = 32, 16, 64
  hidden, unembed, targets, g_lp, g_h = _inputs(7, T, D, V)
  hidden = hidden.at[3].multiply(scale).at[21].multiply(scale)  # masked, in active blocks
  mask = jnp.ones((T,), bool).at[3].set(False).at[21].set(False)
  results = {"pallas": _run(lambda h, u: pallas_logprobs(
      h, u, targets, mask, variant=variant, block_t=16, block_v=32, temperature=temperature,
      interpret=True), hidden, unembed, g_lp, g_h)}
  for impl in ("xla", "reference"):
    results[impl] = _run(lambda h, u, impl=impl: fused_logprobs(
        h, u, targets, mask, impl=impl, temperature=temperature, chunk=16),
        hidden, unembed, g_lp, g_h)
  for name, (lp, ent, (d_hidden, d_unembed)) in results.items():
    for value in (lp, ent, d_hidden, d_unembed):
      assert bool(jnp.isfinite(value).all()), name
    assert float(jnp.abs(lp[jnp.array([3, 21])]).max()) == 0.0, name
    assert float(jnp.abs(d_hidden[jnp.array([3, 21])]).max()) == 0.0, name
  keep = mask
  for name in ("pallas", "xla"):
    lp, ent, (d_hidden, d_unembed) = results[name]
    ref_lp, ref_ent, (ref_dh, ref_du) = results["reference"]
    _assert_relative_error(lp[keep], ref_lp[keep], 1e-5)
    _assert_relative_error(ent[keep], ref_ent[keep], 1e-4)
    _assert_relative_error(d_hidden[keep], ref_dh[keep], 1e-4)
    _assert_relative_error(d_unembed, ref_du, 1e-4)
