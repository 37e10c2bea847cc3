"""The token-in/token-out guarantee of multi-turn episodes: for every episode, the learner's
log-probs of the sampled tokens, with the weights that sampled them, equal the engine's
behaviour log-probs; the loss mask covers exactly the sampled tokens; the environment's tokens
are exactly what the renderer gave for its messages."""

import concurrent.futures

import jax
import numpy as np

from rlx.config import ArchConfig
from rlx.envs import Episode, Observation, Renderer, ToolRunner
from rlx.models import builtin_tokenizer, init_model
from rlx.rollout import Engine, generate_episodes
from rlx.trainer.draw import layout
from rlx.update import sequence_logprobs


class Chatty:
  """Answers every turn with a user message of varying length, for three turns."""

  def __init__(self, row):
    self.row, self.turns = row, 0

  def reset(self):
    return [{"role": "user", "content": self.row["prompt"]}]

  def step(self, text):
    self.turns += 1
    return Observation(messages=[{"role": "user", "content": "again" + "!" * self.turns}],
                       done=self.turns == 3, reward=float(len(text)))


def test_learner_logprobs_equal_behaviour_logprobs_over_whole_episodes():
  tokenizer = builtin_tokenizer()
  arch = ArchConfig(num_layers=2, vocab_size=128, hidden_size=32, intermediate_size=64,
                    num_heads=4, num_kv_heads=2, head_dim=8, eos_token_ids=(tokenizer.eos_id,))
  model = init_model(arch, jax.random.key(0))
  params = model.params
  # many stop tokens, so that the untrained model ends its turns early and episodes have
  # several turns
  stops = tuple(tokenizer.encode("abcdefghijklmno", add_special_tokens=False)) + (tokenizer.eos_id,)
  engine = Engine(model.transformer, max_slots=4, max_len=128, max_prompt_len=32, decode_steps=4,
                  max_stop_tokens=16)
  rows = [{"prompt": f"What is {a}*{b}?", "answer": str(a * b)} for a, b in [(12, 34), (56, 78)]]
  runner = ToolRunner(num_workers=0)
  episodes, prompts = {}, []
  for p, row in enumerate(rows):
    for s in range(3):
      episodes[(p, s)] = Episode(Chatty(row), Renderer(tokenizer, "builtin"), runner, None,
                                 format="builtin", max_turns=5)
      prompt = episodes[(p, s)].start()
    prompts.append(prompt)
  pool = concurrent.futures.ThreadPoolExecutor(2)
  increments = {}

  def respond(p, s, tokens, reason):
    def answer():
      reply = episodes[(p, s)].respond(tokenizer.decode(tokens), reason)
      increments.setdefault((p, s), []).append(reply.tokens)
      return reply
    return pool.submit(answer)

  completions = generate_episodes(engine, prompts, respond, params=params, n=3, max_new_tokens=12,
                                  max_tokens=80, stop_token_ids=stops, temperature=1.0, seed=5)
  assert sum(c.turns >= 2 for c in completions) >= 3  # the check below covers real multi-turn
  arrays = layout(completions, tokenizer.pad_id)
  logprobs, _ = sequence_logprobs(model.transformer, params, arrays["tokens"],
                                  arrays["attention_mask"], arrays["response_mask"])
  logprobs = np.asarray(logprobs)
  mask = arrays["response_mask"]
  for b, c in enumerate(completions):
    sampled = np.array(c.sampled_mask)
    start = int(np.argmax(arrays["attention_mask"][b])) + len(c.prompt_tokens)
    row_mask = mask[b, start:start + len(c.response_tokens)]
    assert (row_mask == sampled).all() and mask[b].sum() == sampled.sum()
    np.testing.assert_allclose(logprobs[b][mask[b]], np.array(c.logprobs)[sampled], atol=5e-5)
    # the environment's tokens are the renderer's increments, in order, unchanged
    env_tokens = [t for t, m in zip(c.response_tokens, sampled) if not m]
    given = [t for tokens in increments.get((c.prompt_index, c.sample_index), []) for t in tokens]
    assert env_tokens == given[:len(env_tokens)]
  runner.close()
