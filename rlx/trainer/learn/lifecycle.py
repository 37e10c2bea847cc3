"""A run's start and end around its learner, shared by every loop.

    started = begin(config, workdir, say, evaluate)
    ...                                                # the loop: learner.learn(draw) per step
    ended = finish(run, learner, start=start, step=step, stop=stop, seconds=..., ...)

``begin`` builds the run, resumes from the newest checkpoint, publishes the first weights and
measures the held-out accuracy before RL; ``finish`` saves the last step, exports the final
policy and evaluates it. Every deployment begins the same way, through ``begin``
(``rlx.trainer.learn.loop.learn_run``: ``begin``, the controller restored, the deployment's
batch source behind the replay buffer when asked, the learn loop).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

from rlx import cli, distributed, progress
from rlx.checkpoint import CheckpointError
from rlx.config import RunConfig
from rlx.trainer.common import Evaluate, Say
from rlx.trainer.learn.learner import Learner
from rlx.trainer.setup.run import Run, prepare


@dataclasses.dataclass(frozen=True)
class Started:
  """A run begun: built, resumed, its first weights published."""

  run: Run
  learner: Learner
  step: int | None
  """The step it resumed from (None: a fresh run)."""
  accuracy_before: float | None
  seconds: dict[str, float]
  """Where its time went so far: ``warm-up``, ``start-up`` and ``evals``."""


def begin(config: RunConfig, workdir: str | pathlib.Path, say: Say,
          evaluate: Evaluate) -> Started:
  """Builds a run and its learner, resumes from the newest checkpoint if there is one (the
  data stream continues from the checkpoint's position), publishes the first weights and (on
  a fresh run) measures the held-out accuracy before RL with ``evaluate``."""
  started = time.perf_counter()
  progress.doing("building the run (model, data, rewards)")
  run = prepare(config, workdir, say)
  progress.doing("building the learner")
  learner = Learner.for_run(run, say)
  progress.doing("restoring the newest checkpoint")
  # a checkpoint whose data position the stream refuses is damaged like an unreadable one
  try:
    restored = learner.restore(usable=lambda restored: run.stream.set_state(restored.data_state))
  except CheckpointError as error:
    raise CheckpointError(f"{error}{_what_changed(run)}") from None
  start = None
  if restored is not None:
    start = restored.step
    saved, now = restored.meta.get("data_fingerprint"), run.source.fingerprint()
    if saved is not None and saved != now:
      say(f"rlx: warning: the data changed since the checkpoint was written ({saved} then, "
          f"{now} now); the run resumes at the saved position of the changed data")
    say(f"rlx: resumed from {learner.checkpointer.directory} at step {start}")
  # versions from this one on are written again; a dead run's are never sampled from
  discarded = run.sync.discard_from(learner.version)
  if discarded:
    say(f"rlx: moved {discarded} policy version(s) from {learner.version} on aside: a stopped "
        "run wrote them after the checkpoint this run resumes from")
  progress.doing("publishing the first policy version")
  learner.publish()
  progress.doing("the held-out evaluation before RL")
  evaluated = time.perf_counter()
  initial = evaluate(run, learner.generation_params()) if start is None else {}
  evals = time.perf_counter() - evaluated
  accuracy_before = initial.get("eval/accuracy")
  if initial and distributed.lead():  # the baseline a report draws at step 0
    (run.workdir / "eval_initial.json").write_text(json.dumps(dict(initial, step=0), indent=1))
  if accuracy_before is not None:
    say(f"rlx: held-out accuracy before RL: {accuracy_before:.1%}")
  elif start is not None:  # resumed: the run's first start measured it
    accuracy_before = _initial_accuracy(run.workdir)
  seconds = {"warm-up": run.warmup_s, "evals": evals,
             "start-up": time.perf_counter() - started - run.warmup_s - evals}
  return Started(run, learner, start, accuracy_before, seconds)


def timed(evaluate: Evaluate, seconds: dict[str, float]) -> Evaluate:
  """``evaluate``, its time added to ``seconds["evals"]``."""
  def evaluate_timed(run, params) -> dict:
    started = time.perf_counter()
    try:
      return evaluate(run, params)
    finally:
      seconds["evals"] = seconds.get("evals", 0.0) + time.perf_counter() - started
  return evaluate_timed


def _initial_accuracy(workdir: pathlib.Path) -> float | None:
  """The held-out accuracy before RL that the run's first start wrote, if it did."""
  try:
    return json.loads((workdir / "eval_initial.json").read_text()).get("eval/accuracy")
  except (OSError, ValueError, AttributeError):
    return None


def _what_changed(run: Run) -> str:
  """The fields of the config that changed since the run's previous start (its config.json
  kept aside by ``rlx.main``), as a sentence; "" when none was kept."""
  earlier = sorted(run.workdir.glob("config.*.json"))
  if not earlier:
    return ""
  try:
    changes = cli.config_changes(json.loads(earlier[-1].read_text()), run.config)
  except (OSError, ValueError):
    return ""
  return (f". The config differs from the one of the run's previous start ({earlier[-1].name}) "
          f"in: {'; '.join(changes)}") if changes else ""


def finish(run: Run, learner: Learner, *, start: int | None, step: int, stop, data_state: dict,
           say: Say, evaluate: Evaluate, seconds: dict[str, float], loop_started: float,
           loop_evals: dict[str, float], save_meta: dict | None = None,
           final: dict | None = None) -> dict:
  """Saves the last step (unless that save is already started), waits until it is on disk,
  and returns ``{"seconds": where the time went, "eval_accuracy_after": the held-out accuracy
  after RL, "final": the final evaluation's figures}`` (skipped after a stop signal, so that
  a stop takes seconds). ``final``: that evaluation, when the loop's last step ran it (the
  same weights are not evaluated twice). The final evaluation's every figure (pass@k with ``trainer.eval_samples``) goes to
  ``WORKDIR/eval_final.json``, and the final policy to ``WORKDIR/hf/final`` (Hugging Face
  format, what ``python -m rlx.serve --model`` and ``transformers`` load). ``seconds``: where
  the time went before the loop (``begin``'s), ``loop_evals["evals"]``: the evaluations' since
  ``loop_started`` (``time.perf_counter()``), ``evaluate`` adding to it (``timed``)."""
  if final is not None:  # nothing samples again: the save and the export take the memory of
    learner.release_generation_copy()  # the generator's copy
  loop_seconds = time.perf_counter() - loop_started - loop_evals.get("evals", 0.0)
  if step != (start or 0) and learner.saved_step != step:
    learner.save(step, data_state, **(save_meta or {}))
  learner.close()  # waits for every started save
  if run.stream.skipped:
    say(f"rlx: data: skipped {run.stream.skipped} prompt(s) longer than "
        f"config.rollout.max_prompt_len (config.data.on_bad_row=skip); the first: "
        f"{run.stream.first_skipped}")
  if stop.agree():
    saved = learner.checkpointer.latest_step()
    where = (f"checkpoint saved at step {saved} in {learner.checkpointer.directory}"
             if saved is not None else "no checkpoint to save yet")
    say(f"rlx: stopped by {stop.received} after step {step}: {where}; the final evaluation is "
        "skipped; rerun the same command to resume")
    accuracy_after, final = None, {}
  else:
    if run.model is not None:  # a run without a model (a test's stand-in) has none to export
      exported = learner.export(run.workdir / "hf" / "final", run.tokenizer)
      kind = "a PEFT adapter" if learner.base is not None else "Hugging Face format"
      say(f"rlx: final policy (step {step}) in {kind}: {', '.join(map(str, exported))}")
    if final is None:
      final = evaluate(run, learner.generation_params())
    accuracy_after = final.get("eval/accuracy")
    if final and distributed.lead():  # every held-out figure of the final policy, kept
      (run.workdir / "eval_final.json").write_text(json.dumps(dict(final, step=step), indent=1))
    passes = {name.removeprefix("eval/"): value for name, value in final.items()
              if name.startswith("eval/pass@")}
    if passes:
      say("rlx: held-out after RL, sampled: " + ", ".join(f"{k} {v:.1%}" for k, v in passes.items()))
  seconds = dict(seconds, **{"RL loop": loop_seconds,
                             "evals": seconds.get("evals", 0.0) + loop_evals.get("evals", 0.0)})
  return {"seconds": seconds, "eval_accuracy_after": accuracy_after, "final": final}
