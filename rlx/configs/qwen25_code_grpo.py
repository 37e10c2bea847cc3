"""GRPO on code with Qwen2.5-1.5B-Instruct: each sampled program runs against the row's
assert tests in the code sandbox and scores the fraction it passes.

Each JSONL row: ``{"prompt": "Write a function ...", "tests": ["assert f(1) == 2", ...]}``
(MBPP's ``text`` / ``test_list`` fit with ``--config.data.prompt_field=text
--config.reward.code_tests_field=test_list``).

    huggingface-cli download Qwen/Qwen2.5-1.5B-Instruct --local-dir models/Qwen2.5-1.5B-Instruct
    python -m rlx.main --config configs/qwen25_code_grpo.py --workdir runs/qwen25-code \\
        --config.data.source=data/mbpp/train.jsonl

Hardware: 8 accelerators of 40 GB or more; the sandbox needs Linux user namespaces on the
hosts. Checked with: the deviceless compile of its learner step and decode at these shapes
(``tests/test_recipes.py``); not yet trained on accelerators here.
"""

import dataclasses

from rlx.configs import _real as real


def get_config():
  config = real.real_model("qwen25_code_grpo", "models/Qwen2.5-1.5B-Instruct", real.QWEN25_15B,
                           max_prompt_len=768, max_new_tokens=1024, group_size=8,
                           prompts_per_step=32)
  return dataclasses.replace(
      config,
      algorithm=dataclasses.replace(config.algorithm, dynamic_sampling=True, clip_eps_high=0.28),
      data=dataclasses.replace(config.data, source="data/code/train.jsonl", answer_field=""),
      reward=dataclasses.replace(config.reward, name="code", code_scoring="fraction",
                                 code_timeout_s=5.0, timeout_s=10.0),
      trainer=dataclasses.replace(config.trainer, eval_samples=0),
  )
