"""A run's prompts: the training source and the held-out rows, a prompt rendered as the run
renders every prompt, and an episode's first prompt (its environment's first messages with the
tools' schemas), checked against the prompt length before anything is trained.

    source, eval_rows = sources(config, tokenizer, say)
"""

from __future__ import annotations

import dataclasses
import functools

from rlx.config import RunConfig
from rlx.data import DataError, PromptStream, TaskSource, hold_out, open_source
from rlx.envs import verifiers
from rlx.models import Tokenizer
from rlx.trainer.common import EpisodesFailedError, Say
from rlx.trainer.episodes import Episodes


def named(open_source, field: str, path: str, **options):
  """``open_source(path)``, its refusal naming the config field that gave the path."""
  try:
    return open_source(path, **options)
  except DataError as error:
    if f"config.{field}" in str(error):
      raise
    raise DataError(f"config.{field}={path!r}: {error}") from None


def sources(config: RunConfig, tokenizer: Tokenizer, say: Say) -> tuple[object, list[dict]]:
  """The training source and the held-out rows (tokenized): a built-in task's eval split, the
  rows of data.eval_source, or data.eval_fraction of the data file, held out."""
  data, wanted = config.data, config.trainer.eval_prompts
  options = dict(prompt_field=data.prompt_field, answer_field=data.answer_field,
                 answer_format=data.answer_format, on_bad_row=data.on_bad_row,
                 seed=data.shuffle_seed,
                 eval_fraction=data.eval_fraction)
  taskset = verifiers.taskset_id(config.env.agent)
  if taskset is not None:  # a verifiers environment: its tasks are the prompts
    source = verifiers.TaskRows(taskset, config.env.verifiers_config)
    say(f"rlx: data: the {len(source)} tasks of the verifiers taskset {source.taskset} are the "
        f"prompts (config.data.source={data.source!r} is not read)")
    data = dataclasses.replace(data, eval_source="")
  else:
    source = named(open_source, "data.source", data.source, **options)
  if source.skipped:
    say(f"rlx: data: skipped {source.skipped} malformed row(s) (config.data.on_bad_row=skip); "
        f"the first: {source.first_skipped}")
  held = None
  if wanted and data.eval_source:
    held = named(open_source, "data.eval_source", data.eval_source, **dict(options, split="eval"))
  elif wanted and isinstance(source, TaskSource):
    held = TaskSource(source.task, seed=data.shuffle_seed, split="eval",
                      eval_fraction=source.eval_fraction)
  elif wanted:
    total = len(source)
    source, held = hold_out(source, data.eval_fraction)
    say(f"rlx: data: {len(held)} of the {total} rows of {data.source} are held out for "
        f"evaluation, never trained on (data.eval_fraction={data.eval_fraction}); give "
        "data.eval_source, or set trainer.eval_prompts=0 to train on every row")
  eval_rows, too_long = [], 0
  for i in range(min(wanted, len(held)) if held is not None else 0):
    row = held[i]
    try:
      tokens = prompt_encoder(config, tokenizer)(row["prompt"])
    except ValueError as error:
      raise DataError(f"{row['where']}: {error}") from None
    if len(tokens) > config.rollout.max_prompt_len:
      too_long += 1
      continue
    eval_rows.append(dict(row, prompt_tokens=tokens))
  if too_long:
    say(f"rlx: eval: {too_long} held-out prompt(s) are longer than config.rollout.max_prompt_len="
        f"{config.rollout.max_prompt_len} and are left out; {len(eval_rows)} are scored")
  if held is not None and not eval_rows:
    raise DataError(f"no held-out prompt fits config.rollout.max_prompt_len="
                    f"{config.rollout.max_prompt_len}; raise it")
  return source, eval_rows


def episode_prompted(config: RunConfig, tokenizer: Tokenizer, batches):
  """Warm-up batches whose prompts are what the episodes will see: each row's environment's
  first messages with the tools' schemas (a row whose reset fails is left out)."""
  episodes = Episodes(config, tokenizer, [], 1)
  try:
    for batch in batches:
      first = len(episodes.prompts)
      episodes.add(batch)
      yield [dict(row, prompt_tokens=prompt) for row, prompt in
             zip(episodes.rows[first:], episodes.prompts[first:])]
      for p in range(first, len(episodes.prompts)):
        episodes.forget(p)
  finally:
    episodes.close()


def check_episode_prompts(config: RunConfig, source, tokenizer: Tokenizer, rows: int = 8) -> None:
  """Starts the environments of the first ``rows`` rows once, as the episodes will (their
  first messages with the tools' schemas), and refuses a prompt past rollout.max_prompt_len
  now rather than at the first draw. Every row's reset failing ends the run here, in one
  ``env.step_timeout_s``: their resets run at once."""
  probe = PromptStream(source, batch_size=min(rows, len(source)), seed=config.data.shuffle_seed,
                       encode=prompt_encoder(config, tokenizer), on_bad_row="skip")
  rows = next(probe)
  episodes = Episodes(config, tokenizer, rows, 1)
  episodes.close()
  if rows and episodes.failed_rows == len(rows):
    raise EpisodesFailedError(episodes.errors.none_started(config, len(rows), "tried at start"))


def prompt_encoder(config: RunConfig, tokenizer: Tokenizer):
  """``encode(prompt) -> ids``: a row's prompt rendered as the run renders every prompt, with
  ``data.system_prompt`` and ``data.chat_template_kwargs``."""
  return functools.partial(tokenizer.encode_prompt, system=config.data.system_prompt,
                           template_kwargs=config.data.template_kwargs)
