"""In-flight weight updates in the driver: a new version swapped in between decode chunks
reaches the sequences in flight, every token keeps the version that sampled it, and what each
version sampled is exactly what that version alone samples from the same keys."""

import numpy as np

from rlx import rollout
from rlx.rollout.engine import Engine
from tests.rollout.test_engine import PROMPTS, _model

KWARGS = dict(n=3, max_new_tokens=40, temperature=1.0, top_k=20, stop_token_ids=[3], seed=5)


class _Publisher:
  """Publishes ``later`` as version 1 once the driver has asked ``after`` times."""

  def __init__(self, first, later, after):
    self.first, self.later, self.after, self.asked = first, later, after, 0

  def __call__(self):
    self.asked += 1
    return (self.first, 0) if self.asked <= self.after else (self.later, 1)


def _engine(model):
  return Engine(model.transformer, max_slots=4, max_len=56, max_prompt_len=16, decode_steps=4)


def test_a_new_version_reaches_sequences_in_flight_and_each_token_keeps_its_version():
  old, new = _model(scale=4.0), _model(seed=1, scale=4.0)
  engine = _engine(old)
  only_old = rollout.generate(engine, PROMPTS, params=old.params, **KWARGS)
  only_new = rollout.generate(engine, PROMPTS, params=new.params, policy_version=1, **KWARGS)
  swapped = rollout.generate(engine, PROMPTS, params=old.params, **KWARGS,
                             weights=_Publisher(old.params, new.params, after=12))
  kinds = {"old": 0, "new": 0, "mixed": 0}
  for a, b, c in zip(only_old, only_new, swapped):
    versions = c.versions()
    assert len(versions) == len(c.response_tokens) and versions[0] == c.policy_version
    assert versions == sorted(versions)  # a version, once taken, is never given up
    if c.token_versions is None:  # wholly one version: exactly what it samples alone
      alone = a if c.policy_version == 0 else b
      kinds["old" if c.policy_version == 0 else "new"] += 1
      assert c.response_tokens == alone.response_tokens
      np.testing.assert_allclose(c.logprobs, alone.logprobs, rtol=1e-5, atol=1e-6)
      continue
    kinds["mixed"] += 1
    assert c.policy_version == 0 and c.newest_version == 1
    cut = versions.index(1)  # the tokens before the swap are the old version's own
    assert c.response_tokens[:cut] == a.response_tokens[:cut]
    np.testing.assert_allclose(c.logprobs[:cut], a.logprobs[:cut], rtol=1e-5, atol=1e-6)
  # 18 requests on 4 slots, the swap after 12 chunks: some finished before it, some started
  # after it, and some were decoding across it
  assert all(kinds.values()), kinds
  assert sum(not np.array_equal(a.response_tokens, c.response_tokens)
             for a, c in zip(only_old, swapped) if c.token_versions is not None)


def test_a_new_version_number_alone_changes_no_token():
  """Swapping in the same weights under a new version: the samples are those of no swap, and
  only the stamps differ."""
  model = _model(scale=4.0)
  engine = _engine(model)
  plain = rollout.generate(engine, PROMPTS, params=model.params, **KWARGS)
  stamped = rollout.generate(engine, PROMPTS, params=model.params, **KWARGS,
                             weights=_Publisher(model.params, model.params, after=12))
  assert [c.response_tokens for c in plain] == [c.response_tokens for c in stamped]
  assert {c.newest_version for c in stamped} == {0, 1}
  assert any(c.token_versions is not None for c in stamped)


def test_a_stop_string_cut_keeps_the_versions_in_step():
  c = rollout.Completion(prompt_tokens=[1], response_tokens=[], logprobs=[], policy_logprobs=[],
                         finish_reason="length", policy_version=2, prompt_index=0,
                         sample_index=0)
  for count, version in ((2, 2), (3, 3)):
    c.stamp(count, version)
    c.response_tokens += [10 + len(c.response_tokens) + i for i in range(count)]
    c.logprobs += [0.0] * count
    c.policy_logprobs += [0.0] * count
  assert c.versions() == [2, 2, 3, 3, 3]
  decode = lambda tokens: "".join(chr(97 + t - 10) for t in tokens)  # noqa: E731
  assert c.cut_at_stop_strings(["c"], decode)
  assert c.response_tokens == [10, 11, 12] and c.versions() == [2, 2, 3]


def test_a_sample_inserted_after_a_swap_from_a_prefix_made_before_it_keeps_its_version():
  """Three samples of one prompt on two slots: the third enters after the swap, from the
  prefix the old version computed, so its first token is the old version's (stamped 0, the
  old version's own token) and the rest the new one's."""
  old, new = _model(scale=4.0), _model(seed=1, scale=4.0)
  engine = Engine(old.transformer, max_slots=2, max_len=56, max_prompt_len=16, decode_steps=4)
  settings = dict(n=3, max_new_tokens=12, temperature=1.0, stop_token_ids=[], seed=5)
  only_old = rollout.generate(engine, [[5, 6, 7]], params=old.params, **settings)
  swapped = rollout.generate(engine, [[5, 6, 7]], params=old.params, **settings,
                             weights=_Publisher(old.params, new.params, after=1))
  third = next(c for c in swapped if c.sample_index == 2)
  assert third.versions()[0] == third.policy_version == 0
  assert set(third.versions()[1:]) == {1}
  assert third.response_tokens[0] == only_old[2].response_tokens[0]
