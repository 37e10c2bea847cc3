"""The generation engine (JetStream contract: prefill / insert / generate over slots),
continuous batching, multi-turn episodes, sampling and behaviour log-probs."""

from rlx.rollout.driver import Completion, generate
from rlx.rollout.episodes import generate_episodes
from rlx.rollout.engine import DecodeState, Engine, Prefix, SamplingParams, StepResult, shard_params
from rlx.rollout.sampling import sample, truncate_logits

__all__ = ["Completion", "DecodeState", "Engine", "Prefix", "SamplingParams", "StepResult",
           "generate", "generate_episodes", "sample", "shard_params", "truncate_logits"]
