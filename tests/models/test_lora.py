"""LoRA: fresh adapters are the base, unmerged equals merged (plain and cached forwards), only
the adapters get gradients and optimizer state (in the compiled step's memory too), the PEFT
format round-trips, adapter-only sync generates what a full sync does."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx import update
from rlx.config import ArchConfig, LoraConfig, ModelConfig, RunConfig
from rlx.models import Transformer, init_model, lora
from rlx.models.safetensors_io import CheckpointError, SafetensorsReader
from rlx.rollout import generate
from rlx.sync import LoraSync, ReshardSync
from rlx.types import RolloutBatch

ARCH = ArchConfig(family="qwen2", num_layers=2, vocab_size=64, hidden_size=32,
                  intermediate_size=48, num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True,
                  tie_word_embeddings=False)
EVERY = LoraConfig(rank=4, alpha=8.0)


def _random_adapters(config=EVERY, seed=1, scale=0.2):
  adapters = lora.init_adapters(ARCH, config, jax.random.key(seed))
  keys = iter(jax.random.split(jax.random.key(seed + 100), 64))
  return jax.tree.map(lambda x: scale * jax.random.normal(next(keys), x.shape), adapters)


@pytest.fixture(scope="module")
def base():
  return init_model(ARCH, jax.random.key(0)).params


def _tokens(seed=0, shape=(3, 9)):
  return jax.random.randint(jax.random.key(seed), shape, 0, ARCH.vocab_size)


def test_fresh_adapters_leave_the_model_exactly_the_base(base):
  transformer = Transformer(ARCH, lora_scale=EVERY.scale)
  adapters = lora.init_adapters(ARCH, EVERY, jax.random.key(3))
  assert jnp.all(adapters["layers"]["q_lora_b"] == 0) and jnp.any(adapters["layers"]["q_lora_a"] != 0)
  forward = jax.jit(lambda params: transformer(params, _tokens())[0])
  np.testing.assert_array_equal(forward(lora.combine(base, adapters)), forward(base))


@pytest.mark.parametrize("targets", [("q", "k", "v", "o", "gate", "up", "down"), ("v", "down")])
def test_the_unmerged_forward_equals_the_merged_one(base, targets):
  config = LoraConfig(rank=4, alpha=8.0, targets=targets)
  adapters = _random_adapters(config)
  transformer = Transformer(ARCH, lora_scale=config.scale)
  combined, merged = lora.combine(base, adapters), lora.merge(base, adapters, config.scale)
  tokens, mask = _tokens(), jnp.arange(9)[None] >= jnp.array([[0], [2], [4]])  # left padding
  forward = jax.jit(lambda params: transformer(params, tokens, mask)[0])
  unmerged = forward(combined)
  assert float(jnp.abs(unmerged - forward(base)).max()) > 1e-2  # the adapters change it
  np.testing.assert_allclose(unmerged, forward(merged), atol=2e-5)

  @functools.partial(jax.jit, static_argnums=1)
  def cached(params, layout):  # prefill, then one decode step through the cache
    cache = transformer.init_cache(3, 16, layout)
    logits, cache = transformer(params, tokens, mask, cache)
    return jnp.concatenate([logits, transformer(params, tokens[:, :1], None, cache)[0]], 1)

  for layout in ("stacked", "per_layer"):
    np.testing.assert_allclose(cached(combined, layout), cached(merged, layout), atol=2e-5,
                               err_msg=layout)


def _config(lora_config=EVERY, **trainer):
  config = RunConfig()
  return dataclasses.replace(
      config, model=dataclasses.replace(config.model, lora=lora_config),
      trainer=dataclasses.replace(config.trainer, **trainer),
      optimizer=dataclasses.replace(config.optimizer, learning_rate=1e-2),
      rollout=dataclasses.replace(config.rollout, max_new_tokens=10))


def _batch(seed=0, rows=4, length=10):
  rng = np.random.default_rng(seed)
  response = np.arange(length)[None] >= 3
  return RolloutBatch(
      tokens=jnp.asarray(rng.integers(0, ARCH.vocab_size, (rows, length))),
      attention_mask=jnp.ones((rows, length), bool), response_mask=jnp.asarray(response.repeat(rows, 0)),
      advantages=jnp.asarray(np.where(response, rng.normal(size=(rows, 1)), 0.0), jnp.float32),
      old_logprobs=None, behaviour_logprobs=jnp.full((rows, length), -4.0),
      policy_version=jnp.zeros(rows, jnp.int32))


def test_only_the_adapters_get_gradients_and_optimizer_state(base):
  config = _config()
  transformer = Transformer(ARCH, lora_scale=EVERY.scale)
  adapters = _random_adapters()
  optimizer, _ = update.make_optimizer(config.optimizer, total_steps=10)
  state = update.init_train_state(adapters, optimizer, jax.random.key(0))
  assert jax.tree.structure(state.opt_state[1][0].mu) == jax.tree.structure(adapters)
  loss, grads, _ = jax.jit(update.loss_and_grads, static_argnames=("config", "transformer"))(
      adapters, _batch(), 0.0, frozen=base, config=config, transformer=transformer)
  assert jax.tree.structure(grads) == jax.tree.structure(adapters)
  assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))
  before = jax.tree.map(np.asarray, base)
  step = update.make_update_step(config, transformer, optimizer)
  new, metrics = step(state, _batch(), frozen=base)
  assert int(metrics["train/skipped"]) == 0 and int(new.policy_version) == 1
  assert float(jnp.abs(new.params["layers"]["q_lora_b"] - adapters["layers"]["q_lora_b"]).max()) > 0
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, base), before)


def test_the_compiled_lora_step_holds_no_gradient_or_state_of_the_base():
  """In the compiled step's memory: the LoRA step's outputs are the adapters' state alone and
  its temporaries lack the base-sized gradient and moments the full step has."""
  arch = dataclasses.replace(ARCH, hidden_size=128, intermediate_size=384, num_heads=8,
                             num_kv_heads=4, head_dim=16, vocab_size=512)
  config = _config(LoraConfig(rank=2, alpha=4.0))
  transformer = Transformer(arch, lora_scale=1.0)
  params = jax.eval_shape(lambda: transformer.init(jax.random.key(0)))
  adapters = jax.eval_shape(lambda: lora.init_adapters(arch, config.model.lora, jax.random.key(0)))
  optimizer, _ = update.make_optimizer(config.optimizer, total_steps=10)
  base_bytes = lora.nbytes(params)
  batch = jax.eval_shape(_batch)
  scalar = jax.ShapeDtypeStruct((), jnp.float32)

  def memory(trainable, frozen):
    state = jax.eval_shape(lambda p: update.TrainState(
        step=jnp.zeros((), jnp.int32), params=p, opt_state=optimizer.init(p),
        key=jax.random.key(0), policy_version=jnp.zeros((), jnp.int32)), trainable)
    step = update.make_update_step(config, transformer, optimizer)
    compiled = step.jitted.lower(state, batch, scalar, scalar, scalar, frozen, None).compile()
    return compiled.memory_analysis()

  full, low = memory(params, None), memory(adapters, params)
  assert full.output_size_in_bytes > 3 * base_bytes  # params and Adam's two moments
  assert low.output_size_in_bytes < 0.1 * base_bytes
  assert low.argument_size_in_bytes < 1.1 * base_bytes  # the base once, beside tiny adapters
  assert low.temp_size_in_bytes < full.temp_size_in_bytes - 0.9 * base_bytes


def test_the_peft_format_round_trips(base, tmp_path):
  adapters = _random_adapters()
  lora.save_peft(adapters, ARCH, EVERY, tmp_path, base_path="models/base")
  config = json.loads((tmp_path / "adapter_config.json").read_text())
  assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"
  assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                             "up_proj", "down_proj"])
  reader = SafetensorsReader(tmp_path, weights="adapter_model.safetensors")
  name = "base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight"
  assert tuple(reader.get(name).shape) == (4, 32)  # [r, in = heads x head_dim]
  assert tuple(reader.get(name.replace("lora_A", "lora_B")).shape) == (32, 4)  # [out = D, r]
  assert tuple(reader.get("base_model.model.model.layers.0.mlp.up_proj.lora_B.weight").shape) == (48, 4)
  loaded = lora.load_peft(tmp_path, ARCH, EVERY)
  jax.tree.map(np.testing.assert_array_equal, loaded, adapters)
  forward = jax.jit(lambda params: Transformer(ARCH, lora_scale=EVERY.scale)(params, _tokens())[0])
  np.testing.assert_array_equal(forward(lora.combine(base, loaded)),
                                forward(lora.combine(base, adapters)))
  with pytest.raises(CheckpointError, match=r"rank r=4 \(model.lora.rank=8\)"):
    lora.load_peft(tmp_path, ARCH, LoraConfig(rank=8))
  with pytest.raises(CheckpointError, match="target_modules"):
    lora.load_peft(tmp_path, ARCH, LoraConfig(rank=4, alpha=8.0, targets=("q", "v")))


def test_adapter_only_sync_generates_what_a_full_sync_does(base):
  model = init_model(ARCH, jax.random.key(0))
  adapters = _random_adapters(scale=0.5)
  shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)
  full = ReshardSync(shardings(base))
  full.publish(lora.merge(base, adapters, EVERY.scale), 3)
  small = LoraSync(ReshardSync(shardings(adapters)), base, EVERY.scale)
  small.publish(adapters, 3)
  assert small.last_bytes == lora.nbytes(adapters) < full.last_bytes / 5
  (theirs, version), (ours, _) = small.latest(), full.latest()
  assert version == 3 and small.latest() [0] is theirs  # merged once per version
  prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
  runs = [generate(model, prompts, n=2, max_new_tokens=6, seed=5, params=params,
                   stop_token_ids=[]) for params in (theirs, ours)]
  assert [c.response_tokens for c in runs[0]] == [c.response_tokens for c in runs[1]]
  np.testing.assert_allclose([c.logprobs for c in runs[0]], [c.logprobs for c in runs[1]],
                             atol=1e-5)
  assert small.latest(newer_than=3) is None


def test_lora_config_errors():
  from rlx.config import ConfigError
  with pytest.raises(ConfigError, match="model.lora.targets.*choose from"):
    LoraConfig(rank=4, targets=("qkv",))
  with pytest.raises(ConfigError, match="model.lora.path.*rank > 0"):
    LoraConfig(path="adapter")
  with pytest.raises(ConfigError, match="model.lora.dropout"):
    LoraConfig(rank=4, dropout=1.0)
  assert not ModelConfig().lora.enabled and LoraConfig(rank=16, alpha=32).scale == 2.0


def test_peft_loads_the_exported_adapter_with_rlx_s_logits(hf_dir, tmp_path):
  """Runs where torch, transformers and peft are installed (the bench extra; not in CI)."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  peft = pytest.importorskip("peft")
  from rlx import models
  from tests.conftest import HF_FAMILIES

  config = LoraConfig(rank=4, alpha=16.0)
  tokens = np.array([[3, 17, 42, 8, 99, 5, 23], [64, 2, 11, 7, 30, 1, 50]])
  for family in HF_FAMILIES:
    model = models.from_pretrained(hf_dir(family))
    adapters = lora.init_adapters(model.arch, config, jax.random.key(4))
    keys = iter(jax.random.split(jax.random.key(5), 64))
    adapters = jax.tree.map(lambda x: 0.1 * jax.random.normal(next(keys), x.shape), adapters)
    lora.save_peft(adapters, model.arch, config, tmp_path / family, base_path=str(hf_dir(family)))
    ours = Transformer(model.arch, lora_scale=config.scale)(
        lora.combine(model.params, adapters), jnp.asarray(tokens))[0]
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir(family))
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / family).eval()
    with torch.no_grad():
      logits = theirs(input_ids=torch.tensor(tokens)).logits.numpy()
    assert np.abs(np.asarray(ours) - np.asarray(model(tokens))).max() > 1e-3, family  # adapted
    np.testing.assert_allclose(logits, ours, atol=1e-4, err_msg=family)


def test_dropout_acts_on_the_adapters_input_in_the_loss_forward_only(base):
  config = _config(LoraConfig(rank=4, alpha=8.0, dropout=0.5))
  transformer = Transformer(ARCH, lora_scale=config.model.lora.scale, lora_dropout=0.5)
  adapters = _random_adapters()
  loss = jax.jit(lambda key: update.microbatch_loss(
      adapters, _batch(), 1.0, 0.0, frozen=base, dropout_key=key, config=config,
      transformer=transformer)[0])
  plain = jax.jit(lambda: update.microbatch_loss(
      adapters, _batch(), 1.0, 0.0, frozen=base, config=config,
      transformer=Transformer(ARCH, lora_scale=config.model.lora.scale))[0])()
  dropped = [float(loss(jax.random.key(k))) for k in range(2)]
  assert dropped[0] != dropped[1] and float(plain) not in dropped  # a fresh mask per key
  assert float(loss(None)) == pytest.approx(float(plain), rel=1e-6)  # no key: no dropout


def test_a_rank_past_the_projections_own_is_refused_naming_the_field():
  # rank 100000 was accepted and allocated adapters larger than the model
  smallest = min(ARCH.hidden_size, ARCH.num_kv_heads * ARCH.head_dim)  # k and v's outputs
  assert lora.adapter_specs(ARCH, LoraConfig(rank=smallest, targets=("k",)))
  with pytest.raises(ValueError, match=r"config.model.lora.rank=100000 exceeds the rank of the"):
    lora.adapter_specs(ARCH, LoraConfig(rank=100000))
  with pytest.raises(ValueError, match=f"of the k projection \\({smallest}"):
    lora.adapter_specs(ARCH, LoraConfig(rank=smallest + 1, targets=("k",)))
