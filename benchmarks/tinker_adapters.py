"""Several LoRA adapters resident on one base in the Tinker-compatible service: how sampling
and training share it with 1, 2, 4 and 8 clients at once.

    python benchmarks/tinker_adapters.py --model models/SmolLM2-135M-Instruct [--clients 1,2,4,8]
        [--samples 32] [--max-tokens 32] [--rank 16] [--arms bank,apart]

Each client is a training client of its own (an adapter and its Adam state, trained one step so
that it differs from the base) with a saved sampler. In a round, every client asks at once for
``--samples`` samples of its own 60-token prompt, one call per sample (as tinker-cookbook's
environments do), through the service's queue (``Service.sample``: its batching included, HTTP
not); then every client trains one GRPO-shaped batch (4 prompts x 8 responses,
``importance_sampling``) and steps. One round compiles first, untimed. Prints JSON: for each
count, the samples and sampled tokens per second of all clients together, and the median
training step (``forward_backward`` + ``optim_step``) of a client.

Two arms, one after the other in one process: ``bank``, the service as it runs (the calls of up
to 8 samplers decode in one batch, each slot with its own adapter), and ``apart``, each
sampler's calls decoded in a batch of their own, its adapters merged into the base (the
service before slots carried adapters: ``BANK_SIZE`` 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import numpy as np

NAME = "base"


def datums(rng, vocab: int):
  from rlx.tinker.wire import Datum

  rows = []
  for _ in range(4):
    prompt = rng.integers(5, vocab, 60).tolist()
    for _ in range(8):
      tokens = prompt + rng.integers(5, vocab, int(rng.integers(8, 33))).tolist()
      n = len(tokens) - 1
      logprobs, advantages = np.zeros(n, np.float32), np.zeros(n, np.float32)
      logprobs[59:], advantages[59:] = -1.0, rng.normal()
      rows.append(Datum(np.asarray(tokens[:-1], np.int32),
                        {"target_tokens": np.asarray(tokens[1:]), "logprobs": logprobs,
                         "advantages": advantages}))
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", required=True)
  parser.add_argument("--clients", default="1,2,4,8")
  parser.add_argument("--samples", type=int, default=32)
  parser.add_argument("--max-tokens", type=int, default=32)
  parser.add_argument("--rank", type=int, default=16)
  parser.add_argument("--arms", default="bank,apart")
  args = parser.parse_args()

  from rlx.tinker import server as server_lib
  from rlx.tinker.server import Service
  from rlx.tinker.training import AdamHyper, Base

  base = Base.load(NAME, args.model)
  service = Service({NAME: base}, tempfile.mkdtemp(prefix="rlx-tinker-adapters-"))
  session = service.create_session()
  rng = np.random.default_rng(0)
  vocab = base.vocab_size
  counts = [int(c) for c in args.clients.split(",")]
  clients = []  # (model_id, sampler path, prompt, batch)
  for i in range(max(counts)):
    future = service.create_model({"session_id": session, "base_model": NAME,
                                   "lora_config": {"rank": args.rank, "seed": i},
                                   "model_seq_id": i})
    model_id = service.retrieve(future["request_id"])["model_id"]
    batch = datums(rng, vocab)
    adapter = service.adapters[model_id]
    adapter.forward_backward(batch, "importance_sampling", {})
    adapter.optim_step(AdamHyper(learning_rate=1e-3))
    saved = service.save_weights({"model_id": model_id, "path": "bench"}, for_sampler=True)
    path = service.retrieve(saved["request_id"])["path"]
    clients.append((model_id, path, rng.integers(5, vocab, 60).tolist(), batch))

  def round_of(n: int, train: bool = True) -> tuple[float, int, float]:
    started = time.perf_counter()
    futures = [service.sample({"model_path": path, "prompt": {"chunks": [{"tokens": prompt}]},
                               "num_samples": 1, "sampling_params": {
                                   "max_tokens": args.max_tokens, "temperature": 1.0}})
               for _, path, prompt, _ in clients[:n] for _ in range(args.samples)]
    from tinker.proto import tinker_public_pb2 as pb

    tokens = 0
    for future in futures:
      answer = service.retrieve(future["request_id"], wait_s=600)
      if not isinstance(answer, bytes):
        raise SystemExit(f"a sampling call failed: {answer}")
      tokens += sum(len(s.tokens) // 4 for s in pb.SampleResponse.FromString(answer).sequences)
    sampling_s = time.perf_counter() - started
    steps = [0.0]
    for model_id, _, _, batch in clients[:n] if train else ():
      adapter = service.adapters[model_id]
      began = time.perf_counter()
      adapter.forward_backward(batch, "importance_sampling", {})
      adapter.optim_step(AdamHyper(learning_rate=1e-4))
      steps.append(time.perf_counter() - began)
    return sampling_s, tokens, statistics.median(steps)

  arms = {}
  for arm in args.arms.split(","):
    server_lib.BANK_SIZE = {"bank": 8, "apart": 1}[arm]
    for n in counts:  # compiles each count's programs (slots, bank sizes) first
      round_of(n, train=n == counts[0])
    results = {}
    for n in counts:
      sampling_s, tokens, step_s = round_of(n)
      results[n] = {"samples_per_s": round(n * args.samples / sampling_s, 2),
                    "tokens_per_s": round(tokens / sampling_s, 1),
                    "sampling_s": round(sampling_s, 2), "train_step_s": round(step_s, 2)}
    one = results[counts[0]]["samples_per_s"]
    for n in counts:
      results[n]["samples_per_s_vs_one"] = round(results[n]["samples_per_s"] / one, 2)
    arms[arm] = results
  print(json.dumps({"model": args.model, "samples_per_client": args.samples,
                    "max_tokens": args.max_tokens, "rank": args.rank, "arms": arms}, indent=1))


if __name__ == "__main__":
  main()
