"""``python -m rlx.tinker --model NAME=DIR [--model ...] [--port 8000] [--sampling beside]``:
serves the base models at DIR under the names clients pass as ``base_model``."""

from __future__ import annotations

import argparse
import logging
import pathlib
import sys


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m rlx.tinker", description=__doc__)
  parser.add_argument("--model", action="append", required=True, metavar="NAME=DIR",
                      help="a base model: the name clients use, and its Hugging Face directory")
  parser.add_argument("--host", default="127.0.0.1")
  parser.add_argument("--port", type=int, default=8000)
  parser.add_argument("--workdir", default="tinker_runs", help="where saved weights go")
  parser.add_argument("--api-key", default=None,
                      help="the key clients must send (default: any; the SDK wants 'tml-...')")
  parser.add_argument("--max-length", type=int, default=4096,
                      help="the longest sequence (prompt and response) a call may hold")
  parser.add_argument("--sampling", choices=("auto", "beside", "inline"), default="auto",
                      help="beside: sampling runs on a device of its own, beside training (on "
                           "a CPU, the host is split into two devices); inline: one call at a "
                           "time on one device; auto: beside where the accelerator has two "
                           "devices or more")
  args = parser.parse_args(argv)
  models = {}
  for spec in args.model:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
      print(f"rlx.tinker: --model {spec!r}: give NAME=DIR", file=sys.stderr)
      return 2
    if not (pathlib.Path(path) / "config.json").is_file():
      print(f"rlx.tinker: --model {spec!r}: {path} holds no Hugging Face config.json",
            file=sys.stderr)
      return 2
    models[name] = path
  try:
    import fastapi  # noqa: F401, PLC0415 - after the arguments are checked
    import uvicorn  # noqa: PLC0415
  except ImportError as error:
    print(f"rlx.tinker: {error.name} is not installed: the service needs the tinker extra "
          "(pip install 'rlx[tinker]', or pip install -e '.[tinker]' in a checkout)",
          file=sys.stderr)
    return 2

  import jax  # noqa: PLC0415

  if args.sampling == "beside":
    jax.config.update("jax_num_cpu_devices", 2)  # a CPU's two devices; no other platform's
  split = args.sampling == "beside" or (args.sampling == "auto"
                                        and len(jax.local_devices()) >= 2)
  if split and len(jax.local_devices()) < 2:
    print(f"rlx.tinker: --sampling beside needs two devices; {jax.default_backend()} has one "
          "here (use --sampling inline)", file=sys.stderr)
    return 2

  from rlx.tinker.routes import app  # noqa: PLC0415
  from rlx.tinker.server import HEARTBEAT_TIMEOUT_S, Service  # noqa: PLC0415
  from rlx.tinker.training import Base  # noqa: PLC0415

  logging.basicConfig(level=logging.INFO, format="%(message)s")
  bases = {name: Base.load(name, path, args.max_length) for name, path in models.items()}
  service = Service(bases, args.workdir, api_key=args.api_key, split=split)
  where = (f"sampling on {service.sample_device} beside training on {jax.local_devices()[0]}"
           if split else f"one call at a time on {jax.local_devices()[0]}")
  print(f"rlx.tinker: serving {sorted(bases)} on http://{args.host}:{args.port} ({where}); a "
        f"session without a heartbeat for {HEARTBEAT_TIMEOUT_S:g} s releases its adapters",
        flush=True)
  uvicorn.run(app(service), host=args.host, port=args.port, log_level="warning")
  return 0


if __name__ == "__main__":
  sys.exit(main())
