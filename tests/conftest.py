"""Test setup, before JAX starts: 8 fake CPU devices for meshes, a quick XLA:CPU backend, one
compilation cache for the whole session, CPU collectives as patient as a run's, and fixture
paths.

The suite compiles hundreds of small programs and runs each a few times, so compiling is most
of its time. LLVM's optimisation passes (``xla_backend_optimization_level``) change how fast
the compiled code runs, never what it computes; at level 0 the update-step tests take half as
long. XLA:CPU's older loop emitters (``xla_cpu_use_fusion_emitters=false``) compile a tiny run's
programs in two thirds of the time of the MLIR fusion emitters, to the same values up to float
rounding (``XLA_FLAGS`` set by hand wins, flag by flag). Programs compiled by one test are loaded by the next
from a session-wide persistent cache, which ``tiny.OVERRIDES`` hands to the runs tests start as
subprocesses too; nothing is written under the user's home.
"""

import gc
import os
import pathlib
import shutil
import tempfile

for _flag, _value in (("xla_backend_optimization_level", "0"), ("xla_cpu_use_fusion_emitters", "false")):
  if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{_flag}={_value}".strip()
from rlx.main import patient_collectives  # noqa: E402 - imports no JAX backend yet

patient_collectives()  # a loaded machine slows a device past XLA:CPU's 40 s, as in a run
_OWN_CACHE = "RLX_TEST_COMPILE_CACHE" not in os.environ  # else the caller's, kept
if _OWN_CACHE:
  os.environ["RLX_TEST_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="rlx-test-compile-cache-")
COMPILE_CACHE = os.environ["RLX_TEST_COMPILE_CACHE"]

import jax  # noqa: E402 - after the flags above
import pytest  # noqa: E402

from rlx import compilation  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
compilation.start(COMPILE_CACHE)

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
HF_FAMILIES = ("llama", "qwen2", "qwen3")


# The longest tests (whole runs in subprocesses, 30-100 s each on 2 cores) are handed out first,
# so that no worker is left running one of them after the others have finished; the group of
# tests that start several processes (one worker runs them one after another, ~150 s) first of
# all.
LONGEST_FIRST = (
    "test_jobs.py::", "test_multihost.py::", "test_distributed.py::",
    "test_multihost_checkpoint.py::",
    "test_config.py::test_main_trains_the_default_split_config",
    "test_checkpoint.py::test_a_kill_at_any_moment_of_an_async_save",
    "test_experience.py::test_the_learner_compiles_once_per_bucket",
    "test_colocated.py::test_resumed_run_equals_straight_run",
    "test_buffer.py::test_a_split_run_trains_on_reused_groups",
    "test_faults.py::test_a_stop_signal_to_the_process_group",
    "test_advise.py::test_the_advisor_probes_a_tiny_config_end_to_end",
    "test_real_tasks.py::",
    "test_real_model.py::",
    "test_config.py::test_main_trains_a_hugging_face_model",
    "test_recipes.py::test_a_newcomer_runs_a_recipe",
    "test_lora_runs.py::test_a_lora_run_trains_the_adapters",
    "test_faults.py::test_the_newest_checkpoint_unreadable",
)


def pytest_collection_modifyitems(session, config, items):
  def rank(item):
    return next((i for i, name in enumerate(LONGEST_FIRST) if name in item.nodeid),
                len(LONGEST_FIRST))
  items.sort(key=rank)


# Every compiled XLA:CPU program holds its machine code in memory maps of its own, and a worker
# keeps the programs of every test it ran: past ~500 tests one worker held 60,000 maps, the
# kernel's limit (vm.max_map_count, 65,530 by default), and the next compile or cache load
# failed inside LLVM: a segfault or an abort that took the worker down. Past half the limit,
# the compiled programs are dropped (the next test that needs one loads it from the cache).
MAPS_BEFORE_CLEARING = 30_000


def _memory_maps() -> int:
  try:
    with open("/proc/self/maps", "rb") as maps:
      return sum(1 for _ in maps)
  except OSError:  # not Linux
    return 0


@pytest.fixture(autouse=True)
def _bounded_compiled_programs():
  yield
  if _memory_maps() > MAPS_BEFORE_CLEARING:
    jax.clear_caches()
    gc.collect()


def pytest_sessionfinish(session, exitstatus):
  if _OWN_CACHE:
    shutil.rmtree(COMPILE_CACHE, ignore_errors=True)


@pytest.fixture
def hf_dir():
  """Path of the tiny Hugging Face checkpoint of a family."""
  return lambda family: FIXTURES / "hf" / family
