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
from rlx.trainer.produce.tally import Tally, merge_rewards

AGENT_SUMS = ("episodes", "turns", "truncated", "env_s", "tool_wait_s", "step_timeouts",
              "slot_steps", "busy_steps", "held_steps", "parked_s", "life_s", "away_s", *COUNTS)


def given_reward(episode: Episode) -> tuple[float, bool] | None:
  """The (reward, correct) an episode's environment gave (its ``correct`` info, else a reward
  of at least 1), or None when it gave none and the reward function is asked."""
  if not episode.rewarded:
    return None
  return episode.reward, episode.info.get("correct", float(episode.reward >= 1.0)) >= 1


def run_episodes(run, params, rows: list[dict], *, n: int, temperature: float, seed: int,
                 version: int, first_prompt_index: int = 0, inflight=None,
                 tally: Tally | None = None) -> tuple[list[Completion], Scored]:
  """``n`` episodes of each row, and their rewards, verdicts and statistics (``inflight``:
  newer weights between decode chunks, as in ``collect.generate_and_score``; ``tally``: the
  batch's books, given the tool calls' latencies)."""
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
  scored = merge_rewards(
      run.pool, [given_reward(e) for e in ordered],
      lambda i: (ordered[i].final_text,
                 dict(episodes.rows[completions[i].prompt_index], messages=ordered[i].messages)))
  counts = dict(scored.counts)
  sums = episode_sums(ordered, completions)
  sums["step_timeouts"] = episodes.step_timeouts()
  sums["env_errors"] += episodes.failed_rows  # rows whose reset failed, skipped
  sums.update(slots)
  counts.update({f"agent:{key}": value for key, value in sums.items()})
  if tally is not None:
    tally.latencies += [call for e in ordered for call in e.tool_seconds]
  if jax.process_index() == 0 and temperature > 0:  # training episodes, not greedy evals
    write_samples(run, completions, scored.rewards)
  return completions, scored._replace(counts=counts)


SAMPLES_FILE = "episodes.jsonl"
_SAMPLE_EVERY_S = 30.0
_written: dict[pathlib.Path, float] = {}  # when each samples file was last written to


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
  path = pathlib.Path(run.workdir) / SAMPLES_FILE
  if now - _written.get(path, 0.0) < _SAMPLE_EVERY_S or not completions:
    return
  _written[path] = now
  order = np.argsort(rewards)
  chosen = sorted({int(order[-1]), int(order[0])})[:count]
  with open(path, "a") as f:
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
