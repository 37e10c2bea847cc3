"""Multi-turn episodes in continuous batching: environment tokens appended into parked slots,
the sampled tokens kept exactly, behaviour log-probs equal to a full recompute of the whole
episode, limits, and slots that keep decoding while an environment is slow."""

import concurrent.futures
import dataclasses
import random
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx.config import ArchConfig
from rlx.models import init_model
from rlx.rollout import Engine, generate_episodes

ARCH = ArchConfig(num_layers=2, vocab_size=48, hidden_size=32, intermediate_size=48, num_heads=4,
                  num_kv_heads=2, head_dim=8, eos_token_ids=(3,))
STOP = (3, 4)  # 3 ends the episode, 4 ends a turn that asks the environment


@pytest.fixture(scope="module")
def model():
  return init_model(ARCH, jax.random.key(2))


@dataclasses.dataclass
class Reply:
  tokens: list
  done: bool
  truncated: bool = False


class FakeEnv:
  """Answers every turn not ending in 3 with 1-5 tokens (delayed up to ``delay`` s), up to 3
  turns."""

  def __init__(self, delay=0.0):
    self.pool = concurrent.futures.ThreadPoolExecutor(4)
    self.turns, self.delay, self.lock = {}, delay, threading.Lock()
    self.seen = {}

  def respond(self, p, s, tokens, reason):
    def answer():
      time.sleep(random.random() * self.delay)
      with self.lock:
        self.seen.setdefault((p, s), []).append(list(tokens))
        turn = self.turns[(p, s)] = self.turns.get((p, s), 0) + 1
      if tokens[-1] == 3 or turn >= 3:
        return Reply([], done=True)
      return Reply([10 + (p + s + turn + k) % 30 for k in range(1 + (p + s + turn) % 5)], False)
    return self.pool.submit(answer)


def _full_logprobs(model, tokens, length=128):
  padded = list(tokens) + [0] * (length - len(tokens))
  return np.asarray(jax.nn.log_softmax(model(jnp.array([padded]))[0, :len(tokens)]))


@pytest.mark.parametrize("release", [False, True])
def test_episodes_keep_sampled_tokens_and_match_a_full_recompute(model, release):
  """Parked in their slots, or released and prefilled again when the reply comes (then with
  fewer slots than episodes, so that the slots really change hands)."""
  engine = Engine(model.transformer, max_slots=2 if release else 4, max_len=96,
                  max_prompt_len=48 if release else 16, decode_steps=4)
  env = FakeEnv()
  prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
  completions = generate_episodes(engine, prompts, env.respond, params=model.params, n=2,
                                  max_new_tokens=6, max_tokens=40, stop_token_ids=STOP, seed=1,
                                  release=release)
  assert len(completions) == 6
  assert max(c.turns for c in completions) >= 2  # some episodes really had several turns
  for c in completions:
    mask = np.array(c.sampled_mask)
    assert len(mask) == len(c.response_tokens) == len(c.logprobs)
    assert len(c.response_tokens) <= 40
    # the turns the environment saw are exactly the sampled runs of tokens, in order
    runs, current = [], []
    for token, sampled in zip(c.response_tokens, mask):
      if sampled:
        current.append(token)
      elif current:
        runs.append(current)
        current = []
    runs.append(current)
    assert runs == env.seen[(c.prompt_index, c.sample_index)]
    assert np.all(np.array(c.logprobs)[~mask] == 0)
    # the behaviour log-probs (temperature 1, no truncation) are the policy's over the episode
    full = _full_logprobs(model, c.prompt_tokens + c.response_tokens)
    P = len(c.prompt_tokens)
    want = [full[P + i - 1][t] for i, t in enumerate(c.response_tokens)]
    np.testing.assert_allclose(np.array(c.logprobs)[mask], np.array(want)[mask], atol=5e-5)


def test_a_slow_environment_never_stalls_the_other_slots(model):
  engine = Engine(model.transformer, max_slots=4, max_len=96, max_prompt_len=16, decode_steps=4)
  env = FakeEnv(delay=0.3)
  prompts = [[5, 6, 7], [8, 9], [13], [20, 21]]
  completions = generate_episodes(engine, prompts, env.respond, params=model.params, n=3,
                                  max_new_tokens=6, max_tokens=40, stop_token_ids=STOP, seed=3)
  assert [(c.prompt_index, c.sample_index) for c in completions] == [
      (p, s) for p in range(4) for s in range(3)]


def test_an_environment_that_never_answers_ends_its_episode_truncated(model):
  engine = Engine(model.transformer, max_slots=2, max_len=64, max_prompt_len=8, decode_steps=4)
  never = concurrent.futures.Future()
  completions = generate_episodes(engine, [[5, 6]], lambda *a: never, params=model.params, n=2,
                                  max_new_tokens=4, max_tokens=20, stop_token_ids=STOP,
                                  step_timeout_s=0.2)
  assert [c.finish_reason for c in completions] == ["length", "length"]


def test_released_episodes_leave_their_slots_to_others_while_their_environment_works(model):
  """Two slots, six episodes, an environment that takes 0.3 s a step: parked in their slots at
  most two episodes wait on it at once; released, the slots take the others meanwhile."""
  for release, most in ((False, 2), (True, 3)):
    waiting = []
    lock = threading.Lock()
    pool = concurrent.futures.ThreadPoolExecutor(8)
    futures = []

    def respond(p, s, tokens, reason):
      def answer():
        time.sleep(0.3)
        return Reply([] if tokens[-1] == 3 else [10, 11], done=tokens[-1] == 3)
      with lock:
        futures.append(pool.submit(answer))
        waiting.append(sum(not f.done() for f in futures))
        return futures[-1]

    engine = Engine(model.transformer, max_slots=2, max_len=96, max_prompt_len=48,
                    decode_steps=4)
    stats = {}
    completions = generate_episodes(engine, [[5, 6], [7, 8], [9, 10]], respond,
                                    params=model.params, n=2, max_new_tokens=4, max_tokens=30,
                                    stop_token_ids=STOP, seed=5, release=release, stats=stats)
    pool.shutdown()
    assert len(completions) == 6
    assert (max(waiting) >= most) if release else (max(waiting) <= most), (release, waiting)
    # every environment step keeps its episode 0.3 s: out of the slots when released, in
    # its slot when parked
    assert stats["life_s"] >= 0.3 * len(futures)
    if release:
      assert 0.3 * len(futures) <= stats["away_s"] < stats["life_s"], stats
    else:
      assert stats["away_s"] == 0.0


def test_a_release_the_engine_cannot_prefill_again_is_refused(model):
  engine = Engine(model.transformer, max_slots=2, max_len=64, max_prompt_len=8, decode_steps=4)
  with pytest.raises(ValueError, match="max_prompt_len of 21"):
    generate_episodes(engine, [[5, 6]], FakeEnv().respond, params=model.params, max_new_tokens=4,
                      max_tokens=20, stop_token_ids=STOP, release=True)


def test_decoding_slots_move_below_parked_ones_and_sample_the_same(model, monkeypatch):
  """16 slots, 12 episodes parked on an environment at different times: each chunk first moves
  the decoding slots into the holes below the narrowest width that holds them (parked slots go
  up in exchange), so it computes fewer idle slots, and every episode samples exactly what it
  samples where it stays in its slot."""
  from rlx.rollout.driver import _Run

  engine = Engine(model.transformer, max_slots=16, max_len=96, max_prompt_len=16, decode_steps=4)
  prompts = [[5, 6, 7], [8, 9], [13], [20, 21], [22], [23, 24, 25]]
  kwargs = dict(params=model.params, n=2, max_new_tokens=6, max_tokens=40, stop_token_ids=STOP,
                seed=7)
  runs = {}
  for compacts in (True, False):
    monkeypatch.setattr(_Run, "compacts", compacts)
    stats = {}
    done = generate_episodes(engine, prompts, FakeEnv(delay=0.05).respond, stats=stats, **kwargs)
    runs[compacts] = done, stats["busy_steps"] / stats["slot_steps"]
  (moved, moved_busy), (stayed, stayed_busy) = runs[True], runs[False]
  for a, b in zip(moved, stayed):
    assert (a.prompt_index, a.sample_index) == (b.prompt_index, b.sample_index)
    assert a.response_tokens == b.response_tokens and a.sampled_mask == b.sampled_mask
    np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-6)
  assert max(c.turns for c in moved) >= 2
  assert moved_busy > stayed_busy, (moved_busy, stayed_busy)


def test_one_released_episode_is_away_for_each_of_its_environment_steps(model):
  """One episode alone, released for every environment step of 0.3 s: its time away from the
  slots is those steps', its last one included (the step that ends it), and no more."""
  pool = concurrent.futures.ThreadPoolExecutor(2)
  steps = []

  def respond(p, s, tokens, reason):
    def answer():
      time.sleep(0.3)
      return Reply([] if tokens[-1] == 3 else [10, 11], done=tokens[-1] == 3)
    steps.append(pool.submit(answer))
    return steps[-1]

  engine = Engine(model.transformer, max_slots=2, max_len=96, max_prompt_len=48,
                  decode_steps=4)
  for _ in range(2):  # the second time, with its programs compiled
    steps.clear()
    stats = {}
    generate_episodes(engine, [[5, 6]], respond, params=model.params, n=1, max_new_tokens=4,
                      max_tokens=30, stop_token_ids=STOP, seed=5, release=True, stats=stats)
  pool.shutdown()
  assert len(steps) >= 2
  assert 0.3 * len(steps) <= stats["away_s"] < 0.3 * len(steps) + 0.25, (len(steps), stats)
