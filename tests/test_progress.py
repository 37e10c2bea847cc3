"""The hang watchdog: a process that gets nothing done past ``trainer.hang_timeout_s`` while not
waiting on a peer ends loudly, with every thread's stack, instead of holding its devices."""

import subprocess
import sys
import textwrap

from rlx import progress


def test_the_watchdog_fires_only_past_the_timeout_and_never_while_waiting():
  now = [0.0]
  hangs = []
  dog = progress.Watchdog(10.0, on_hang=hangs.append, clock=lambda: now[0])
  progress.doing("training on rollout 3")
  start = progress.snapshot()["progress_at"]
  now[0] = start + 9
  assert not dog.check() and not hangs
  now[0] = start + 11
  assert dog.check()
  assert "training on rollout 3" in hangs[0] and "trainer.hang_timeout_s=10" in hangs[0]
  progress.waiting("the checkpoint write")  # a peer's or the storage's time, not a hang
  now[0] = progress.snapshot()["progress_at"] + 1000
  assert not dog.check()
  progress.tick()  # work again: the clock restarts, and the wait is over
  now[0] = progress.snapshot()["progress_at"] + 5
  assert not dog.check() and len(hangs) == 1
  now[0] = progress.snapshot()["progress_at"] + 11  # so a stall past the timeout is a hang
  assert dog.check() and len(hangs) == 2


def test_a_hung_process_ends_with_its_stacks_and_exit_status_70():
  script = textwrap.dedent("""
      import time
      from rlx import progress

      def stuck_in_a_call_that_never_returns():
        time.sleep(60)

      progress.doing("scoring rewards")
      with progress.Watchdog(0.5, interval_s=0.1):
        stuck_in_a_call_that_never_returns()
  """)
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        timeout=50, check=False)
  assert done.returncode == progress.EXIT_HUNG, done
  assert "has got nothing done" in done.stderr and "while scoring rewards" in done.stderr
  assert "stuck_in_a_call_that_never_returns" in done.stderr  # the hung thread's stack


def test_a_zero_timeout_watches_nothing():
  with progress.Watchdog(0) as dog:
    assert dog._thread is None


def test_a_hang_names_the_stage_of_each_thread_that_has_one():
  """A learner thread and a generator thread of one process each set their stage: the
  watchdog's line names both, not whichever set its stage last."""
  import threading
  progress.doing("updating on the batch of step 4")
  started, release = threading.Event(), threading.Event()

  def generator():
    progress.doing("scoring rollout 5")
    started.set()
    release.wait()

  thread = threading.Thread(target=generator, name="rlx-generator")
  thread.start()
  started.wait()
  try:
    doing = progress.snapshot()["doing"]
    assert "the main thread: updating on the batch of step 4" in doing
    assert "rlx-generator: scoring rollout 5" in doing
  finally:
    release.set()
    thread.join()
  # its thread is gone: the stage is the one of the thread still there
  assert progress.snapshot()["doing"] == "updating on the batch of step 4"


def test_a_reward_call_names_its_stage_beside_the_generating_thread_s():
  """The scorer thread says it is scoring while the reward function runs (a reward that never
  returns is reported as one), beside the generating thread's own stage."""
  import types

  import numpy as np

  from rlx.rollout import Completion
  from rlx.trainer.produce import collect

  seen = []

  def score(texts, rows):
    seen.append(progress.snapshot()["doing"])
    return types.SimpleNamespace(rewards=np.zeros(len(texts), np.float32),
                                 correct=np.zeros(len(texts), bool), counts={}, components={})

  run = types.SimpleNamespace(pool=types.SimpleNamespace(score=score),
                              tokenizer=types.SimpleNamespace(decode=lambda ids: "text"))
  progress.doing("sampling and scoring rollout 7")
  scorer = collect._Scorer(run, [{"prompt": "p"}])
  scorer.submit(Completion(prompt_tokens=[1], response_tokens=[2], logprobs=[0.0],
                           policy_logprobs=[0.0], finish_reason="stop", policy_version=0,
                           prompt_index=0, sample_index=0))
  scorer.finish()
  assert "rlx-scorer: scoring the rewards of 1 sample(s)" in seen[0], seen
  assert "the main thread: sampling and scoring rollout 7" in seen[0], seen


def test_a_program_far_past_its_longest_run_ends_the_run_in_one_line(monkeypatch):
  import types

  from rlx import compilation

  now = [1000.0]
  monkeypatch.setattr(progress, "time", types.SimpleNamespace(time=lambda: now[0]))
  monkeypatch.setattr(compilation, "finished_at", lambda: 0.0)
  compiling = [None]
  monkeypatch.setattr(compilation, "compiling", lambda: compiling[0])
  hangs = []
  dog = progress.Watchdog(0, on_hang=hangs.append, clock=lambda: now[0], programs_s=150.0)
  name = "the update step (test 1)"
  for took in (40.0, 2.0, 1.5):  # the first run compiles: its time is not the program's
    with progress.running(name):
      now[0] += took
  assert progress._longest[name] == 2.0
  progress.doing("the update that makes policy version 7")
  with progress.running(name):
    now[0] += 29  # a loaded machine's slow step: under the floor
    assert not dog.check()
    now[0] += 2
    compiling[0] = "jit_update"  # a new batch shape compiling: no one's hang
    assert not dog.check()
    compiling[0] = None
    assert dog.check()
  assert hangs == [f"rlx: error: {name} has run for 31s where it took at most 2.0s before "
                   "(the update that makes policy version 7): its devices wait at a collective "
                   "they reached in different orders (a deadlock); ending the run. Every "
                   "thread's stack follows; the newest checkpoint resumes it"]
  # a program never timed is never called stuck; and a watchdog without programs_s never looks
  with progress.running("the warm-up step (test 1)"):
    now[0] += 10_000
    assert not dog.check()
  with progress.running(name):
    now[0] += 10_000
    assert not progress.Watchdog(0, on_hang=hangs.append, clock=lambda: now[0]).check()
  assert len(hangs) == 1


def test_a_program_may_run_ten_times_its_longest_up_to_the_collective_timeout():
  assert progress.stuck_after(2.0, 150.0) == 30.0  # the floor
  assert progress.stuck_after(10.0, 150.0) == 100.0
  assert progress.stuck_after(20.0, 150.0) == 150.0  # XLA's collective timeout, less a margin
  assert progress.stuck_after(60.0, 150.0) == 180.0  # but never under three times its longest
