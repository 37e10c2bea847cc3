"""Throughput of the code reward: programs scored per second through the reward pool, and the
latency of one sandboxed run, for a trivial program and its assert tests (or stdin/stdout
tests, each run in a fresh interpreter).

    python benchmarks/sandbox.py [--programs 256] [--workers 1,2] [--repeats 3] [--tests asserts|stdin]

Prints JSON: for each worker count, the median programs/s over ``--repeats`` batches of
``--programs`` (every one run in its own sandbox: namespaces, fresh root, own uid, seccomp);
and the median, p90 and max seconds of a single run, one at a time.
"""

import argparse
import json
import os
import statistics
import time

from rlx.rewards import RewardFn, RewardPool
from rlx.rewards.sandbox import capabilities, normalize_tests, run_tests

PROGRAMS = {"asserts": "```python\ndef f(x):\n    return x + 1\n```",
            "stdin": "```python\nprint(int(input()) + 1)\n```"}
TESTS = {"asserts": ["assert f(1) == 2", "assert f(-3) == -2", "assert f(10) == 11"],
         "stdin": [{"input": "1", "output": "2"}, {"input": "-3", "output": "-2"},
                   {"input": "10", "output": "11"}]}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--programs", type=int, default=256)
  parser.add_argument("--workers", default="1,2")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--tests", choices=sorted(TESTS), default="asserts")
  args = parser.parse_args()
  program, test_rows = PROGRAMS[args.tests], TESTS[args.tests]
  capabilities()  # refuses, with the reason, where the sandbox cannot be built
  single = []
  tests = normalize_tests(test_rows)
  for _ in range(50):
    result = run_tests(program.split("\n", 1)[1].rsplit("```", 1)[0], tests)
    assert all(result.passed), result
    single.append(result.seconds)
  single.sort()
  results = {"cpus": os.cpu_count(), "programs": args.programs, "tests": args.tests,
             "single_run_s": {"median": statistics.median(single),
                              "p90": single[int(0.9 * len(single))], "max": single[-1]},
             "programs_per_s": {}}
  rows = [{"tests": test_rows}] * args.programs
  for workers in map(int, args.workers.split(",")):
    with RewardPool(RewardFn("code"), num_workers=workers, timeout_s=10) as pool:
      pool.score([program] * workers, rows[:workers])  # the workers are up
      rates = []
      for _ in range(args.repeats):
        started = time.perf_counter()
        scored = pool.score([program] * args.programs, rows)
        rates.append(args.programs / (time.perf_counter() - started))
        assert scored.correct.all(), scored.counts
    results["programs_per_s"][str(workers)] = statistics.median(rates)
  print(json.dumps(results, indent=2))


if __name__ == "__main__":
  main()
