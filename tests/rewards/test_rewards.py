"""Answer extraction, the verifiers, and the worker pool's handling of errors and timeouts."""

import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from rlx import rewards
from rlx.rewards import verifiers
from tests.processes import alive


@pytest.mark.parametrize("text, expected", [
    ("work... <answer>42</answer>", "42"),
    ("<answer>1</answer> then <answer>2</answer>", "2"),
    ("so the result is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("\\boxed{1} and finally \\boxed{x^{2}}", "x^{2}"),
    ("Some steps.\nAnswer: 17", "17"),
    ("Some steps.\nThe answer is 3/4.", "3/4"),
    ("#### 12", "12"),
    ("I think it is 41 or maybe 42", None),  # numbers in the text are not answers
    ("Answer: 5\nbut wait, more text", None),
    ("", None),
])
def test_final_answer_only_from_explicit_markers(text, expected):
  assert rewards.final_answer(text) == expected


def test_arithmetic():
  assert rewards.arithmetic_reward("12 + 30 = <answer>42</answer>", "42") == 1.0
  assert rewards.arithmetic_reward("<answer>41</answer>", "42") == 0.0
  assert rewards.arithmetic_reward("42", "42") == 0.0  # no marked answer
  assert rewards.arithmetic_reward("<answer>forty-two</answer>", "42") == 0.0
  assert rewards.arithmetic_reward("<answer>-7</answer>", "-7") == 1.0


@pytest.mark.parametrize("answer, expected", [
    ("(6 - 4) * 12", 1.0), ("12 * (6 - 4) = 24", 1.0), ("12 * 2", 0.0),  # 2 is not given
    ("6 * 4", 1.0),  # a subset of the numbers is allowed
    ("6 * 4 * 1 / 1", 0.0),  # 1 not given
    ("6 + 6 + 12", 0.0),  # 6 given once
    ("__import__('os')", 0.0), ("12 / (6 - 6)", 0.0), ("12 ** 2", 0.0),
])
def test_countdown(answer, expected):
  assert rewards.countdown_reward(f"<answer>{answer}</answer>", "24|6,4,12") == expected


def test_expression_evaluator_is_exact_and_refuses_code():
  value, numbers = rewards.evaluate_expression("(1 + 2) / 3 - -4")
  assert value == 5 and numbers == [1, 2, 3, 4]
  with pytest.raises(ValueError):
    rewards.evaluate_expression("len('abc')")


def test_math_verify_equivalence():
  assert rewards.math_reward("so \\boxed{\\frac{1}{2}}", "0.5") == 1.0
  assert rewards.math_reward("Answer: 2/4", "\\frac{1}{2}") == 1.0
  assert rewards.math_reward("\\boxed{x^2 + 2x + 1}", "(x+1)^2") == 1.0
  assert rewards.math_reward("\\boxed{3}", "\\frac{1}{2}") == 0.0
  assert rewards.math_reward("the value 1/2 appears here", "\\frac{1}{2}") == 0.0


def test_format_and_weighted_score():
  assert rewards.format_reward("think <answer>7</answer>") == 1.0
  assert rewards.format_reward("<answer>7</answer> trailing words") == 0.0
  reward = rewards.RewardFn("arithmetic", format_weight=0.1)
  assert rewards.judge(reward, "<answer>7</answer>", {"answer": "7"}) == (pytest.approx(1.1), True, {})
  assert rewards.judge(reward, "<answer>8</answer>", {"answer": "7"}) == (pytest.approx(0.1), False, {})


def _boom(response, reference):
  raise RuntimeError("reward function bug")


def _sleepy(response, reference):
  time.sleep(30 if response == "slow" else 0)
  return 1.0


def test_inline_pool_counts_exceptions(monkeypatch):
  monkeypatch.setitem(verifiers.VERIFIERS, "arithmetic", _boom)
  pool = rewards.RewardPool("arithmetic", num_workers=0)
  scores, _, counts, _ = pool.score(["<answer>1</answer>"] * 3, ["1"] * 3)
  np.testing.assert_array_equal(scores, [0, 0, 0])
  assert counts["reward/errors"] == 3 and pool.totals["reward/errors"] == 3


def test_worker_pool_scores_and_counts_errors():
  with rewards.RewardPool("countdown", num_workers=2, timeout_s=5) as pool:
    scores, _, counts, _ = pool.score(["<answer>6 * 4</answer>", "<answer>6 + 4</answer>", "nothing"],
                                ["24|6,4", "24|6,4", "24|6,4"])
    np.testing.assert_array_equal(scores, [1, 0, 0])
    assert counts == {"reward/errors": 0, "reward/timeouts": 0}
    # A malformed reference makes the verifier raise: it scores 0, is counted, the run goes on.
    scores, _, counts, _ = pool.score(["<answer>6 * 4</answer>"] * 2, ["24", "24|6,4"])
    np.testing.assert_array_equal(scores, [0, 1])
    assert counts["reward/errors"] == 1 and pool.totals["reward/errors"] == 1


def test_worker_pool_replaces_a_stuck_worker():
  with rewards.RewardPool(_sleepy, num_workers=2, timeout_s=1) as pool:
    started = time.monotonic()
    scores, _, counts, _ = pool.score(["fast", "slow", "fast"], ["", "", ""])
    assert time.monotonic() - started < 15
    np.testing.assert_array_equal(scores, [1, 0, 1])
    assert counts["reward/timeouts"] == 1
    scores, _, counts, _ = pool.score(["fast"] * 4, [""] * 4)  # fresh workers carry on
    np.testing.assert_array_equal(scores, [1] * 4)
    assert counts["reward/timeouts"] == 0


def _chaos(response, reference):
  """Behaves as the response says: scores, raises, hangs, or kills its own process."""
  if response == "raise":
    raise RuntimeError("a broken reward function")
  if response == "hang":
    time.sleep(3600)
  if response == "die":
    os._exit(3)
  return 1.0


def test_pool_shared_by_two_threads_survives_raises_hangs_and_deaths():
  """Two threads score a few hundred batches at once through one pool while the reward
  randomly raises, hangs or kills its worker: nothing crashes, every call gets its own answer,
  every failure is counted exactly once."""
  expected_totals = {"reward/errors": 0, "reward/timeouts": 0}
  failures: list[BaseException] = []
  lock = threading.Lock()

  def client(pool, seed):
    rng = np.random.default_rng(seed)
    try:
      for _ in range(100):
        responses = list(rng.choice(["ok", "raise", "hang", "die"], size=6,
                                    p=[0.94, 0.04, 0.01, 0.01]))
        scores, correct, counts, _ = pool.score(responses, [""] * len(responses))
        ok = np.array([r == "ok" for r in responses])
        np.testing.assert_array_equal(scores, ok.astype(np.float32))
        np.testing.assert_array_equal(correct, ok)
        errors = sum(r in ("raise", "die") for r in responses)
        timeouts = responses.count("hang")
        assert counts == {"reward/errors": errors, "reward/timeouts": timeouts}, (responses, counts)
        with lock:
          expected_totals["reward/errors"] += errors
          expected_totals["reward/timeouts"] += timeouts
    except BaseException as error:  # noqa: BLE001 - reported by the main thread
      failures.append(error)

  with rewards.RewardPool(_chaos, num_workers=2, timeout_s=1.0) as pool:
    threads = [threading.Thread(target=client, args=(pool, seed)) for seed in (1, 2)]
    for thread in threads:
      thread.start()
    for thread in threads:
      thread.join(timeout=600)  # the watchdog: a hang fails the test instead of the suite
      assert not thread.is_alive(), "a scoring thread hung"
    assert not failures, failures
    assert pool.totals == expected_totals
    assert expected_totals["reward/timeouts"] > 0 and expected_totals["reward/errors"] > 0


def test_workers_ignore_the_stop_signals_sent_to_the_process_group():
  with rewards.RewardPool("arithmetic", num_workers=2, timeout_s=5) as pool:
    # Signalled while they start (a spawned child does not inherit a blocked signal mask).
    starting = [worker.process for worker in list(pool._idle.queue)]
    for worker in starting:
      os.kill(worker.pid, signal.SIGINT)
      os.kill(worker.pid, signal.SIGTERM)
    pool.score(["<answer>1</answer>"] * 4, ["1"] * 4)  # the workers are up
    workers = [worker.process for worker in list(pool._idle.queue)]
    assert sorted(w.pid for w in workers) == sorted(w.pid for w in starting)
    for worker in workers:
      os.kill(worker.pid, signal.SIGINT)
      os.kill(worker.pid, signal.SIGTERM)
    time.sleep(0.5)
    assert all(worker.is_alive() for worker in workers)
    scores, correct, counts, _ = pool.score(["<answer>2</answer>", "<answer>3</answer>"], ["2", "2"])
    np.testing.assert_array_equal(scores, [1, 0])
    assert counts == {"reward/errors": 0, "reward/timeouts": 0}
  assert not any(worker.is_alive() for worker in workers)


def test_accuracy_is_the_verdict_not_the_format_bonus():
  pool = rewards.RewardPool("sort", format_weight=1.0, num_workers=0)
  scores, correct, _, _ = pool.score(["<answer>1379</answer>", "<answer>9731</answer>"],
                                  ["1379", "1379"])
  np.testing.assert_array_equal(scores, [2.0, 1.0])  # the wrong answer still earns its format
  np.testing.assert_array_equal(correct, [True, False])


def test_unknown_verifier_is_refused():
  with pytest.raises(rewards.RewardError, match="unknown reward 'maths'"):
    rewards.RewardPool("maths", num_workers=0)


@pytest.mark.parametrize("response, expected", [
    ("<answer>1379</answer>", 1.0), ("<answer>1, 3, 7, 9</answer>", 1.0),
    ("<answer>1 3 7 9</answer>", 1.0), ("<answer>1397</answer>", 0.0),
    ("<answer>137</answer>", 0.0), ("1379", 0.0)])
def test_sort_reward_credits_only_the_sorted_digits(response, expected):
  assert rewards.sort_reward(response, "1379") == expected


def test_a_reward_no_float32_holds_is_a_counted_error_not_a_reward():
  pool = rewards.RewardPool("tests.trainer.toy_rewards:huge", num_workers=0)
  scored = pool.score(["a", "b"], ["1", "2"])
  assert scored.counts["reward/errors"] == 2 and list(scored.rewards) == [0.0, 0.0]
  assert "1e+39" in pool.first_error and "not a finite float32" in pool.first_error


def _spawner(response, row):
  """Starts a sleeper child, and a daemon that leaves its session, and writes down their pids;
  then answers at once ("ok") or hangs past the timeout ("hang")."""
  import subprocess
  child = subprocess.Popen(["sleep", "60"])
  pids = [child.pid]
  read, write = os.pipe()
  if os.fork() == 0:  # a double fork: the daemon's parent exits, it escapes the group
    os.setsid()
    daemon = os.fork()
    if daemon == 0:
      time.sleep(60)
      os._exit(0)
    os.write(write, str(daemon).encode())
    os._exit(0)
  os.close(write)
  pids.append(int(os.read(read, 32)))
  with open(row["file"], "a") as f:
    f.write(" ".join(map(str, pids)) + "\n")
  if response == "hang":
    time.sleep(3600)
  return 1.0


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_processes_a_reward_call_starts_end_with_the_call(tmp_path):
  pids_file = tmp_path / "pids"
  row = {"file": str(pids_file), "answer": ""}
  with rewards.RewardPool(_spawner, num_workers=2, timeout_s=2) as pool:
    scores, _, counts, _ = pool.score(["ok"] * 4, [row] * 4)
    assert list(scores) == [1.0] * 4
    pids = [int(p) for p in pids_file.read_text().split()]
    assert len(pids) == 8
    deadline = time.monotonic() + 10
    while any(map(alive, pids)) and time.monotonic() < deadline:
      time.sleep(0.1)
    assert not [p for p in pids if alive(p)], "a reward call's processes outlived it"
    # a call that times out: its worker is killed with its process group
    pids_file.write_text("")
    scores, _, counts, _ = pool.score(["hang"], [row])
    assert counts["reward/timeouts"] == 1
    # the child in its group and the daemon in a session of its own both end with the call
    pids = [int(p) for p in pids_file.read_text().split()]
    deadline = time.monotonic() + 10
    while any(map(alive, pids)) and time.monotonic() < deadline:
      time.sleep(0.1)
    assert not [p for p in pids if alive(p)], "a timed-out call's processes outlived it"


_TRAINER = """
import sys
from rlx import rewards
from tests.rewards.test_rewards import _spawner
pool = rewards.RewardPool(_spawner, num_workers=1, timeout_s=600)
pool.score(["hang"], [{"file": sys.argv[1], "answer": ""}])
"""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_trainer_killed_mid_call_leaves_no_process_of_its_reward_behind(tmp_path):
  """SIGKILL of the trainer while a reward function waits on a child in its group and a
  daemon in a session of its own: the worker notices and kills both before it exits."""
  pids_file = tmp_path / "pids"
  pids_file.write_text("")
  trainer = subprocess.Popen([sys.executable, "-c", _TRAINER, str(pids_file)],
                             cwd=pathlib.Path(__file__).parent.parent.parent)
  try:
    deadline = time.monotonic() + 60
    while not pids_file.read_text().strip() and time.monotonic() < deadline:
      time.sleep(0.1)
    pids = [int(p) for p in pids_file.read_text().split()]
    worker = int(open(f"/proc/{pids[0]}/stat").read().rsplit(")", 1)[1].split()[1])
    assert len(pids) == 2
  finally:
    trainer.kill()
    trainer.wait()
  deadline = time.monotonic() + 10
  while any(map(alive, pids + [worker])) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not [p for p in pids + [worker] if alive(p)], "processes outlived the trainer"


def test_the_math_verifier_scores_in_a_thread_without_workers():
  """reward.num_workers=0 scores in the calling thread: the collector's scoring thread in both
  deployments, where math-verify's signal-based timeouts cannot run."""
  responses = ["<answer>\\frac{1}{2}</answer>", "<answer>0.5</answer>", "<answer>3</answer>"]
  found = {}

  def score():
    with rewards.RewardPool("math", num_workers=0) as pool:
      found["scored"] = pool.score(responses, ["1/2"] * 3)

  score()  # the main thread
  assert found["scored"].counts["reward/errors"] == 0
  assert list(found["scored"].correct) == [True, True, False]
  found.clear()
  thread = threading.Thread(target=score)
  thread.start()
  thread.join()
  assert found["scored"].counts["reward/errors"] == 0  # every call raised here before
  assert list(found["scored"].correct) == [True, True, False]


def test_extra_rewards_add_with_weights_are_logged_and_leave_the_verdict(tmp_path):
  (tmp_path / "shaping.py").write_text(
      "def brevity(response, row):\n  return -len(response) / 100\n\n"
      "def noted(response, row):\n  return {'reward': 2.0, 'correct': False}\n")
  reward = rewards.RewardFn("arithmetic", extra=((f"{tmp_path}/shaping.py:brevity", 0.5),
                                                 (f"{tmp_path}/shaping.py:noted", 0.25)))
  rewards.check(reward)
  response = "<answer>7</answer>"
  value, correct, components = rewards.judge(reward, response, {"answer": "7"})
  assert correct  # the main reward's verdict; the extra's 'correct' does not count
  assert components == {"brevity": pytest.approx(-len(response) / 100), "noted": 2.0}
  assert value == pytest.approx(1.0 + 0.5 * -len(response) / 100 + 0.25 * 2.0)
  with pytest.raises(rewards.RewardError, match="unknown reward"):
    rewards.check(rewards.RewardFn("arithmetic", extra=(("nonsense", 1.0),)))


def test_extra_rewards_come_from_the_config():
  from rlx.config import ConfigError, RewardConfig
  from rlx.rewards.functions import from_config

  reward = from_config(RewardConfig(name="math", extra=(("countdown", 0.2),)), "data.jsonl")
  assert reward.extra == (("countdown", 0.2),)
  with pytest.raises(ConfigError, match="reward.extra"):
    RewardConfig(extra=(("math", float("nan")),))


def test_what_a_reward_prints_goes_to_the_log_file(tmp_path):
  (tmp_path / "chatty.py").write_text(
      "import sys\n\ndef score(response, row):\n"
      "  print('scoring', response)\n  print('warned', file=sys.stderr)\n  return 1.0\n")
  log = tmp_path / "not-made-yet" / "reward.log"  # a run's workdir (the advisor's probes')
  with rewards.RewardPool(f"{tmp_path}/chatty.py:score", num_workers=1, timeout_s=30,
                          log_path=log) as pool:
    scores, _, _, _ = pool.score(["a", "b"], ["", ""])
  assert list(scores) == [1.0, 1.0]
  text = log.read_text()
  assert "scoring a" in text and "scoring b" in text and "warned" in text
