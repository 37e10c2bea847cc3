"""A draw: a full batch of scored groups, what both wings pass between them, with its bytes
in a rollout file (``encode`` / ``decode``) and its array layout for the learner (``layout``).

    draw = Draw(completions=..., rewards=..., correct=..., counts=..., generate_seconds=...,
                data_state=...)
    data = encode(draw, extra)            # a rollout file's bytes (rlx.trainer.deploy.exchange)
    draw, extra = decode(data)
    arrays = layout(draw.completions, pad_id)   # tokens, masks, behaviour log-probs [B, T]

A rollout file is msgpack of the completions' tokens, behaviour log-probs and policy
versions (flat arrays with offsets), the rewards and verdicts, the counts, the data-stream
position after the batch, the seed, the sampling temperature and start time, and the
generator's timings.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import numpy as np
from flax import serialization

from rlx.rollout import Completion


@dataclasses.dataclass(kw_only=True)
class Draw:
  """A full batch of scored groups (this process's share of it), and what it cost. Built by
  name, never by position."""

  completions: list[Completion]
  rewards: np.ndarray
  """float32 [N]: the reward of each kept completion."""
  correct: np.ndarray
  """bool [N]: the verifier's verdict on each kept completion."""
  counts: dict
  """Metrics of the draw: reward mean and accuracy, errors, dropped groups, components..."""
  generate_seconds: float
  data_state: dict
  temperature: float | None = None
  """The sampling temperature (an entropy controller may have raised it); None: rollout.temperature."""
  born: float = 0.0
  """Wall-clock time (``time.time()``) sampling started: the data's age is measured from it."""



def _flat(rows: list[list], dtype) -> tuple[np.ndarray, np.ndarray]:
  offsets = np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)
  values = np.concatenate([np.asarray(r, dtype) for r in rows]) if rows else np.zeros(0, dtype)
  return values.astype(dtype), offsets


def _rows(values: np.ndarray, offsets: np.ndarray) -> list[list]:
  return [values[offsets[i]:offsets[i + 1]].tolist() for i in range(len(offsets) - 1)]


def encode(draw: Draw, extra: dict | None = None) -> bytes:
  """The bytes of one rollout file."""
  c = draw.completions
  arrays = {}
  for name, dtype in (("prompt_tokens", np.int32), ("response_tokens", np.int32),
                      ("logprobs", np.float32), ("policy_logprobs", np.float32)):
    arrays[name], arrays[name + "_offsets"] = _flat([getattr(x, name) for x in c], dtype)
  if any(x.sampled_mask is not None for x in c):  # multi-turn episodes
    arrays["sampled_mask"], _ = _flat([x.sampled_mask if x.sampled_mask is not None else
                                       [True] * len(x.response_tokens) for x in c], bool)
  if any(x.token_versions is not None for x in c):  # an in-flight update reached some
    arrays["token_versions"], _ = _flat([x.versions() for x in c], np.int32)
  arrays.update(
      policy_version=np.array([x.policy_version for x in c], np.int32),
      prompt_index=np.array([x.prompt_index for x in c], np.int32),
      sample_index=np.array([x.sample_index for x in c], np.int32),
      turns=np.array([x.turns for x in c], np.int32),
      rewards=np.asarray(draw.rewards, np.float32), correct=np.asarray(draw.correct, bool))
  meta = {"finish_reason": [x.finish_reason for x in c], "counts": draw.counts,
          "generate_seconds": draw.generate_seconds, "data_state": draw.data_state,
          "temperature": draw.temperature, "born": draw.born, **(extra or {})}
  return serialization.msgpack_serialize({"arrays": arrays, "meta": json.dumps(meta)})


def decode(data: bytes) -> tuple[Draw, dict]:
  """(the draw, the extra fields) of one rollout file's bytes."""
  content = serialization.msgpack_restore(data)
  a, meta = content["arrays"], json.loads(content["meta"])
  rows = {name: _rows(a[name], a[name + "_offsets"])
          for name in ("prompt_tokens", "response_tokens", "logprobs", "policy_logprobs")}
  masks = (_rows(np.asarray(a["sampled_mask"], bool), a["response_tokens_offsets"])
           if "sampled_mask" in a else None)
  versions = (_rows(np.asarray(a["token_versions"], np.int32), a["response_tokens_offsets"])
              if "token_versions" in a else None)
  completions = [
      Completion(prompt_tokens=rows["prompt_tokens"][i], response_tokens=rows["response_tokens"][i],
                 logprobs=rows["logprobs"][i], policy_logprobs=rows["policy_logprobs"][i],
                 finish_reason=meta["finish_reason"][i], policy_version=int(a["policy_version"][i]),
                 prompt_index=int(a["prompt_index"][i]), sample_index=int(a["sample_index"][i]),
                 sampled_mask=masks[i] if masks else None,
                 turns=int(a["turns"][i]) if "turns" in a else 1,
                 token_versions=(versions[i] if versions and len(set(versions[i])) > 1
                                 else None))
      for i in range(len(meta["finish_reason"]))]
  draw = Draw(completions=completions, rewards=np.asarray(a["rewards"], np.float32),
              correct=np.asarray(a["correct"], bool), counts=meta.pop("counts"),
              generate_seconds=meta.pop("generate_seconds"), data_state=meta.pop("data_state"),
              temperature=meta.pop("temperature", None), born=meta.pop("born", 0.0))
  meta.pop("finish_reason")
  return draw, meta



def _bucket(length: int, smallest: int = 8) -> int:
  size = smallest
  while size < length:
    size *= 2
  return size


def layout(completions: Sequence[Completion], pad_id: int, bucket: bool = True,
           lengths: tuple[int, int] = (0, 0)) -> dict[str, np.ndarray]:
  """Token ids, attention and response masks, and behaviour log-probs [B, T] (NumPy).

  With ``bucket``, the prompt and response parts are padded to powers of two, so
  that the jitted learner step sees few distinct shapes (it compiles once per shape).
  ``lengths`` are the least (prompt, response) lengths to lay out (the longest of every
  process, so that their rows make one array).
  """
  prompt_len = max(lengths[0], *(len(c.prompt_tokens) for c in completions))
  response_len = max(lengths[1], *(len(c.response_tokens) for c in completions))
  if bucket:
    prompt_len, response_len = _bucket(prompt_len), _bucket(response_len)
  B, T = len(completions), prompt_len + response_len
  tokens = np.full((B, T), pad_id, np.int32)
  attention = np.zeros((B, T), bool)
  response = np.zeros((B, T), bool)
  behaviour = np.zeros((B, T), np.float32)
  for b, c in enumerate(completions):
    start = prompt_len - len(c.prompt_tokens)
    end = prompt_len + len(c.response_tokens)
    tokens[b, start:prompt_len] = c.prompt_tokens
    tokens[b, prompt_len:end] = c.response_tokens
    attention[b, start:end] = True
    # an episode's environment tokens are context, never actions: outside the mask
    response[b, prompt_len:end] = True if c.sampled_mask is None else c.sampled_mask
    behaviour[b, prompt_len:end] = c.logprobs
  return {"tokens": tokens, "attention_mask": attention, "response_mask": response,
          "behaviour_logprobs": behaviour}
