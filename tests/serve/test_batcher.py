"""Requests submitted one by one from other threads (``serve.Batcher``) against
``rollout.generate`` of the same prompts with the same keys: the same tokens and log-probs,
whichever requests share the slots; stop strings; an engine that raises fails the requests."""

import concurrent.futures
import threading

import jax
import numpy as np
import pytest

from rlx import rollout
from rlx.config import ArchConfig
from rlx.models import init_model
from rlx.rollout.engine import Engine
from rlx.serve.batcher import Batcher, Request, ServingClosed

ARCH = ArchConfig(num_layers=2, vocab_size=48, hidden_size=32, intermediate_size=48, num_heads=4,
                  num_kv_heads=2, head_dim=8, eos_token_ids=(3,))


@pytest.fixture(scope="module")
def model():
  model = init_model(ARCH, jax.random.key(1))
  return model.replace(params=jax.tree.map(lambda p: p * 8 if p.ndim > 1 else p, model.params))


def _key(seed, i, j):
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), i), j)


def test_submitted_requests_match_generate(model):
  engine = Engine(model.transformer, max_slots=4, max_len=48, max_prompt_len=16, decode_steps=4)
  prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [14, 15], [16, 17, 18, 19], [20], [21, 22, 23]]
  reference = rollout.generate(engine, prompts, params=model.params, n=2, max_new_tokens=12,
                               temperature=1.0, stop_token_ids=(3,), seed=7, policy_version=4)
  batcher = Batcher(engine, model.params, version=4)
  futures = {}

  def client(indices):
    for i in indices:  # out of order, from two threads
      for j in (1, 0):
        futures[(i, j)] = batcher.submit(Request(prompt=prompts[i], max_tokens=12,
                                                 key=_key(7, i, j), stop_ids=(3,)))

  threads = [threading.Thread(target=client, args=(part,)) for part in ([5, 0, 2], [1, 4, 3])]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  batcher.serve(until=lambda: all(f.done() for f in futures.values()))
  for c in reference:
    got = futures[(c.prompt_index, c.sample_index)].result()
    assert got.tokens == c.response_tokens
    np.testing.assert_allclose(got.logprobs, c.logprobs, atol=1e-5)
    np.testing.assert_allclose(got.policy_logprobs, c.policy_logprobs, atol=1e-5)
    assert got.finish_reason == c.finish_reason and got.policy_version == 4
  assert batcher.stats["requests"] == 12
  # every token a chunk emitted counted once (the first of each request is sampled at insert)
  stats = batcher.stats
  assert stats["busy_steps"] == sum(len(c.response_tokens) - 1 for c in reference)
  assert stats["busy_steps"] <= stats["held_steps"] <= stats["slot_steps"]


def test_stop_text_ends_a_request_and_the_slot_is_reused(model):
  engine = Engine(model.transformer, max_slots=2, max_len=48, max_prompt_len=16, decode_steps=4)
  decode = lambda ids: " ".join(map(str, ids)) + " "
  batcher = Batcher(engine, model.params, decode=decode)
  free = batcher.submit(Request(prompt=[5, 6], max_tokens=20, key=_key(1, 0, 0)))
  batcher.serve(until=lambda: free.done())
  tokens = free.result().tokens
  assert len(tokens) >= 4
  stop = f" {tokens[1]} {tokens[2]} "  # ends after the third token
  futures = [batcher.submit(Request(prompt=[5, 6], max_tokens=20, key=_key(1, 0, 0),
                                    stop_texts=(stop,)))]
  futures += [batcher.submit(Request(prompt=[7, 8, 9], max_tokens=6, key=_key(1, 1, 0)))
              for _ in range(3)]
  batcher.serve(until=lambda: all(f.done() for f in futures))
  cut = futures[0].result()
  assert cut.tokens == tokens[:3] and cut.stop_text == stop and cut.finish_reason == "stop"
  rest = [f.result().tokens for f in futures[1:]]
  assert rest[0] == rest[1] == rest[2]  # the zombie slot never leaked into the others


def test_an_abandoned_request_gives_up_its_slot_at_the_next_chunk(model):
  engine = Engine(model.transformer, max_slots=1, max_len=48, max_prompt_len=16, decode_steps=4)
  alone = Batcher(engine, model.params)
  reference = alone.submit(Request(prompt=[7, 8, 9], max_tokens=8, key=_key(2, 1, 0)))
  alone.serve(until=reference.done)

  batcher = Batcher(engine, model.params)
  long = batcher.submit(Request(prompt=[5, 6], max_tokens=40, key=_key(2, 0, 0)))
  chunks, later = [], []
  decode = batcher._decode

  def chunk(state, slots, waiting):
    if not chunks:  # its client hangs up while the first chunk decodes
      batcher.abandon(long)
      later.append(batcher.submit(Request(prompt=[7, 8, 9], max_tokens=8, key=_key(2, 1, 0))))
    chunks.append(slots)
    return decode(state, slots, waiting)

  batcher._decode = chunk
  batcher.serve(until=lambda: bool(later) and later[0].done())
  with pytest.raises(concurrent.futures.CancelledError):
    long.result(timeout=1)
  # the one slot went to the later request after one chunk of the long one (40 tokens would
  # take 10), and its stale cache did not leak into the later request's tokens
  assert later[0].result().tokens == reference.result().tokens
  assert len(chunks) <= 3 and batcher.stats["abandoned"] == 1
  assert not batcher.partial and batcher.abandoned == set()
  # a queued request abandoned never starts
  queued = batcher.submit(Request(prompt=[5], max_tokens=4, key=_key(0, 0, 0)))
  batcher.abandon(queued)
  batcher.serve(until=lambda: True)
  assert queued.cancelled() and batcher.stats["requests"] == 2
  assert batcher.stats["abandoned"] == 2


def test_a_prompt_too_long_is_refused_and_close_fails_the_queue(model):
  engine = Engine(model.transformer, max_slots=2, max_len=32, max_prompt_len=8, decode_steps=4)
  batcher = Batcher(engine, model.params)
  with pytest.raises(ValueError, match="max_prompt_len"):
    batcher.submit(Request(prompt=list(range(5, 20)), max_tokens=4, key=_key(0, 0, 0)))
  queued = batcher.submit(Request(prompt=[5], max_tokens=4, key=_key(0, 0, 0)))
  batcher.close("the run ended")
  with pytest.raises(ServingClosed, match="the run ended"):
    queued.result(timeout=1)
  with pytest.raises(ServingClosed):
    batcher.submit(Request(prompt=[5], max_tokens=4, key=_key(0, 0, 0)))


@pytest.mark.parametrize("platform", ["cpu", "tpu"])  # the per_layer and stacked cache layouts
def test_a_continuing_request_extends_the_parked_slot_as_a_prefill_would(model, platform):
  engine = Engine(model.transformer, max_slots=4, max_len=64, max_prompt_len=63, decode_steps=4,
                  platform=platform)
  results = {}
  for reuse in (False, True):
    batcher = Batcher(engine, model.params, reuse=reuse)
    firsts = [batcher.submit(Request(prompt=p, max_tokens=6, key=_key(3, i, 0), temperature=0.0,
                                     stop_ids=(3,)))
              for i, p in enumerate([[5, 6, 7], [9, 10, 11, 12]])]
    answers = []

    def follow_up():  # the agent's next turn, sent as soon as its first answer is back
      for i, first in enumerate(firsts):
        tokens = first.result().tokens
        prompt = [[5, 6, 7], [9, 10, 11, 12]][i] + tokens + [20 + i, 21, 22]
        answers.append(batcher.submit(Request(prompt=prompt, max_tokens=8, key=_key(3, i, 1),
                                              temperature=0.0)))

    thread = threading.Thread(target=follow_up)
    thread.start()
    batcher.serve(until=lambda: len(answers) == 2 and all(f.done() for f in answers))
    thread.join()
    results[reuse] = ([f.result() for f in firsts + answers], dict(batcher.stats))
  (plain, plain_stats), (reused, reused_stats) = results[False], results[True]
  assert plain_stats["reused"] == 0 and reused_stats["reused"] == 2
  # what each parked slot held: its first prompt and answer, all but the answer's last token
  # (sampled, not yet through the model: the follow-up's prefill of its new part starts there)
  held = sum(len(p) + len(r.tokens) - 1
             for p, r in zip([[5, 6, 7], [9, 10, 11, 12]], reused[:2]))
  assert reused_stats["reused_tokens"] == held
  for a, b in zip(plain, reused):
    assert a.tokens == b.tokens
    np.testing.assert_allclose(a.policy_logprobs, b.policy_logprobs, atol=2e-5)


def test_a_parked_slot_keeps_its_cache_while_shorter_requests_decode(model):
  # per_layer caches shrink to what the decoding slots need; a parked slot's must survive that
  engine = Engine(model.transformer, max_slots=2, max_len=192, max_prompt_len=191,
                  decode_steps=4, platform="cpu")
  long_prompt = [5 + i % 40 for i in range(90)]
  results = {}
  for reuse in (False, True):
    batcher = Batcher(engine, model.params, reuse=reuse)
    done = []

    def agent():
      first = batcher.submit(Request(prompt=long_prompt, max_tokens=5, key=_key(4, 0, 0),
                                     temperature=0.0, stop_ids=(3,))).result()
      batcher.submit(Request(prompt=[6, 7], max_tokens=12, key=_key(4, 1, 0),
                             temperature=0.0)).result()  # decodes alone, in a short cache
      prompt = long_prompt + first.tokens + [30, 31]
      done.append(batcher.submit(Request(prompt=prompt, max_tokens=6, key=_key(4, 0, 1),
                                         temperature=0.0)).result())

    thread = threading.Thread(target=agent)
    thread.start()
    batcher.serve(until=lambda: bool(done))
    thread.join()
    results[reuse] = (done[0], batcher.stats["reused"])
  assert results[True][1] == 1 and results[False][1] == 0
  assert results[True][0].tokens == results[False][0].tokens
  np.testing.assert_allclose(results[True][0].policy_logprobs, results[False][0].policy_logprobs,
                             atol=2e-5)
