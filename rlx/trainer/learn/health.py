"""One console line when a run is not learning, naming the likely cause and the config field
to change.

    health = Health(config)
    for line in health.check(metrics):    # after every step
      say(line)

A symptom is reported once it has held for ``logging.warn_after_steps`` steps in a row, and
again only after it has cleared and come back. ``skip_cause`` names the likely cause of an
update the learner skipped (a non-finite loss, gradient or update).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from rlx.config import RunConfig
from rlx.trainer.draw import Draw


@dataclasses.dataclass(frozen=True)
class Symptom:
  name: str
  holds: Callable[[dict], bool]
  """Whether the step's metrics show it (False when a metric it reads is absent)."""
  advice: str


ENTROPY_COLLAPSED = 0.01
"""policy/entropy (nats per token) below which exploration is over."""
MOSTLY_TRUNCATED = 0.5
"""response/truncated_frac above which the generation budget is too short."""

SYMPTOMS = (
    Symptom("equal_groups",
            lambda m: m.get("advantage/zero_groups_frac", 0.0) >= 1.0,
            "every group's samples got the same reward, so every advantage is 0 and nothing is "
            "learned: the task is too hard (or too easy) for the model as it is. Look at what it "
            "generates; raise rollout.group_size or rollout.temperature, warm it up "
            "(trainer.warmup_sft_steps), or check the reward (reward.name)"),
    Symptom("zero_reward",
            lambda m: "reward/mean" in m and m["reward/mean"] == 0.0,
            "no sample earned any reward: check that the reward reads the answer format the "
            "model writes (reward.name, data.answer_field), or warm the model up first "
            "(trainer.warmup_sft_steps)"),
    Symptom("entropy_collapse",
            lambda m: "policy/entropy" in m and m["policy/entropy"] < ENTROPY_COLLAPSED,
            f"policy/entropy is below {ENTROPY_COLLAPSED}: the policy samples one answer and "
            "exploration is over. Set algorithm.entropy_floor or algorithm.entropy_target, or "
            "raise rollout.temperature"),
    Symptom("truncated",
            lambda m: m.get("response/truncated_frac", 0.0) > MOSTLY_TRUNCATED,
            f"more than {MOSTLY_TRUNCATED:.0%} of the responses hit rollout.max_new_tokens and were "
            "cut: raise it, or shape lengths with algorithm.overlong_buffer"),
)


class Health:
  """Counts how long each symptom has held; ``check`` returns the lines to print."""

  def __init__(self, config: RunConfig, symptoms: tuple[Symptom, ...] = SYMPTOMS):
    self.after = config.logging.warn_after_steps
    self.symptoms = symptoms
    self.streaks = {s.name: 0 for s in symptoms}

  def check(self, metrics: dict) -> list[str]:
    if not self.after:
      return []
    lines = []
    for symptom in self.symptoms:
      streak = self.streaks[symptom.name] + 1 if symptom.holds(metrics) else 0
      self.streaks[symptom.name] = streak
      if streak == self.after:
        steps = f"{streak} steps in a row" if streak > 1 else "a step"
        lines.append(f"rlx: warning: for {steps}, {symptom.advice}")
    return lines


def sample_rows(step: int, draw, tokenizer, groups: int, group_size: int) -> list[dict]:
  """The first ``groups`` groups of a draw as readable rows: prompt and response text (the
  response as the model wrote it, special tokens included), reward, the verifier's verdict,
  why it ended, the policy version that sampled it."""
  rows = []
  for i, completion in enumerate(draw.completions[:groups * group_size]):
    rows.append({
        "step": step, "group": i // group_size,
        "prompt": tokenizer.decode(completion.prompt_tokens),
        "response": tokenizer.decode(completion.response_tokens, skip_special_tokens=False),
        "reward": float(draw.rewards[i]), "correct": bool(draw.correct[i]),
        "finish_reason": completion.finish_reason, "policy_version": completion.policy_version,
        "response_tokens": len(completion.response_tokens)})
  return rows


def describe_sample(row: dict, width: int = 300) -> str:
  """One sample of ``sample_rows`` for the console: the prompt's end, the response, the
  reward and verdict (long texts cut to ``width`` characters)."""
  cut = lambda text, keep_end=False: (text if len(text) <= width else
                                      ("…" + text[-width:]) if keep_end else (text[:width] + "…"))
  return (f"rlx: sample at step {row['step']} (reward {row['reward']:.3g}, "
          f"{'correct' if row['correct'] else 'wrong'}, {row['finish_reason']}):\n"
          f"  prompt:   {cut(row['prompt'], keep_end=True)!r}\n"
          f"  response: {cut(row['response'])!r}")


def skip_cause(metrics: dict, draw: Draw, config: RunConfig) -> str:
  """The likely cause of a skipped update, from what the step observed, with the fix."""
  if not np.all(np.isfinite(draw.rewards)):
    return "some rewards are not finite; check the reward function"
  if not np.isfinite(metrics.get("advantage/std", 0.0)):
    return "the advantages are not finite; check the rewards' scale"
  if metrics.get("train/skipped_update", 0):
    return (f"the loss and gradient were finite but the update made the weights non-finite, "
            f"or moved them by more than config.optimizer.max_update_ratio="
            f"{config.optimizer.max_update_ratio:g} of their norm: lower "
            f"config.optimizer.learning_rate (now {config.optimizer.learning_rate:g})")
  if not np.isfinite(metrics.get("loss", 0.0)):
    return ("the loss is not finite; lower config.optimizer.learning_rate, or check the "
            "rewards and config.algorithm's coefficients")
  return ("the gradient norm is not finite; lower config.optimizer.learning_rate or "
          "config.optimizer.max_grad_norm")
