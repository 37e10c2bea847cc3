"""Hugging Face checkpoints: logits equal transformers', save -> load round trips, clear refusals."""

import json
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlx import models
from rlx.models import hf
from rlx.models.safetensors_io import SafetensorsReader
from tests.conftest import HF_FAMILIES


def _expected(directory):
  data = np.load(directory / "expected.npz")
  return data["tokens"], data["mask"], data["logits"]


@pytest.mark.parametrize("family", HF_FAMILIES)
@pytest.mark.parametrize("attention", ["fused", "reference"])
def test_logits_match_transformers(hf_dir, family, attention):
  tokens, mask, expected = _expected(hf_dir(family))
  model = models.from_pretrained(hf_dir(family), attention=attention)
  assert model.arch.family == family
  logits = model(tokens, mask)
  assert logits.dtype == jnp.float32 and logits.shape == expected.shape
  # Padded positions are garbage in both implementations; compare real tokens.
  np.testing.assert_allclose(np.asarray(logits)[mask], expected[mask], atol=1e-4, rtol=1e-4)
  # Without padding the mask may be omitted.
  np.testing.assert_allclose(np.asarray(model(tokens[:1]))[0], expected[0], atol=1e-4, rtol=1e-4)


def test_family_features_are_read(hf_dir):
  llama = models.from_pretrained(hf_dir("llama")).arch
  assert (llama.rope_scaling, llama.rope_factor, llama.rope_original_max_len) == ("llama3", 8.0, 64)
  assert not llama.tie_word_embeddings and llama.eos_token_ids == (2, 3)
  qwen2 = models.from_pretrained(hf_dir("qwen2")).arch
  assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.tie_word_embeddings
  qwen3 = models.from_pretrained(hf_dir("qwen3")).arch
  assert qwen3.qk_norm and qwen3.head_dim * qwen3.num_heads != qwen3.hidden_size


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_save_then_load_round_trip(hf_dir, tmp_path, family):
  original = models.from_pretrained(hf_dir(family))
  models.save_pretrained(original, tmp_path)
  # Same tensor names, shapes and values as the transformers checkpoint.
  theirs, ours = SafetensorsReader(hf_dir(family)), SafetensorsReader(tmp_path)
  assert ours.names() == theirs.names()
  for name in theirs.names():
    np.testing.assert_array_equal(ours.get(name), theirs.get(name), err_msg=name)
  # The config keeps what matters to transformers.
  saved, source = (json.loads((d / "config.json").read_text()) for d in (tmp_path, hf_dir(family)))
  assert saved["architectures"] == source["architectures"]
  assert hf.arch_from_hf(saved) == hf.arch_from_hf(source)
  reloaded = models.from_pretrained(tmp_path)
  chex.assert_trees_all_equal(reloaded.params, original.params)


def test_save_in_several_files_with_an_index(hf_dir, tmp_path):
  model = models.from_pretrained(hf_dir("llama"))
  models.save_pretrained(model, tmp_path, max_shard_bytes=100_000)
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  assert len(set(index["weight_map"].values())) > 1
  assert not (tmp_path / "model.safetensors").exists()
  chex.assert_trees_all_equal(models.from_pretrained(tmp_path).params, model.params)


def test_bfloat16_load_and_save(hf_dir, tmp_path):
  tokens, mask, expected = _expected(hf_dir("qwen3"))
  model = models.from_pretrained(hf_dir("qwen3"), dtype="bfloat16")
  assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(model.params))
  logits = np.asarray(model(tokens, mask))
  assert logits.dtype == np.float32
  np.testing.assert_allclose(logits[mask], expected[mask], atol=3e-2)
  models.save_pretrained(model, tmp_path)
  assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
  assert SafetensorsReader(tmp_path).get("model.norm.weight").dtype == jnp.bfloat16


def test_missing_tensor_is_refused(hf_dir, tmp_path):
  source = hf_dir("qwen3")
  shutil.copy(source / "config.json", tmp_path / "config.json")
  reader = SafetensorsReader(source)
  from safetensors.numpy import save_file
  kept = {n: np.asarray(reader.get(n)) for n in reader.names() if "layers.1.mlp.up_proj" not in n}
  save_file(kept, str(tmp_path / "model.safetensors"))
  with pytest.raises(models.CheckpointError, match=r"missing tensors model\.layers\.1\.mlp\.up_proj"):
    models.from_pretrained(tmp_path)


def test_shape_mismatch_is_refused(hf_dir, tmp_path):
  shutil.copytree(hf_dir("llama"), tmp_path, dirs_exist_ok=True)
  config = json.loads((tmp_path / "config.json").read_text())
  config["intermediate_size"] = 64
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(models.CheckpointError, match="disagree"):
    models.from_pretrained(tmp_path)


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "unsupported architecture"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "rope scaling 'yarn'"),
    ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'dynamic'"),
])
def test_unsupported_configs_are_refused(hf_dir, tmp_path, change, message):
  shutil.copytree(hf_dir("qwen2"), tmp_path, dirs_exist_ok=True)
  config = json.loads((tmp_path / "config.json").read_text())
  config.update(change)
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(models.CheckpointError, match=message):
    models.from_pretrained(tmp_path)


def _truncate(path, keep):
  data = path.read_bytes()
  path.write_bytes(data[:keep(len(data))])


def _drop_key(path, key):
  config = json.loads(path.read_text())
  del config[key]
  path.write_text(json.dumps(config))


@pytest.mark.parametrize("damage, file, message", [
    (lambda d: _truncate(d / "model-00002-of-00004.safetensors", lambda n: n // 2),
     "model-00002-of-00004.safetensors", "is truncated"),
    (lambda d: _truncate(d / "model-00002-of-00004.safetensors", lambda n: 20),
     "model-00002-of-00004.safetensors", "not a readable safetensors file"),
    (lambda d: (d / "config.json").write_text("{not json"), "config.json", "not valid JSON"),
    (lambda d: _drop_key(d / "config.json", "hidden_size"), "config.json", "'hidden_size'"),
    (lambda d: (d / "model.safetensors.index.json").write_text("{"),
     "model.safetensors.index.json", "not valid JSON"),
    (lambda d: (d / "tokenizer.json").write_text("{}"), "tokenizer.json", "not a tokenizer"),
    (lambda d: (d / "tokenizer_config.json").write_text("{oops"), "tokenizer_config.json",
     "not valid JSON"),
])
def test_a_damaged_model_directory_names_the_file(hf_dir, tmp_path, damage, file, message):
  shutil.copytree(hf_dir("qwen2"), tmp_path, dirs_exist_ok=True)
  damage(tmp_path)
  with pytest.raises(models.CheckpointError, match=f"{tmp_path / file} .*{message}.*fetch the "
                                                   "model again"):
    models.from_pretrained(tmp_path)
    models.load_tokenizer(tmp_path)


def test_not_a_model_directory(tmp_path):
  with pytest.raises(models.CheckpointError, match="no config.json"):
    models.from_pretrained(tmp_path)


def test_transformers_loads_what_rlx_saves(hf_dir, tmp_path):
  """Runs where torch and transformers are installed (not in CI)."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  for family in HF_FAMILIES:
    tokens, mask, expected = _expected(hf_dir(family))
    models.save_pretrained(models.from_pretrained(hf_dir(family)), tmp_path / family)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / family).eval()
    with torch.no_grad():
      logits = theirs(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(int)),
                      position_ids=torch.tensor(np.maximum(np.cumsum(mask, 1) - 1, 0))).logits
    np.testing.assert_allclose(logits.numpy()[mask], expected[mask], atol=1e-5)


def _full_conversion(tensor, tmap):
  return np.asarray(tensor).reshape(tmap.split).transpose(tmap.perm)


@pytest.mark.parametrize("seed", range(4))
def test_partial_reads_equal_slicing_the_converted_tensor(seed):
  """The per-shard read (what each device copies out of the file) against converting the
  whole tensor and slicing it, for random blocks of every kind of mapping."""
  rng = np.random.default_rng(seed)
  arch = hf.ArchConfig(vocab_size=12, hidden_size=8, intermediate_size=10, num_layers=1,
                       num_heads=4, num_kv_heads=2, head_dim=6, qkv_bias=True, qk_norm=False,
                       tie_word_embeddings=False)
  maps = jax.tree.leaves(hf.tensor_maps(arch), is_leaf=lambda x: isinstance(x, hf._TensorMap))
  for tmap in maps:
    tensor = rng.normal(size=tmap.hf_shape).astype(np.float32)
    ours_shape = tuple(tmap.split[d] for d in tmap.perm)
    index = []
    for size in ours_shape:
      parts = rng.choice([1, 2]) if size % 2 == 0 else 1
      which = rng.integers(parts)
      index.append(slice(which * size // parts, (which + 1) * size // parts))
    index = tuple(index)
    np.testing.assert_array_equal(hf._hf_block(tensor, tmap, index),
                                  _full_conversion(tensor, tmap)[index], err_msg=tmap.name)


def test_a_hub_id_is_told_to_download_first(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(models.CheckpointError, match="huggingface-cli download Qwen/Qwen2.5-0.5B"):
    models.from_pretrained("Qwen/Qwen2.5-0.5B-Instruct")
