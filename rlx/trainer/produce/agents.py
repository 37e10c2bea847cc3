"""Multi-turn episodes for the trainer: an environment per episode (``config.env``), its tool
calls in the run's tool workers, and the episode's reward.

    completions, scored = run_episodes(run, params, rows, n=8, temperature=1.0, seed=0, version=3)

Each group's ``n`` episodes start from the same prompt, rendered from the first messages of
its environment with the tools' schemas. Environments answer on a thread pool, so that the
engine keeps decoding the other slots meanwhile. The reward of an episode is what its
environment gave (summed over turns), or, when it gave none, the run's reward function on the
final assistant turn, with the row and the episode's ``messages``.

The scored counts carry the episodes' statistics as sums (``agent:<name>``); ``agent_metrics``
turns the sums of a step into the logged ``agent/*`` metrics.
"""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Sequence

import jax
import numpy as np

from rlx import rollout
from rlx.envs import COUNTS, Episode
from rlx.envs.calls import turn_stop_ids
from rlx.rewards import Scored
from rlx.rollout import Completion
from rlx.trainer.episodes import Episodes, tool_format

AGENT_SUMS = ("episodes", "turns", "truncated", "env_s", "tool_wait_s", "step_timeouts",
              "slot_steps", "busy_steps", "held_steps", "parked_s", "life_s", "away_s", *COUNTS)


def run_episodes(run, params, rows: list[dict], *, n: int, temperature: float, seed: int,
                 version: int, first_prompt_index: int = 0,
                 inflight=None) -> tuple[list[Completion], Scored]:
  """``n`` episodes of each row, and their rewards, verdicts and statistics (``inflight``:
  newer weights between decode chunks, as in ``collect.generate_and_score``)."""
  config = run.config
  episodes = Episodes(run.config, run.tokenizer, rows, n, tools=run.tools,
                      errors=run.env_errors)
  r = config.rollout
  slots: dict = {}
  try:
    completions = rollout.generate_episodes(
        run.engine, episodes.prompts, episodes.respond, params=params, n=n,
        max_new_tokens=config.env.turn_max_new_tokens or r.max_new_tokens,
        max_tokens=config.env.max_tokens, temperature=temperature, top_p=r.top_p, top_k=r.top_k,
        stop_token_ids=turn_stop_ids(run.tokenizer, tool_format(config, run.tokenizer)),
        seed=seed, policy_version=version,
        first_prompt_index=first_prompt_index, step_timeout_s=config.env.step_timeout_s,
        stats=slots, weights=inflight, release=config.env.release_slots)
  finally:
    episodes.close()
  ordered = [episodes.episodes[(c.prompt_index, c.sample_index)] for c in completions]
  unrewarded = [i for i, e in enumerate(ordered) if not e.rewarded]
  scored = run.pool.score([ordered[i].final_text for i in unrewarded],
                          [dict(episodes.rows[completions[i].prompt_index],
                                messages=ordered[i].messages)
                           for i in unrewarded])
  rewards = np.zeros(len(completions), np.float32)
  correct = np.zeros(len(completions), bool)
  rewards[unrewarded], correct[unrewarded] = scored.rewards, scored.correct
  for i, episode in enumerate(ordered):
    if episode.rewarded:
      rewards[i] = episode.reward
      correct[i] = episode.info.get("correct", float(episode.reward >= 1.0)) >= 1
  counts = dict(scored.counts)
  sums = episode_sums(ordered, completions)
  sums["step_timeouts"] = episodes.step_timeouts()
  sums["env_errors"] += episodes.failed_rows  # rows whose reset failed, skipped
  sums.update(slots)
  counts.update({f"agent:{key}": value for key, value in sums.items()})
  components = {name: np.full(len(completions), np.nan, np.float32) for name in scored.components}
  for name, values in scored.components.items():
    components[name][unrewarded] = values
  run.tool_latencies.extend(call for e in ordered for call in e.tool_seconds)
  if jax.process_index() == 0 and temperature > 0:  # training episodes, not greedy evals
    write_samples(run, completions, rewards)
  return completions, Scored(rewards, correct, counts, components)


SAMPLES_FILE = "episodes.jsonl"
_SAMPLE_EVERY_S = 30.0


def segments(tokenizer, completion: Completion) -> list[list]:
  """An episode as [text, sampled] runs: the prompt (False), then the sampled turns (True) and
  the environment's tokens (False), each decoded on its own."""
  runs = [[tokenizer.decode(completion.prompt_tokens, skip_special_tokens=False), False]]
  mask = completion.sampled_mask or [True] * len(completion.response_tokens)
  start = 0
  for i in range(1, len(mask) + 1):
    if i == len(mask) or mask[i] != mask[start]:
      runs.append([tokenizer.decode(completion.response_tokens[start:i],
                                    skip_special_tokens=False), bool(mask[start])])
      start = i
  return runs


def write_samples(run, completions: Sequence[Completion], rewards: np.ndarray,
                  count: int = 2) -> None:
  """Appends ``count`` episodes (the best and the worst of the call) to the workdir's
  ``episodes.jsonl``, at most every 30 s: what the report shows as sample trajectories."""
  now = time.time()
  if now - getattr(run, "samples_written", 0.0) < _SAMPLE_EVERY_S or not completions:
    return
  run.samples_written = now
  order = np.argsort(rewards)
  chosen = sorted({int(order[-1]), int(order[0])})[:count]
  with open(pathlib.Path(run.workdir) / SAMPLES_FILE, "a") as f:
    for i in chosen:
      c = completions[i]
      f.write(json.dumps({"time": now, "policy_version": c.policy_version,
                          "reward": float(rewards[i]), "turns": c.turns,
                          "finish_reason": c.finish_reason,
                          "segments": segments(run.tokenizer, c)}) + "\n")


def episode_sums(episodes: Sequence[Episode], completions: Sequence[Completion]) -> dict[str, float]:
  """The statistics of some episodes, as sums (``agent_metrics`` makes them means)."""
  sums = dict.fromkeys(AGENT_SUMS, 0.0)
  for episode, completion in zip(episodes, completions):
    sums["episodes"] += 1
    sums["turns"] += completion.turns
    sums["truncated"] += completion.finish_reason == "length"
    sums["env_s"] += episode.env_seconds
    sums["tool_wait_s"] += episode.tool_wait_seconds
    for key in COUNTS:
      sums[key] += episode.counts[key]
  return sums


def slot_metrics(sums: dict[str, float]) -> dict[str, float]:
  """The decode slots' use from ``_Run``'s counts: of the slot steps the chunks computed, those
  that produced a token (occupancy) and those that held a decoding sample when their chunk
  began (free and parked slots hold none)."""
  computed = max(sums.get("slot_steps", 0), 1)
  return {"rollout/slot_occupancy": sums.get("busy_steps", 0) / computed,
          "rollout/slots_held_frac": sums.get("held_steps", 0) / computed}


def agent_metrics(sums: dict[str, float],
                  latencies: Sequence[tuple[str, float]]) -> dict[str, float]:
  """``agent/*`` metrics of a step from its summed statistics and its tool calls' (tool name,
  seconds): latency percentiles over every call, and per tool when there are several."""
  episodes = max(sums.get("episodes", 0), 1)
  metrics = {
      "agent/turns_mean": sums.get("turns", 0) / episodes,
      "agent/tool_calls_mean": sums.get("tool_calls", 0) / episodes,
      "agent/malformed_calls": sums.get("malformed_calls", 0),
      "agent/truncated_frac": sums.get("truncated", 0) / episodes,
      **slot_metrics(sums),
  }
  if "requests" in sums:  # an agent program's episodes (config.env.agent): it runs its tools
    failures = (sums.get("program_errors", 0) + sums.get("program_timeouts", 0)
                + sums.get("silent_episodes", 0))
    metrics.update({
        "agent/requests_mean": sums["requests"] / episodes,
        "agent/program_errors": sums.get("program_errors", 0),
        "agent/program_timeouts": sums.get("program_timeouts", 0),
        "agent/silent_episodes": sums.get("silent_episodes", 0),
        "agent/failed_groups": sums.get("failed_groups", 0),
        # of every episode run: the kept ones, those dropped with a failed group, the failed
        "agent/failed_frac": failures / max(sums.get("episodes", 0)
                                            + sums.get("dropped_episodes", 0) + failures, 1),
        "agent/history_rewrites": sums.get("history_rewrites", 0),
        # sampled tokens left out of training: other segments, unchosen choices of n > 1
        "agent/dropped_token_frac": (sums.get("dropped_tokens", 0)
                                     / max(sums.get("sampled_tokens", 0), 1)),
    })
  else:
    metrics.update({
        "agent/tool_errors": sums.get("tool_errors", 0),
        "agent/tool_timeouts": sums.get("tool_timeouts", 0),
        "agent/env_errors": sums.get("env_errors", 0),
        "agent/env_timeouts": sums.get("step_timeouts", 0),
        "time/env_s": sums.get("env_s", 0.0),
        # a call's wait for a free tool worker, before it runs (the latencies leave it out)
        "agent/tool_wait_mean_s": sums.get("tool_wait_s", 0.0) / max(sums.get("tool_calls", 0), 1),
        "time/all_slots_parked_s": sums.get("parked_s", 0.0),
        # the share of an episode's life in a decode slot (released episodes leave theirs
        # while their environment works): mesh.groups_in_flight needs slots / this episodes
        "agent/in_slot_frac": (1.0 - sums.get("away_s", 0.0) / sums["life_s"]
                               if sums.get("life_s", 0.0) > 0 else 1.0),
    })
  tools = sorted({name for name, _ in latencies})
  for tool in [None, *tools] if len(tools) > 1 else [None] * bool(tools):
    seconds = np.asarray([s for name, s in latencies if tool is None or name == tool])
    suffix = "" if tool is None else f"/{tool}"
    for q, value in zip((50, 90, 99), np.percentile(seconds, [50, 90, 99])):
      metrics[f"agent/tool_latency_p{q}_s{suffix}"] = float(value)
  return metrics
