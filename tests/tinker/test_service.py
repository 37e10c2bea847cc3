"""The real ``tinker`` SDK drives rlx's Tinker-compatible service on a tiny model."""

import contextlib
import json
import socket
import threading
import time

import jax
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
uvicorn = pytest.importorskip("uvicorn")

from rlx.tinker import queue as queue_lib  # noqa: E402
from rlx.tinker import routes  # noqa: E402
from rlx.tinker import server as server_lib  # noqa: E402
from rlx.tinker.training import Base  # noqa: E402
from tests.conftest import FIXTURES  # noqa: E402

BASE = "rlx/tiny-llama"


@contextlib.contextmanager
def _serving(workdir, **options):
  """A service of the tiny base (its own copy: engines are cached per model) over HTTP."""
  base = Base.load(BASE, str(FIXTURES / "hf" / "llama"), max_length=64)
  service = server_lib.Service({BASE: base}, workdir, **options)
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
  config = uvicorn.Config(routes.app(service), host="127.0.0.1", port=port, log_level="warning")
  server = uvicorn.Server(config)
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  while not server.started:
    time.sleep(0.05)
  yield f"http://127.0.0.1:{port}", service
  server.should_exit = True
  thread.join(10)


@pytest.fixture(scope="module")
def service_url(tmp_path_factory):
  with _serving(tmp_path_factory.mktemp("tinker")) as served:
    yield served


@pytest.fixture(scope="module")
def client(service_url):
  # closed before the service stops: its heartbeat thread would warn about the gone service
  with tinker.ServiceClient(base_url=service_url[0], api_key="tml-test") as client:
    yield client


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
  training = client.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
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


def test_sampling_from_the_base_and_from_saved_weights(client):
  training = client.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
  prompt = tinker.ModelInput.from_ints([1, 5, 9, 13])
  params = tinker.SamplingParams(max_tokens=6, temperature=1.0, seed=3)
  base = client.create_sampling_client(base_model=BASE).result()
  drawn = base.sample(prompt, num_samples=3, sampling_params=params).result()
  assert len(drawn.sequences) == 3
  for sequence in drawn.sequences:
    assert 1 <= len(sequence.tokens) <= 6 and len(sequence.logprobs) == len(sequence.tokens)
    assert all(lp <= 0 for lp in sequence.logprobs)
  # a fresh adapter (B = 0) is exactly the base: same seed, same tokens
  fresh = training.save_weights_and_get_sampling_client().result()
  same = fresh.sample(prompt, num_samples=3, sampling_params=params).result()
  assert [s.tokens for s in same.sequences] == [s.tokens for s in drawn.sequences]


def test_save_and_load_weights_round_trip_bitwise(client, service_url):
  service = service_url[1]
  training = client.create_lora_training_client(base_model=BASE, rank=4, seed=2).result()
  data = [_datum([3, 7, 11, 15, 19])]
  training.forward_backward(data, "cross_entropy").result()
  training.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
  path = training.save_state("after-one").result().path
  model_id = training.model_id
  saved = {k: np.asarray(v) for k, v in _flat(service.adapters[model_id].adapters).items()}
  training.forward_backward(data, "cross_entropy").result()
  training.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
  moved = _flat(service.adapters[model_id].adapters)
  assert any(not np.array_equal(saved[k], np.asarray(moved[k])) for k in saved)
  training.load_state_with_optimizer(path).result()
  loaded = _flat(service.adapters[model_id].adapters)
  assert all(np.array_equal(saved[k], np.asarray(loaded[k])) for k in saved)


def _flat(tree):
  import jax

  return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def test_one_clients_step_never_changes_anothers(client):
  one = client.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
  two = client.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
  data = [_datum([1, 5, 9, 13, 17])]
  before = two.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
  two.optim_step(tinker.AdamParams(learning_rate=0.0)).result()  # clears two's gradient
  for _ in range(3):
    one.forward_backward(data, "cross_entropy").result()
    one.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
  assert one.forward_backward(data, "cross_entropy").result().metrics["loss:sum"] < before
  assert two.forward_backward(data, "cross_entropy").result().metrics["loss:sum"] == before


def test_a_custom_loss_trains_as_the_built_in_loss_it_equals(client):
  """``forward_backward_custom`` (the SDK's forward, the loss's gradient on the client, a
  backward with it as cross-entropy weights), with the optimizer step submitted before its
  result: the same steps as the built-in loss it computes, and any differentiable loss runs."""
  import torch

  data = [_datum([1, 5, 9, 13, 17, 21]), _datum([2, 4, 6, 8])]
  custom = client.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
  built_in = client.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()

  def weighted_nll(datums, logprobs):
    loss = sum(-(torch.tensor(d.loss_fn_inputs["weights"].to_numpy()) * lp).sum()
               for d, lp in zip(datums, logprobs))
    return loss, {"nll": float(loss)}

  for _ in range(2):
    futures = [custom.forward_backward_custom(data, weighted_nll),
               custom.optim_step(tinker.AdamParams(learning_rate=1e-2))]
    out = futures[0].result()
    futures[1].result()
    reference = built_in.forward_backward(data, "cross_entropy").result()
    built_in.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    assert np.isclose(out.metrics["nll"], reference.metrics["loss:sum"], rtol=1e-5)
  after = [c.forward(data, "cross_entropy").result().metrics["loss:sum"]
           for c in (custom, built_in)]
  assert np.isclose(after[0], after[1], rtol=1e-5) and after[0] < reference.metrics["loss:sum"]
  # a loss no built-in computes: the square of every log-prob, through the same path
  squared = custom.forward_backward_custom(
      data, lambda datums, logprobs: (sum((lp ** 2).sum() for lp in logprobs), {})).result()
  assert squared.metrics
  custom.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()


@pytest.mark.parametrize("make, message", [
    (lambda: [_datum([1, 2, 999])], "outside the vocabulary"),
    (lambda: [tinker.Datum(model_input=tinker.ModelInput.from_ints([1, 2, 3]),
                           loss_fn_inputs={"target_tokens": np.array([2, 3], np.int64),
                                           "weights": np.ones(2, np.float32)})],
     "one per token"),
    (lambda: [tinker.Datum(model_input=tinker.ModelInput.from_ints([1, 2, 3]),
                           loss_fn_inputs={"target_tokens": np.array([2, 3, 4], np.int64)})],
     "missing"),
])
def test_bad_datums_fail_their_call_with_the_reason_and_change_nothing(client, service_url, make,
                                                                       message):
  training = client.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
  adapters = _flat(service_url[1].adapters[training.model_id].adapters)
  with pytest.raises(tinker.RequestFailedError, match=message):
    training.forward_backward(make(), "cross_entropy").result()
  assert service_url[1].adapters[training.model_id].pending is None
  after = _flat(service_url[1].adapters[training.model_id].adapters)
  assert all(np.array_equal(np.asarray(adapters[k]), np.asarray(after[k])) for k in adapters)
  # the service keeps serving
  assert training.forward_backward([_datum([1, 2, 3])], "cross_entropy").result().metrics


def test_an_unknown_loss_or_config_key_is_refused_by_name(client):
  training = client.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
  with pytest.raises(tinker.RequestFailedError, match="'dpo' is not served"):
    training.forward_backward([_datum([1, 2, 3])], "dpo").result()
  with pytest.raises(tinker.RequestFailedError, match="'stable_reinforce' is not served: its "
                     "definition is not public; pass one of ppo"):
    training.forward_backward([_datum([1, 2, 3])], "stable_reinforce").result()
  with pytest.raises(tinker.RequestFailedError, match="clip_lo"):
    training.forward_backward([_datum([1, 2, 3])], "cross_entropy",
                              loss_fn_config={"clip_lo": 0.5}).result()


def test_an_unknown_base_model_is_refused_with_the_served_ones(client):
  with pytest.raises(Exception, match="not served here"):
    client.create_lora_training_client(base_model="nobody/none", rank=4).result()


def test_compute_logprobs_gives_each_prompt_tokens_log_prob(client):
  sampler = client.create_sampling_client(base_model=BASE).result()
  tokens = [1, 7, 19, 23, 42, 5]
  logprobs = sampler.compute_logprobs(tinker.ModelInput.from_ints(tokens)).result()
  assert len(logprobs) == len(tokens) and logprobs[0] is None
  assert all(lp is not None and lp < 0 for lp in logprobs[1:])
  # the same numbers as the training side's forward pass on the base (a fresh adapter)
  training = client.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
  out = training.forward([_datum(tokens)], "cross_entropy").result()
  np.testing.assert_allclose(out.loss_fn_outputs[0]["logprobs"].to_numpy(), logprobs[1:],
                             rtol=1e-4, atol=1e-5)


def test_finished_futures_past_the_limit_are_forgotten_oldest_first(service_url, monkeypatch):
  service = service_url[1]
  monkeypatch.setattr(queue_lib, "KEPT_FUTURES", 3)
  ids = [service.submit(lambda i=i: {"i": i})["request_id"] for i in range(6)]
  assert service.retrieve(ids[-1]) == {"i": 5}
  time.sleep(0.1)
  assert len(service.futures) <= 3 and ids[0] not in service.futures
  with pytest.raises(server_lib.BadInput, match="never issued"):
    service.retrieve(ids[0])


def _sample_request(tokens, **settings):
  return {"base_model": BASE, "prompt": {"chunks": [{"tokens": tokens}]}, "num_samples": 1,
          "sampling_params": {"max_tokens": 8, "temperature": 1.0, **settings}}


def test_queued_sampling_calls_on_the_same_weights_decode_together(service_url, monkeypatch):
  service, base = service_url[1], service_url[1].bases[BASE]
  calls = []
  sample = base.sample
  monkeypatch.setattr(base, "sample", lambda params, prompts, **kw: calls.append(
      (list(map(list, prompts)), kw["seed"])) or sample(params, prompts, **kw))
  gate = threading.Event()
  service.submit(lambda: gate.wait(10) and {})  # holds the worker while the calls queue
  prompts = [[1, 5, 9], [2, 4, 6, 8], [1, 5, 9], [3, 3]]
  futures = [service.sample(_sample_request(p)) for p in prompts]
  other = service.sample(_sample_request([7, 7], max_tokens=4))  # other settings: its own batch
  seeded = [service.sample(_sample_request([1, 5, 9], seed=11)) for _ in range(2)]
  gate.set()
  results = [service.retrieve(f["request_id"]) for f in [*futures, other, *seeded]]
  assert all(isinstance(r, bytes) for r in results), results
  assert [c[0] for c in calls] == [prompts, [[7, 7]], [[1, 5, 9]], [[1, 5, 9]]]
  # calls without a seed draw afresh (the same prompt twice is two different samples); calls
  # with one run alone and repeat exactly
  first, third = (wire_tokens(results[i]) for i in (0, 2))
  assert first != third
  assert calls[2][1] == calls[3][1] == 11
  assert wire_tokens(results[5]) == wire_tokens(results[6])


def test_calls_on_different_samplers_decode_together_each_with_its_own_adapter(client,
                                                                                service_url,
                                                                                monkeypatch):
  service, base = service_url[1], service_url[1].bases[BASE]
  paths = []
  for seed, tokens in ((5, [1, 5, 9, 13, 17]), (6, [2, 6, 10, 14, 18])):
    training = client.create_lora_training_client(base_model=BASE, rank=4, seed=seed).result()
    for _ in range(3):  # far from the base, and from each other
      training.forward_backward([_datum(tokens)], "cross_entropy").result()
      training.optim_step(tinker.AdamParams(learning_rate=5e-2)).result()
    paths.append(training.save_weights_for_sampler(f"bank-{seed}").result().path)
  calls = []
  sample = base.sample
  monkeypatch.setattr(base, "sample", lambda params, prompts, **kw: calls.append(
      kw["adapters"]) or sample(params, prompts, **kw))
  gate = threading.Event()
  service.submit(lambda: gate.wait(10) and {})  # holds the worker while the calls queue
  requests = [dict(_sample_request(prompt), model_path=path, base_model=None)
              for path in paths for prompt in ([1, 5, 9], [2, 6])]
  requests.append(_sample_request([1, 5, 9]))  # the base alone, in the same batch
  futures = [service.sample(r) for r in requests]
  gate.set()
  results = [service.retrieve(f["request_id"]) for f in futures]
  assert calls == [[0, 0, 1, 1, -1]]  # one decode, each call's slots on its own adapter
  from tinker.proto import tinker_public_pb2 as pb

  for request, result in zip(requests, results, strict=True):
    prompt = request["prompt"]["chunks"][0]["tokens"]
    where = request.get("model_path") or f"base:{BASE}"
    (sequence,) = pb.SampleResponse.FromString(result).sequences
    tokens = np.frombuffer(sequence.tokens, np.int32).tolist()
    # the sampled tokens' log-probs are those of the call's own weights, no other's
    own = base.prompt_logprobs(service._weights(base, [where])[0], prompt + tokens)[len(prompt):]
    np.testing.assert_allclose(np.frombuffer(sequence.logprobs, np.float32), own, atol=1e-4)


def test_split_sampling_runs_beside_training_on_a_device_of_its_own(service_url, tmp_path):
  one_lane = service_url[1]
  with _serving(tmp_path, split=True) as (url, split):
    assert split.sample_device == jax.local_devices()[-1] != jax.local_devices()[0]
    gate, running = threading.Event(), threading.Event()
    held = split.submit(lambda: running.set() or gate.wait(60) and {})  # a long training call
    assert running.wait(10)
    request = _sample_request([1, 5, 9], seed=3)
    answer = split.retrieve(split.sample(request)["request_id"], wait_s=30)
    assert isinstance(answer, bytes), answer  # sampled while the training call still ran
    assert not split.futures[held["request_id"]].done.is_set()
    gate.set()
    assert split.retrieve(held["request_id"]) == {}
    # the same tokens as the one-lane service's, on the sampling device
    assert wire_tokens(answer) == wire_tokens(
        one_lane.retrieve(one_lane.sample(request)["request_id"]))
    assert {d for leaf in jax.tree.leaves(split._base_params(split.bases[BASE]))
            for d in leaf.devices()} == {split.sample_device}

    # trained on the first device, sampled on the other: what the one-lane service gives
    def train_and_sample(base_url):
      with tinker.ServiceClient(base_url=base_url, api_key="tml-test") as client:
        training = client.create_lora_training_client(base_model=BASE, rank=4, seed=9)
        for _ in range(2):
          training.forward_backward([_datum([1, 5, 9, 13, 17])], "cross_entropy").result()
          training.optim_step(tinker.AdamParams(learning_rate=5e-2)).result()
        sampler = training.save_weights_and_get_sampling_client("split-check").result()
        return sampler.sample(tinker.ModelInput.from_ints([1, 5]), num_samples=2,
                              sampling_params=tinker.SamplingParams(max_tokens=6, seed=4)
                              ).result().sequences

    ours, theirs = train_and_sample(url), train_and_sample(service_url[0])
    assert [s.tokens for s in ours] == [s.tokens for s in theirs]
    np.testing.assert_allclose([s.logprobs for s in ours], [s.logprobs for s in theirs],
                               atol=1e-5)


def wire_tokens(proto: bytes) -> list[list[int]]:
  from tinker.proto import tinker_public_pb2 as pb

  response = pb.SampleResponse.FromString(proto)
  return [np.frombuffer(sequence.tokens, np.int32).tolist() for sequence in response.sequences]


def test_closing_the_client_ends_its_session_and_releases_its_adapters(service_url):
  with tinker.ServiceClient(base_url=service_url[0], api_key="tml-test") as closing:
    training = closing.create_lora_training_client(base_model=BASE, rank=4).result()
    saved = training.save_weights_for_sampler("kept").result().path
    assert training.model_id in service_url[1].adapters
  assert training.model_id not in service_url[1].adapters
  assert saved in service_url[1].samplers  # what it saved stays usable


def test_a_sampler_checkpoint_serves_other_clients_and_a_restarted_service(client, service_url):
  service = service_url[1]
  training = client.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
  training.forward_backward([_datum([1, 5, 9, 13, 17])], "cross_entropy").result()
  training.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
  path = training.save_weights_for_sampler("shared").result().path
  # another client's sampling client asks the service for the checkpoint's base model
  with tinker.ServiceClient(base_url=service_url[0], api_key="tml-test") as other:
    sampler = other.create_sampling_client(model_path=path).result()
    drawn = sampler.sample(tinker.ModelInput.from_ints([1, 5, 9]), num_samples=2,
                           sampling_params=tinker.SamplingParams(max_tokens=4, seed=5)).result()
  assert len(drawn.sequences) == 2
  # a service started again on the same directory finds it, bitwise
  again = server_lib.Service({BASE: service.bases[BASE]}, service.workdir)
  base, adapters, scale = again.sampler(path)
  assert base is service.bases[BASE] and scale == service.samplers[path][2]
  saved = _flat(service.samplers[path][1])
  assert all(np.array_equal(np.asarray(saved[k]), np.asarray(v)) for k, v in _flat(adapters).items())


def test_calls_that_come_milliseconds_apart_to_an_idle_service_decode_together(service_url,
                                                                               monkeypatch):
  service, base = service_url[1], service_url[1].bases[BASE]
  calls = []
  sample = base.sample
  monkeypatch.setattr(base, "sample", lambda params, prompts, **kw: calls.append(len(prompts))
                      or sample(params, prompts, **kw))
  futures = []
  for tokens in ([1, 2], [3, 4], [5, 6], [7, 8]):
    futures.append(service.sample(_sample_request(tokens, max_tokens=3)))
    time.sleep(0.005)  # a client's calls, one by one
  assert all(isinstance(service.retrieve(f["request_id"]), bytes) for f in futures)
  assert calls == [4]


def test_one_clients_step_never_changes_anothers_samples(client):
  one = client.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
  two = client.create_lora_training_client(base_model=BASE, rank=4, seed=4).result()
  two.forward_backward([_datum([2, 6, 10, 14])], "cross_entropy").result()
  two.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
  sampler = two.save_weights_and_get_sampling_client().result()
  prompt, params = tinker.ModelInput.from_ints([1, 5, 9]), tinker.SamplingParams(max_tokens=6,
                                                                                  seed=8)
  before = [s.tokens for s in sampler.sample(prompt, 3, params).result().sequences]
  for _ in range(2):
    one.forward_backward([_datum([1, 5, 9, 13, 17])], "cross_entropy").result()
    one.optim_step(tinker.AdamParams(learning_rate=1e-1)).result()
  after = [s.tokens for s in sampler.sample(prompt, 3, params).result().sequences]
  assert after == before


def test_a_client_gone_in_the_middle_of_a_call_leaves_the_service_serving(service_url):
  body = json.dumps(_sample_request([1, 5, 9], max_tokens=6)).encode()
  host, port = service_url[0].removeprefix("http://").split(":")
  with socket.create_connection((host, int(port))) as sock:  # sends half a request, then goes
    sock.sendall(b"POST /api/v1/asample HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:len(body) // 2])
  with socket.create_connection((host, int(port))) as sock:  # a whole one, unread
    sock.sendall(b"POST /api/v1/asample HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
  rest = tinker.RestClient(base_url=service_url[0], api_key="tml-test")
  assert [m.model_name for m in rest.get_server_capabilities().result().supported_models] == [BASE]
  with tinker.ServiceClient(base_url=service_url[0], api_key="tml-test") as fresh:
    sampler = fresh.create_sampling_client(base_model=BASE).result()
    drawn = sampler.sample(tinker.ModelInput.from_ints([1, 5, 9]), 1,
                           tinker.SamplingParams(max_tokens=4, seed=1)).result()
  assert len(drawn.sequences) == 1


def test_a_new_training_client_from_a_saved_state_with_and_without_its_optimizer(client,
                                                                               service_url):
  service = service_url[1]
  training = client.create_lora_training_client(base_model=BASE, rank=4, seed=6).result()
  for _ in range(2):
    training.forward_backward([_datum([3, 7, 11, 15])], "cross_entropy").result()
    training.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
  path = training.save_state("resume-me").result().path
  saved = service.adapters[training.model_id]
  resumed = client.create_training_client_from_state_with_optimizer(path).result()
  fresh = client.create_training_client_from_state(path).result()
  for new in (resumed, fresh):
    assert new.model_id != training.model_id and new.get_info().lora_rank == 4
    loaded = service.adapters[new.model_id]
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
               zip(_flat(saved.adapters).values(), _flat(loaded.adapters).values()))
  same_state = lambda a, b: all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(
      jax.tree.leaves(a.opt_state), jax.tree.leaves(b.opt_state)))
  assert same_state(saved, service.adapters[resumed.model_id])
  assert not same_state(saved, service.adapters[fresh.model_id])  # a fresh Adam state
  with pytest.raises(Exception, match="not a checkpoint of this service"):
    client.create_training_client_from_state("tinker://nowhere/weights/none").result()


def test_the_rest_client_lists_runs_and_checkpoints_reads_weights_info_and_deletes(client,
                                                                                 service_url):
  """What tinker-cookbook asks the RestClient: a run by a checkpoint's path (its base and
  the renderer kept in its metadata), its checkpoints, a checkpoint's shape; and it deletes
  its rolling checkpoints. A restarted service reads the same from disk."""
  training = client.create_lora_training_client(
      base_model=BASE, rank=4, seed=3, train_mlp=False,
      user_metadata={"renderer_name": "qwen3"}).result()
  state = training.save_state("rolling-1").result().path
  sampler = training.save_weights_for_sampler("final").result().path
  rest = client.create_rest_client()
  run = rest.get_training_run_by_tinker_path(sampler).result()
  assert run.training_run_id == training.model_id and run.base_model == BASE
  assert run.is_lora and run.lora_rank == 4
  assert run.user_metadata == {"renderer_name": "qwen3"}
  assert run.last_checkpoint.tinker_path == state
  assert run.last_sampler_checkpoint.tinker_path == sampler
  listed = rest.list_checkpoints(training.model_id).result().checkpoints
  assert [(c.checkpoint_type, c.tinker_path) for c in listed] == [("training", state),
                                                                   ("sampler", sampler)]
  assert all(c.size_bytes > 0 for c in listed)
  info = rest.get_weights_info_by_tinker_path(state).result()
  assert (info.base_model, info.lora_rank, info.train_attn, info.train_mlp) == (BASE, 4, True,
                                                                                False)
  runs = rest.list_training_runs(limit=100).result()
  assert training.model_id in [r.training_run_id for r in runs.training_runs]
  assert runs.cursor.total_count >= len(runs.training_runs)
  rest.delete_checkpoint_from_tinker_path(state).result()
  left = rest.list_checkpoints(training.model_id).result().checkpoints
  assert [c.tinker_path for c in left] == [sampler]
  with pytest.raises(Exception, match="no checkpoint"):
    rest.delete_checkpoint_from_tinker_path(state).result()
  # another service on the same directory: the run and its checkpoint, from disk
  again = server_lib.Service(service_url[1].bases, service_url[1].workdir)
  assert again.runs.training_run(training.model_id)["user_metadata"] == {"renderer_name": "qwen3"}
  assert [c["tinker_path"] for c in again.runs.checkpoints(training.model_id)] == [sampler]


def test_checkpoints_are_published_and_expire_after_their_time_to_live(client, service_url):
  """The RestClient publishes a checkpoint and makes it private again (each twice is a
  conflict), gives it a time to live or takes it away; a save can carry one (tinker-cookbook's
  ``ttl_seconds``). An expired checkpoint is gone: listed no more, its files deleted, and it
  can no longer be sampled from."""
  training = client.create_lora_training_client(base_model=BASE, rank=4, seed=5).result()
  kept = training.save_weights_for_sampler("kept").result().path
  short = training.save_state("short", ttl_seconds=60).result().path
  rest = client.create_rest_client()
  rest.publish_checkpoint_from_tinker_path(kept).result()
  with pytest.raises(Exception, match="already public"):
    rest.publish_checkpoint_from_tinker_path(kept).result()
  listed = {c.tinker_path: c for c in rest.list_checkpoints(training.model_id).result().checkpoints}
  assert listed[kept].public and not listed[short].public
  assert listed[short].expires_at is not None and listed[kept].expires_at is None
  rest.unpublish_checkpoint_from_tinker_path(kept).result()
  with pytest.raises(Exception, match="already private"):
    rest.unpublish_checkpoint_from_tinker_path(kept).result()
  rest.set_checkpoint_ttl_from_tinker_path(short, 1).result()
  rest.set_checkpoint_ttl_from_tinker_path(kept, 1).result()
  rest.set_checkpoint_ttl_from_tinker_path(kept, None).result()  # never expires after all
  time.sleep(1.5)
  listed = {c.tinker_path: c for c in rest.list_checkpoints(training.model_id).result().checkpoints}
  assert list(listed) == [kept] and not listed[kept].public and listed[kept].expires_at is None
  service = service_url[1]
  assert not service._directory(short).exists()
  sampling = client.create_sampling_client(model_path=kept)
  rest.set_checkpoint_ttl_from_tinker_path(kept, 1).result()
  time.sleep(1.5)
  with pytest.raises(Exception, match="not a checkpoint of this service"):
    sampling.sample(tinker.ModelInput.from_ints([1, 2]), 1,
                    tinker.SamplingParams(max_tokens=2)).result()
  with pytest.raises(Exception, match="ttl_seconds must be"):
    training.save_state("bad", ttl_seconds=-5).result()


def test_an_abandoned_sampling_call_is_dropped_from_the_queue(service_url):
  """The SDK cancels sampling calls its caller abandoned (``cancel_future``, on once the
  dynamic config says so): a queued one never decodes; one done is left as it is."""
  import httpx
  url, service = service_url
  assert httpx.post(f"{url}/api/v1/client/dynamic_config", json={}).json()[
      "sample_cancel_enabled"]
  gate = threading.Event()
  service.submit(lambda: gate.wait(10) and {})  # holds the worker while the calls queue
  kept = service.sample(_sample_request([1, 5, 9]))
  dropped = service.sample(_sample_request([2, 4], max_tokens=4))
  answer = httpx.post(f"{url}/api/v1/cancel_future", json={"request_id": dropped["request_id"]})
  assert answer.status_code == 200
  gate.set()
  assert isinstance(service.retrieve(kept["request_id"]), bytes)
  assert service.retrieve(dropped["request_id"]) == {"error": "cancelled by the client",
                                                     "category": "user"}
  assert not service.cancel(kept["request_id"])


def test_the_rest_client_lists_sessions_and_reads_one(service_url):
  """``list_sessions`` (newest first) and ``get_session``: a session's training runs, the
  sampling sessions created in it and the metadata the client was made with."""
  with tinker.ServiceClient(base_url=service_url[0], api_key="tml-test",
                            user_metadata={"experiment": "sessions"}) as client:
    training = client.create_lora_training_client(base_model=BASE, rank=4, seed=4).result()
    client.create_sampling_client(base_model=BASE)
    rest = client.create_rest_client()
    session_id = training.model_id.split(":train:")[0]
    assert rest.list_sessions(limit=1).result().sessions == [session_id]
    found = rest.get_session(session_id).result()
    assert found.training_run_ids == [training.model_id] and len(found.sampler_ids) == 1
    assert found.user_metadata == {"experiment": "sessions"}
    with pytest.raises(Exception, match="unknown"):
      rest.get_session("session-none").result()


@pytest.mark.parametrize("name", sorted(routes.REFUSED))
def test_calls_the_service_does_not_serve_are_refused_naming_the_call(service_url, name):
  import urllib.error
  import urllib.request

  request = urllib.request.Request(f"{service_url[0]}/api/v1/{name}", data=b"{}",
                                   headers={"Content-Type": "application/json"})
  with pytest.raises(urllib.error.HTTPError) as refused:
    urllib.request.urlopen(request, timeout=10)
  assert refused.value.code == 400
  assert json.loads(refused.value.read())["error"].startswith(f"{name} is not served by rlx: ")
