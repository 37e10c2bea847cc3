"""Tiny sizes for end-to-end loop tests: the shipped configs, shrunk by command-line overrides."""

import json
import os
import pathlib
import sys
import types

import jax

from rlx import cli
from rlx.models import builtin_tokenizer, init_model
from rlx.rollout import Engine
from rlx.trainer.setup.run import agent_endpoint

ROOT = pathlib.Path(__file__).parent.parent.parent

OVERRIDES = (
    "--config.model.arch.num_layers=1", "--config.model.arch.vocab_size=128",
    "--config.model.arch.hidden_size=32", "--config.model.arch.intermediate_size=64",
    "--config.model.arch.num_heads=2", "--config.model.arch.num_kv_heads=1",
    "--config.model.arch.head_dim=16", "--config.rollout.max_new_tokens=8",
    "--config.rollout.max_slots=8", "--config.rollout.group_size=2",
    "--config.data.prompts_per_step=2", "--config.trainer.warmup_sft_steps=2",
    "--config.trainer.warmup_sft_batch=4", "--config.trainer.eval_prompts=4",
    "--config.trainer.eval_every=0", "--config.reward.num_workers=0",
    "--config.reward.format_weight=0.5", "--config.logging.progress_bar=false",
    "--config.logging.tensorboard=false", "--config.checkpoint.async_save=false",
    "--config.optimizer.learning_rate=1e-3",
    # one optimizer step per batch keeps the loop tests cheap; test_loops covers mini-batches
    "--config.trainer.mini_batches=1",
    # the session's compilation cache (tests/conftest.py), also for runs in subprocesses
    f"--config.trainer.compile_cache={os.environ.get('RLX_TEST_COMPILE_CACHE', '')}",
)


def this_python_env() -> dict[str, str]:
  """The environment for a launcher that starts ``python``: this interpreter's first on PATH,
  whether or not its virtual environment is activated."""
  return dict(os.environ, PATH=f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")


def config(name: str, *overrides: str):
  """``configs/{name}.py`` at a tiny size, with more overrides on top."""
  loaded = cli.load_config_file(str(ROOT / "configs" / f"{name}.py"))
  return cli.apply_overrides(loaded, OVERRIDES + overrides)


def metrics(workdir) -> list[dict]:
  return [json.loads(line) for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text()
          .splitlines()]


def agent_run(config, pool, workdir):
  """What ``run_agent_programs`` reads of a run, at a tiny size: the config's random model, an
  engine of 4 slots, the built-in tokenizer and ``pool`` as the reward; its endpoint started
  (stop it with ``run.endpoint.stop()``)."""
  model = init_model(config.model.arch, jax.random.key(0))
  engine = Engine(model.transformer, max_slots=4, max_len=160, max_prompt_len=159,
                  decode_steps=4)
  tokenizer = builtin_tokenizer()
  return types.SimpleNamespace(config=config, engine=engine, tokenizer=tokenizer, pool=pool,
                               endpoint=agent_endpoint(config, engine, tokenizer),
                               workdir=workdir, model=model)
