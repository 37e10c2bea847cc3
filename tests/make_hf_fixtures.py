"""Writes the tiny Hugging Face checkpoints and expected outputs under tests/fixtures/hf/.

Needs torch and transformers (the tests themselves do not); run it once and
commit what it writes:

    pip install torch transformers
    python tests/make_hf_fixtures.py

For each family (llama, qwen2, qwen3) it saves a random tiny model with
``transformers`` and, in ``expected.npz``, a batch of tokens (one row
left-padded), its mask, its positions and the float32 logits that
``transformers`` computes. It also trains a tiny BPE tokenizer with a ChatML
template and records what ``transformers`` renders and encodes with it.
"""

import json
import pathlib

import numpy as np
import tokenizers
import torch
import transformers

OUT = pathlib.Path(__file__).parent / "fixtures" / "hf"
VOCAB = 320  # above the tokenizer's 300 ids, as real models pad their vocabulary

FAMILIES = {
    # Llama 3.x: GQA, untied embeddings, llama3 rope scaling over all three bands.
    "llama": transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=[2, 3],
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        rope_theta=10000.0),
    # Qwen2.5: q/k/v biases, tied embeddings, GQA.
    "qwen2": transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1000000.0, bos_token_id=1,
        eos_token_id=2),
    # Qwen3: q/k RMSNorm, head_dim (24) independent of hidden_size / heads (16).
    "qwen3": transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, head_dim=24, max_position_embeddings=128,
        rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=1000000.0, bos_token_id=1,
        eos_token_id=2),
}

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def make_model(family: str, config) -> None:
  torch.manual_seed({"llama": 0, "qwen2": 1, "qwen3": 2}[family])
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
  with torch.no_grad():  # non-trivial norms and biases, so a mix-up cannot hide
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
      elif name.endswith("bias"):
        p.copy_(0.1 * torch.randn_like(p))
  directory = OUT / family
  # qwen2 is written in several files, to cover model.safetensors.index.json.
  model.save_pretrained(directory, max_shard_size="100KB" if family == "qwen2" else "50MB")
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, VOCAB, size=(2, 12))
  mask = np.ones_like(tokens, dtype=bool)
  mask[1, :5] = False  # left padding
  tokens[1, :5] = 0
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
  with torch.no_grad():
    logits = model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)),
                   position_ids=torch.tensor(positions)).logits.float().numpy()
  np.savez(directory / "expected.npz", tokens=tokens, mask=mask, positions=positions, logits=logits)


def make_tokenizer(directory: pathlib.Path) -> None:
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  backend = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=300, special_tokens=specials,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  corpus = ["What is 12 + 30? The answer is 42.", "user assistant system",
            "Sort the numbers 5 3 9 1 in ascending order.", "Countdown: reach 24 with 3 4 6 8."] * 50
  backend.train_from_iterator(corpus, trainer)
  backend.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
      "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML,
      "model_max_length": 128}, indent=2))
  (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
  # Re-save through transformers, so the files are what it writes for a Qwen2 model
  # (its pre-tokenizer split, the chat template in its own file).
  transformers.AutoTokenizer.from_pretrained(directory).save_pretrained(directory)
  hf_tok = transformers.AutoTokenizer.from_pretrained(directory)
  messages = [{"role": "system", "content": "Answer briefly."},
              {"role": "user", "content": "What is 12 + 30?"}]
  text = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
  ids = hf_tok(text, add_special_tokens=False)["input_ids"]
  plain = hf_tok("Sort the numbers 5 3 9 1.")["input_ids"]
  (directory / "expected_tokenizer.json").write_text(json.dumps({
      "messages": messages, "chat_text": text, "chat_ids": ids, "plain_text": "Sort the numbers 5 3 9 1.",
      "plain_ids": plain, "eos_id": hf_tok.eos_token_id, "pad_id": hf_tok.pad_token_id}, indent=2))


def main():
  for family, config in FAMILIES.items():
    make_model(family, config)
  make_tokenizer(OUT / "qwen2")
  print(f"wrote {sorted(p.name for p in OUT.iterdir())} under {OUT}")


if __name__ == "__main__":
  main()
