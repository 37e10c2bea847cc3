"""``python -m rlx.serve``: a Hugging Face directory served to the openai client, stopped
cleanly by SIGTERM; an address other machines can reach is refused without an API key."""

import os
import re
import signal
import subprocess
import sys

import openai
import pytest

from tests.conftest import FIXTURES

MODEL = FIXTURES / "hf" / "qwen2"


def _serve(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.Popen([sys.executable, "-m", "rlx.serve", "--model", str(MODEL),
                           "--dtype", "float32", "--max-len", "64", "--max-slots", "2", *args],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_serves_a_checkpoint_to_the_openai_client_and_stops_on_sigterm():
  server = _serve("--port", "0", "--api-key", "secret", "--max-tokens", "8")
  try:
    line = server.stdout.readline()
    url = re.search(r"on (http://\S+/v1)", line)
    assert url, line + server.stderr.read()
    client = openai.OpenAI(base_url=url.group(1), api_key="secret", max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "hello"}], n=2, seed=3,
        max_tokens=100, logprobs=True)
    assert len(reply.choices) == 2 and reply.usage.completion_tokens <= 16
    assert all(len(c.logprobs.content) <= 8 for c in reply.choices)
    with pytest.raises(openai.AuthenticationError, match="invalid API key"):
      openai.OpenAI(base_url=url.group(1), api_key="wrong", max_retries=0).models.list()
    assert client.models.list().data[0].id == "policy"
    text = client.completions.create(model="policy", prompt="hello", max_tokens=4, seed=1)
    assert text.choices[0].finish_reason in ("stop", "length")
  finally:
    server.send_signal(signal.SIGTERM)
    out, err = server.communicate(timeout=60)
  assert server.returncode == 0, err
  assert "stopped" in out


def test_a_public_address_needs_an_api_key():
  server = _serve("--host", "0.0.0.0", "--port", "0")
  out, err = server.communicate(timeout=120)
  assert server.returncode == 2 and "needs an API key" in err
