"""Agent programs through the endpoint (``trainer.agent_programs``), on a tiny random model:
the trained trajectories are token-consistent (the learner's log-probs of the sampled tokens,
with the weights that sampled them, equal the engine's behaviour log-probs, and the loss mask
covers exactly them); programs that raise, hang, never call or return nonsense are counted and
drop their groups without stalling the batch; rewards come from the program, or else from the
run's reward function."""

import dataclasses
import pathlib
import time

import numpy as np
import pytest

from rlx.rewards import Scored
from rlx.trainer.produce.tally import Tally
from rlx.trainer.produce.agent_programs import run_agent_programs
from rlx.trainer.draw import layout
from rlx.update import sequence_logprobs
from tests.trainer import tiny

AGENT = pathlib.Path(__file__).parent / "agent_fixture.py"


class _Pool:
  """Scores an answer by its length (and remembers what it was given)."""

  def __init__(self):
    self.rows = []

  def score(self, texts, rows):
    self.rows += rows
    rewards = np.array([len(t) % 3 for t in texts], np.float32)
    return Scored(rewards, rewards >= 2, {"reward/errors": 0, "reward/timeouts": 0}, {})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  config = tiny.config("agent_calc_openai", f"--config.env.agent={AGENT}:run",
                       "--config.env.agent_timeout_s=120")
  run = tiny.agent_run(config, _Pool(), tmp_path_factory.mktemp("agents"))
  yield run
  run.endpoint.stop()


def test_trajectories_are_token_consistent(run):
  rows = [{"prompt": "What is 12*34?", "mode": "ok"}, {"prompt": "What is 5*6?", "mode": "dict"}]
  completions, scored = run_agent_programs(run, run.model.params, rows, n=3, temperature=1.0,
                                           seed=1, version=5)
  assert len(completions) == 6 and all(c.turns == 3 and c.policy_version == 5 for c in completions)
  arrays = layout(completions, run.tokenizer.pad_id)
  logprobs, _ = sequence_logprobs(run.model.transformer, run.model.params, arrays["tokens"],
                                  arrays["attention_mask"], arrays["response_mask"])
  logprobs, mask = np.asarray(logprobs), arrays["response_mask"]
  for b, c in enumerate(completions):
    sampled = np.array(c.sampled_mask)
    assert mask[b].sum() == sampled.sum() and (~sampled).sum() > 0
    np.testing.assert_allclose(logprobs[b][mask[b]], np.array(c.logprobs)[sampled], atol=5e-5)
    # the user's later messages are there, as the builtin renderer shows them
    env_text = run.tokenizer.decode([t for t, m in zip(c.response_tokens, sampled) if not m])
    assert "again!" in env_text and "again!!" in env_text
  # "ok" returned None: the run's reward scored the final answer, with the messages
  assert all(len(row["messages"]) == 6 for row in run.pool.rows[-3:])
  assert scored.rewards[3:].tolist() == [7.0] * 3 and scored.correct[3:].all()  # "dict"
  assert scored.counts["agent:requests"] == 18 and scored.counts["agent:failed_groups"] == 0


def test_failing_programs_are_counted_and_drop_their_groups(run):
  modes = ["raise", "ok", "hang", "silent", "bad", "rewrite", "block"]
  rows = [{"prompt": f"What is {i}*7?", "mode": mode} for i, mode in enumerate(modes)]
  # compiled first (an episode's timeout includes compiling the engine's programs)
  run_agent_programs(run, run.model.params, [dict(row, mode="rewrite") for row in rows], n=2,
                     temperature=1.0, seed=2, version=0)
  run.config = dataclasses.replace(
      run.config, env=dataclasses.replace(run.config.env, agent_timeout_s=5.0))
  started = time.monotonic()
  tally = Tally(2)
  completions, scored = run_agent_programs(run, run.model.params, rows, n=2, temperature=1.0,
                                           seed=2, version=0, tally=tally)
  assert time.monotonic() - started < 30  # the hanging group waited its timeout (5 s), no more
  assert sorted({c.prompt_index for c in completions}) == [1, 5], ({k: v for k, v in scored.counts.items() if v}, tally.first_error)
  counts = scored.counts
  # the blocking program (time.sleep past its timeout) fails its own group only: the others
  # ran beside it
  assert counts["agent:program_errors"] == 4 and counts["agent:program_timeouts"] == 4
  assert counts["agent:silent_episodes"] == 2 and counts["agent:failed_groups"] == 5
  assert "the agent broke" in tally.first_error
  # the rewriting episodes: two segments each, the last one trained on
  assert counts["agent:history_rewrites"] == 2 and counts["agent:dropped_tokens"] > 0
  last = [c for c in completions if c.prompt_index == 5]
  assert all(c.turns == 1 and run.tokenizer.decode(c.prompt_tokens).startswith("summary:")
             for c in last)
