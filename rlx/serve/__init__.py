"""Serving the policy over HTTP: an OpenAI-compatible endpoint on the rollout engine, the
episodes an agent program drives through it, and ``python -m rlx.serve`` for a checkpoint."""

from rlx.serve.batcher import Batcher, Generated, Request, ServingClosed
from rlx.serve.trajectories import EpisodeLog, Node

__all__ = ["Batcher", "EpisodeLog", "Generated", "Node", "Request", "ServingClosed"]
