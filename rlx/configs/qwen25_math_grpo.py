"""GRPO on grade-school math: Qwen2.5-0.5B-Instruct (or 1.5B) on a GSM8K-format JSONL.

Each row is ``{"question": ..., "answer": "...rationale...\\n#### 72"}`` (GSM8K's own format:
``data.answer_format=gsm8k`` reads the number after ``####``); the ``math`` reward compares
the model's final answer with it (math-verify). Download the model and the data first
(rlx reads from disk only):

    huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct --local-dir models/Qwen2.5-0.5B-Instruct
    python -c "import datasets; [datasets.load_dataset('openai/gsm8k', 'main', split=s).to_json(f'data/gsm8k/{s}.jsonl') for s in ('train', 'test')]"
    python -m rlx.main --config configs/qwen25_math_grpo.py --workdir runs/qwen25-grpo \\
        [--config.model.path=models/Qwen2.5-1.5B-Instruct]

Hardware: 8 accelerators of 16 GB or more (GPU or TPU), FSDP over all 8, colocated.
GRPO's settings as the peers publish them: learning rate 1e-6 with 10 warm-up steps, 8
samples per prompt, 64 prompts per step, 4 optimizer steps per batch, 1024 new tokens, no
KL, bf16 compute with fp32 master weights, full remat. Checked with: the deviceless compile
of its learner step and decode at these shapes (``tests/test_recipes.py``, and
``python -m rlx.advise --target h100`` / ``v5e``); not yet trained on accelerators here.
"""

import dataclasses

from rlx.configs import _real as real


def get_config():
  config = real.real_model("qwen25_math_grpo", "models/Qwen2.5-0.5B-Instruct", real.QWEN25_05B,
                           max_prompt_len=512, max_new_tokens=1024, group_size=8,
                           prompts_per_step=64)
  return dataclasses.replace(
      config,
      data=dataclasses.replace(config.data, source="data/gsm8k/train.jsonl",
                               eval_source="data/gsm8k/test.jsonl", prompt_field="question",
                               answer_field="answer", answer_format="gsm8k",
                               system_prompt="Please reason step by step, and put your final "
                                             "answer within \\boxed{}."),
  )
