"""LoRA runs end to end: adapters trained on a frozen base, versions and checkpoints of the
adapters alone, PEFT and merged exports that give the policy's logits, a resume onto another
base refused naming both, and a generator that holds another base refused."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from rlx import cli, export, models
from rlx.checkpoint import CheckpointError
from rlx.models import lora
from rlx.sync import BaseMismatch, LoraSync, ReshardSync
from rlx.mesh import single_device_mesh
from rlx.trainer import train
from rlx.trainer.setup.policy_files import initial_adapters
from tests.trainer import tiny

LORA = ("--config.model.lora.rank=4", "--config.trainer.warmup_sft=never",
        "--config.checkpoint.every_steps=1", "--config.algorithm.entropy_coef=0.05")


def test_a_lora_run_trains_the_adapters_exports_them_and_refuses_another_base(tmp_path):
  config = tiny.config("grpo_colocated", "--config.trainer.steps=2", *LORA)
  (tmp_path / "config.json").write_text(cli.to_json(config))  # as rlx.main writes it
  train(config, tmp_path)
  rows = tiny.metrics(tmp_path)
  adapters_bytes = lora.nbytes(jax.eval_shape(lambda: lora.init_adapters(
      config.model.arch, config.model.lora, jax.random.key(0))))
  assert [row["sync/bytes"] for row in rows] == [adapters_bytes] * 2
  assert rows[-1]["optim/grad_norm"] > 0 and rows[-1]["policy/kl"] > 0  # the adapters moved
  # the generator's merged weights sample what the learner's unmerged adapters compute: a
  # merge at alpha instead of alpha / rank shows from the second step on
  assert all(row["rollout/mismatch_kl"] < 1e-6 for row in rows), rows
  final = tmp_path / "hf" / "final"
  assert json.loads((final / "adapter_config.json").read_text())["r"] == 4
  assert not (final / "model.safetensors").exists()
  # the exported adapter on the base, merged by the export, and the policy: the same logits
  merged = export.export(tmp_path, merged=True, say=lambda _: None)
  base = models.build_model(config.model)
  tokens = np.array([[5, 9, 17, 3, 40, 2]])
  adapters = lora.load_peft(tmp_path / "hf" / "step_2", base.arch, config.model.lora)
  ours = base.transformer(lora.combine(base.params, adapters), tokens)[0]
  assert float(np.abs(ours - base(tokens)).max()) > 0  # trained away from the base
  np.testing.assert_allclose(models.from_pretrained(merged)(tokens), ours, atol=1e-5)
  np.testing.assert_array_equal(lora.load_peft(final, base.arch, config.model.lora)["layers"]["v_lora_b"],
                                adapters["layers"]["v_lora_b"])
  # a new run starts from the exported adapter (model.lora.path)
  from_adapter = dataclasses.replace(config, model=dataclasses.replace(
      config.model, lora=dataclasses.replace(config.model.lora, path=str(final))))
  started = initial_adapters(from_adapter, base, single_device_mesh())
  jax.tree.map(np.testing.assert_array_equal, started, lora.load_peft(final, base.arch,
                                                                      config.model.lora))
  # resumed with another base (another seed of the built-in model): refused, naming both
  other = tiny.config("grpo_colocated", "--config.trainer.steps=3", "--config.model.seed=7", *LORA)
  with pytest.raises(CheckpointError, match=r"trained on the base the built-in model "
                     r"\(fingerprint \w+\), but this run's base is the built-in model"):
    train(other, tmp_path)
  # resumed with another alpha (it would rescale the trained adapters) or without LoRA: refused
  # in one line naming the field, before the state is read, and config.json stays the run's
  from rlx import main

  written = (tmp_path / "config.json").read_text()
  for change, named in (("--config.model.lora.alpha=8", "model.lora.alpha=32.0 then, 8.0 now"),
                        ("--config.model.lora.rank=0", "trained with LoRA rank 4, this run uses "
                                                       "full fine-tuning")):
    status = main.main(["--config", str(tiny.ROOT / "configs/grpo_colocated.py"), "--workdir",
                        str(tmp_path), *tiny.OVERRIDES, "--config.trainer.steps=3", *LORA, change])
    assert status == 2
    assert (tmp_path / "config.json").read_text() == written
  with pytest.raises(CheckpointError, match=named):
    train(tiny.config("grpo_colocated", "--config.trainer.steps=3", *LORA, change), tmp_path)


def test_a_generator_with_another_base_refuses_the_adapters(tmp_path):
  config = tiny.config("grpo_colocated", "--config.model.lora.rank=2")
  base = models.build_model(config.model).params
  adapters = lora.init_adapters(config.model.arch, config.model.lora, jax.random.key(0))
  shardings = jax.tree.map(lambda x: x.sharding, adapters)
  inner = ReshardSync(shardings)
  mine = {"path": "models/a", "fingerprint": "0123"}
  LoraSync(inner, base, 1.0, reference=mine, reference_file=tmp_path / "base.json").publish(adapters, 1)
  theirs = LoraSync(inner, base, 1.0, reference={"path": "models/b", "fingerprint": "4567"},
                    reference_file=tmp_path / "base.json")
  with pytest.raises(BaseMismatch, match="trained on the base models/a .fingerprint 0123.*"
                     "this generator holds models/b .fingerprint 4567"):
    theirs.latest()
  same = LoraSync(inner, base, 1.0, reference=mine, reference_file=tmp_path / "base.json")
  assert same.latest()[1] == 1
