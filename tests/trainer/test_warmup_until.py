"""The supervised warm-up's early stop (``trainer.warmup_sft_until``): its measure, the share of
prompts greedy decoding answers exactly with their target, equals what the engine's greedy
decoding does; and the warm-up stops at the first check that reaches the target."""

import jax
import numpy as np
import pytest

from rlx import rollout
from rlx.config import ArchConfig
from rlx.models import builtin_tokenizer, init_model
from rlx.rollout import Completion, Engine
from rlx.trainer.draw import layout
from rlx.trainer.setup.warmup import exact_share, sft_batches, warm_up

ARCH = ArchConfig(vocab_size=64, num_layers=2, hidden_size=32, intermediate_size=64, num_heads=2,
                  num_kv_heads=1, head_dim=16)


def _rows(rng, count):
  return [{"prompt_tokens": [int(t) for t in rng.integers(3, 60, rng.integers(2, 6))]}
          for _ in range(count)]


def test_the_exact_share_is_the_share_of_greedy_answers_equal_to_their_target():
  """A reference against the fast path: the engine decodes each prompt greedily; a row counts
  when its answer is its target token for token. Half the targets are the model's own greedy
  answers (so they count), the other half those answers with the first token changed (so
  they do not)."""
  model = init_model(ARCH, jax.random.key(3))
  rng = np.random.default_rng(0)
  rows = _rows(rng, 12)
  engine = Engine(model.transformer, max_slots=12, max_len=16, max_prompt_len=6)
  eos = 2
  tokenizer = builtin_tokenizer()
  answers = rollout.generate(engine, [r["prompt_tokens"] for r in rows], params=model.params,
                             n=1, max_new_tokens=6, temperature=0.0, stop_token_ids=[eos],
                             seed=0, policy_version=0)
  answers = sorted(answers, key=lambda c: c.prompt_index)
  batches, expected = [], []
  for i, (row, answer) in enumerate(zip(rows, answers)):
    # a target the model answers greedily (eos included, or the tokens up to the length limit)
    target = list(answer.response_tokens)
    if i % 2:  # ... and one it does not: its first token changed
      target[0] = 3 if target[0] != 3 else 4
    expected.append(i % 2 == 0)
    batches.append((row, target))
  arrays = layout([Completion(prompt_tokens=row["prompt_tokens"], response_tokens=target,
                              logprobs=[0.0] * len(target), policy_logprobs=[],
                              finish_reason="stop", policy_version=0, prompt_index=0,
                              sample_index=0) for row, target in batches], tokenizer.pad_id)
  share = jax.jit(lambda p, a: exact_share(model.transformer, p, a["tokens"],
                                           a["attention_mask"], a["response_mask"]))(
      model.params, {k: arrays[k] for k in ("tokens", "attention_mask", "response_mask")})
  np.testing.assert_allclose(float(share), np.mean(expected), atol=1e-6)


def test_the_warm_up_stops_at_the_first_check_that_reaches_the_target():
  tokenizer = builtin_tokenizer()
  model = init_model(ARCH, jax.random.key(0))

  def rows():
    while True:
      yield [{"prompt_tokens": [5, 6, 7], "sft_target": "1"} for _ in range(4)]

  probe = next(sft_batches(rows(), tokenizer))
  said = []
  # one prompt, one answer: a few steps at a high rate learn it
  _, losses = warm_up(model, rows(), tokenizer, steps=200, learning_rate=1e-2, until=1.0,
                      probe=probe, say=said.append, check_every=2)
  assert len(losses) < 200 and len(losses) % 2 == 0
  assert any("answered exactly" in line and f"after {len(losses)} steps" in line for line in said)
  # without a target (or a probe) it runs every step
  _, losses = warm_up(model, rows(), tokenizer, steps=6, learning_rate=1e-2, probe=probe)
  assert len(losses) == 6


def test_a_start_up_stop_signal_its_exception_missed_ends_the_warm_up():
  """The start-up's signal handler raises where the signal lands; when that was a callback
  that only prints it (a garbage collector's), the recorded signal ends the warm-up at its
  next step, with the exception the command turns into its exit status."""
  from rlx import cli

  tokenizer = builtin_tokenizer()
  model = init_model(ARCH, jax.random.key(0))

  def rows():
    cli.stop_at_start("SIGTERM")  # before the first step's batch: as if during its compile
    while True:
      yield [{"prompt_tokens": [5, 6, 7], "sft_target": "1"} for _ in range(4)]

  with pytest.raises(cli.StoppedAtStart):
    warm_up(model, rows(), tokenizer, steps=50, learning_rate=1e-2)
  assert not cli.stopped_at_start()  # taken: the training loop does not stop a rerun for it
