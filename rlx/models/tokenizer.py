"""Tokenizer of a Hugging Face model directory: ``tokenizer.json`` plus its special tokens
and chat template, without ``transformers``.

    tok = rlx.models.load_tokenizer("path/to/model")
    ids = tok.apply_chat_template([{"role": "user", "content": "2+2?"}])
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from rlx.models.safetensors_io import CheckpointError, read_json


class Tokenizer:
  """A ``tokenizers.Tokenizer`` with bos/eos/pad ids and the model's chat template."""

  def __init__(self, backend: tokenizers.Tokenizer, *, bos_token: str | None = None,
               eos_token: str | None = None, pad_token: str | None = None,
               chat_template: str | None = None, extra_eos_ids: Sequence[int] = (),
               generation_config: dict[str, Any] | None = None):
    self.backend = backend
    self.bos_token, self.eos_token = bos_token, eos_token
    self.pad_token = pad_token if pad_token is not None else eos_token
    self.chat_template = chat_template
    self.bos_id = self._id(bos_token)
    self.eos_id = self._id(eos_token)
    self.pad_id = self._id(self.pad_token)
    ids = [self.eos_id] if self.eos_id is not None else []
    self.eos_ids = tuple(dict.fromkeys([*ids, *extra_eos_ids]))
    """Every id that ends a response: the eos token and the generation config's eos ids."""
    self.generation_config = dict(generation_config or {})
    """The model's ``generation_config.json`` as read (its published sampling defaults too)."""

  def _id(self, token: str | None) -> int | None:
    if token is None:
      return None
    token_id = self.backend.token_to_id(token)
    if token_id is None:
      raise CheckpointError(f"special token {token!r} is not in the tokenizer's vocabulary")
    return token_id

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                  **kwargs) -> str:
    """The chat template applied to ``messages``, as text (Hugging Face's Jinja semantics)."""
    if self.chat_template is None:
      raise ValueError("this tokenizer has no chat template; encode the prompt as plain text")
    return _compile(self.chat_template).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt,
        bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)

  def apply_chat_template(self, messages: Sequence[dict[str, Any]],
                          add_generation_prompt: bool = True, **kwargs) -> list[int]:
    """Token ids of the rendered chat; the template writes its own special tokens."""
    return self.encode(self.render_chat(messages, add_generation_prompt, **kwargs),
                       add_special_tokens=False)

  def save_pretrained(self, path: str | pathlib.Path) -> pathlib.Path:
    """Writes ``tokenizer.json`` and ``tokenizer_config.json`` (special tokens, chat template),
    which ``load_tokenizer`` and ``transformers`` read back."""
    directory = pathlib.Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    self.backend.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": self.bos_token,
              "eos_token": self.eos_token, "pad_token": self.pad_token}
    if self.chat_template is not None:
      config["chat_template"] = self.chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (directory / "generation_config.json").write_text(json.dumps(self.exported_generation_config(),
                                                                 indent=2))
    return directory

  def exported_generation_config(self) -> dict[str, Any]:
    """The generation config a saved model carries: the one read, its special ids updated to
    this tokenizer's (every eos id, so that ``generate`` stops where rlx's rollouts stopped)."""
    config = dict(self.generation_config)
    if self.eos_ids:
      config["eos_token_id"] = self.eos_ids[0] if len(self.eos_ids) == 1 else list(self.eos_ids)
    for key, value in (("bos_token_id", self.bos_id), ("pad_token_id", self.pad_id)):
      if value is not None:
        config[key] = value
    return config

  def encode_prompt(self, prompt: str | Sequence[dict[str, Any]], system: str = "",
                    template_kwargs: dict | None = None) -> list[int]:
    """A prompt as ids: plain text as a user message through the chat template (as it is
    when there is none), or a list of chat messages through the chat template. ``system``:
    a system message first (unless the messages start with their own; without a template,
    plain text and a blank line before the prompt); ``template_kwargs``: the template's extra
    variables (Qwen3's ``enable_thinking``)."""
    if isinstance(prompt, str):
      if self.chat_template is None:
        return self.encode(f"{system}\n\n{prompt}" if system else prompt)
      prompt = [{"role": "user", "content": prompt}]
    elif self.chat_template is None:
      raise ValueError("the prompt is a list of chat messages, but the tokenizer has no chat "
                       "template to render them; use a model whose tokenizer_config.json has "
                       "one, or plain-text prompts")
    if system and (not prompt or prompt[0].get("role") != "system"):
      prompt = [{"role": "system", "content": system}, *prompt]
    return self.apply_chat_template(prompt, **(template_kwargs or {}))


def _raise(message: str):
  raise jinja2.exceptions.TemplateError(message)


def _compile(template: str) -> jinja2.Template:
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
      x, indent=indent, ensure_ascii=ensure_ascii)
  env.globals["raise_exception"] = _raise
  env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
  return env.from_string(template)


def _token_text(value: Any) -> str | None:
  """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
  if isinstance(value, dict):
    return value.get("content")
  return value


def load_tokenizer(path: str | pathlib.Path) -> Tokenizer:
  """Reads ``tokenizer.json``, the special tokens of ``tokenizer_config.json`` and the
  chat template (``chat_template.jinja`` or the config's ``chat_template``)."""
  directory = pathlib.Path(path)
  file = directory / "tokenizer.json"
  if not file.is_file():
    raise CheckpointError(f"{directory} has no tokenizer.json (only fast tokenizers are supported)")
  try:
    backend = tokenizers.Tokenizer.from_file(str(file))
  except Exception as error:  # noqa: BLE001 - the tokenizers library raises plain Exception
    raise CheckpointError(f"{file} is not a tokenizer rlx can read ({error}); the download is "
                          "incomplete or the file was damaged: fetch the model again") from None
  config_file = directory / "tokenizer_config.json"
  config = read_json(config_file) if config_file.is_file() else {}
  template = config.get("chat_template")
  if isinstance(template, list):  # named templates: take the default one
    template = next((t["template"] for t in template if t.get("name") == "default"), None)
  if (directory / "chat_template.jinja").is_file():
    template = (directory / "chat_template.jinja").read_text()
  generation_file = directory / "generation_config.json"
  generation = read_json(generation_file) if generation_file.is_file() else {}
  eos = generation.get("eos_token_id")
  extra_eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
  return Tokenizer(backend, bos_token=_token_text(config.get("bos_token")),
                   eos_token=_token_text(config.get("eos_token")),
                   pad_token=_token_text(config.get("pad_token")), chat_template=template,
                   extra_eos_ids=extra_eos, generation_config=generation)


BUILTIN_SPECIALS = ("<|pad|>", "<|eos|>")
BUILTIN_TAGS = ("<answer>", "</answer>", "<call>", "</call>", "<result>", "</result>")


def builtin_tokenizer() -> Tokenizer:
  """The built-in model's tokenizer: one token per printable ASCII character and newline, plus
  pad and eos, and the answer and tool-call tags as single (non-special) tokens. No chat
  template."""
  import string

  vocab = {token: i for i, token in enumerate(
      [*BUILTIN_SPECIALS, *BUILTIN_TAGS, *string.printable[:95], "\n"])}
  backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=" "))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."), "isolated")
  backend.decoder = tokenizers.decoders.Fuse()
  backend.add_special_tokens(list(BUILTIN_SPECIALS))
  backend.add_tokens(list(BUILTIN_TAGS))
  return Tokenizer(backend, eos_token="<|eos|>", pad_token="<|pad|>")
