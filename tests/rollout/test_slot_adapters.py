"""An engine whose slots each decode with their own LoRA adapter out of a bank: every prompt's
samples equal its samples decoded alone with its adapter, whatever shares the chunk."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx import rollout
from rlx.config import ArchConfig, LoraConfig
from rlx.models import init_model, lora
from rlx.rollout.engine import Engine

ARCH = ArchConfig(num_layers=2, vocab_size=48, hidden_size=32, intermediate_size=48, num_heads=4,
                  num_kv_heads=2, head_dim=8, eos_token_ids=(3,))
PROMPTS = [[5, 6, 7], list(range(10, 21)), [9], [30, 31, 32, 33, 34], [40, 41]]


def _adapter(seed: int, rank: int, targets=("q", "k", "v", "o", "gate", "up", "down")):
  """An adapter that moves the model: A as initialised, B random (a fresh one's is zero)."""
  config = LoraConfig(rank=rank, alpha=2.0 * rank, targets=targets)
  tree = lora.init_adapters(ARCH, config, jax.random.key(seed))
  keys = iter(jax.random.split(jax.random.key(seed + 100), len(tree["layers"])))
  tree = {"layers": {name: (jax.random.normal(next(keys), x.shape) * 0.5
                            if name.endswith("_lora_b") else x)
                     for name, x in tree["layers"].items()}}
  return tree, config.alpha / rank


@pytest.fixture(scope="module")
def model():
  model = init_model(ARCH, jax.random.key(0))
  return model.replace(params=jax.tree.map(lambda p: p * 4.0 if p.ndim > 1 else p, model.params))


@pytest.fixture(scope="module")
def adapters():
  # uneven ranks and targets: the bank pads ranks and fills missing targets with zeros
  return [_adapter(1, 4), _adapter(2, 8, ("q", "v", "down")), _adapter(3, 2, ("gate", "up"))]


def _alone(model, prompt, index, tree, scale, **options):
  """Prompt ``index``'s samples decoded alone, its adapter merged into the base (or none)."""
  params = model.params if tree is None else lora.merge(model.params, tree, scale)
  return rollout.generate(model, [prompt], params=params, first_prompt_index=index, **options)


def test_every_slot_decodes_with_its_own_adapter(model, adapters):
  ids = [0, 1, 2, -1, 1]  # -1: the base alone
  bank = lora.bank(model.params, adapters)
  # 25 requests on 16 slots, stopping on token 3: slots refill, and chunks compact the
  # decoding slots into the narrowest width (the ids move with them)
  options = dict(n=5, max_new_tokens=12, temperature=1.0, seed=7, stop_token_ids=[3])
  together = rollout.generate(model, PROMPTS, params=bank, adapters=ids, max_slots=16, **options)
  for index, (prompt, adapter) in enumerate(zip(PROMPTS, ids)):
    tree, scale = adapters[adapter] if adapter >= 0 else (None, 1.0)
    alone = _alone(model, prompt, index, tree, scale, **options)
    mine = [c for c in together if c.prompt_index == index]
    assert [c.response_tokens for c in mine] == [c.response_tokens for c in alone], index
    np.testing.assert_allclose(np.concatenate([c.logprobs for c in mine]),
                               np.concatenate([c.logprobs for c in alone]), atol=2e-5)


def test_adapters_change_what_a_slot_samples(model, adapters):
  """Guards the test above against adapters too weak to matter: each one's greedy answer to
  the same prompt differs from the base's."""
  prompt = PROMPTS[1]
  bank = lora.bank(model.params, adapters)
  answers = rollout.generate(model, [prompt] * 4, params=bank, adapters=[-1, 0, 1, 2], n=1,
                             max_new_tokens=8, temperature=0.0, stop_token_ids=[])
  base = answers[0].response_tokens
  assert all(a.response_tokens != base for a in answers[1:])


def test_the_bank_path_equals_the_unmerged_adapters(model, adapters):
  """Prefill logits through the bank, row by row, equal each row's own unmerged adapter."""
  engine = Engine(model.transformer, max_slots=4, max_len=32, max_prompt_len=16,
                  slot_adapters=True)
  tokens = np.zeros((4, 16), np.int32)
  for row, prompt in enumerate(PROMPTS[:4]):
    tokens[row, :len(prompt)] = prompt
  lengths = np.array([len(p) for p in PROMPTS[:4]], np.int32)
  ids = np.array([2, 0, -1, 1], np.int32)
  banked = engine.prefill(lora.bank(model.params, adapters), tokens, lengths, ids).logits
  plain = dataclasses.replace(engine, slot_adapters=False)
  for row, adapter in enumerate(ids):
    transformer = model.transformer
    params = model.params
    if adapter >= 0:
      tree, scale = adapters[adapter]
      transformer = dataclasses.replace(transformer, lora_scale=scale)
      params = lora.combine(params, tree)
    own = dataclasses.replace(plain, transformer=transformer).prefill(params, tokens, lengths)
    np.testing.assert_allclose(banked[row], own.logits[row], rtol=1e-5, atol=1e-5)


def test_a_bank_without_adapter_ids_is_refused(model, adapters):
  bank = lora.bank(model.params, adapters)
  with pytest.raises(ValueError, match="no row names its adapter"):
    model.transformer.hidden_states(bank, jnp.zeros((1, 4), jnp.int32))
  engine = Engine(model.transformer, max_slots=4, max_len=32, max_prompt_len=16)
  with pytest.raises(ValueError, match="slot_adapters=True"):
    rollout.generate(engine, [[5, 6]], params=bank, adapters=[0], max_new_tokens=2)
