"""The learner's controllers, run on a real learner: the adaptive entropy bonus
(``algorithm.entropy_target``) applies on the side of the target it is meant for."""

import pytest

from rlx.trainer import prepare
from rlx.trainer.learn.learner import Learner
from tests.trainer import tiny
from tests.trainer.test_learner_memory import batch_of_4_groups


@pytest.mark.parametrize("target, below", [(5.0, True), (0.01, False)])
def test_the_entropy_bonus_applies_only_below_algorithm_entropy_target(tmp_path, target, below):
  """With ``algorithm.entropy_target``, the learner hands the update the bonus's coefficient
  while the policy's entropy is below the target and 0 while above, and moves the coefficient
  up below it, down above it (the tiny model's entropy is between the two targets)."""
  config = tiny.config("dapo_split", "--config.mesh.mode=colocated",
                       "--config.trainer.warmup_sft_steps=0", "--config.data.prompts_per_step=4",
                       f"--config.algorithm.entropy_target={target}",
                       "--config.algorithm.entropy_coef=0.01",
                       "--config.algorithm.entropy_coef_step=0.005")
  draw = batch_of_4_groups()
  run = prepare(config, tmp_path, say=lambda line: None)
  try:
    learner = Learner.for_run(run, say=lambda line: None)
    handed, step = [], learner.step_fn

    def recording(state, batch, kl_coef, clip_eps_high, entropy_coef, **kwargs):
      handed.append(float(entropy_coef))
      return step(state, batch, kl_coef, clip_eps_high, entropy_coef, **kwargs)

    learner.step_fn = recording
    for _ in range(2):
      learner.publish()
      metrics = learner.learn(draw)
    assert (metrics["policy/entropy"] < target) == below
    assert learner.entropy_below_target == below
    # the first update has no entropy to judge by yet: the starting coefficient
    assert handed[0] == pytest.approx(0.01)
    assert handed[1] == (pytest.approx(0.015) if below else 0.0)
    assert learner.entropy_coef == pytest.approx(0.02 if below else 0.0)
  finally:
    run.close()


def test_the_mismatch_has_one_figure_a_batch_the_producer_s_where_it_measured_one(tmp_path):
  """``rollout/mismatch_kl``: the learner's, from the rows the current weights sampled, unless
  the draw carries the producer's measure from its hand-over."""
  config = tiny.config("dapo_split", "--config.mesh.mode=colocated",
                       "--config.trainer.warmup_sft_steps=0", "--config.data.prompts_per_step=4")
  draw = batch_of_4_groups()  # sampled by version 0: the current weights' rows
  run = prepare(config, tmp_path, say=lambda line: None)
  try:
    learner = Learner.for_run(run, say=lambda line: None)
    learner.publish()
    own = learner.learn(draw)["rollout/mismatch_kl"]
    assert own > 0  # the batch's log-probs are not the model's
    learner.publish()
    draw.counts["rollout/mismatch_kl"] = 1e-9
    for c in draw.completions:
      c.policy_version = learner.version
    assert learner.learn(draw)["rollout/mismatch_kl"] == 1e-9
  finally:
    run.close()
