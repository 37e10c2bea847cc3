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


CONFIGS = {**{name: {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
              for name in ("ppo", "cispo", "gspo")}, "dro": {"beta": 0.2}}
"""The settings the tests give (the reference below uses the same numbers)."""


def _plain(adapters, base_params, tokens, mask, inputs, *, transformer, loss_fn):
  """The loss from full logits of datums each on its own row, right-padded (causal attention
  never sees the padding), and each row's target log-probs."""
  params = lora.combine(base_params, adapters)
  hidden, _ = transformer.hidden_states(params, tokens, mask)
  logits = transformer.logits(params, hidden)
  logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits), inputs["target_tokens"][..., None],
                                 -1)[..., 0]
  config = CONFIGS.get(loss_fn, {})
  a = inputs["advantages"]
  if loss_fn == "cross_entropy":
    per_token = -inputs["weights"] * logprobs
  elif loss_fn == "dro":
    per_token = -(logprobs * a - 0.5 * config["beta"] * (logprobs - inputs["logprobs"]) ** 2)
  else:
    ratio = jnp.exp(logprobs - inputs["logprobs"])
    if loss_fn == "gspo":  # the datum's geometric-mean ratio, each token's own gradient
      marked = inputs["sequence_ratio_mask"] * mask
      fixed = jax.lax.stop_gradient(logprobs)
      mean = jnp.sum(marked * (fixed - inputs["logprobs"]), 1) / jnp.sum(marked, 1)
      ratio = jnp.exp(mean[:, None] + logprobs - fixed)
    low, high = config.get("clip_low_threshold"), config.get("clip_high_threshold")
    if loss_fn == "importance_sampling":
      per_token = -ratio * a
    elif loss_fn in ("ppo", "gspo"):
      per_token = -jnp.minimum(ratio * a, jnp.clip(ratio, low, high) * a)
    else:  # cispo
      per_token = -jax.lax.stop_gradient(jnp.clip(ratio, low, high)) * a * logprobs
  return jnp.sum(jnp.where(mask, per_token, 0.0)), logprobs


_plain_grad = jax.jit(jax.value_and_grad(_plain, has_aux=True),
                      static_argnames=("transformer", "loss_fn"))


def _reference(adapter, rows, loss_fn):
  """``_plain``'s (loss, target log-probs of each datum), gradient for ``rows``: (tokens,
  inputs) per datum."""
  L = max(len(tokens) for tokens, _ in rows)
  pad = lambda x: np.pad(np.asarray(x), (0, L - len(x)))
  names = {"target_tokens", "weights", "logprobs", "advantages", "sequence_ratio_mask"}
  inputs = {name: np.stack([pad(i[name] if name in i else np.ones(len(t), np.float32))
                            for t, i in rows]) for name in names}
  (loss, logprobs), grads = _plain_grad(
      adapter.adapters, adapter.base.model.params, np.stack([pad(t) for t, _ in rows]),
      np.stack([pad(np.ones(len(t), bool)) for t, _ in rows]), inputs,
      transformer=adapter.transformer, loss_fn=loss_fn)
  return loss, [np.asarray(logprobs)[b, :len(t)] for b, (t, _) in enumerate(rows)], grads


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo", "cispo", "gspo", "dro"])
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
    rows.append((tokens, inputs))
    datums.append(Datum(tokens, inputs))
  outputs, metrics = adapter.forward_backward(datums, loss_fn, CONFIGS.get(loss_fn, {}))
  _check_against_the_plain_computation(adapter, rows, loss_fn, outputs, metrics)


def _check_against_the_plain_computation(adapter, rows, loss_fn, outputs, metrics):
  value, logprobs, grads = _reference(adapter, rows, loss_fn)
  np.testing.assert_allclose(metrics["loss:sum"], float(value), rtol=1e-4)
  for ours, theirs in zip(jax.tree.leaves(adapter.pending), jax.tree.leaves(grads)):
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=2e-3, atol=1e-5)
  for output, expected in zip(outputs, logprobs, strict=True):
    np.testing.assert_allclose(output["logprobs"], expected, rtol=1e-4, atol=1e-4)


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


def test_target_pairs_pad_by_a_quarter_at_most_with_four_shapes_an_octave():
  from rlx.tinker.training import WIDTHS, _fine_bucket

  sizes = {_fine_bucket(n) for n in range(1, 4097)}
  assert sorted(sizes)[:9] == [16, 32, 64, 80, 96, 112, 128, 160, 192]
  assert all(n <= _fine_bucket(n) and (n <= 64 or _fine_bucket(n) <= 1.25 * n)
             for n in range(1, 4097))
  assert [w for w in WIDTHS if 256 <= w <= 512] == [256, 320, 384, 448, 512]


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
      rows.append((sequence[:-1].astype(np.int32), inputs))
      datums.append(Datum(sequence[:-1].astype(np.int32), inputs))
  return rows, datums


# the layout is the same for every loss: one per kind of input (weights; a ratio; a ratio over
# the datum), with next-token and with arbitrary targets
@pytest.mark.parametrize("loss_fn, next_targets", [
    ("cross_entropy", True), ("importance_sampling", False), ("gspo", True), ("dro", False)])
def test_shared_prompts_forwarded_once_equal_the_plain_computation(base, loss_fn, next_targets):
  from rlx.tinker.training import layout

  rng = np.random.default_rng(11)
  rows, datums = _grouped_datums(base, rng, next_targets)
  adapter = _adapter(base, 5)
  # each group's prompt is placed once
  placed = layout([d.tokens for d in datums], adapter._check(datums, loss_fn))
  real = int((placed.rows["segment_ids"] >= 0).sum())
  assert placed.rows["shared"].any() and real < sum(len(d.tokens) for d in datums)
  outputs, metrics = adapter.forward_backward(datums, loss_fn, CONFIGS.get(loss_fn, {}))
  _check_against_the_plain_computation(adapter, rows, loss_fn, outputs, metrics)


def test_links_leave_each_sequence_a_token_of_its_own():
  from rlx.tinker.training import shared_links

  assert shared_links([np.array([1, 2, 3, 4]), np.array([1, 2, 5]), np.array([1, 2]),
                       np.array([7])]).tolist() == [0, 2, 1, 0]
