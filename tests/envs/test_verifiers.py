"""``verifiers`` environments through the endpoint (``rlx.envs.verifiers``), on a tiny random
model and a taskset the tests build (``verifiers_tasksets/rlx_questions``): its tasks become the prompt rows,
its harness's calls are recorded token by token under each episode's key, its own scoring is
the reward, and an episode it reports as failed drops its group."""

import pathlib
import sys

import numpy as np
import pytest

pytest.importorskip("verifiers.v1")

from rlx.config import ConfigError  # noqa: E402
from rlx.envs import load_agent  # noqa: E402
from rlx.envs.verifiers import TaskRows  # noqa: E402
from rlx.rewards import Scored  # noqa: E402
from rlx.trainer.produce.tally import Tally  # noqa: E402
from rlx.trainer.produce.agent_programs import run_agent_programs  # noqa: E402
from rlx.trainer.setup.run import prepare  # noqa: E402
from tests.trainer import tiny  # noqa: E402

# verifiers imports a taskset by a top-level module name: the fixture's folder goes on the path
sys.path.insert(0, str(pathlib.Path(__file__).parent / "verifiers_tasksets"))
TASKSET = "rlx_questions"


class _Pool:
  def score(self, texts, rows):  # given nothing: the environment scores its episodes
    assert not texts, "the run's reward function scored a verifiers episode"
    return Scored(np.zeros(0, np.float32), np.zeros(0, bool), {}, {})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  config = tiny.config("agent_calc_openai", f"--config.env.agent=verifiers:{TASKSET}",
                       "--config.env.agent_timeout_s=120")
  run = tiny.agent_run(config, _Pool(), tmp_path_factory.mktemp("verifiers"))
  yield run
  run.endpoint.stop()


def test_tasks_are_rows_and_episodes_are_recorded_and_scored_by_the_environment(run):
  rows = TaskRows(TASKSET)
  assert len(rows) == 6 and rows[2]["prompt"] == "What is 2*7?" and rows[2]["verifiers_task"] == 2
  picked = [rows[1], rows[5], rows[3]]  # task 5's harness fails
  tally = Tally(2)
  completions, scored = run_agent_programs(run, run.model.params, picked, n=2, temperature=1.0,
                                           seed=3, version=4, tally=tally)
  assert sorted(c.prompt_index for c in completions) == [0, 0, 2, 2]  # task 5's group dropped
  counts = scored.counts
  assert counts["agent:program_errors"] == 2 and counts["agent:failed_groups"] == 1
  assert "the harness broke" in tally.first_error
  assert counts["agent:requests"] == 8  # two turns, through verifiers' interception proxy
  for c, reward in zip(completions, scored.rewards):
    assert c.turns == 2 and c.policy_version == 4
    sampled = np.array(c.sampled_mask)
    env_text = run.tokenizer.decode([t for t, m in zip(c.response_tokens, sampled) if not m])
    assert "again!" in env_text  # one trajectory: the second request extended the first
    # the environment's reward: the length of the final reply, modulo 3 (its text as the
    # endpoint decoded the last turn's sampled tokens)
    last_turn = np.flatnonzero(~sampled)[-1] + 1
    last_reply = run.tokenizer.decode(
        [t for t, m in zip(c.response_tokens[last_turn:], sampled[last_turn:]) if m])
    assert reward == len(last_reply.strip()) % 3 or reward == len(last_reply) % 3


def test_bad_names_and_configs_are_config_errors(tmp_path):
  with pytest.raises(ValueError, match="verifiers taskset 'no_such_taskset'.*not found"):
    load_agent("verifiers:no_such_taskset")
  with pytest.raises(ValueError, match="a top-level module"):
    load_agent("verifiers:tests.envs.no_such_taskset")
  with pytest.raises(ValueError, match="env.verifiers_config is not JSON"):
    load_agent(f"verifiers:{TASKSET}", "{runtime")
  with pytest.raises(ValueError, match="name the taskset"):
    load_agent("verifiers: ")
  config = tiny.config("agent_calc_openai", "--config.env.agent=verifiers:no_such_taskset")
  with pytest.raises(ConfigError, match="config.env.agent: verifiers taskset"):
    prepare(config, tmp_path, say=lambda *_: None)
