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


def test_chat_template_sources(tokenizer_dir, tmp_path):
  for name in ("tokenizer.json", "tokenizer_config.json"):
    (tmp_path / name).write_bytes((tokenizer_dir / name).read_bytes())
  config = json.loads((tmp_path / "tokenizer_config.json").read_text())
  hi = [{"role": "user", "content": "hi"}]
  # In tokenizer_config.json (older transformers), as a string or a list of named templates.
  config["chat_template"] = "{{ messages[0]['content'] }}?"
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  assert models.load_tokenizer(tmp_path).render_chat(hi) == "hi?"
  config["chat_template"] = [{"name": "tool_use", "template": "x"},
                             {"name": "default", "template": "{{ messages[0]['content'] }}."}]
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  assert models.load_tokenizer(tmp_path).render_chat(hi) == "hi."
  # chat_template.jinja (newer transformers) wins.
  (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
  assert models.load_tokenizer(tmp_path).render_chat(hi) == "hi!"
  # No template: prompts are plain text.
  config.pop("chat_template")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  (tmp_path / "chat_template.jinja").unlink()
  tok = models.load_tokenizer(tmp_path)
  assert tok.encode_prompt("hi") == tok.encode("hi")
  with pytest.raises(ValueError, match="no chat template"):
    tok.render_chat(hi)


def test_missing_tokenizer_is_refused(tmp_path):
  with pytest.raises(models.CheckpointError, match="no tokenizer.json"):
    models.load_tokenizer(tmp_path)


def test_a_saved_tokenizer_loads_back_the_same(tmp_path):
  from rlx.models import builtin_tokenizer, load_tokenizer

  original = builtin_tokenizer()
  loaded = load_tokenizer(original.save_pretrained(tmp_path))
  text = "What is 3 + 4? <answer>7</answer>"
  assert loaded.encode(text) == original.encode(text)
  assert (loaded.eos_id, loaded.pad_id, loaded.vocab_size) == (original.eos_id, original.pad_id,
                                                                original.vocab_size)


def test_system_prompt_and_template_variables(tokenizer_dir, tmp_path):
  tok = models.load_tokenizer(tokenizer_dir)
  text = lambda ids: tok.decode(ids, skip_special_tokens=False)
  with_system = text(tok.encode_prompt("What is 2 + 2?", system="Answer briefly."))
  assert with_system.startswith("<|im_start|>system\nAnswer briefly.<|im_end|>")
  assert "What is 2 + 2?" in with_system
  own = [{"role": "system", "content": "Mine."}, {"role": "user", "content": "hi"}]
  assert "Answer briefly" not in text(tok.encode_prompt(own, system="Answer briefly."))
  # a template variable reaches the template (Qwen3's enable_thinking works this way)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    (tmp_path / name).write_bytes((tokenizer_dir / name).read_bytes())
  (tmp_path / "chat_template.jinja").write_text(
      "{{ messages[-1]['content'] }}{% if enable_thinking is defined and not enable_thinking %}"
      " /no_think{% endif %}")
  plain = models.load_tokenizer(tmp_path)
  assert plain.decode(plain.encode_prompt("hi", template_kwargs={"enable_thinking": False})) \
      == "hi /no_think"
  assert plain.decode(plain.encode_prompt("hi")) == "hi"


def test_a_malformed_template_kwargs_value_is_refused():
  from rlx.config import ConfigError, DataConfig

  assert DataConfig(chat_template_kwargs='{"enable_thinking": false}').template_kwargs == {
      "enable_thinking": False}
  for bad in ("enable_thinking=false", "[1]"):
    with pytest.raises(ConfigError, match="data.chat_template_kwargs"):
      DataConfig(chat_template_kwargs=bad)


def test_a_saved_model_keeps_its_generation_config(tokenizer_dir, tmp_path):
  # export once wrote none: a model whose generate() stops at eos 2 or 0 came back stopping at
  # 2 only, and lost its published sampling defaults
  source = tmp_path / "source"
  source.mkdir()
  for name in ("tokenizer.json", "tokenizer_config.json"):
    (source / name).write_bytes((tokenizer_dir / name).read_bytes())
  (source / "generation_config.json").write_text(json.dumps(
      {"eos_token_id": [2, 0], "temperature": 0.7, "top_p": 0.8, "do_sample": True}))
  saved = models.load_tokenizer(source).save_pretrained(tmp_path / "saved")
  written = json.loads((saved / "generation_config.json").read_text())
  assert written["eos_token_id"] == [2, 0]
  assert (written["temperature"], written["top_p"], written["do_sample"]) == (0.7, 0.8, True)
  assert models.load_tokenizer(saved).eos_ids == (2, 0)
  transformers = pytest.importorskip("transformers")
  loaded = transformers.GenerationConfig.from_pretrained(saved)
  assert loaded.eos_token_id == [2, 0] and loaded.temperature == 0.7
  # a model without one gets its eos and pad ids written
  builtin = models.builtin_tokenizer()
  written = json.loads((builtin.save_pretrained(tmp_path / "builtin") / "generation_config.json")
                       .read_text())
  assert written == {"eos_token_id": builtin.eos_id, "pad_token_id": builtin.pad_id}
