"""The replay buffer: groups as the unit, eviction by lag, age and capacity, reuse, one
temperature per batch, its state through a checkpoint, and a split run that trains on reused
groups while the generator is slow."""

import numpy as np
import pytest

from rlx.rollout import Completion
from rlx.trainer import train_split
from rlx.trainer.learn.buffer import ReplayBuffer
from rlx.trainer.draw import Draw
from tests.trainer import tiny

GROUP = 2


def _draw(version: int, born: float, prompts: int = 2, temperature=None, first: int = 0) -> Draw:
  completions = [Completion(prompt_tokens=[1, p], response_tokens=[2, s + 3], logprobs=[-0.5, -1.0],
                            policy_logprobs=[-0.25, -0.75], finish_reason="stop",
                            policy_version=version, prompt_index=first + p, sample_index=s)
                 for p in range(prompts) for s in range(GROUP)]
  rewards = np.arange(len(completions), dtype=np.float32) + 10 * version
  return Draw(completions=completions, rewards=rewards, correct=rewards > 0,
              counts={"reward/mean": float(rewards.mean())}, generate_seconds=0.1,
              data_state={"next_index": first + prompts}, temperature=temperature, born=born)


def _buffer(**overrides):
  max_lag, max_age_s = overrides.pop("max_lag", 1), overrides.pop("max_age_s", None)
  options = dict(group_size=GROUP, groups_per_batch=2, capacity=8, reuse=1,
                 fresh=lambda lag, age: lag <= max_lag and (max_age_s is None or age <= max_age_s))
  return ReplayBuffer(**dict(options, **overrides))


def _prompts(draw):
  return sorted({(c.policy_version, c.prompt_index) for c in draw.completions})


def test_groups_are_taken_whole_newest_first_and_each_once_without_reuse():
  buffer = _buffer()
  buffer.put(_draw(0, born=1.0, first=0))
  buffer.put(_draw(1, born=2.0, first=10))
  taken = buffer.take(version=1, now=3.0)
  assert _prompts(taken) == [(1, 10), (1, 11)]  # the newest groups first
  assert [c.sample_index for c in taken.completions] == [0, 1, 0, 1]  # whole groups, in order
  np.testing.assert_array_equal(taken.rewards, [10, 11, 12, 13])
  assert taken.counts == {"reward/mean": 11.5} and taken.born == 2.0
  assert _prompts(buffer.take(version=1, now=3.0)) == [(0, 0), (0, 1)]
  assert buffer.take(version=1, now=3.0) is None and len(buffer) == 0
  assert buffer.metrics(3.0)["buffer/reused"] == 0


def test_reuse_trains_a_group_again_while_fresh_least_used_first():
  buffer = _buffer(reuse=2)
  buffer.put(_draw(0, born=1.0))
  first = buffer.take(version=0, now=1.0)
  second = buffer.take(version=1, now=1.0)  # the same two groups, a version later
  assert _prompts(first) == _prompts(second)
  assert buffer.take(version=2, now=1.0) is None  # used twice: gone
  assert buffer.metrics(1.0)["buffer/reused"] == 2
  # a fresh group goes before one already used
  buffer = _buffer(reuse=3, groups_per_batch=1)
  buffer.put(_draw(0, born=1.0, prompts=1, first=0))
  buffer.take(version=0, now=1.0)
  buffer.put(_draw(0, born=0.5, prompts=1, first=5))
  assert _prompts(buffer.take(version=0, now=1.0)) == [(0, 5)]


def test_groups_past_the_lag_bound_the_age_limit_or_the_capacity_are_evicted_and_counted():
  buffer = _buffer(max_lag=1, max_age_s=10.0, capacity=3, groups_per_batch=1)
  buffer.put(_draw(0, born=0.0, first=0))    # 2 groups, version 0
  buffer.put(_draw(2, born=5.0, first=10))   # 2 groups, version 2
  buffer.take(version=2, now=6.0)            # version 0 is 2 behind: both evicted
  assert buffer.evicted == 2 and len(buffer) == 1
  buffer.put(_draw(2, born=20.0, prompts=3, first=20))  # 4 groups > capacity 3: oldest goes
  taken = buffer.take(version=2, now=20.0)
  assert buffer.evicted == 3 and all(c.prompt_index >= 20 for c in taken.completions)
  assert buffer.take(version=2, now=31.0) is None  # older than 10 s
  assert buffer.evicted == 5 and buffer.metrics(31.0)["buffer/size"] == 0


def test_a_batch_holds_one_sampling_temperature():
  buffer = _buffer(groups_per_batch=2)
  buffer.put(_draw(0, born=1.0, prompts=1, temperature=None, first=0))
  buffer.put(_draw(0, born=2.0, prompts=1, temperature=1.25, first=5))
  assert buffer.take(version=0, now=2.0) is None  # one group at each temperature
  buffer.put(_draw(0, born=3.0, prompts=1, temperature=1.25, first=9))
  taken = buffer.take(version=0, now=3.0)
  assert taken.temperature == 1.25 and _prompts(taken) == [(0, 5), (0, 9)]


def test_the_state_round_trips_through_json():
  import json

  buffer = _buffer(reuse=2)
  buffer.put(_draw(3, born=7.0, first=0, temperature=1.125))
  buffer.take(version=3, now=7.0)
  buffer.put(_draw(4, born=8.0, prompts=1, first=4, temperature=1.125))
  restored = _buffer(reuse=2)
  restored.restore(json.loads(json.dumps(buffer.state())))
  assert restored.metrics(9.0) == buffer.metrics(9.0)
  a, b = buffer.take(version=4, now=9.0), restored.take(version=4, now=9.0)
  assert a.completions == b.completions and a.temperature == b.temperature == 1.125
  np.testing.assert_array_equal(a.rewards, b.rewards)


def test_a_split_run_trains_on_reused_groups_while_the_generator_is_slow(tmp_path):
  config = tiny.config("dapo_split", "--config.algorithm.dynamic_sampling=false",
                       "--config.trainer.steps=6", "--config.checkpoint.every_steps=3",
                       "--config.buffer.enabled=true", "--config.buffer.reuse=3",
                       "--config.mesh.max_staleness=2")
  summary = train_split(config, tmp_path, generator_delay_s=0.5, say=lambda m: None)
  rows = tiny.metrics(tmp_path)
  assert summary.steps == 6 and len(rows) == 6
  assert rows[-1]["buffer/reused"] > 0  # the learner did not wait for every batch
  assert max(row["rollout/policy_lag_max"] for row in rows) <= 2
  assert {"buffer/size", "buffer/evicted", "buffer/age_mean_s"} <= set(rows[-1])
  # the checkpoint holds the buffer; a resumed run starts from it
  more = tiny.config("dapo_split", "--config.algorithm.dynamic_sampling=false",
                     "--config.trainer.steps=7", "--config.checkpoint.every_steps=3",
                     "--config.buffer.enabled=true", "--config.buffer.reuse=3",
                     "--config.mesh.max_staleness=2")
  said = []
  train_split(more, tmp_path, say=said.append)
  assert any("resumed" in line for line in said)
  assert len(tiny.metrics(tmp_path)) == 7


def test_the_buffer_needs_a_learner_of_one_process():
  from rlx.config import ConfigError, check

  check(tiny.config("grpo_colocated", "--config.buffer.enabled=true"))  # every deployment
  with pytest.raises(ConfigError, match="buffer.enabled"):
    check(tiny.config("grpo_colocated", "--config.buffer.enabled=true",
                      "--config.mesh.multihost=true"))
  with pytest.raises(ConfigError, match="buffer.reuse"):
    check(tiny.config("dapo_split", "--config.buffer.reuse=2"))
