"""What the reward tests share: the code sandbox, or a skip saying why this system has none."""

import pytest

from rlx.rewards import sandbox


@pytest.fixture(scope="module")
def available():
  try:
    return sandbox.capabilities()
  except sandbox.SandboxUnavailable as error:
    pytest.skip(str(error))
