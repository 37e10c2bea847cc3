"""The training loops (colocated and split) and what they share: building a run, drawing and
scoring rollouts, turning them into the learner's batch, and the learner.

    summary = rlx.trainer.train(config, workdir)   # the loop config.mesh.mode asks for
"""

from rlx.config import ConfigError, check
from rlx.trainer.colocated import train_colocated
from rlx.trainer.common import (DynamicSamplingError, Learner, NonFiniteError, TrainingError,
                                collect, evaluate, prepare)
from rlx.trainer.experience import (Sampled, layout, make_prepare, sample_arrays,
                                    sequence_advantages, shaped_rewards)
from rlx.trainer.split import Generator, train_split
from rlx.trainer.warmup import warm_up


def train(config, workdir, say=print) -> dict:
  """Runs (or resumes) the loop of ``config.mesh.mode``; returns its summary."""
  check(config)
  if config.mesh.multihost:
    raise ConfigError(
        "config.mesh.multihost=true: the training loops drive one process for now (the rollout "
        "engine and the learner's batches place host data on local devices); run one process "
        "with all of this machine's devices, or split learner and generator into separate jobs "
        "over config.mesh.weight_sync=orbax once that launcher lands")
  loop = train_split if config.mesh.mode == "split" else train_colocated
  return loop(config, workdir, say)


__all__ = ["DynamicSamplingError", "Generator", "Learner", "NonFiniteError", "Sampled",
           "TrainingError", "collect", "evaluate", "layout", "make_prepare", "prepare",
           "sample_arrays", "sequence_advantages", "shaped_rewards", "train", "train_colocated",
           "train_split", "warm_up"]
