"""The tokenizer wrapper against what transformers produced for the same files."""

import json

import pytest

from rlx import models


@pytest.fixture
def tokenizer_dir(hf_dir):
  return hf_dir("qwen2")


def test_chat_template_matches_transformers(tokenizer_dir):
  expected = json.loads((tokenizer_dir / "expected_tokenizer.json").read_text())
  tok = models.load_tokenizer(tokenizer_dir)
  assert tok.render_chat(expected["messages"]) == expected["chat_text"]
  assert tok.apply_chat_template(expected["messages"]) == expected["chat_ids"]
  assert tok.encode(expected["plain_text"]) == expected["plain_ids"]
  assert tok.decode(tok.encode(expected["plain_text"])) == expected["plain_text"]


def test_special_tokens(tokenizer_dir):
  expected = json.loads((tokenizer_dir / "expected_tokenizer.json").read_text())
  tok = models.load_tokenizer(tokenizer_dir)
  assert (tok.eos_id, tok.pad_id, tok.bos_id) == (expected["eos_id"], expected["pad_id"], None)
  assert tok.eos_ids == (expected["eos_id"], 0)  # plus generation_config.json's eos ids
  prompt = tok.encode_prompt("What is 2 + 2?")
  assert tok.decode(prompt, skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_chat_template_file_wins_and_missing_template_is_plain(tokenizer_dir, tmp_path):
  for name in ("tokenizer.json", "tokenizer_config.json"):
    (tmp_path / name).write_bytes((tokenizer_dir / name).read_bytes())
  (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
  tok = models.load_tokenizer(tmp_path)
  assert tok.render_chat([{"role": "user", "content": "hi"}]) == "hi!"
  config = json.loads((tmp_path / "tokenizer_config.json").read_text())
  del config["chat_template"]
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  (tmp_path / "chat_template.jinja").unlink()
  tok = models.load_tokenizer(tmp_path)
  assert tok.encode_prompt("hi") == tok.encode("hi")
  with pytest.raises(ValueError, match="no chat template"):
    tok.render_chat([{"role": "user", "content": "hi"}])


def test_missing_tokenizer_is_refused(tmp_path):
  with pytest.raises(models.CheckpointError, match="no tokenizer.json"):
    models.load_tokenizer(tmp_path)
