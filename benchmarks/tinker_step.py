"""The Tinker-compatible service's training step on a GRPO-shaped batch: through the real
``tinker`` SDK over HTTP, and the same adapter's step called in-process, side by side.

    python benchmarks/tinker_step.py --model models/SmolLM2-135M-Instruct [--groups 4]
        [--group-size 8] [--prompt 60] [--response 24] [--rank 16] [--repeats 3]

A batch is ``--groups`` prompts of ``--prompt`` random tokens, each with ``--group-size``
responses of 1..``--response`` tokens (their log-probs and advantages random), trained with
``importance_sampling``: one ``forward_backward`` of every datum, then one ``optim_step``.
Prints JSON: the median seconds of each part over ``--repeats`` steps after one that
compiles, for the SDK (HTTP, futures and protobuf included) and in-process, and their ratio.
"""

import argparse
import json
import socket
import statistics
import threading
import time

import numpy as np


def batch(rng, groups: int, size: int, prompt: int, response: int, vocab: int):
  """(tokens, inputs) per datum: prompt + response, the loss read on the response only."""
  rows = []
  for _ in range(groups):
    head = rng.integers(5, vocab, prompt).tolist()
    for _ in range(size):
      tail = rng.integers(5, vocab, int(rng.integers(1, response + 1))).tolist()
      tokens = head + tail
      n = len(tokens) - 1
      logprobs = np.zeros(n, np.float32)
      advantages = np.zeros(n, np.float32)
      logprobs[prompt - 1:] = rng.uniform(-3, -0.1, len(tail))
      advantages[prompt - 1:] = rng.normal()
      rows.append((tokens, {"target_tokens": np.asarray(tokens[1:], np.int64),
                            "logprobs": logprobs, "advantages": advantages}))
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", required=True)
  parser.add_argument("--groups", type=int, default=4)
  parser.add_argument("--group-size", type=int, default=8)
  parser.add_argument("--prompt", type=int, default=60)
  parser.add_argument("--response", type=int, default=24)
  parser.add_argument("--rank", type=int, default=16)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()

  import tinker  # noqa: PLC0415 - the tinker extra
  import uvicorn  # noqa: PLC0415

  from rlx.tinker import routes  # noqa: PLC0415
  from rlx.tinker import server as server_lib  # noqa: PLC0415
  from rlx.tinker.training import Adapter, AdamHyper, Base  # noqa: PLC0415
  from rlx.tinker.wire import Datum  # noqa: PLC0415

  base = Base.load("bench", args.model)
  service = server_lib.Service({"bench": base}, "/tmp/rlx-tinker-bench")
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
  server = uvicorn.Server(uvicorn.Config(routes.app(service), host="127.0.0.1", port=port,
                                         log_level="warning"))
  threading.Thread(target=server.run, daemon=True).start()
  while not server.started:
    time.sleep(0.05)
  client = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key="tml-bench")
  training = client.create_lora_training_client(base_model="bench", rank=args.rank).result()
  local = Adapter(base, rank=args.rank)
  rows = batch(np.random.default_rng(0), args.groups, args.group_size, args.prompt,
               args.response, base.vocab_size)
  sdk_data = [tinker.Datum(model_input=tinker.ModelInput.from_ints(t[:-1]), loss_fn_inputs=i)
              for t, i in rows]
  local_data = [Datum(np.asarray(t[:-1], np.int32), i) for t, i in rows]
  times = {"sdk_forward_backward_s": [], "sdk_optim_step_s": [], "local_forward_backward_s": [],
           "local_optim_step_s": []}
  for repeat in range(args.repeats + 1):  # the first compiles
    start = time.perf_counter()
    training.forward_backward(sdk_data, "importance_sampling").result()
    middle = time.perf_counter()
    training.optim_step(tinker.AdamParams(learning_rate=1e-5)).result()
    end = time.perf_counter()
    local.forward_backward(local_data, "importance_sampling", {})
    local_middle = time.perf_counter()
    local.optim_step(AdamHyper(learning_rate=1e-5))
    local_end = time.perf_counter()
    if repeat:
      times["sdk_forward_backward_s"].append(middle - start)
      times["sdk_optim_step_s"].append(end - middle)
      times["local_forward_backward_s"].append(local_middle - end)
      times["local_optim_step_s"].append(local_end - local_middle)
  result = {name: round(statistics.median(values), 3) for name, values in times.items()}
  result["sdk_over_local"] = round(
      (result["sdk_forward_backward_s"] + result["sdk_optim_step_s"])
      / (result["local_forward_backward_s"] + result["local_optim_step_s"]), 3)
  result.update(datums=len(rows), tokens=sum(len(t) - 1 for t, _ in rows), rank=args.rank)
  print(json.dumps(result, indent=1))
  server.should_exit = True


if __name__ == "__main__":
  main()
