"""A batch's books, kept once for both producer loops: the rewards of the samples drawn for it
(an environment's own, else the reward pool's), and the tally of every group drawn, kept or
not, that becomes the batch's ``reward/*``, ``rollout/*`` and ``agent/*`` metrics.

    scored = merge_rewards(pool, given, describe)     # given[i]: (reward, correct) or None
    tally = Tally(group_size)
    keep = tally.add(scored, dynamic=True)            # per sample: its group gives a gradient
    counts = tally.metrics(distributed.sums_over_processes(tally.sums(names)), draws=2)

``collect`` (batch admission) adds each draw and sums the tally over processes before its
metrics; the stream (continuous admission) adds each group as it completes and takes the
metrics at every hand-over.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from rlx import algorithms
from rlx.rewards import Scored


def merge_rewards(pool, given: Sequence[tuple[float, bool] | None],
                  describe: Callable[[int], tuple[str, dict]]) -> Scored:
  """Each sample's reward and verdict: ``given[i]`` where its environment (or agent program)
  rewarded it, else the reward pool's on ``describe(i)``, its (text, row). The counts and the
  named components are the pool's, over the samples it scored (a component is NaN where the
  pool did not score)."""
  asked = [i for i, g in enumerate(given) if g is None]
  described = [describe(i) for i in asked]
  if len(asked) == len(given):
    return pool.score([t for t, _ in described], [r for _, r in described])
  rewards, correct = np.zeros(len(given), np.float32), np.zeros(len(given), bool)
  for i, g in enumerate(given):
    if g is not None:
      rewards[i], correct[i] = g
  counts: dict = {"reward/errors": 0, "reward/timeouts": 0}
  components: dict = {}
  if asked:
    scored = pool.score([t for t, _ in described], [r for _, r in described])
    rewards[asked], correct[asked] = scored.rewards, scored.correct
    counts = dict(scored.counts)
    for name, values in scored.components.items():
      components.setdefault(name, np.full(len(given), np.nan, np.float32))[asked] = values
  return Scored(rewards, correct, counts, components)


def component_key(name: str) -> str:
  """The metric of a reward's named component (never one of the loop's own reward metrics)."""
  own = ("mean", "accuracy", "errors", "timeouts")
  return f"reward/{name}" if name not in own else f"reward/component_{name}"


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
        "agent/abandoned_requests": sums.get("abandoned_requests", 0),
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


@dataclasses.dataclass
class Tally:
  """What the groups drawn for a batch showed, every one, kept or not."""

  group_size: int
  groups: int = 0
  samples: int = 0
  reward: float = 0.0
  correct: float = 0.0
  alike: int = 0
  """Groups whose rewards were all equal (a zero group-relative advantage)."""
  dropped: int = 0
  """Groups dynamic sampling left out."""
  counts: dict[str, int] = dataclasses.field(default_factory=dict)
  """The reward pool's counts (``reward/errors``, ``reward/timeouts``)."""
  parts: dict[str, list[float]] = dataclasses.field(default_factory=dict)
  """A reward's named components: [sum, count] of the samples that have one."""
  agent: dict[str, float] = dataclasses.field(default_factory=dict)
  """Multi-turn episodes' statistics, summed (``agents.episode_sums``)."""
  latencies: list = dataclasses.field(default_factory=list)
  """Their tool calls' (name, seconds)."""
  first_error: str | None = None
  """The first error an agent program raised (for the message when no group survives)."""

  def count(self, counts: dict) -> None:
    """Adds a scoring's counts; those named ``agent:<key>`` are episodes' statistics."""
    for key, value in counts.items():
      if key.startswith("agent:"):
        key = key.split(":", 1)[1]
        self.agent[key] = self.agent.get(key, 0.0) + value
      else:
        self.counts[key] = self.counts.get(key, 0) + value

  def add(self, scored: Scored, *, dynamic: bool) -> np.ndarray:
    """Adds whole groups' rewards, verdicts and components (not their counts: ``count``);
    returns which samples to keep: all, or with ``dynamic`` those of groups whose rewards
    vary."""
    size = self.group_size
    self.samples += len(scored.rewards)
    self.groups += len(scored.rewards) // size
    self.reward += float(np.sum(scored.rewards))
    self.correct += float(np.sum(scored.correct))
    for name, values in scored.components.items():
      given = values[~np.isnan(values)]
      part = self.parts.setdefault(name, [0.0, 0])
      part[0], part[1] = part[0] + float(given.sum()), part[1] + given.size
    varied = np.asarray(algorithms.dynamic_sampling_keep(jnp.asarray(scored.rewards), size))
    self.alike += int((~varied).sum()) // size
    keep = varied if dynamic else np.ones(len(scored.rewards), bool)
    self.dropped += int((~keep).sum()) // size
    return keep

  def sums(self, names: Sequence[str] | None = None) -> dict[str, float]:
    """The tally as one flat dict of numbers, to be summed over processes as it is (``names``:
    the components of every process, default this one's)."""
    names = self.parts if names is None else names
    return {"groups": self.groups, "samples": self.samples, "reward": self.reward,
            "correct": self.correct, "alike": self.alike, "dropped": self.dropped,
            **{f"count:{key}": value for key, value in self.counts.items()},
            **{f"agent:{key}": value for key, value in self.agent.items()},
            **{f"part_sum:{name}": self.parts.get(name, (0.0, 0))[0] for name in names},
            **{f"part_count:{name}": self.parts.get(name, (0.0, 0))[1] for name in names}}

  def metrics(self, totals: dict[str, float], *, draws: int,
              slots: dict | None = None) -> dict[str, float]:
    """A batch's metrics from ``totals`` (``sums``, summed over processes): its reward pool's
    counts, components, rewards of every sample drawn (before dynamic sampling dropped any
    group), and with episodes their ``agent/*`` metrics (``slots``: the engine's slot counts
    when the episodes' statistics do not carry them)."""
    counts: dict[str, float] = {key.split(":", 1)[1]: int(value)
                                for key, value in totals.items() if key.startswith("count:")}
    for key, total in totals.items():
      if key.startswith("part_sum:"):
        name = key.split(":", 1)[1]
        if totals[f"part_count:{name}"]:
          counts[component_key(name)] = total / totals[f"part_count:{name}"]
    agent = {key.split(":", 1)[1]: value for key, value in totals.items()
             if key.startswith("agent:")}
    if agent:
      counts.update(agent_metrics({**agent, **(slots or {})}, self.latencies))
    sampled = max(totals["samples"], 1)
    counts.update({
        "rollout/dropped_groups": int(totals["dropped"]), "rollout/draws": draws,
        "reward/mean": totals["reward"] / sampled,
        "reward/accuracy": totals["correct"] / sampled,
        # of every group drawn: samples that all scored alike give no gradient
        "advantage/zero_groups_frac": totals["alike"] / max(totals["groups"], 1),
        # samples whose reward call failed (raised, timed out, not finite)
        "reward/error_frac": (counts.get("reward/errors", 0)
                              + counts.get("reward/timeouts", 0)) / sampled})
    return counts
