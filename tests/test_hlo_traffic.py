"""The memory traffic read from optimized HLO (``rlx.hlo_traffic``) against XLA's own cost
analysis, which the CPU compiler has: the same bytes for plain kernels, slices read through a
fusion, a buffer updated in place and a conditional's costliest branch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx import hlo_traffic


def _compiled(fn, *args, **jit_kwargs):
  return jax.jit(fn, **jit_kwargs).lower(*args).compile()


def _both(compiled):
  ops = hlo_traffic.traffic(compiled.as_text())
  return sum(op.bytes for op in ops), compiled.cost_analysis()["bytes accessed"]


@pytest.mark.parametrize("name", ["matmul", "slice", "in_place", "conditional", "loop"])
def test_bytes_equal_xla_cost_analysis_on_cpu(name):
  big = jnp.ones((1024, 1024))
  programs = {
      "matmul": (lambda x, w: jnp.tanh(x @ w) + 1, (jnp.ones((256, 512)), jnp.ones((512, 128))),
                 {}),
      # The fusion reads 8 of 1024 columns, not the whole array.
      "slice": (lambda b: jnp.sum(b[:, :8] * 2, axis=1), (big,), {}),
      # A donated buffer updated in place: one row read and written, not 4 MiB.
      "in_place": (lambda b, v: b.at[3].set(v), (big, jnp.ones(1024)), {"donate_argnums": 0}),
      "conditional": (lambda p, b: jax.lax.cond(p, lambda: jnp.sum(jnp.sin(b)), lambda: b[0, 0]),
                      (True, big), {}),
      # a loop's body counted once, as XLA does
      "loop": (lambda x, w: jax.lax.fori_loop(0, 10, lambda i, x: jnp.tanh(x @ w), x),
               (jnp.ones((8, 512)), jnp.ones((512, 512))), {}),
  }
  fn, args, kwargs = programs[name]
  ours, xla = _both(_compiled(fn, *args, **kwargs))
  # 64 bytes: XLA also counts the pointer tuples of a while or conditional and the loop's
  # scalar compare (16 and 57 bytes here; see the module docstring)
  assert ours == pytest.approx(xla, rel=1e-3, abs=64)
  if name == "in_place":
    assert ours < 10_000
  if name == "slice":
    assert ours < big.nbytes / 10


def test_flops_from_the_generic_analysis():
  x, w = jnp.ones((64, 96)), jnp.ones((96, 32))
  flops = hlo_traffic.flops(_compiled(jnp.matmul, x, w).as_text())
  assert flops == 2 * 64 * 96 * 32


def test_tiles_are_padded_and_tuples_summed():
  assert hlo_traffic.shape_bytes("bf16[64,2,7,64]{3,2,1,0:T(8,128)(2,1)}") == 64 * 2 * 8 * 128 * 2
  # minor_to_major {0,1}: dimension 0 is the minor one, padded to 128
  assert hlo_traffic.shape_bytes("s32[64,3]{0,1:T(8,128)}") == 128 * 8 * 4
  assert hlo_traffic.shape_bytes("(f32[10]{0}, pred[3,3]{1,0})") == 40 + 9


def test_largest_groups_by_jax_operation():
  def step(x, ws):
    for w in ws:
      x = jnp.tanh(x @ w)
    return x
  ws = [jnp.ones((256, 256)) for _ in range(3)]
  ops = hlo_traffic.traffic(_compiled(step, jnp.ones((8, 256)), ws).as_text())
  top = hlo_traffic.largest(ops, 2)
  assert top[0]["op"].endswith("dot_general") and top[0]["count"] == 3
  assert top[0]["share"] > 0.5 and sum(row["share"] for row in top) <= 1.0
  total = sum(op.bytes for op in ops)
  # each matmul reads its weights and input and writes its output
  assert np.isclose(top[0]["share"] * total, 3 * (256 * 256 + 2 * 8 * 256) * 4, rtol=0.01)


def test_refuses_text_without_an_entry():
  with pytest.raises(ValueError, match="ENTRY"):
    hlo_traffic.traffic("HloModule empty\n")


def test_a_loop_body_counts_once_and_is_marked():
  def program(x, w):
    return jax.lax.fori_loop(0, 10, lambda i, x: jnp.tanh(x @ w), x)
  ops = hlo_traffic.traffic(_compiled(program, jnp.ones((8, 512)), jnp.ones((512, 512))).as_text())
  inside = sum(op.bytes for op in ops if op.in_loop)
  # once: the weights and the carry read, the carry written; not ten times
  assert 512 * 512 * 4 <= inside < 2 * 512 * 512 * 4


def test_a_conditional_counts_the_branch_asked_for():
  big = jnp.ones((1024, 1024))
  text = _compiled(lambda p, b: jax.lax.cond(p, lambda: jnp.sum(jnp.sin(b)), lambda: b[0, 0]),
                   True, big).as_text()
  costliest, cheapest = (sum(op.bytes for op in hlo_traffic.traffic(text, branch))
                         for branch in ("costliest", "cheapest"))
  assert costliest >= big.nbytes > 1000 * cheapest
  with pytest.raises(ValueError, match="cheapest"):
    hlo_traffic.traffic(text, "first")
