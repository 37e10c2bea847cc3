"""Users' own reward functions: named by file or module, given the whole row, returning a
number or named components, batched and async; and every way one can misbehave (raise, exit,
hang, print, kill its process, run out of memory, leak) scores 0, is counted, and never stops
scoring."""

import numpy as np
import pytest

from rlx import rewards

USER_REWARDS = '''
import asyncio, os, sys, time

def scored(response, row):
    """Components, and the row's extra fields."""
    right = response.strip() == row["answer"]
    return {"reward": float(right) + 0.5 * row["meta"]["bonus"], "correct": right,
            "format": 1.0, "length": float(len(response))}

def plain(response, row):
    return 1.0 if response == row["answer"] else 0.0

LEAK = []

def misbehaves(response, row):
    if response == "raise":
        raise RuntimeError("a broken reward")
    if response == "exit":
        sys.exit(3)
    if response == "hard_exit":
        os._exit(3)
    if response == "hang":
        time.sleep(3600)
    if response == "print":
        print("noise from a reward function " * 100)
        sys.stderr.write("more noise\\n")
    if response == "memory":
        return float(len(bytearray(2 * 2**30)))
    if response == "leak":
        LEAK.append(bytearray(200 * 2**20))
    if response == "nan":
        return float("nan")
    return 1.0

async def judged_by_a_model(responses, rows):
    await asyncio.sleep(0.01)  # a request to a reward server
    return [{"reward": float(r == row["answer"]), "batch": float(len(responses))}
            for r, row in zip(responses, rows)]

def wrong_length(responses, rows):
    return [1.0]
'''


@pytest.fixture(scope="module")
def module_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("user") / "my_rewards.py"
  path.write_text(USER_REWARDS)
  return path


def test_a_function_in_a_file_gets_the_whole_row_and_its_components_are_kept(module_file):
  rows = [{"prompt": "p", "answer": "42", "meta": {"bonus": b}} for b in (0, 1, 0)]
  with rewards.RewardPool(f"{module_file}:scored", num_workers=2, timeout_s=10) as pool:
    scored = pool.score(["42", "42", "7"], rows)
  np.testing.assert_allclose(scored.rewards, [1.0, 1.5, 0.0])
  np.testing.assert_array_equal(scored.correct, [True, True, False])
  assert sorted(scored.components) == ["format", "length"]
  np.testing.assert_allclose(scored.components["length"], [2, 2, 1])
  assert scored.counts == {"reward/errors": 0, "reward/timeouts": 0}


def test_a_module_function_by_name():
  reward = rewards.RewardFn("tests.trainer.toy_rewards:odd_length")
  assert rewards.judge(reward, "abc", {"answer": ""}) == (1.0, True, {})


@pytest.mark.parametrize("name, message", [
    ("no_such_file.py:f", "no_such_file.py does not exist"),
    ("{dir}/broken.py:f", "importing .*broken.py failed: SyntaxError"),
    ("{dir}/my_rewards.py:missing", "my_rewards.py has no function 'missing'"),
    ("{dir}/my_rewards.py:LEAK", "LEAK is a list"),
    ("no_such_module:f", "importing module 'no_such_module' failed: ModuleNotFoundError"),
    ("maths", "unknown reward 'maths'"),
    ("my_rewards.py:", "name a function as"),
])
def test_a_reward_that_cannot_be_used_is_named_before_any_work(module_file, name, message):
  (module_file.parent / "broken.py").write_text("def f(:\n")
  with pytest.raises(rewards.RewardError, match=message):
    rewards.RewardPool(name.format(dir=module_file.parent), num_workers=0)


def test_misbehaving_functions_score_zero_are_counted_and_scoring_goes_on(module_file, capfd):
  responses = ["ok", "raise", "exit", "hard_exit", "print", "memory", "nan", "ok", "hang", "ok"]
  # 8 s: on a loaded machine (two CI workers and their runs) a fresh worker's import, or a
  # leak's growth, may take seconds
  with rewards.RewardPool(f"{module_file}:misbehaves", num_workers=2, timeout_s=8,
                          memory_mb=1024) as pool:
    scored = pool.score(responses, [{"answer": ""}] * len(responses))
    np.testing.assert_array_equal(scored.rewards, [1, 0, 0, 0, 1, 0, 0, 1, 0, 1])
    assert scored.counts == {"reward/errors": 5, "reward/timeouts": 1}
    # a leaking function: its worker is replaced once it has grown past half its memory
    pids = set()
    for _ in range(6):
      pids |= {worker.process.pid for worker in list(pool._idle.queue)}
      leaked = pool.score(["leak"] * 2, [{"answer": ""}] * 2)
      np.testing.assert_array_equal(leaked.rewards, [1, 1])
    assert len(pids) > 2, "no leaking worker was replaced"
  assert "noise from a reward function" not in capfd.readouterr().out


def test_a_batched_async_function_is_called_in_chunks(module_file):
  rows = [{"answer": str(i)} for i in range(5)]
  reward = rewards.RewardFn(f"{module_file}:judged_by_a_model", batched=True)
  with rewards.RewardPool(reward, num_workers=2, timeout_s=10, batch_size=2) as pool:
    scored = pool.score(["0", "1", "x", "3", "4"], rows)
  np.testing.assert_array_equal(scored.rewards, [1, 1, 0, 1, 1])
  np.testing.assert_array_equal(scored.components["batch"], [2, 2, 2, 2, 1])
  bad = rewards.RewardPool(rewards.RewardFn(f"{module_file}:wrong_length", batched=True),
                           num_workers=0, batch_size=4)
  scored = bad.score(["a", "b"], rows[:2])
  assert scored.counts["reward/errors"] == 2 and not scored.rewards.any()


def test_a_dict_without_reward_is_an_error():
  with pytest.raises(rewards.RewardError, match="without 'reward'"):
    rewards.judge(rewards.RewardFn(lambda response, row: {"score": 1.0}), "x", {})


def test_config_names_the_reward(module_file):
  from rlx.config import RewardConfig

  reward = rewards.from_config(RewardConfig(name=f"{module_file}:plain", format_weight=0.5),
                               "data.jsonl")
  assert rewards.check(reward)("a", {"answer": "a"}) == 1.0
  assert rewards.judge(reward, "<answer>a</answer>", {"answer": "<answer>a</answer>"}) == (
      1.5, True, {})
  assert rewards.from_config(RewardConfig(), "code").name == "code"
  assert rewards.from_config(RewardConfig(), "data.jsonl").name == "math"
