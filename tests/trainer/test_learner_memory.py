"""Host memory while training: the weights held are the learner's state (params and the
optimizer's moments) and the generator's copy, no more (a second copy of the params kept by
the run for its whole length cost 0.5 GB on a 135M-parameter model), and freed large buffers
leave the process (glibc kept 0.9 GB of freed temporaries resident)."""

import gc
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from rlx.trainer import Draw, prepare
from rlx.trainer.learn.learner import Learner
from tests.trainer import tiny
from tests.trainer.test_experience import _completion


@pytest.mark.parametrize("mode", ["colocated", "split"])
def test_the_only_copies_of_the_weights_are_the_state_s_and_the_generator_s(tmp_path, mode):
  config = tiny.config("dapo_split", f"--config.mesh.mode={mode}",
                       "--config.trainer.warmup_sft_steps=0")
  gc.collect()
  earlier = jax.live_arrays()  # other tests' (held, so that no new array takes their ids)
  run = prepare(config, tmp_path, say=lambda line: None)
  try:
    learner = Learner.for_run(run, say=lambda line: None)
    learner.sync.publish(learner.policy_params(), 0)
    gc.collect()
    shape = learner.state.params["embed"].shape
    held = {id(learner.state.params["embed"]), id(learner.sync.latest()[0]["embed"])}
    held |= {id(leaf) for leaf in jax.tree.leaves(learner.state.opt_state)
             if getattr(leaf, "shape", None) == shape}
    before = {id(a) for a in earlier}
    live = [a for a in jax.live_arrays() if a.shape == shape and id(a) not in before]
    assert len(held) == 4  # params, the two moments, the generator's copy
    assert {id(a) for a in live} == held, [a.sharding for a in live if id(a) not in held]
    # the train state took the run's weights: what would read the run's copy fails loudly
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(run.model.params))
  finally:
    run.close()


def batch_of_4_groups() -> Draw:
  """A batch of 4 prompts x 8 samples of random tokens and rewards, as a learner takes it."""
  rng = np.random.default_rng(0)
  return Draw(completions=[_completion(rng.integers(1, 32, 4), rng.integers(1, 32, 6), version=0,
                                       prompt_index=i // 8, sample_index=i % 8)
                           for i in range(32)],
              rewards=rng.random(32).round().astype(np.float32), correct=np.ones(32, bool),
              counts={}, generate_seconds=0.0, data_state={})


@pytest.mark.parametrize("mode", ["colocated", "split"])
def test_a_colocated_update_runs_without_the_generator_s_copy(tmp_path, mode):
  """Colocated, nothing samples during the update: the generator's copy of the weights is let
  go before it and made again by the next publish. Split, the generator decodes beside it."""
  config = tiny.config("dapo_split", f"--config.mesh.mode={mode}",
                       "--config.trainer.warmup_sft_steps=0", "--config.data.prompts_per_step=4")
  draw = batch_of_4_groups()
  run = prepare(config, tmp_path, say=lambda line: None)
  try:
    learner = Learner.for_run(run, say=lambda line: None)
    learner.publish()
    shape = learner.state.params["embed"].shape
    gone = []
    step = learner.step_fn

    def counting(state, *args, **kwargs):  # how many of the weights' arrays went before it
      gc.collect()
      gone.append(held - sum(a.shape == shape for a in jax.live_arrays()))
      return step(state, *args, **kwargs)

    gc.collect()
    held = sum(a.shape == shape for a in jax.live_arrays())  # with the generator's copy
    learner.step_fn = counting
    learner.learn(draw)
    assert gone == [1 if mode == "colocated" else 0]  # the generator's copy went
    if mode == "colocated":
      with pytest.raises(RuntimeError, match="publish the next version"):
        run.sync.latest()
    learner.publish()
    params, version = run.sync.latest()
    assert version == learner.version == 1 and params["embed"].shape == shape
  finally:
    run.close()


FREE_TWICE = """
import sys
import numpy as np
from rlx import main
if sys.argv[1] == "set":
  assert main.return_freed_memory()
def rss():
  return int([l for l in open("/proc/self/status") if l.startswith("VmRSS")][0].split()[1])
first = np.ones(2_500_000)  # a freed 20 MB buffer: glibc's default then keeps smaller ones in
del first  # its heap
kept = [np.ones(2_000_000) for _ in range(20)]  # 16 MB each, like a step's temporaries
del kept[::2]  # half of them freed, between live ones: resident unless unmapped
print(rss() // 1024)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_large_buffers_go_back_to_the_system():
  """A step's freed temporaries must not stay resident: with ``return_freed_memory`` freed 16 MB
  buffers leave the process; with glibc's default they stay, once a larger one was freed."""
  rss = {how: int(subprocess.run([sys.executable, "-c", FREE_TWICE, how], capture_output=True,
                                 text=True, check=True, env={**os.environ}).stdout)
         for how in ("set", "default")}
  assert rss["set"] + 120 < rss["default"], rss  # 160 MB freed


TRIM = """
import numpy as np
from rlx import hostmem, main
assert main.return_freed_memory()
trimmer = hostmem.HeapTrimmer(growth_bytes=50 << 20)
assert not trimmer.check()  # its first look: nothing freed since
kept = [np.ones(65_536) for _ in range(400)]  # 512 KB each: under the mmap threshold, in the heap
del kept[::2]  # 100 MB freed between live buffers: resident until trimmed
before = hostmem.resident_bytes()
assert trimmer.check() and trimmer.trims == 1
assert not trimmer.check()  # trimmed pages still count as free: not trimmed again
print(before // 2**20, hostmem.resident_bytes() // 2**20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_small_buffers_go_back_to_the_system_once_they_add_up():
  before, after = map(int, subprocess.run([sys.executable, "-c", TRIM], capture_output=True,
                                          text=True, check=True).stdout.split())
  assert after + 60 < before, (before, after)


def test_the_heaps_are_trimmed_when_their_free_bytes_grew_since_the_last_trim():
  from rlx.hostmem import HeapTrimmer
  frees, trims = iter([100, 90, 150, 200, 120, 250, 260]), []
  trimmer = HeapTrimmer(growth_bytes=100, free=lambda: next(frees), trim=lambda: trims.append(1))
  # the floor is the least seen (90): 150 is 60 above it, 200 is 110
  assert [trimmer.check() for _ in range(3)] == [False, False, False]
  assert trimmer.check() and trims == [1] and trimmer.floor == 200
  # reused (120), then freed again (250: 130 above 120)
  assert not trimmer.check() and trimmer.check() and trims == [1, 1]
  assert not trimmer.check()  # 260: 10 above what the last trim left counted as free

