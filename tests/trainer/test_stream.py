"""Continuous admission (``rlx.trainer.produce.stream``): the real generator thread streaming a tiny
engine, against a fake learner in the test's thread. Every group is handed over whole and
once; with k = 0 every token is the version the learner trains at (the gate holds new
prompts back), with k = 2 the stream works ahead and new versions reach sequences in flight;
a task where every group is alike stops with the cause instead of streaming forever."""

import json
import threading
import zlib
import types

import jax
import numpy as np
import pytest

from rlx.data import PromptStream
from rlx.models import builtin_tokenizer, init_model
from rlx.rewards import Scored
from rlx.rollout import Engine
from rlx.trainer import control
from rlx.trainer.common import DynamicSamplingError
from rlx.trainer.deploy.split import Generator
from tests.trainer import tiny

PER_BATCH, GROUP = 2, 2


def _stream():
  """The prompt stream: rows whose prompts no other row has, in batches."""
  rows = [{"prompt_tokens": [5, 10 + i // 90, 10 + i % 90], "id": i} for i in range(400)]
  return PromptStream(rows, batch_size=PER_BATCH, seed=0)


class _Sync:
  """The weight sync: the learner publishes a version (scaled params) after every batch."""

  def __init__(self, params):
    self.params, self.version, self.lock = params, 0, threading.Lock()

  def publish(self, version):
    with self.lock:
      self.version = version

  def latest(self, newer_than=-1):
    with self.lock:
      version = self.version
    if version <= newer_than:
      return None
    return jax.tree.map(lambda p: p * (1 + 0.05 * version), self.params), version


def _job(k: int, reward, *overrides: str):
  config = tiny.config("dapo_split", "--config.mesh.admission=continuous",
                       f"--config.mesh.max_staleness={k}", "--config.rollout.decode_steps=2",
                       "--config.algorithm.dynamic_sampling_max_draws=8", *overrides)
  model = init_model(config.model.arch, jax.random.key(0))
  engine = Engine(model.transformer, max_slots=4, max_len=24, max_prompt_len=8, decode_steps=2)
  tokenizer = builtin_tokenizer()

  def score(texts, rows):
    rewards = np.array([reward(t, r) for t, r in zip(texts, rows)], np.float32)
    return Scored(rewards, rewards > 0, {"reward/errors": 0, "reward/timeouts": 0}, {})

  return types.SimpleNamespace(config=config, engine=engine, tokenizer=tokenizer,
                               stream=_stream(), pool=types.SimpleNamespace(score=score),
                               sync=_Sync(model.params))


def _learn(job, k: int, batches: int, first: int = 0):
  """Trains on ``batches`` batches as the learner loop would (publish, then finish); returns
  them with the version each was trained at."""
  generator = Generator(job, first_step=first)
  generator.start()
  seen = []
  try:
    for version in range(first, first + batches):
      produced = generator.next(timeout=60)
      seen.append((version, produced))
      job.sync.publish(version + 1)
      generator.gate.finish()
  finally:
    generator.stop()
    generator.join(timeout=30)
  assert not generator.is_alive()
  return seen


def _varied(text, row):  # rewards differ unless the samples do not
  return float(zlib.crc32(text.encode()) % 997)


@pytest.mark.parametrize("k", [0, 2])
def test_groups_are_handed_over_whole_once_and_within_the_gate(k):
  seen = _learn(_job(k, _varied), k, batches=6)
  handed = []
  for version, produced in seen:
    draw = produced.draw
    assert len(draw.completions) == PER_BATCH * GROUP and len(draw.rewards) == PER_BATCH * GROUP
    for g in range(PER_BATCH):
      group = draw.completions[g * GROUP:(g + 1) * GROUP]
      assert [c.sample_index for c in group] == list(range(GROUP))
      assert len({tuple(c.prompt_tokens) for c in group}) == 1
      assert np.ptp(draw.rewards[g * GROUP:(g + 1) * GROUP]) > 0  # dynamic sampling kept it
      handed.append(tuple(group[0].prompt_tokens))
    for c in draw.completions:
      assert c.versions() == sorted(c.versions()) and len(c.versions()) == len(c.response_tokens)
    _, lag_max = control.lag([c.policy_version for c in draw.completions], version)
    if k == 0:  # synchronous: nothing is admitted for a batch before the learner is done
      assert {v for c in draw.completions for v in c.versions()} == {version}
    assert 0 <= lag_max <= k  # the bound the stream keeps
    assert 0 <= draw.counts["rollout/slot_occupancy"] <= 1
    # a sequence's tokens span versions no newer than the batch's and no older than its start
    assert 0 <= draw.counts["rollout/version_span_max"] <= lag_max
  assert len(set(handed)) == len(handed)  # no group twice
  if k:  # it worked ahead: some batch holds rows sampled before the version it trains at, and
    # new versions reached sequences in flight; the slots were busy
    assert any(min(c.policy_version for c in p.draw.completions) < v for v, p in seen)
    assert any(p.draw.counts["rollout/version_span_max"] >= 1 for _, p in seen)
    assert np.mean([p.draw.counts["rollout/slot_occupancy"] for _, p in seen]) > 0.5


def _first_batch_raises(reward, error, match: str) -> None:
  """The stream's first batch raises ``error`` (matching ``match``) in the learner's thread,
  and the generator thread ends."""
  generator = Generator(_job(1, reward), first_step=0)
  generator.start()
  try:
    with pytest.raises(error, match=match):
      generator.next(timeout=60)
  finally:
    generator.stop()
    generator.join(timeout=30)
  assert not generator.is_alive()


def test_a_task_where_every_group_is_alike_stops_with_the_cause():
  _first_batch_raises(lambda text, row: 0.0, DynamicSamplingError,
                      "dynamic sampling kept 0 of 2 groups")


def test_a_reward_that_raises_stops_the_stream_with_its_error():
  def broken(text, row):
    raise KeyError("anwser")

  _first_batch_raises(broken, KeyError, "anwser")


@pytest.mark.parametrize("in_flight", [0, 3])
def test_a_run_resumed_mid_stream_loses_and_repeats_no_group(in_flight):
  """A crash after batch 2 was trained (its checkpoint holds batch 2's data position) while
  later groups were in flight or handed over untrained: the resumed stream starts them again,
  and no group trained before the crash comes twice. An odd bound on groups in flight (3, with
  2 groups a batch) leaves rows drawn from the stream and not yet admitted when the position
  is saved."""
  k = 2
  flight = f"--config.mesh.groups_in_flight={in_flight}"
  crashed = _learn(_job(k, _varied, flight), k, batches=5)
  ids = lambda produced: [c.prompt_tokens for c in produced.draw.completions[::GROUP]]
  trained = [tuple(p) for _, produced in crashed[:2] for p in ids(produced)]
  lost = [tuple(p) for _, produced in crashed[2:] for p in ids(produced)]
  checkpoint = json.loads(json.dumps(crashed[1][1].draw.data_state))
  job = _job(k, _varied, flight)
  job.stream.set_state(checkpoint)
  resumed = [tuple(p) for _, produced in _learn(job, k, batches=6, first=2)
             for p in ids(produced)]
  assert not set(trained) & set(resumed)  # nothing twice
  assert len(set(resumed)) == len(resumed)
  assert set(lost) <= set(resumed)  # nothing lost


def test_the_stream_fills_its_groups_in_flight_bound_and_never_passes_it(monkeypatch):
  """With the gate wide open (k = 6) the bound on groups admitted and not yet handed over is
  what holds admission back: it is reached, and never passed."""
  from rlx.trainer.produce import stream as stream_lib
  held = []
  admit = stream_lib.Streamer._admit

  def counted(self):
    started = admit(self)
    held.append((len(self.flight) + len(self.ready), self.bound))
    return started

  monkeypatch.setattr(stream_lib.Streamer, "_admit", counted)
  job = _job(6, _varied, "--config.mesh.groups_in_flight=3")
  _learn(job, 6, 4)
  assert {bound for _, bound in held} == {3}
  assert max(n for n, _ in held) == 3 and all(n <= 3 for n, _ in held), held


class _AskedGate:
  """A gate that records which batch each admission asks about and opens none."""

  def __init__(self):
    self.asked = []

  def wait(self, index, timeout=None):
    self.asked.append(index)
    return False


@pytest.mark.parametrize("complete, running, batch", [(1, 1, 1), (0, 2, 1), (2, 1, 1),
                                                      (1, 0, 0), (0, 0, 0)])
def test_admission_asks_the_gate_about_the_batch_the_next_group_would_complete(
    complete, running, batch):
  """k = 0, groups finishing at different times: with one group of batch 0 complete and the
  other still running, the next group belongs to batch 1, and that is the batch the gate is
  asked about (counting only the running groups would ask about batch 0, open, and sample a
  group one version too old). Groups complete but not handed over count as much as running
  ones."""
  from rlx.trainer.produce.stream import Streamer, _Group
  job = _job(0, _varied, "--config.mesh.groups_in_flight=8")
  weights = types.SimpleNamespace(seconds=0.0, swaps=0)
  gate = _AskedGate()
  streamer = Streamer(job, gate, weights, sink=None, first=3)
  group = lambda i: _Group({}, i, i, 0, 0.0, [None] * GROUP, np.zeros(GROUP), np.zeros(GROUP))
  streamer.ready = [group(i) for i in range(complete)]
  streamer.flight = {i: group(i) for i in range(complete, complete + running)}
  assert streamer._admit() == []
  assert gate.asked == [3 + batch]  # the batches count from the stream's first, 3
