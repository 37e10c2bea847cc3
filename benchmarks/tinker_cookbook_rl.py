"""tinker-cookbook's own RL loop, unchanged, trains a model through rlx's Tinker-compatible
service on a built-in task: the held-out greedy accuracy before and after, and the time.

    python benchmarks/tinker_cookbook_rl.py [--model models/SmolLM2-135M-Instruct]
        [--task word_sums] [--steps 30] [--learning-rate 2e-4] [--rank 16]
        [--workdir runs/tinker_cookbook_rl] [--base-url URL]

It needs tinker-cookbook beside rlx in its environment (``pip install tinker-cookbook``; its
``tml-renderers`` requirement serves only the Inkling models and may be left out with
``--no-deps``). Without ``--base-url`` it starts ``python -m rlx.tinker`` on the model itself,
on a free port, and stops it at the end.

The loop is ``tinker_cookbook.rl.train.main`` with the cookbook's ChatML renderer
(``qwen3_instruct``: ``<|im_start|>role ... <|im_end|>``, SmolLM2's chat format) and a
conversation that starts with SmolLM2's default system message, as its chat template and
``rlx.main`` write it. The task is rlx's: each step's 4 problems come from ``rlx.data.tasks``'
train split, 8 samples each at temperature 0.7, 32 new tokens, scored by the task's own reward
(``rlx.rewards``), with the cookbook's ``ProblemEnv`` (no format bonus: the reward is the task's).
The evaluation samples the held-out split greedily through the same service before and after
(the base, then the run's final sampler weights) and scores it with the same reward.

Prints one JSON object: the accuracies, the wall time of the training, its median step time
(the cookbook's ``time/total``), and the first and last lines the loop logged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
"""SmolLM2's chat template writes this system message when a conversation has none."""
RENDERER = "qwen3_instruct"


def _free_port() -> int:
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def start_service(model: str, workdir: pathlib.Path, python: str) -> tuple[subprocess.Popen, str]:
  port = _free_port()
  log = open(workdir / "service.log", "w")  # noqa: SIM115 - kept open for the service's life
  process = subprocess.Popen([python, "-m", "rlx.tinker", "--model", f"{MODEL_NAME}={model}",
                              "--port", str(port), "--workdir", str(workdir / "service")],
                             stdout=log, stderr=subprocess.STDOUT)
  url = f"http://127.0.0.1:{port}"
  deadline = time.monotonic() + 600
  while time.monotonic() < deadline:
    if process.poll() is not None:
      raise SystemExit(f"the service exited with {process.returncode}: see {log.name}")
    try:
      urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=2).read()
      return process, url
    except OSError:
      time.sleep(1)
  process.kill()
  raise SystemExit(f"the service did not answer in 600 s: see {log.name}")


def stop_service(process: subprocess.Popen | None) -> None:
  if process is not None:
    process.terminate()
    process.wait(30)


def arguments(doc: str, workdir: str) -> argparse.ArgumentParser:
  """The options both cookbook benchmarks take: the model, the task, the adapter and its
  learning rate, the evaluation, and the service (started here unless one is given)."""
  parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
  parser.add_argument("--model", default="models/SmolLM2-135M-Instruct")
  parser.add_argument("--task", default="word_sums")
  parser.add_argument("--learning-rate", type=float, default=2e-4)
  parser.add_argument("--rank", type=int, default=16)
  parser.add_argument("--max-tokens", type=int, default=32)
  parser.add_argument("--eval-prompts", type=int, default=200)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--workdir", default=workdir)
  parser.add_argument("--base-url", default=None, help="a running service (default: start one)")
  parser.add_argument("--service-python", default=sys.executable)
  return parser


def build(args):
  """The cookbook classes for the task (imported here: the cookbook is optional)."""
  import chz
  from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder
  from tinker_cookbook.rl.types import RLDataset, RLDatasetBuilder

  from rlx.data.tasks import task_rows
  from rlx.rewards.verifiers import VERIFIERS

  reward = VERIFIERS[args.task]

  class TaskEnv(ProblemEnv):
    def __init__(self, renderer, row):
      super().__init__(renderer, convo_prefix=[{"role": "system", "content": SYSTEM}],
                       format_coef=0.0)
      self.row = row

    def get_question(self) -> str:
      return self.row["prompt"]

    def check_answer(self, sample_str: str) -> bool:
      return reward(sample_str, self.row["answer"]) > 0

    def check_format(self, sample_str: str) -> bool:
      return True

    def get_reference_answer(self) -> str:
      return self.row["answer"]

  class TaskDataset(RLDataset):
    def __init__(self, renderer, rows, prompts_per_step, group_size):
      self.renderer, self.rows = renderer, rows
      self.prompts_per_step, self.group_size = prompts_per_step, group_size

    def get_batch(self, index):
      rows = self.rows[index * self.prompts_per_step:(index + 1) * self.prompts_per_step]
      return [ProblemGroupBuilder(env_thunk=lambda row=row: TaskEnv(self.renderer, row),
                                  num_envs=self.group_size, dataset_name=args.task)
              for row in rows]

    def __len__(self):
      return len(self.rows) // self.prompts_per_step

  @chz.chz
  class TaskDatasetBuilder(RLDatasetBuilder):
    task: str
    steps: int
    prompts_per_step: int
    group_size: int
    seed: int

    async def __call__(self):
      from tinker_cookbook import renderers
      from tinker_cookbook.tokenizer_utils import get_tokenizer

      renderer = renderers.get_renderer(RENDERER, get_tokenizer(MODEL_NAME))
      rows = task_rows(self.task, self.steps * self.prompts_per_step, seed=self.seed)
      return TaskDataset(renderer, rows, self.prompts_per_step, self.group_size), None

  return TaskEnv, TaskDatasetBuilder


def evaluate(service, sampler, renderer, task: str, count: int, max_tokens: int) -> float:
  """Held-out greedy accuracy of ``sampler`` (every prompt sampled at once); None for no
  prompts."""
  if count == 0:
    return None
  import tinker
  from tinker_cookbook import renderers

  from rlx.data.tasks import task_rows
  from rlx.rewards.verifiers import VERIFIERS

  rows = task_rows(task, count, split="eval")
  params = tinker.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                 stop=renderer.get_stop_sequences())
  futures = [sampler.sample(renderer.build_generation_prompt(
      [{"role": "system", "content": SYSTEM}, {"role": "user", "content": row["prompt"]}]),
      num_samples=1, sampling_params=params) for row in rows]
  correct = 0.0
  for row, future in zip(rows, futures, strict=True):
    message, _ = renderer.parse_response(future.result().sequences[0].tokens)
    correct += VERIFIERS[task](renderers.get_text_content(message), row["answer"])
  return correct / len(rows)


def train_and_evaluate(loop, config, client, renderer, args, log_path: pathlib.Path
                       ) -> tuple[float, float]:
  """Runs the cookbook's ``loop(config)``; returns its seconds and the held-out greedy accuracy
  of its final sampler checkpoint."""
  from tinker_cookbook import checkpoint_utils

  started = time.perf_counter()
  asyncio.run(loop(config))
  seconds = time.perf_counter() - started
  final = checkpoint_utils.get_last_checkpoint(str(log_path), required_key="sampler_path")
  after = evaluate(client, client.create_sampling_client(model_path=final.sampler_path).result(),
                   renderer, args.task, args.eval_prompts, args.max_tokens)
  print(f"held-out greedy accuracy after: {after}", file=sys.stderr, flush=True)
  return seconds, after


def main() -> None:
  parser = arguments(__doc__, "runs/tinker_cookbook_rl")
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--prompts-per-step", type=int, default=4)
  parser.add_argument("--group-size", type=int, default=8)
  parser.add_argument("--temperature", type=float, default=0.7)
  parser.add_argument("--evaluate", default=None, metavar="SAMPLER_PATH",
                      help="only evaluate this sampler checkpoint (tinker://...) of the service "
                           "in --workdir, and print its accuracy")
  args = parser.parse_args()

  import tinker
  from tinker_cookbook import renderers
  from tinker_cookbook.rl import train
  from tinker_cookbook.tokenizer_utils import get_tokenizer, register_tokenizer

  from rlx.models import load_tokenizer

  # the cookbook's clients take the key from the environment (the service accepts any 'tml-' key)
  os.environ.setdefault("TINKER_API_KEY", "tml-local")
  workdir = pathlib.Path(args.workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                      handlers=[logging.FileHandler(
                          workdir / ("evaluate.log" if args.evaluate else "cookbook.log"), mode="w")])
  # the cookbook asks the Hugging Face hub for the tokenizer by the model's name: give it the
  # local one (Hugging Face's own class, as the cookbook expects)
  import transformers

  register_tokenizer(MODEL_NAME, lambda: transformers.AutoTokenizer.from_pretrained(args.model))
  load_tokenizer(args.model)  # fails early, with rlx's message, on a directory with none
  service_process, url = (None, args.base_url) if args.base_url else start_service(
      args.model, workdir, args.service_python)
  try:
    renderer = renderers.get_renderer(RENDERER, get_tokenizer(MODEL_NAME))
    client = tinker.ServiceClient(base_url=url, api_key="tml-local")
    if args.evaluate:
      sampler = client.create_sampling_client(model_path=args.evaluate).result()
      accuracy = evaluate(client, sampler, renderer, args.task, args.eval_prompts, args.max_tokens)
      print(json.dumps({"sampler": args.evaluate, "task": args.task, "accuracy": accuracy}))
      return
    base = client.create_sampling_client(base_model=MODEL_NAME).result()
    before = evaluate(client, base, renderer, args.task, args.eval_prompts, args.max_tokens)
    print(f"held-out greedy accuracy before: {before}", file=sys.stderr, flush=True)

    _, builder = build(args)
    log_path = workdir / "log"
    config = train.Config(
        learning_rate=args.learning_rate, model_name=MODEL_NAME, renderer_name=RENDERER,
        max_tokens=args.max_tokens, temperature=args.temperature, lora_rank=args.rank,
        log_path=str(log_path), base_url=url, loss_fn="importance_sampling",
        recipe_name=f"rlx_{args.task}",
        dataset_builder=builder(task=args.task, steps=args.steps,
                                prompts_per_step=args.prompts_per_step,
                                group_size=args.group_size, seed=args.seed),
        eval_every=0, save_every=0, max_steps=args.steps)
    train_s, after = train_and_evaluate(train.main, config, client, renderer, args, log_path)
  finally:
    stop_service(service_process)
  metrics = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
  steps = [m for m in metrics if "time/total" in m]
  lines = (workdir / "cookbook.log").read_text().splitlines()
  print(json.dumps({
      "task": args.task, "steps": len(steps), "model": args.model,
      "accuracy_before": before, "accuracy_after": after,
      "gain_points": None if before is None else round(100 * (after - before), 1),
      "train_minutes": round(train_s / 60, 2),
      "median_step_s": round(statistics.median(m["time/total"] for m in steps), 2) if steps else None,
      "reward_first_last": [steps[0].get("env/all/reward/total"), steps[-1].get("env/all/reward/total")]
      if steps else None,
      "first_log_line": lines[0] if lines else None, "last_log_line": lines[-1] if lines else None,
  }, indent=1))


if __name__ == "__main__":
  main()
