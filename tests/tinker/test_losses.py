"""Each Tinker loss, as the service computes it (the fused log-prob kernel, padded buckets,
summed gradients), equals a plain computation from full logits, in value and gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("tinker")

from rlx.models import lora  # noqa: E402
from rlx.tinker.training import Adapter, Base  # noqa: E402
from rlx.tinker.wire import Datum  # noqa: E402
from tests.conftest import FIXTURES  # noqa: E402


@pytest.fixture(scope="module")
def base():
  return Base.load("tiny", str(FIXTURES / "hf" / "llama"), max_length=64)


def _adapter(base, seed):
  adapter = Adapter(base, rank=4, seed=seed)
  key = jax.random.key(seed + 100)  # nonzero B: the adapters act, and every gradient is alive
  leaves, tree = jax.tree.flatten(adapter.adapters)
  keys = jax.random.split(key, len(leaves))
  adapter.adapters = jax.tree.unflatten(
      tree, [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
  return adapter


def _reference_loss(adapter, adapters, rows, loss_fn, config):
  """The loss from full logits, one datum at a time, no padding."""
  params = lora.combine(adapter.base.model.params, adapters)
  total = 0.0
  for tokens, inputs in rows:
    hidden, _ = adapter.transformer.hidden_states(params, tokens[None], jnp.ones((1, len(tokens)), bool))
    logits = adapter.transformer.logits(params, hidden[0])
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits), inputs["target_tokens"][:, None], 1)[:, 0]
    if loss_fn == "cross_entropy":
      total += jnp.sum(-inputs["weights"] * logprobs)
      continue
    ratio = jnp.exp(logprobs - inputs["logprobs"])
    if loss_fn == "gspo":  # the datum's geometric-mean ratio, each token's own gradient
      mask = inputs.get("sequence_ratio_mask", jnp.ones_like(logprobs))
      fixed = jax.lax.stop_gradient(logprobs)
      mean = jnp.sum(mask * (fixed - inputs["logprobs"])) / jnp.sum(mask)
      ratio = jnp.exp(mean + logprobs - fixed)
    a = inputs["advantages"]
    if loss_fn == "importance_sampling":
      total += jnp.sum(-ratio * a)
    elif loss_fn in ("ppo", "gspo"):
      total += jnp.sum(-jnp.minimum(ratio * a, jnp.clip(ratio, config[0], config[1]) * a))
    else:  # cispo
      total += jnp.sum(-jax.lax.stop_gradient(jnp.clip(ratio, config[0], config[1])) * a * logprobs)
  return total


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo", "cispo", "gspo"])
def test_each_loss_equals_the_plain_computation(base, loss_fn):
  rng = np.random.default_rng(7)
  adapter = _adapter(base, 3)
  rows, datums = [], []
  for length in (5, 11, 8):  # uneven: padded to one bucket
    tokens = rng.integers(4, base.vocab_size, length).astype(np.int32)
    inputs = {"target_tokens": rng.integers(4, base.vocab_size, length).astype(np.int32),
              "weights": rng.uniform(0, 1, length).astype(np.float32),
              # sampler log-probs near the policy's, so that ratios straddle the clip range
              "logprobs": (-np.log(base.vocab_size) + rng.normal(0, 0.3, length)).astype(np.float32),
              "advantages": rng.normal(0, 1, length).astype(np.float32)}
    if length != 5:  # GSPO's ratio over the last tokens only; a datum without a mask: all
      inputs["sequence_ratio_mask"] = (np.arange(length) >= 3).astype(np.float32)
    rows.append((jnp.asarray(tokens), {k: jnp.asarray(v) for k, v in inputs.items()}))
    datums.append(Datum(tokens, inputs))
  config = ({"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
            if loss_fn in ("ppo", "cispo", "gspo") else {})
  outputs, metrics = adapter.forward_backward(datums, loss_fn, config)
  bounds = (0.9, 1.1)
  value, grads = jax.value_and_grad(
      lambda a: _reference_loss(adapter, a, rows, loss_fn, bounds))(adapter.adapters)
  np.testing.assert_allclose(metrics["loss:sum"], float(value), rtol=1e-4)
  for ours, theirs in zip(jax.tree.leaves(adapter.pending), jax.tree.leaves(grads)):
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=2e-3, atol=1e-5)
  assert [len(o["logprobs"]) for o in outputs] == [5, 11, 8]


def test_gradients_of_two_calls_add_up_to_one_call_of_both(base):
  rng = np.random.default_rng(0)
  datums = [Datum(rng.integers(4, 300, n).astype(np.int32),
                  {"target_tokens": rng.integers(4, 300, n).astype(np.int32),
                   "weights": np.ones(n, np.float32)}) for n in (6, 9)]
  together, apart = _adapter(base, 1), _adapter(base, 1)
  together.forward_backward(datums, "cross_entropy", {})
  apart.forward_backward(datums[:1], "cross_entropy", {})
  apart.forward_backward(datums[1:], "cross_entropy", {})
  for a, b in zip(jax.tree.leaves(together.pending), jax.tree.leaves(apart.pending)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_buckets_pad_by_a_third_at_most_with_two_shapes_an_octave():
  from rlx.tinker.training import _bucket

  sizes = {_bucket(n, 16) for n in range(1, 4097)}
  assert sorted(sizes)[:6] == [16, 24, 32, 48, 64, 96] and len(sizes) == 17
  assert all(n <= _bucket(n, 16) and (_bucket(n, 16) <= 16 or _bucket(n, 16) < 1.5 * n)
             for n in range(1, 4097))


def _grouped_datums(base, rng, next_targets, groups=3, per_group=4):
  """GRPO-shaped datums: each group's samples share a prompt; targets the next tokens (input
  s[:-1], targets s[1:]) or any tokens."""
  rows, datums = [], []
  for _ in range(groups):
    prompt = rng.integers(4, base.vocab_size, rng.integers(3, 12))
    for _ in range(per_group):
      sequence = np.concatenate([prompt, rng.integers(4, base.vocab_size, rng.integers(1, 9))])
      n = len(sequence) - 1
      targets = sequence[1:] if next_targets else rng.integers(4, base.vocab_size, n)
      inputs = {"target_tokens": targets.astype(np.int32),
                "weights": rng.uniform(0, 1, n).astype(np.float32),
                "logprobs": (-np.log(base.vocab_size) + rng.normal(0, 0.3, n)).astype(np.float32),
                "advantages": rng.normal(0, 1, n).astype(np.float32)}
      rows.append((jnp.asarray(sequence[:-1], jnp.int32),
                   {k: jnp.asarray(v) for k, v in inputs.items()}))
      datums.append(Datum(sequence[:-1].astype(np.int32), inputs))
  return rows, datums


@pytest.mark.parametrize("next_targets", [True, False])
@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo", "cispo", "gspo"])
def test_shared_prompts_forwarded_once_equal_the_plain_computation(base, loss_fn, next_targets):
  from rlx.tinker.training import layout

  rng = np.random.default_rng(11)
  rows, datums = _grouped_datums(base, rng, next_targets)
  adapter = _adapter(base, 5)
  config = ({"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
            if loss_fn in ("ppo", "cispo", "gspo") else {})
  # each group's prompt is placed once
  placed = layout([d.tokens for d in datums], adapter._check(datums, loss_fn))
  real = int((placed.rows["segment_ids"] >= 0).sum())
  assert placed.rows["shared"].any() and real < sum(len(d.tokens) for d in datums)
  outputs, metrics = adapter.forward_backward(datums, loss_fn, config)
  value, grads = jax.value_and_grad(
      lambda a: _reference_loss(adapter, a, rows, loss_fn, (0.9, 1.1)))(adapter.adapters)
  np.testing.assert_allclose(metrics["loss:sum"], float(value), rtol=1e-4)
  for ours, theirs in zip(jax.tree.leaves(adapter.pending), jax.tree.leaves(grads)):
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=2e-3, atol=1e-5)
  params = lora.combine(base.model.params, adapter.adapters)
  for output, (tokens, inputs) in zip(outputs, rows):
    hidden, _ = adapter.transformer.hidden_states(params, tokens[None], jnp.ones((1, len(tokens)), bool))
    expected = jnp.take_along_axis(jax.nn.log_softmax(adapter.transformer.logits(params, hidden[0])),
                                   inputs["target_tokens"][:, None], 1)[:, 0]
    np.testing.assert_allclose(output["logprobs"], np.asarray(expected), rtol=1e-4, atol=1e-4)


def test_links_leave_each_sequence_a_token_of_its_own():
  from rlx.tinker.training import shared_links

  assert shared_links([np.array([1, 2, 3, 4]), np.array([1, 2, 5]), np.array([1, 2]),
                       np.array([7])]).tolist() == [0, 2, 1, 0]
