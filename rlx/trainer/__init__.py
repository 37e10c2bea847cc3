"""The trainer: three wings over a shared floor.

- the floor (``rlx/trainer/*.py``): the controllers (``control.py``), the errors and shared
  helpers (``common.py``), a draw and its bytes and layout (``draw.py``), starting episodes
  (``episodes.py``);
- ``setup/``: building a run's parts, the warm-up;
- ``produce/``: prompts and weights in, scored draws out (the producer loop, ``produce/loop.py``);
- ``learn/``: draws in, policy versions out (the learner loop, ``learn/loop.py``);
- ``deploy/``: colocated, split in one process, the learner and generator jobs: the only wing
  that imports both sides.

    summary = rlx.trainer.train(config, workdir)   # the loop config.mesh.mode asks for
"""

from rlx.checkpoint import EXIT_STOPPED, CheckpointError
from rlx.config import ConfigError, check
from rlx.trainer.deploy.colocated import train_colocated
from rlx.trainer.produce.collect import collect
from rlx.trainer.draw import Draw
from rlx.trainer.common import (DynamicSamplingError, EpisodesFailedError, NonFiniteError,
                                RewardFailedError, TrainingError)
from rlx.trainer.produce.evaluate import evaluate
from rlx.trainer.setup.run import Run, prepare
from rlx.trainer.learn.learner import Learner
from rlx.trainer.learn.loop import Batch, BatchSource, Summary, learn_loop
from rlx.trainer.learn.experience import Sampled, make_prepare, sample_arrays, sequence_advantages, shaped_rewards
from rlx.trainer.draw import layout
from rlx.trainer.deploy.jobs import train_generator, train_learner
from rlx.trainer.deploy.split import Generator, train_split
from rlx.trainer.setup.warmup import warm_up


def train(config, workdir, say=print):
  """Runs (or resumes) the run ``config`` describes; returns its ``Summary`` (a generator
  job: its ``GeneratorSummary``)."""
  check(config)
  if config.mesh.multihost and config.mesh.mode == "split" and config.mesh.role == "both":
    raise ConfigError(
        "config.mesh.multihost=true with config.mesh.mode=split: a split run spans one process "
        "for now; run colocated across processes (config.mesh.mode=colocated), or split in one "
        "process with all of this machine's devices, or split as two jobs "
        "(config.mesh.role=learner / generator, launch/local.sh --learner N --generator M)")
  if config.mesh.multihost and config.mesh.role == "generator":
    raise ConfigError(
        "config.mesh.multihost=true with config.mesh.role=generator: a generator job runs as "
        "one process for now (it writes whole rollout files); give it one process with all of "
        "its machine's devices")
  if config.mesh.role == "learner":
    return train_learner(config, workdir, say)
  if config.mesh.role == "generator":
    return train_generator(config, workdir, say)
  loop = train_split if config.mesh.mode == "split" else train_colocated
  return loop(config, workdir, say)


__all__ = ["EXIT_STOPPED", "Batch", "BatchSource", "Draw", "DynamicSamplingError", "Generator", "Learner", "Run",
           "Summary",
           "learn_loop", "EpisodesFailedError", "NonFiniteError", "RewardFailedError", "Sampled",
           "TrainingError", "collect", "evaluate", "layout", "make_prepare", "prepare",
           "sample_arrays", "sequence_advantages", "shaped_rewards", "train", "train_colocated",
           "train_generator", "train_learner", "train_split", "warm_up"]
