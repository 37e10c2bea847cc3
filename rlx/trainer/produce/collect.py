"""Drawing and scoring rollouts: a full batch of groups with DAPO's dynamic sampling, across
processes, each completion scored as soon as it finishes.

    draw = collect(run, params_fn, seed)            # a full batch of groups, scored
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import jax
import numpy as np

from rlx import distributed, progress, rollout
from rlx.rewards import Scored
from rlx.rollout import Completion
from rlx.trainer.produce.agents import run_episodes
from rlx.trainer.produce.tally import Tally, merge_rewards
from rlx.trainer.common import DynamicSamplingError, EpisodesFailedError, RewardFailedError
from rlx.trainer.draw import Draw
from rlx.trainer.setup.run import Run


def generate_and_score(run: Run, params, rows: list[dict], *, n: int, temperature: float,
                       seed: int, version: int, first_prompt_index: int = 0,
                       inflight: rollout.driver.Weights | None = None,
                       tally: Tally | None = None) -> tuple[list[Completion], Scored]:
  """``n`` samples of each row's prompt, and their rewards and verdicts from the host pool
  (``first_prompt_index``: where ``rows`` start in the batch the processes share). Each
  completion is scored as soon as it finishes, while the others are still decoding.
  ``inflight``: newer weights, asked for between decode chunks (``rollout.generate``'s
  ``weights``); agent programs sample each request with the weights it started with."""
  if run.config.env.agent:
    from rlx.trainer.produce.agent_programs import run_agent_programs  # noqa: PLC0415 - needs rlx[serve]

    return run_agent_programs(run, params, rows, n=n, temperature=temperature, seed=seed,
                              version=version, first_prompt_index=first_prompt_index,
                              tally=tally)
  if run.config.env.enabled:
    return run_episodes(run, params, rows, n=n, temperature=temperature, seed=seed,
                        version=version, first_prompt_index=first_prompt_index,
                        inflight=inflight, tally=tally)
  r = run.config.rollout
  scorer = _Scorer(run, rows)

  def finished(completion: Completion) -> None:  # cut at a stop string before it is scored
    completion.cut_at_stop_strings(r.stop_strings, run.tokenizer.decode)
    scorer.submit(completion)

  try:
    completions = rollout.generate(
        run.engine, [row["prompt_tokens"] for row in rows], params=params, n=n,
        max_new_tokens=r.max_new_tokens, temperature=temperature, top_p=r.top_p, top_k=r.top_k,
        stop_token_ids=run.tokenizer.eos_ids, seed=seed, policy_version=version,
        first_prompt_index=first_prompt_index, weights=inflight,
        on_finished=finished if r.stop_strings else scorer.submit)
  finally:
    parts = scorer.finish()
  return completions, _in_order(completions, parts)


class _Scorer:
  """Scores completions in a thread as generation hands them over, in batches of whatever
  has finished since the last call of the pool."""

  def __init__(self, run: Run, rows: list[dict], describe=None, direct=None):
    """``describe(completion)``: the (text, row) the reward function sees (default: the
    decoded response and its prompt's row); ``direct(completion)``: its (reward, correct)
    when it has them already (an environment rewarded its episode), else None."""
    self.run, self.rows = run, rows
    self.describe, self.direct = describe, direct
    self.queue: queue.Queue[Completion | None] = queue.Queue()
    self.parts: list[tuple[list[Completion], Scored]] = []
    self.error: BaseException | None = None
    self.thread = threading.Thread(target=self._work, name="rlx-scorer", daemon=True)
    self.thread.start()

  def submit(self, completion: Completion) -> None:
    self.queue.put(completion)

  def _work(self) -> None:
    done = False
    while not done:
      batch = [self.queue.get()]
      while True:
        try:
          batch.append(self.queue.get_nowait())
        except queue.Empty:
          break
      done = batch[-1] is None
      batch = [c for c in batch if c is not None]
      if not batch or self.error is not None:
        continue
      try:
        progress.doing(f"scoring the rewards of {len(batch)} sample(s)")
        self.parts.append((batch, self._score(batch)))
        progress.tick()
      except BaseException as error:  # noqa: BLE001 - raised in the generating thread
        self.error = error

  def _score(self, batch: list[Completion]) -> Scored:
    return merge_rewards(
        self.run.pool, [None if self.direct is None else self.direct(c) for c in batch],
        lambda i: (self.describe(batch[i]) if self.describe is not None else
                   (self.run.tokenizer.decode(batch[i].response_tokens),
                    self.rows[batch[i].prompt_index])))

  def finish(self) -> list[tuple[list[Completion], Scored]]:
    self.queue.put(None)
    self.thread.join()
    if self.error is not None:
      raise self.error
    return self.parts


def _in_order(completions: list[Completion],
              parts: list[tuple[list[Completion], Scored]]) -> Scored:
  """One ``Scored`` for ``completions`` from the parts scored as they finished."""
  where = {(c.prompt_index, c.sample_index): i for i, c in enumerate(completions)}
  count = len(completions)
  rewards, correct = np.zeros(count, np.float32), np.zeros(count, bool)
  counts: dict[str, int] = {"reward/errors": 0, "reward/timeouts": 0}
  components: dict[str, np.ndarray] = {}
  for batch, scored in parts:
    index = [where[(c.prompt_index, c.sample_index)] for c in batch]
    rewards[index], correct[index] = scored.rewards, scored.correct
    for key, value in scored.counts.items():
      counts[key] = counts.get(key, 0) + value
    for name, values in scored.components.items():
      components.setdefault(name, np.full(count, np.nan, np.float32))[index] = values
  return Scored(rewards, correct, counts, components)


def exhausted(run: Run, draws: int, kept: int, tally: Tally) -> Exception:
  """Why ``draws`` draws kept only ``kept`` groups of a batch: every agent episode failed,
  every reward call failed, or dynamic sampling found almost no group with varied rewards
  (``tally``: the draws' books)."""
  config, agent, counts = run.config, tally.agent, tally.counts
  wanted = config.data.prompts_per_step // jax.process_count()
  if agent and not config.env.agent and not distributed.any_process(
      agent.get("episodes", 0) > 0):
    return EpisodesFailedError(run.env_errors.none_started(
        config, int(agent.get("env_errors", 0)), f"of {draws} draws"))
  if agent and not distributed.any_process(agent.get("episodes", 0) > 0):
    return EpisodesFailedError(
        f"every episode of the agent program (config.env.agent={config.env.agent!r}) failed "
        f"in {draws} draws: {int(agent.get('program_errors', 0))} raised, "
        f"{int(agent.get('program_timeouts', 0))} ran past env.agent_timeout_s, "
        f"{int(agent.get('silent_episodes', 0))} never called the endpoint; the first "
        f"error: {tally.first_error}")
  failed = counts.get("reward/errors", 0) + counts.get("reward/timeouts", 0)
  if failed >= tally.samples:
    return RewardFailedError(
        f"every reward call of {draws} draws failed, so no group has varied rewards; the "
        f"first error: {run.pool.first_error}. Fix the reward function "
        f"(config.reward.name={config.reward.name!r}) or the data's fields it reads")
  return DynamicSamplingError(
      f"dynamic sampling kept {kept} of {wanted} groups after "
      f"{draws} draws: rewards are all equal in almost every group; make the task easier, "
      "raise config.rollout.group_size or config.algorithm.dynamic_sampling_max_draws, or set "
      "config.algorithm.dynamic_sampling=false")


def collect(run: Run, params_fn: Callable[[], tuple[object, int]], seed: int,
            temperature: float | None = None,
            inflight: Callable[[], tuple[object, int]] | None = None) -> Draw:
  """``prompts_per_step`` groups of ``group_size`` samples. With dynamic sampling, groups whose
  rewards are all equal are dropped and more prompts drawn (at most
  ``algorithm.dynamic_sampling_max_draws`` draws).

  ``params_fn()`` gives the (params, version) to sample with; it is asked before every
  draw, so a refill uses the newest policy the generator has; ``inflight``, when given, is
  also asked before every decode chunk, so that a version published meanwhile reaches the
  sequences in flight (``rollout/mixed_version_frac``: the kept completions whose tokens
  span versions). ``temperature`` overrides ``rollout.temperature`` (the entropy
  controller's).

  With several processes, every process draws the same prompt batches and samples its own
  contiguous share of them (groups never cross processes); they draw again as long as any
  of them lacks groups, so that their data streams and control flow stay the same, and the
  counts (``reward/mean`` ...) are over every process's samples.
  """
  config, group = run.config, run.config.rollout.group_size
  max_draws = config.algorithm.dynamic_sampling_max_draws
  wanted = config.data.prompts_per_step * group // jax.process_count()
  completions, rewards, correct, draws = [], [], [], 0
  tally = Tally(group)  # every group drawn, kept or not
  started, born = time.perf_counter(), time.time()
  temperature = config.rollout.temperature if temperature is None else temperature
  while distributed.any_process(len(completions) < wanted):
    if draws == max_draws:
      raise exhausted(run, draws, len(completions) // group, tally)
    rows, first = distributed.local_share(next(run.stream), "prompts per step")
    params, version = params_fn()
    drawn, scored = generate_and_score(
        run, params, rows, n=group, temperature=temperature, seed=seed * max_draws + draws,
        version=version, first_prompt_index=first, inflight=inflight, tally=tally)
    tally.count(scored.counts)
    keep = np.flatnonzero(tally.add(scored, dynamic=config.algorithm.dynamic))
    completions += [drawn[i] for i in keep]
    rewards += [scored.rewards[i] for i in keep]
    correct += [scored.correct[i] for i in keep]
    draws += 1
  names = distributed.union_over_processes(tally.parts)  # components may differ by process
  kept = completions[:wanted]
  totals = distributed.sums_over_processes({
      **tally.sums(names),  # the same keys everywhere
      "kept": len(kept), "mixed": sum(c.newest_version != c.policy_version for c in kept)})
  counts = tally.metrics(totals, draws=draws)
  if inflight is not None:
    counts["rollout/mixed_version_frac"] = totals["mixed"] / max(totals["kept"], 1)
  return Draw(completions=kept, rewards=np.array(rewards[:wanted], np.float32),
              correct=np.array(correct[:wanted], bool), counts=counts,
              generate_seconds=time.perf_counter() - started, data_state=run.stream.get_state(),
              temperature=temperature, born=born)
