"""What the real-model recipes share: the architectures of the models they name (so that a
deviceless compile checks them at their real shapes without the checkpoint; at run time the
checkpoint's own config.json is what counts), and the settings every recipe starts from."""

import dataclasses

from rlx.config import (AlgorithmConfig, ArchConfig, CheckpointConfig, DataConfig, MeshConfig,
                        ModelConfig, OptimizerConfig, RewardConfig, RolloutConfig, RunConfig,
                        TrainerConfig)

QWEN25_05B = ArchConfig(family="qwen2", vocab_size=151936, hidden_size=896,
                        intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2,
                        head_dim=64, qkv_bias=True, rope_theta=1e6, tie_word_embeddings=True,
                        max_position_embeddings=32768)
"""Qwen2.5-0.5B(-Instruct)'s config.json."""
QWEN25_15B = dataclasses.replace(QWEN25_05B, hidden_size=1536, intermediate_size=8960,
                                 num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128)
"""Qwen2.5-1.5B(-Instruct)'s config.json."""
QWEN3_17B = ArchConfig(family="qwen3", vocab_size=151936, hidden_size=2048,
                       intermediate_size=6144, num_layers=28, num_heads=16, num_kv_heads=8,
                       head_dim=128, qk_norm=True, rope_theta=1e6, tie_word_embeddings=True,
                       max_position_embeddings=40960)
"""Qwen3-1.7B's config.json."""


def real_model(name: str, path: str, arch: ArchConfig, *, max_prompt_len: int,
               max_new_tokens: int, group_size: int, prompts_per_step: int) -> RunConfig:
  """A bf16 model from ``path`` on 8 accelerators (FSDP, full remat), with the settings of
  the peers' published recipes: learning rate 1e-6 with warm-up, no supervised warm-up, a
  held-out evaluation every 25 steps, checkpoints every 50 and a Hugging Face export every
  100. The learner packs sequences: reasoning answers run from a few dozen tokens to the
  limit, and packed rows skip most of the padding."""
  return RunConfig(
      name=name,
      model=ModelConfig(path=path, arch=arch, dtype="bfloat16", param_dtype="float32",
                        remat="full"),
      rollout=RolloutConfig(max_slots=256, max_prompt_len=max_prompt_len,
                            max_new_tokens=max_new_tokens, group_size=group_size,
                            temperature=1.0),
      algorithm=AlgorithmConfig(name="grpo", kl_coef=0.0),
      optimizer=OptimizerConfig(learning_rate=1e-6, warmup_steps=10, weight_decay=0.01,
                                max_grad_norm=1.0),
      mesh=MeshConfig(mode="colocated", data=1, fsdp=-1, tensor=1),
      data=DataConfig(prompts_per_step=prompts_per_step),
      reward=RewardConfig(name="math", num_workers=8),
      checkpoint=CheckpointConfig(every_steps=50, export_hf_every=100),
      trainer=TrainerConfig(steps=500, eval_every=25, eval_prompts=500, eval_samples=8,
                            warmup_sft_steps=0, mini_batches=4, pack_sequences=True),
  )
