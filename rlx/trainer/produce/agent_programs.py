"""Agent programs: black-box agents that reach the policy only through the OpenAI-compatible
endpoint (``config.env.agent``).

    async def run(client: openai.AsyncOpenAI, row: dict) -> float | dict | None:
      reply = await client.chat.completions.create(model="policy", messages=[...], tools=[...])
      ...
      return 1.0 if solved else 0.0

Every episode of a batch runs at once, each with its own ``AsyncOpenAI`` client whose API key
is the episode's key; their requests share the engine's continuous batching, which runs in the
calling thread with this batch's params. The endpoint records each episode's requests and
merges them into trajectories (``serve.trajectories``); the one ``env.trajectory`` chooses is
trained on, with its exact sampled ids and behaviour log-probs.

An episode's reward is what the program returned (a number, or a dict with ``reward`` and
optionally ``correct``), else what it posted to ``/rlx/reward``, else the run's reward function
on its final answer (with the row and the final ``messages``). An episode whose program raised,
ran past ``env.agent_timeout_s`` or never called the endpoint is *failed*: counted, and its whole
group is dropped (the draw goes on, as dynamic sampling does), so that nothing a program does
stalls or poisons the batch.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time

import jax
import numpy as np

from rlx.envs import load_agent
from rlx.rewards import Scored
from rlx.rollout import Completion
from rlx.serve.endpoint import Endpoint, Forced
from rlx.serve.trajectories import EpisodeLog
from rlx.trainer.produce.agents import write_samples
from rlx.trainer.produce.tally import Tally, merge_rewards

_GRACE_S = 10.0  # past the episodes' timeout, a program that blocks its event loop is abandoned





def _drive(agent, base_url: str, logs: list[EpisodeLog], timeout_s: float,
           outcomes: dict, done: threading.Event) -> None:
  """Runs the programs of one group's episodes on an event loop of their own (in its own
  thread): a program that blocks its loop (``time.sleep``, a blocking library) can only make
  its own group's episodes time out."""
  import httpx  # noqa: PLC0415 - optional dependencies, needed here only
  import openai  # noqa: PLC0415

  async def episode(log: EpisodeLog) -> None:
    # A connection pool per episode: one shared by all scans every connection on each request
    # (quadratic in the episodes), and a default one loads the CA certificates (~60 ms) that
    # a plain-HTTP endpoint never uses.
    http = httpx.AsyncClient(verify=False, timeout=timeout_s)
    client = openai.AsyncOpenAI(base_url=base_url, api_key=log.key, max_retries=0,
                                timeout=timeout_s, http_client=http)
    try:
      outcomes[log.key] = ("ok", await asyncio.wait_for(agent(client, dict(log.row)), timeout_s))
    except (asyncio.TimeoutError, TimeoutError):
      outcomes[log.key] = ("timeout", None)
    except Exception as error:  # noqa: BLE001 - the program's failure is counted, not raised
      outcomes[log.key] = ("error", f"{type(error).__name__}: {error}")
    finally:
      await http.aclose()

  async def every() -> None:
    await asyncio.gather(*(episode(log) for log in logs))

  try:
    import uvloop  # noqa: PLC0415 - a faster event loop (uvicorn[standard] installs it)
    run = getattr(uvloop, "run", asyncio.run)  # uvloop.run: 0.18 and later
  except ImportError:
    run = asyncio.run
  try:
    run(every())
  finally:
    done.set()


def _reward_of(outcome) -> tuple[float | None, bool | None, str | None]:
  """(reward, correct, problem) from what a program returned."""
  value = outcome
  if value is None:
    return None, None, None
  if isinstance(value, dict):
    reward, correct = value.get("reward"), value.get("correct")
  else:
    reward, correct = value, None
  if isinstance(reward, bool) or not isinstance(reward, (int, float, np.number)) or (
      not np.isfinite(reward)):
    return None, None, (f"returned {type(value).__name__} {str(value)[:80]!r}; return a "
                        "number, a dict with 'reward', or None")
  return float(reward), (None if correct is None else bool(correct)), None


def run_agent_programs(run, params, rows: list[dict], *, n: int, temperature: float, seed: int,
                       version: int, first_prompt_index: int = 0, tally: Tally | None = None
                       ) -> tuple[list[Completion], Scored]:
  """``n`` episodes of each row by the agent program, and their rewards and statistics (groups
  with a failed episode left out; ``tally``: the batch's books, told the first error a
  program raised)."""
  endpoint = run.endpoint
  with endpoint.in_use:  # one batch at a time (a split run's eval and generator share it)
    return _run(run, endpoint, params, rows, n, temperature, seed, version, first_prompt_index,
                tally if tally is not None else Tally(n))


def _run(run, endpoint: Endpoint, params, rows, n, temperature, seed, version,
         first_prompt_index, tally: Tally) -> tuple[list[Completion], Scored]:
  config = run.config
  e, r = config.env, config.rollout
  agent = load_agent(e.agent, e.verifiers_config)
  endpoint.forced = Forced(temperature, r.top_p, r.top_k, e.turn_max_new_tokens or r.max_new_tokens)
  endpoint.batcher.set_params(params, version)
  base = jax.random.key(seed)
  logs = [[EpisodeLog(secrets.token_urlsafe(18), row,
                      jax.random.fold_in(jax.random.fold_in(base, first_prompt_index + p), s))
           for s in range(n)] for p, row in enumerate(rows)]
  flat = [log for group in logs for log in group]
  outcomes: dict[str, tuple] = {}
  before = dict(endpoint.batcher.stats)
  endpoint.open(flat)
  # a loop per group, each in its thread: one group's blocking program stalls only its loop;
  # a program whose asyncio objects serve every episode (shared_loop) gets one loop for all
  loops = [flat] if getattr(agent, "shared_loop", False) else logs
  dones = [threading.Event() for _ in loops]
  threads = [threading.Thread(target=_drive, args=(agent, endpoint.base_url, group,
                                                   e.agent_timeout_s, outcomes, done),
                              name=f"rlx-agents-{p}", daemon=True)
             for p, (group, done) in enumerate(zip(loops, dones))]
  deadline = time.monotonic() + e.agent_timeout_s + _GRACE_S
  for thread in threads:
    thread.start()
  try:
    endpoint.batcher.serve(until=lambda: all(d.is_set() for d in dones)
                           or time.monotonic() > deadline)
  finally:
    endpoint.close(flat)
    # requests of programs abandoned past the deadline
    endpoint.batcher.fail_queued("the episode's batch is over")

  sums = dict.fromkeys(("episodes", "turns", "truncated", "requests", "tool_calls",
                        "malformed_calls", "program_errors", "program_timeouts",
                        "silent_episodes", "failed_groups", "dropped_episodes",
                        "history_rewrites", "dropped_tokens", "sampled_tokens"), 0.0)
  completions, given = [], []  # given: a program's (reward, correct), or None
  for p, group in enumerate(logs):
    chosen, failed = [], False
    for s, log in enumerate(group):
      status, value = outcomes.get(log.key, ("timeout", None))
      node = log.trajectory(e.trajectory)
      reward, right, problem = _reward_of(value) if status == "ok" else (None, None, None)
      if status == "ok" and problem is not None:
        status, value = "error", problem
      if status == "ok" and node is None:
        status = "silent"
      if status != "ok":
        sums[{"error": "program_errors", "timeout": "program_timeouts",
              "silent": "silent_episodes"}[status]] += 1
        if status == "error" and tally.first_error is None:
          tally.first_error = value
        failed = True
        continue
      if reward is None and log.posted is not None:
        reward, right = log.posted["reward"], log.posted.get("correct")
      chosen.append((s, log, node, reward, right))
    if failed:
      sums["failed_groups"] += 1
      sums["dropped_episodes"] += len(chosen)
      continue
    for s, log, node, reward, right in chosen:
      dropped, sampled = log.dropped_tokens(node)
      sums["episodes"] += 1
      sums["turns"] += node.turns
      sums["truncated"] += node.finish_reason == "length"
      sums["requests"] += len(log.requests)
      sums["tool_calls"] += log.tool_calls
      sums["malformed_calls"] += log.malformed_calls
      sums["history_rewrites"] += log.segments - 1
      sums["dropped_tokens"] += dropped
      sums["sampled_tokens"] += sampled
      completions.append((Completion(
          prompt_tokens=node.prompt_tokens, response_tokens=node.response_tokens,
          logprobs=node.logprobs, policy_logprobs=node.policy_logprobs,
          finish_reason="length" if node.finish_reason == "length" else "stop",
          policy_version=node.policy_version, prompt_index=p, sample_index=s,
          sampled_mask=node.sampled_mask, turns=node.turns), node, rows[p]))
      given.append(None if reward is None else
                   (reward, bool(reward >= 1.0) if right is None else right))
  scored = merge_rewards(
      run.pool, given,
      lambda i: (completions[i][1].text, dict(completions[i][2],
                                              messages=completions[i][1].conversation)))
  counts = dict(scored.counts)
  sums["slot_steps"] = endpoint.batcher.stats["slot_steps"] - before["slot_steps"]
  sums["busy_steps"] = endpoint.batcher.stats["busy_steps"] - before["busy_steps"]
  sums["held_steps"] = endpoint.batcher.stats["held_steps"] - before["held_steps"]
  # requests whose client hung up before the answer: their slots went to others
  sums["abandoned_requests"] = (endpoint.batcher.stats["abandoned"]
                                - before.get("abandoned", 0))
  counts.update({f"agent:{key}": value for key, value in sums.items()})
  completions = [c for c, _, _ in completions]
  if jax.process_index() == 0 and temperature > 0 and completions:
    write_samples(run, completions, scored.rewards)
  return completions, scored._replace(counts=counts)
