"""The same ``calc`` episodes sampled two ways, side by side in one process: by the built-in
environment in the engine (``env.name=calc``: slots park between turns, turns are extended in
the KV cache), and by the black-box agent program through the OpenAI-compatible endpoint
(``env.agent=examples/calc_agent.py:run``: HTTP, the chat messages re-rendered and merged, each
turn a new request). Prints JSON: per arm the median seconds per batch, episodes/s, sampled
tokens/s, turns and tool calls per episode, slot occupancy, and their ratio.

    python benchmarks/agent_endpoint.py --workdir /tmp/rlx-calc-openai [--batches 8]

The model is the warm-up of ``--workdir`` (made first when it has none); both arms sample with
the same params, rows and seeds, alternating batch by batch so that load on the machine hits
both alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdir", type=pathlib.Path, required=True)
  parser.add_argument("--batches", type=int, default=16, help="batches per arm")
  parser.add_argument("--skip", type=int, default=6,
                      help="first batches left out (they compile the engine's buckets)")
  parser.add_argument("--prompts", type=int, default=16)
  parser.add_argument("--group", type=int, default=4)
  args = parser.parse_args()

  from rlx import cli  # noqa: PLC0415
  from rlx.envs import ToolRunner  # noqa: PLC0415
  from rlx.trainer.produce.collect import generate_and_score  # noqa: PLC0415
  from rlx.trainer.setup.run import prepare  # noqa: PLC0415

  config = cli.load_config_file(str(ROOT / "configs" / "agent_calc_openai.py"))
  # sampling only: one device does it, in both arms
  config = dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, mode="colocated"))
  run = prepare(config, args.workdir, say=lambda message: print(message, file=sys.stderr))
  e = config.env
  run = dataclasses.replace(run, tools=ToolRunner(
      num_workers=e.tool_workers, timeout_s=e.tool_timeout_s, memory_mb=e.tool_memory_mb,
      max_chars=e.max_observation_chars))
  arms = {"environment": dataclasses.replace(config, env=dataclasses.replace(e, name="calc",
                                                                             agent="")),
          "agent_program": config}
  params = run.model.params
  results = {arm: [] for arm in arms}
  for batch in range(args.batches):
    rows = next(run.stream)[:args.prompts]
    for arm, arm_config in arms.items():
      started = time.perf_counter()
      completions, scored = generate_and_score(
          dataclasses.replace(run, config=arm_config), params, rows, n=args.group,
          temperature=1.0, seed=batch, version=0)
      seconds = time.perf_counter() - started
      counts = scored.counts
      episodes = max(counts.get("agent:episodes", 0), 1)
      results[arm].append({
          "seconds": seconds, "episodes": len(completions),
          "sampled_tokens": sum(c.sampled_tokens for c in completions),
          "turns": counts.get("agent:turns", 0) / episodes,
          "tool_calls": counts.get("agent:tool_calls", 0) / episodes,
          "reward": float(scored.rewards.mean()) if len(completions) else 0.0,
          "occupancy": counts.get("agent:busy_steps", 0) / max(counts.get("agent:slot_steps", 0), 1)})
      print(f"batch {batch} {arm}: {json.dumps(results[arm][-1])}", file=sys.stderr, flush=True)
  summary = {}
  for arm, rows in results.items():
    kept = rows[args.skip:] or rows
    seconds = statistics.median(r["seconds"] for r in kept)
    summary[arm] = {
        "median_batch_s": seconds,
        "episodes_per_s": statistics.median(r["episodes"] / r["seconds"] for r in kept),
        "sampled_tokens_per_s": statistics.median(r["sampled_tokens"] / r["seconds"] for r in kept),
        "turns_mean": statistics.mean(r["turns"] for r in kept),
        "tool_calls_mean": statistics.mean(r["tool_calls"] for r in kept),
        "reward_mean": statistics.mean(r["reward"] for r in kept),
        "slot_occupancy": statistics.mean(r["occupancy"] for r in kept)}
  summary["agent_program_over_environment_time"] = (summary["agent_program"]["median_batch_s"]
                                                    / summary["environment"]["median_batch_s"])
  run.close()
  print(json.dumps(summary, indent=2))


if __name__ == "__main__":
  main()
