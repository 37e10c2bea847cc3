"""Sampling beside training in the Tinker-compatible service: the same clients' RL loops on a
service that runs its queue in one lane (one call at a time) and on one split in two lanes
(sampling on a device of its own, beside training).

    python benchmarks/tinker_split.py --model models/SmolLM2-135M-Instruct [--clients 2]
        [--rounds 3] [--samples 32] [--max-tokens 32] [--rank 16]

Each client is an RL loop as tinker-cookbook's runs it, through the service's queue
(``Service``: its batching and lanes included, HTTP not): sample ``--samples`` responses to its
own 60-token prompt, one call per sample; train one GRPO-shaped batch (4 prompts x 8 responses,
``importance_sampling``) with ``forward_backward`` and ``optim_step``; save the weights for the
next round's sampler. The clients run at once, each in its own thread, so that one's sampling
can overlap another's training. One round compiles first, untimed. Both services live in one
process with two CPU devices (XLA:CPU shares the machine's cores between them), each with its
own copy of the base, and take turns: one, split, one, split. Prints JSON: for each, the median
over turns of the rounds per second of all clients together and of a client's round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time

import numpy as np

from tinker_adapters import NAME, datums  # this directory's


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", required=True)
  parser.add_argument("--clients", type=int, default=2)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--turns", type=int, default=2)
  parser.add_argument("--samples", type=int, default=32)
  parser.add_argument("--max-tokens", type=int, default=32)
  parser.add_argument("--rank", type=int, default=16)
  args = parser.parse_args()

  import jax

  jax.config.update("jax_num_cpu_devices", 2)
  from rlx.tinker import wire
  from rlx.tinker.server import Service
  from rlx.tinker.training import Base

  def loop(service: Service, model_id: str, path: str, prompt: list[int], batch, rounds: int,
           times: list[float]) -> None:
    for r in range(rounds):
      started = time.perf_counter()
      futures = [service.sample({"model_path": path, "prompt": {"chunks": [{"tokens": prompt}]},
                                 "num_samples": 1, "sampling_params": {
                                     "max_tokens": args.max_tokens, "temperature": 1.0}})
                 for _ in range(args.samples)]
      for future in futures:
        answer = service.retrieve(future["request_id"], wait_s=600)
        if not isinstance(answer, bytes):
          raise SystemExit(f"a sampling call failed: {answer}")
      adapter = service.adapters[model_id]
      trained = service.submit(lambda adapter=adapter: wire.forward_backward_output(
          *adapter.forward_backward(batch, "importance_sampling", {})))
      stepped = service.optim_step({"model_id": model_id,
                                    "adam_params": {"learning_rate": 1e-4}})
      saved = service.save_weights({"model_id": model_id, "path": f"r{r}-{time.time_ns()}"},
                                   for_sampler=True)
      for future in (trained, stepped):
        answer = service.retrieve(future["request_id"], wait_s=600)
        if isinstance(answer, dict) and "error" in answer:
          raise SystemExit(f"a training call failed: {answer}")
      path = service.retrieve(saved["request_id"], wait_s=600)["path"]
      times.append(time.perf_counter() - started)

  def setup(split: bool):
    base = Base.load(NAME, args.model)
    service = Service({NAME: base}, tempfile.mkdtemp(prefix="rlx-tinker-split-"), split=split)
    session = service.create_session()
    rng = np.random.default_rng(0)
    clients = []
    for i in range(args.clients):
      future = service.create_model({"session_id": session, "base_model": NAME,
                                     "lora_config": {"rank": args.rank, "seed": i},
                                     "model_seq_id": i})
      model_id = service.retrieve(future["request_id"])["model_id"]
      saved = service.save_weights({"model_id": model_id, "path": "start"}, for_sampler=True)
      clients.append((model_id, service.retrieve(saved["request_id"])["path"],
                      rng.integers(5, base.vocab_size, 60).tolist(),
                      datums(rng, base.vocab_size)))
    return service, clients

  def turn(service, clients, rounds: int) -> tuple[float, list[float]]:
    times: list[float] = []
    threads = [threading.Thread(target=loop, args=(service, *client, rounds, times))
               for client in clients]
    started = time.perf_counter()
    for thread in threads:
      thread.start()
    for thread in threads:
      thread.join()
    return len(clients) * rounds / (time.perf_counter() - started), times

  arms = {"one_lane": setup(False), "split": setup(True)}
  for service, clients in arms.values():
    turn(service, clients, 1)  # compiles
  results = {arm: {"rounds_per_s": [], "round_s": []} for arm in arms}
  for _ in range(args.turns):
    for arm, (service, clients) in arms.items():
      rate, times = turn(service, clients, args.rounds)
      results[arm]["rounds_per_s"].append(rate)
      results[arm]["round_s"] += times
  summary = {arm: {"rounds_per_s": round(statistics.median(r["rounds_per_s"]), 4),
                   "client_round_s": round(statistics.median(r["round_s"]), 2)}
             for arm, r in results.items()}
  summary["split_vs_one_lane"] = round(summary["split"]["rounds_per_s"]
                                       / summary["one_lane"]["rounds_per_s"], 3)
  print(json.dumps({"model": args.model, "clients": args.clients, "rounds": args.rounds,
                    "turns": args.turns, "samples_per_client": args.samples,
                    "max_tokens": args.max_tokens, "rank": args.rank, **summary}, indent=1))


if __name__ == "__main__":
  main()
