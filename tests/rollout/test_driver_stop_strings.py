"""Stop strings: a response ends at the token that completes the first stop string, keeping
exactly the sampled tokens (and log-probs) up to it."""

import pytest

from rlx.config import ConfigError, RolloutConfig
from rlx.rollout import Completion

PIECES = ["<ans", "wer>", "4", "</", "answer>", " and", " more", "</answer>"]


def _decode(ids):
  return "".join(PIECES[i] for i in ids)


def _completion(ids, mask=None):
  return Completion(prompt_tokens=[9], response_tokens=list(ids),
                    logprobs=[-0.1 * (i + 1) for i in ids], policy_logprobs=[-0.2] * len(ids),
                    finish_reason="length", policy_version=3, prompt_index=0, sample_index=0,
                    sampled_mask=mask)


def test_the_response_ends_at_the_token_that_completes_the_stop_string():
  c = _completion(range(8))
  assert c.cut_at_stop_strings(["</answer>"], _decode)
  assert c.response_tokens == [0, 1, 2, 3, 4]  # "</" + "answer>" completes it at token 4
  assert c.logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5])
  assert len(c.policy_logprobs) == 5
  assert c.finish_reason == "stop"
  # the first of several stop strings to appear wins; none there: nothing changes
  d = _completion(range(8), mask=[True] * 8)
  assert d.cut_at_stop_strings(["more", "4"], _decode) and d.response_tokens == [0, 1, 2]
  assert d.sampled_mask == [True] * 3
  e = _completion(range(3))
  assert not e.cut_at_stop_strings(["zzz"], _decode) and e.response_tokens == [0, 1, 2]
  assert e.finish_reason == "length"


def test_stop_strings_must_be_strings():
  assert RolloutConfig(stop_strings=("</answer>",)).stop_strings == ("</answer>",)
  with pytest.raises(ConfigError, match="rollout.stop_strings"):
    RolloutConfig(stop_strings=("",))
