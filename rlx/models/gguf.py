"""A GGUF file (llama.cpp's format) as a Hugging Face model directory, without torch.

    rlx.models.gguf.convert("SmolLM2-135M-Instruct.Q4_1.gguf", "models/SmolLM2-135M-Instruct")

writes ``config.json``, ``generation_config.json``, ``model.safetensors`` (float32),
``tokenizer.json`` and ``tokenizer_config.json`` (special tokens and the chat template), which
``rlx.models.from_pretrained`` and ``transformers`` both read. Quantized tensors are
dequantized with the ``gguf`` package's numpy kernels: the weights are the quantized model's,
not the original release's (a Q4_1 file gives Q4_1-rounded float32 weights).

Two things llama.cpp's converter changed are undone here:

- q and k projections: llama.cpp interleaves each head's rotary halves (its rope pairs
  neighbouring dims, Hugging Face's pairs dim ``i`` with ``i + head_dim / 2``); the rows are
  permuted back per head.
- the tokenizer: GGUF keeps the BPE vocabulary, merges and token types, and names the
  pre-tokenizer (``tokenizer.ggml.pre``); the ``tokenizers`` pipeline is rebuilt from them.

Only Llama-architecture files with a GPT-2-style byte-level BPE tokenizer are read (SmolLM,
Llama 3); anything else is refused by name.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np

from rlx.models.safetensors_io import CheckpointError

# llama.cpp's pre-tokenizer names -> the split that precedes byte-level BPE. "smollm" (SmolLM,
# StarCoder) splits every digit on its own, as the released tokenizer.json does.
_PRE_TOKENIZERS = {
    "smollm": "digits",
    "starcoder": "digits",
    "default": "none",
    "gpt-2": "none",
}


def _field(reader, key: str, default: Any = None) -> Any:
  field = reader.fields.get(key)
  return default if field is None else field.contents()


def _unpermute_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
  """Undoes llama.cpp's per-head interleave of a q/k projection's ``[heads * head_dim, in]``
  rows: its rows ``(h, j, half)`` go back to ``(h, half, j)``."""
  half = weight.shape[0] // heads // 2
  return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


REQUIRED_FIELDS = ("llama.attention.head_count", "llama.embedding_length",
                   "llama.feed_forward_length", "llama.block_count", "tokenizer.ggml.tokens")
"""The metadata ``hf_config`` cannot do without."""


def hf_config(reader) -> dict[str, Any]:
  """The ``config.json`` of a Llama GGUF file."""
  arch = _field(reader, "general.architecture")
  if arch != "llama":
    raise CheckpointError(f"GGUF architecture {arch!r} is not supported (rlx reads 'llama' GGUF "
                          "files; for Qwen use the Hugging Face release)")
  get = lambda key, default=None: _field(reader, f"llama.{key}", default)  # noqa: E731
  for key in REQUIRED_FIELDS:
    if _field(reader, key) is None:
      raise CheckpointError(f"the GGUF file's metadata has no {key!r}, which a Llama model "
                            "needs: the file is incomplete or not a llama.cpp conversion")
  heads = int(get("attention.head_count"))
  hidden = int(get("embedding_length"))
  tokens = _field(reader, "tokenizer.ggml.tokens")
  names = {t.name for t in reader.tensors}
  config = {
      "architectures": ["LlamaForCausalLM"],
      "model_type": "llama",
      "vocab_size": int(get("vocab_size", len(tokens))),
      "hidden_size": hidden,
      "intermediate_size": int(get("feed_forward_length")),
      "num_hidden_layers": int(get("block_count")),
      "num_attention_heads": heads,
      "num_key_value_heads": int(get("attention.head_count_kv", heads)),
      "head_dim": int(get("rope.dimension_count", hidden // heads)),
      "hidden_act": "silu",
      "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
      "rope_theta": float(get("rope.freq_base", 10000.0)),
      "max_position_embeddings": int(get("context_length", 4096)),
      "tie_word_embeddings": "output.weight" not in names,
      "attention_bias": False,
      "mlp_bias": False,
      "torch_dtype": "float32",
      "use_cache": True,
  }
  if get("rope.scaling.type") not in (None, "none"):
    raise CheckpointError(f"GGUF rope scaling {get('rope.scaling.type')!r} is not supported")
  for key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                        ("pad_token_id", "padding_token_id")):
    value = _field(reader, f"tokenizer.ggml.{gguf_key}")
    if value is not None:
      config[key] = int(value)
  return config


_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(name: str) -> str:
  """A GGUF tensor's Hugging Face name (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``)."""
  if name in _TENSOR_NAMES:
    return _TENSOR_NAMES[name]
  parts = name.split(".")
  if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
  raise CheckpointError(f"GGUF tensor {name!r} has no Llama counterpart")


def hf_tensors(reader, config: dict[str, Any]) -> dict[str, np.ndarray]:
  """Every tensor, dequantized to float32, under its Hugging Face name and in torch's
  ``[out, in]`` layout (GGUF's numpy view already is: its shapes list the fastest dim first)."""
  from gguf import quants

  tensors = {}
  for tensor in reader.tensors:
    if tensor.name.startswith("rope_freqs"):
      continue  # llama.cpp's precomputed rope factors: rlx computes them from the config
    weight = np.asarray(quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
    if ".attn_q." in tensor.name:
      weight = _unpermute_rotary(weight, config["num_attention_heads"])
    elif ".attn_k." in tensor.name:
      weight = _unpermute_rotary(weight, config["num_key_value_heads"])
    tensors[hf_name(tensor.name)] = weight
  return tensors


def hf_tokenizer(reader):
  """The ``tokenizers.Tokenizer`` of a GGUF file with a GPT-2-style (byte-level BPE) vocabulary."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, processors

  kind = _field(reader, "tokenizer.ggml.model")
  if kind != "gpt2":
    raise CheckpointError(f"GGUF tokenizer {kind!r} is not supported (rlx reads byte-level BPE, "
                          "'gpt2', tokenizers)")
  pre = _field(reader, "tokenizer.ggml.pre", "default")
  if pre not in _PRE_TOKENIZERS:
    raise CheckpointError(f"GGUF pre-tokenizer {pre!r} is not supported (supported: "
                          f"{', '.join(sorted(_PRE_TOKENIZERS))})")
  tokens = list(_field(reader, "tokenizer.ggml.tokens"))
  types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
  merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
  backend = tokenizers.Tokenizer(models.BPE(
      vocab={token: i for i, token in enumerate(tokens)}, merges=merges, fuse_unk=False,
      byte_fallback=False))
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True,
                                        use_regex=True)
  backend.pre_tokenizer = (pre_tokenizers.Sequence([
      pre_tokenizers.Digits(individual_digits=True), byte_level])
      if _PRE_TOKENIZERS[pre] == "digits" else byte_level)
  backend.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
  backend.post_processor = processors.ByteLevel(trim_offsets=False)
  # GGUF token types: 3 is CONTROL (special), 4 USER_DEFINED (added, not special).
  backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                              for t, kind in zip(tokens, types) if kind == 3])
  added = [tokenizers.AddedToken(t, special=False, normalized=False)
           for t, kind in zip(tokens, types) if kind == 4]
  if added:
    backend.add_tokens(added)
  return backend


def convert(gguf_file: str | pathlib.Path, out: str | pathlib.Path) -> pathlib.Path:
  """Writes the Hugging Face directory of a Llama GGUF file; returns it."""
  from gguf import GGUFReader
  from safetensors.numpy import save_file

  gguf_file, directory = pathlib.Path(gguf_file), pathlib.Path(out)
  if not gguf_file.is_file():
    raise CheckpointError(f"{gguf_file} does not exist")
  try:
    reader = GGUFReader(str(gguf_file))
  except Exception as error:  # noqa: BLE001 - the reader's errors for a bad file vary by field
    raise CheckpointError(f"{gguf_file} is not a readable GGUF file ({type(error).__name__}: "
                          f"{error})") from None
  try:
    config = hf_config(reader)
  except CheckpointError as error:
    raise CheckpointError(f"{gguf_file}: {error}") from None
  directory.mkdir(parents=True, exist_ok=True)
  tensors = hf_tensors(reader, config)
  save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
  del tensors
  backend = hf_tokenizer(reader)
  backend.save(str(directory / "tokenizer.json"))
  tokens = _field(reader, "tokenizer.ggml.tokens")
  special = lambda key: (tokens[int(v)] if (v := _field(reader, key)) is not None  # noqa: E731
                         else None)
  tokenizer_config = {
      "tokenizer_class": "PreTrainedTokenizerFast",
      "bos_token": special("tokenizer.ggml.bos_token_id"),
      "eos_token": special("tokenizer.ggml.eos_token_id"),
      "pad_token": special("tokenizer.ggml.padding_token_id"),
      "unk_token": special("tokenizer.ggml.unknown_token_id"),
      "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
      "clean_up_tokenization_spaces": False,
      "model_max_length": config["max_position_embeddings"],
  }
  template = _field(reader, "tokenizer.chat_template")
  if template is not None:
    tokenizer_config["chat_template"] = template
  (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
  (directory / "config.json").write_text(json.dumps(config, indent=2))
  generation = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")
                if key in config}
  (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
  (directory / "SOURCE.md").write_text(
      f"Converted by rlx.models.gguf from {gguf_file.name}: every weight is the GGUF file's, "
      "dequantized to float32 (a quantized file's rounding included), not the original "
      "release's.\n")
  return directory
