"""The real ``tinker`` SDK drives rlx's Tinker-compatible service on a tiny model."""

import socket
import threading
import time

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
uvicorn = pytest.importorskip("uvicorn")

from rlx.tinker import server as server_lib  # noqa: E402
from rlx.tinker.training import Base  # noqa: E402
from tests.conftest import FIXTURES  # noqa: E402

BASE = "rlx/tiny-llama"


@pytest.fixture(scope="module")
def service_url(tmp_path_factory):
  base = Base.load(BASE, str(FIXTURES / "hf" / "llama"), max_length=64)
  service = server_lib.Service({BASE: base}, tmp_path_factory.mktemp("tinker"))
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
  config = uvicorn.Config(server_lib.app(service), host="127.0.0.1", port=port, log_level="warning")
  server = uvicorn.Server(config)
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  while not server.started:
    time.sleep(0.05)
  yield f"http://127.0.0.1:{port}", service
  server.should_exit = True
  thread.join(10)


@pytest.fixture(scope="module")
def client(service_url):
  return tinker.ServiceClient(base_url=service_url[0], api_key="tml-test")


def _datum(tokens, weights=None):
  inputs, targets = tokens[:-1], tokens[1:]
  weights = np.ones(len(targets), np.float32) if weights is None else weights
  return tinker.Datum(model_input=tinker.ModelInput.from_ints(inputs),
                      loss_fn_inputs={"target_tokens": np.asarray(targets, np.int64),
                                      "weights": np.asarray(weights, np.float32)})


def test_capabilities_list_the_served_models(service_url):
  rest = tinker.RestClient(base_url=service_url[0], api_key="tml-test")
  capabilities = rest.get_server_capabilities().result()
  assert [m.model_name for m in capabilities.supported_models] == [BASE]


def test_a_supervised_loop_lowers_the_loss(client):
  training = client.create_lora_training_client(base_model=BASE, rank=4, seed=0)
  data = [_datum([1, 5, 9, 13, 17, 21, 25, 29]), _datum([2, 4, 6, 8, 10, 12])]
  losses = []
  for _ in range(8):
    out = training.forward_backward(data, "cross_entropy").result()
    losses.append(out.metrics["loss:sum"])
    training.optim_step(tinker.AdamParams(learning_rate=1e-3)).result()
  # the tiny random model's adapters move its logits slowly (its unembedding stays the base's)
  assert all(b < a for a, b in zip(losses, losses[1:])), losses
  assert losses[-1] < 0.95 * losses[0], losses
  logprobs = out.loss_fn_outputs[0]["logprobs"].to_numpy()
  assert logprobs.shape == (7,) and np.all(logprobs <= 0)
  assert np.isclose(-sum(o["logprobs"].to_numpy().sum() for o in out.loss_fn_outputs),
                    losses[-1], rtol=1e-4)
