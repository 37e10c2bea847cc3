"""Serves a policy on an OpenAI-compatible endpoint, for evaluation with any OpenAI client.

    python -m rlx.serve --model /tmp/rlx-run/hf/step_600          # a run's exported step
    python -m rlx.serve --model ~/models/Qwen2.5-0.5B-Instruct --port 8000

    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
    client.chat.completions.create(model="policy", messages=[...])

The model is a Hugging Face directory (config.json, safetensors, tokenizer); a run writes its
policy as one with ``checkpoint.export_hf_every``. Requests share the engine's continuous
batching and sample as they ask (temperature, top_p, seed, n, stop). It listens on 127.0.0.1;
another address needs ``--api-key`` (or ``RLX_API_KEY``), which clients then pass as their key.
Stop it with Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import sys
import threading


def _arguments(argv):
  parser = argparse.ArgumentParser(prog="python -m rlx.serve", description=__doc__.split("\n")[0])
  parser.add_argument("--model", required=True,
                      help="a Hugging Face model directory (a run's WORKDIR/hf/step_N)")
  parser.add_argument("--host", default="127.0.0.1",
                      help="address to listen on (not a loopback one: --api-key is required)")
  parser.add_argument("--port", type=int, default=8000, help="port (0: any free one)")
  parser.add_argument("--api-key", default=os.environ.get("RLX_API_KEY"),
                      help="bearer token clients must send (default: $RLX_API_KEY; none)")
  parser.add_argument("--served-name", default="policy", help="the model name requests give")
  parser.add_argument("--max-slots", type=int, default=16, help="sequences decoded at once")
  parser.add_argument("--max-len", type=int, default=None,
                      help="prompt + answer tokens per sequence (default: the model's "
                           "max_position_embeddings, at most 4096)")
  parser.add_argument("--max-tokens", type=int, default=1024,
                      help="most tokens one answer may sample (larger requests are capped)")
  parser.add_argument("--max-n", type=int, default=16, help="most choices per request")
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                      help="compute dtype")
  parser.add_argument("--tool-format", default="auto", choices=("auto", "builtin", "qwen", "llama"),
                      help="how the model writes tool calls ('auto': from the chat template)")
  return parser.parse_args(argv)


def main(argv=None) -> int:
  args = _arguments(argv)
  from rlx.models import CheckpointError, from_pretrained, load_tokenizer  # noqa: PLC0415
  from rlx.rollout import Engine  # noqa: PLC0415
  try:
    from rlx.serve.endpoint import Endpoint, _fastapi  # noqa: PLC0415
    _fastapi()
  except ImportError as error:
    hint = "" if "pip install" in str(error) else "; pip install 'rlx[serve]'"
    print(f"rlx.serve: {error}{hint}", file=sys.stderr)
    return 2

  directory = pathlib.Path(args.model).expanduser()
  try:
    model = from_pretrained(directory, dtype=args.dtype)
    tokenizer = load_tokenizer(directory)
  except CheckpointError as error:
    print(f"rlx.serve: {error}", file=sys.stderr)
    return 2
  max_len = args.max_len or min(model.arch.max_position_embeddings, 4096)
  if max_len < 2:
    print("rlx.serve: --max-len must be >= 2", file=sys.stderr)
    return 2
  engine = Engine(model.transformer, max_slots=args.max_slots, max_len=max_len,
                  max_prompt_len=max_len - 1)
  try:
    endpoint = Endpoint(engine, tokenizer, model.params, host=args.host, port=args.port,
                        api_key=args.api_key, model_name=args.served_name,
                        tool_format=None if args.tool_format == "auto" else args.tool_format,
                        max_tokens=args.max_tokens, max_n=args.max_n).start()
  except (ValueError, OSError) as error:
    print(f"rlx.serve: {error}", file=sys.stderr)
    return 2
  stop = threading.Event()
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda *_: stop.set())
  print(f"rlx.serve: {directory} as {args.served_name!r} on {endpoint.base_url} "
        f"({engine.max_slots} slots of {max_len} tokens)", flush=True)
  try:
    endpoint.batcher.serve(until=stop.is_set, poll_s=0.05)
  finally:
    endpoint.stop()
  print("rlx.serve: stopped", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
