"""Test setup, before JAX starts: 8 fake CPU devices for meshes, a quick XLA:CPU backend, one
compilation cache for the whole session, and fixture paths.

The suite compiles hundreds of small programs and runs each a few times, so compiling is most
of its time. LLVM's optimisation passes (``xla_backend_optimization_level``) change how fast
the compiled code runs, never what it computes; at level 0 the update-step tests take half as
long (``XLA_FLAGS`` set by hand wins). Programs compiled by one test are loaded by the next
from a session-wide persistent cache, which ``tiny.OVERRIDES`` hands to the runs tests start as
subprocesses too; nothing is written under the user's home.
"""

import os
import pathlib
import shutil
import tempfile

if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_backend_optimization_level=0").strip()
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


def pytest_sessionfinish(session, exitstatus):
  if _OWN_CACHE:
    shutil.rmtree(COMPILE_CACHE, ignore_errors=True)


@pytest.fixture
def hf_dir():
  """Path of the tiny Hugging Face checkpoint of a family."""
  return lambda family: FIXTURES / "hf" / family
