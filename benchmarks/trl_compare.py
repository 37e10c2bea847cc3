"""rlx against TRL's ``GRPOTrainer`` on a real model: the same model, prompts, reward, sampling,
group size, learning rate, steps and no KL, one after the other on this machine, each final
policy then scored by one shared greedy evaluation.

    python -m rlx.fetch --out models/SmolLM2-135M-Instruct                  # once
    python -m venv .venv-trl && .venv-trl/bin/pip install trl torch         # TRL's own venv
    python benchmarks/trl_compare.py [--model models/SmolLM2-135M-Instruct] [--task word_sums]
        [--steps 30] [--seeds 0,1,2] [--trl-python .venv-trl/bin/python] [--threads 2]
        [--eval-prompts 200] [--workdir runs/trl_compare] [--skip trl|rlx]
        [--rlx-arg=--config.mesh.mode=colocated ...]

The settings are the SmolLM2 recipe's (``configs/smollm2_math.py``): 4 prompts x 8 samples a
step, 32 new tokens at temperature 0.7 (top-k and top-p off), learning rate 1e-5 held
constant, AdamW without weight decay, gradients clipped at norm 1, one optimizer step per
batch, GRPO's group-normalised advantages with the sequence-mean-token-mean loss and a clip of
0.2, no KL. Both train on the same ``steps x 4`` training prompts of ``--task`` (written to one
JSONL file, rendered by the model's chat template), scored by rlx's reward for that task (TRL
imports the same function). rlx runs its recipe (split: one device generates while one learns,
one step of policy lag; ``--rlx-arg`` passes a config override to it, e.g. colocated, on-policy
as TRL is); TRL runs on-policy in torch with ``--threads`` threads.

Prints one JSON object: for each seed and trainer, the median step time, the training wall
clock and the held-out greedy accuracy of the final policy; the base model's accuracy; and
per trainer the medians over seeds. The shared evaluation is rlx's (``rlx.trainer.produce.evaluate``:
greedy, ``--eval-prompts`` problems of the task's held-out split, never trained on) applied to
each final policy in Hugging Face format.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]

# The TRL side, run by TRL's own interpreter: argv[1] is a JSON object of settings.
TRL_MAIN = r'''
import json, pathlib, statistics, sys, time
settings = json.loads(sys.argv[1])
sys.path.insert(0, settings["repo"])
import torch
torch.set_num_threads(settings["threads"])
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from rlx.rewards.verifiers import VERIFIERS

verify = VERIFIERS[settings["task"]]
rows = [json.loads(line) for line in open(settings["data"])]
dataset = Dataset.from_list([{"prompt": r["text"], "answer": r["answer"]} for r in rows])

def reward(completions, answer, **_):
  return [float(verify(c, a)) for c, a in zip(completions, answer)]

class Clock(TrainerCallback):
  def __init__(self):
    self.times, self.last = [], None
  def on_step_begin(self, args, state, control, **_):
    self.last = time.perf_counter()
  def on_step_end(self, args, state, control, **_):
    self.times.append(time.perf_counter() - self.last)

config = GRPOConfig(
    output_dir=settings["out"], per_device_train_batch_size=settings["batch"],
    num_generations=settings["group"], max_completion_length=settings["max_new"],
    temperature=settings["temperature"], top_p=1.0, top_k=0,
    learning_rate=settings["lr"], lr_scheduler_type="constant", warmup_steps=0,
    weight_decay=0.0, max_grad_norm=1.0, beta=0.0, loss_type="grpo", scale_rewards="group",
    epsilon=0.2, num_iterations=1, gradient_accumulation_steps=1, max_steps=settings["steps"],
    use_cpu=True, bf16=False, logging_steps=1, save_strategy="no", report_to="none",
    seed=settings["seed"], model_init_kwargs={"dtype": torch.float32})
tokenizer = AutoTokenizer.from_pretrained(settings["model"])
clock = Clock()
trainer = GRPOTrainer(model=settings["model"], reward_funcs=reward, args=config,
                      train_dataset=dataset, processing_class=tokenizer, callbacks=[clock])
started = time.perf_counter()
trainer.train()
wall = time.perf_counter() - started
trainer.save_model(settings["out"])
tokenizer.save_pretrained(settings["out"])
# TRL's own per-step figures (reward, grad_norm, clip ratios, entropy), beside rlx's metrics.jsonl
with open(f"{settings['out']}/log_history.json", "w") as f:
  json.dump(trainer.state.log_history, f)
print("TRL_RESULT " + json.dumps({"step_s": statistics.median(clock.times[1:] or clock.times),
                                  "wall_s": wall, "steps": len(clock.times)}))
'''


def training_rows(model: str, task: str, count: int, seed: int) -> list[dict]:
  """``count`` training problems of ``task``, each with its prompt rendered by the model's chat
  template (what both trainers feed the model)."""
  from rlx.data.tasks import task_rows
  from rlx.models import load_tokenizer
  tokenizer = load_tokenizer(model)
  rows = task_rows(task, count, seed=seed, split="train")
  return [{"prompt": r["prompt"], "answer": r["answer"],
           "text": tokenizer.render_chat([{"role": "user", "content": r["prompt"]}])}
          for r in rows]


def run_rlx(args, data: pathlib.Path, workdir: pathlib.Path, seed: int) -> dict:
  """The recipe on the file's prompts; its step times from its metrics."""
  command = [sys.executable, "-m", "rlx.main", "--config", str(REPO / "configs/smollm2_math.py"),
             f"--workdir={workdir}", f"--config.model.path={args.model}",
             f"--config.data.source={data}", f"--config.reward.name={args.task}",
             f"--config.trainer.steps={args.steps}", "--config.trainer.eval_prompts=0",
             f"--config.trainer.seed={seed}", f"--config.data.shuffle_seed={seed}",
             *args.rlx_arg]
  started = time.perf_counter()
  subprocess.run(command, check=True, cwd=REPO)
  wall = time.perf_counter() - started
  steps = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  times = [r["time/step_s"] for r in steps if "time/step_s" in r]
  return {"step_s": statistics.median(times[1:] or times), "wall_s": wall,
          "steps": len(times), "policy": str(workdir / "hf" / "final")}


def run_trl(args, data: pathlib.Path, workdir: pathlib.Path, seed: int) -> dict:
  settings = {"repo": str(REPO), "model": args.model, "data": str(data), "out": str(workdir),
              "task": args.task, "threads": args.threads, "batch": 4 * 8, "group": 8,
              "max_new": 32, "temperature": 0.7, "lr": 1e-5, "steps": args.steps, "seed": seed}
  env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
  out = subprocess.run([args.trl_python, "-c", TRL_MAIN, json.dumps(settings)], check=True,
                       cwd=REPO, env=env, stdout=subprocess.PIPE, text=True).stdout
  line = next(l for l in out.splitlines() if l.startswith("TRL_RESULT "))
  return dict(json.loads(line[len("TRL_RESULT "):]), policy=str(workdir))


def held_out_accuracy(args, policy: str, workdir: pathlib.Path) -> float:
  """The shared evaluation: rlx's greedy held-out accuracy of the policy in ``policy``."""
  from rlx.configs import smollm2_math
  from rlx.trainer import prepare
  from rlx.trainer.produce.evaluate import evaluate
  config = smollm2_math.get_config()
  config = dataclasses.replace(
      config, model=dataclasses.replace(config.model, path=policy),
      mesh=dataclasses.replace(config.mesh, mode="colocated", cpu_devices=1),
      data=dataclasses.replace(config.data, source=args.task),
      reward=dataclasses.replace(config.reward, name=args.task),
      trainer=dataclasses.replace(config.trainer, eval_prompts=args.eval_prompts))
  run = prepare(config, workdir, say=lambda line: None)
  try:
    return evaluate(run, run.model.params)["eval/accuracy"]
  finally:
    run.close()


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="models/SmolLM2-135M-Instruct")
  parser.add_argument("--task", default="word_sums")
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--seeds", default="0")
  parser.add_argument("--trl-python", default=".venv-trl/bin/python")
  parser.add_argument("--threads", type=int, default=2)
  parser.add_argument("--eval-prompts", type=int, default=200)
  parser.add_argument("--workdir", default="runs/trl_compare")
  parser.add_argument("--skip", choices=["trl", "rlx"], default=None)
  parser.add_argument("--rlx-arg", action="append", default=[],
                      help="a flag for rlx.main's recipe run (repeatable)")
  args = parser.parse_args()
  args.model = str(pathlib.Path(args.model).resolve())
  root = pathlib.Path(args.workdir).resolve()
  root.mkdir(parents=True, exist_ok=True)
  trainers = [t for t in ("rlx", "trl") if t != args.skip]
  results = {"model": args.model, "task": args.task, "steps": args.steps,
             "rlx_args": args.rlx_arg, "seeds": {}}
  results["base_accuracy"] = held_out_accuracy(args, args.model, root / "eval_base")
  for seed in map(int, args.seeds.split(",")):
    data = root / f"train_seed{seed}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in
                            training_rows(args.model, args.task, 4 * args.steps, seed)))
    for trainer in trainers:
      workdir = root / f"{trainer}_seed{seed}"
      result = (run_rlx if trainer == "rlx" else run_trl)(args, data, workdir, seed)
      result["accuracy"] = held_out_accuracy(args, result["policy"], root / f"eval_{trainer}{seed}")
      results["seeds"].setdefault(str(seed), {})[trainer] = result
      print(json.dumps({"seed": seed, trainer: result}), flush=True)
  summary = {}
  for trainer in trainers:
    runs = [by[trainer] for by in results["seeds"].values()]
    summary[trainer] = {key: statistics.median(r[key] for r in runs)
                        for key in ("step_s", "wall_s", "accuracy")}
  if len(trainers) == 2:
    summary["trl_step_over_rlx_step"] = round(summary["trl"]["step_s"] / summary["rlx"]["step_s"], 2)
  results["summary"] = summary
  print(json.dumps(results, indent=1))


if __name__ == "__main__":
  main()
