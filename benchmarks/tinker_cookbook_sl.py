"""tinker-cookbook's own supervised loop, unchanged, fine-tunes a model through rlx's
Tinker-compatible service on a local chat file: the held-out greedy accuracy before and after,
and the time.

    python benchmarks/tinker_cookbook_sl.py [--model models/SmolLM2-135M-Instruct]
        [--task word_sums] [--examples 256] [--batch-size 16] [--learning-rate 2e-4]
        [--rank 16] [--workdir runs/tinker_cookbook_sl] [--base-url URL]

The loop is ``tinker_cookbook.supervised.train.main`` with the cookbook's
``FromConversationFileBuilder`` reading a JSONL file of conversations written here from rlx's
task (each: SmolLM2's default system message, the problem, the task's reference answer as the
assistant's turn; trained on the assistant's turns), the cookbook's ChatML renderer, LoRA.
Everything else (the service it starts, the evaluation of the held-out split before and after
through the same service, the tokenizer given to the cookbook) is ``tinker_cookbook_rl.py``'s.

Prints one JSON object: the accuracies, the wall time of the training, its steps, and the
first and last lines the loop logged.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from tinker_cookbook_rl import (MODEL_NAME, RENDERER, SYSTEM, arguments,  # noqa: E402
                                evaluate, start_service, stop_service,
                                train_and_evaluate)


def write_conversations(path: pathlib.Path, task: str, count: int, seed: int) -> None:
  """``count`` training problems of ``task`` as chat conversations, one JSON line each."""
  from rlx.data.tasks import task_rows
  from rlx.trainer.setup.warmup import target_text

  with open(path, "w") as f:
    for row in task_rows(task, count, seed=seed):
      f.write(json.dumps({"messages": [
          {"role": "system", "content": SYSTEM}, {"role": "user", "content": row["prompt"]},
          {"role": "assistant", "content": target_text(row)}]}) + "\n")


def main() -> None:
  parser = arguments(__doc__, "runs/tinker_cookbook_sl")
  parser.add_argument("--examples", type=int, default=256)
  parser.add_argument("--batch-size", type=int, default=16)
  parser.add_argument("--epochs", type=int, default=1)
  args = parser.parse_args()

  import tinker
  import transformers
  from tinker_cookbook import renderers
  from tinker_cookbook.supervised import train
  from tinker_cookbook.supervised.data import FromConversationFileBuilder
  from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
  from tinker_cookbook.tokenizer_utils import get_tokenizer, register_tokenizer

  from rlx.models import load_tokenizer

  os.environ.setdefault("TINKER_API_KEY", "tml-local")
  workdir = pathlib.Path(args.workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                      handlers=[logging.FileHandler(workdir / "cookbook.log", mode="w")])
  register_tokenizer(MODEL_NAME, lambda: transformers.AutoTokenizer.from_pretrained(args.model))
  load_tokenizer(args.model)  # fails early, with rlx's message, on a directory with none
  conversations = workdir / "conversations.jsonl"
  write_conversations(conversations, args.task, args.examples, args.seed)
  service_process, url = (None, args.base_url) if args.base_url else start_service(
      args.model, workdir, args.service_python)
  try:
    renderer = renderers.get_renderer(RENDERER, get_tokenizer(MODEL_NAME))
    client = tinker.ServiceClient(base_url=url, api_key="tml-local")
    base = client.create_sampling_client(base_model=MODEL_NAME).result()
    before = evaluate(client, base, renderer, args.task, args.eval_prompts, args.max_tokens)
    print(f"held-out greedy accuracy before: {before}", file=sys.stderr, flush=True)
    log_path = workdir / "log"
    config = train.Config(
        log_path=str(log_path), model_name=MODEL_NAME, renderer_name=RENDERER,
        recipe_name=f"rlx_sl_{args.task}", base_url=url, learning_rate=args.learning_rate,
        lora_rank=args.rank, num_epochs=args.epochs, save_every=0, eval_every=0,
        dataset_builder=FromConversationFileBuilder(
            file_path=str(conversations), shuffle_seed=args.seed,
            common_config=ChatDatasetBuilderCommonConfig(
                model_name_for_tokenizer=MODEL_NAME, renderer_name=RENDERER, max_length=256,
                batch_size=args.batch_size)))
    train_s, after = train_and_evaluate(train.main, config, client, renderer, args, log_path)
  finally:
    stop_service(service_process)
  metrics = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
  losses = [m["train_mean_nll"] for m in metrics if "train_mean_nll" in m]
  lines = (workdir / "cookbook.log").read_text().splitlines()
  print(json.dumps({
      "task": args.task, "examples": args.examples, "steps": len(losses), "model": args.model,
      "accuracy_before": before, "accuracy_after": after,
      "gain_points": None if before is None else round(100 * (after - before), 1),
      "train_minutes": round(train_s / 60, 2),
      "train_nll_first_last": [losses[0], losses[-1]] if losses else None,
      "first_log_line": lines[0] if lines else None, "last_log_line": lines[-1] if lines else None,
  }, indent=1))


if __name__ == "__main__":
  main()
