"""Sources and the prompt stream: fields, malformed rows (error naming file and line, or skip
and count), deterministic shuffles, epochs, checkpointable position, tokenization."""

import collections
import json
import random

import pytest

from rlx.data import DataError, JsonlSource, ParquetSource, PromptStream, TaskSource, open_source


def _jsonl(path, rows):
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
  return path


def test_jsonl_fields_and_random_access(tmp_path):
  path = _jsonl(tmp_path / "d.jsonl", [{"question": f"q{i}", "solution": i} for i in range(5)])
  source = JsonlSource(path, prompt_field="question", answer_field="solution")
  # every field is kept (for reward functions); the prompt and answer under their own names
  assert len(source) == 5 and source[3] == {"prompt": "q3", "answer": "3", "question": "q3",
                                              "solution": 3, "where": f"{path}:4"}


@pytest.mark.parametrize("bad, message", [
    ("{not json", "d.jsonl:3: not valid JSON"),
    ({"prompt": "p"}, "d.jsonl:3: missing field(s) 'answer'"),
    ({"prompt": "", "answer": 1}, "d.jsonl:3: field 'prompt' must be a non-empty string"),
    ([1, 2], "d.jsonl:3: expected a JSON object"),
])
def test_malformed_rows_are_named_or_skipped(tmp_path, bad, message):
  good = {"prompt": "p", "answer": "a"}
  path = _jsonl(tmp_path / "d.jsonl", [good, good, bad, good])
  with pytest.raises(DataError) as error:
    JsonlSource(path)
  assert message in str(error.value) and "on_bad_row=skip" in str(error.value)
  source = JsonlSource(path, on_bad_row="skip")
  assert len(source) == 3 and source.skipped == 1 and message in source.first_skipped


def test_a_field_the_first_row_lacks_points_at_the_config_not_at_skipping(tmp_path):
  # skipping rows without a misspelled prompt_field would skip every row
  path = _jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "a"}] * 3)
  for on_bad_row in ("error", "skip"):
    with pytest.raises(DataError) as error:
      JsonlSource(path, prompt_field="questoin", on_bad_row=on_bad_row)
    assert "config.data.prompt_field" in str(error.value)
    assert "on_bad_row" not in str(error.value) and "'question'" in str(error.value)


def test_a_missing_file_names_the_config_field_that_gave_it(tmp_path):
  from rlx.trainer.setup.prompts import named

  for field in ("data.source", "data.eval_source"):
    with pytest.raises(DataError, match=f"config.{field}=.*missing.jsonl.*does not exist"):
      named(open_source, field, str(tmp_path / "missing.jsonl"))


def test_parquet(tmp_path):
  pa = pytest.importorskip("pyarrow")
  import pyarrow.parquet as pq
  path = tmp_path / "d.parquet"
  pq.write_table(pa.table({"problem": ["a", None, "c"], "answer": ["1", "2", "3"]}), path)
  with pytest.raises(DataError, match="row 1: missing field"):
    ParquetSource(path, prompt_field="problem")
  source = ParquetSource(path, prompt_field="problem", on_bad_row="skip")
  assert [source[i]["prompt"] for i in range(len(source))] == ["a", "c"] and source.skipped == 1
  with pytest.raises(DataError, match="no column"):
    ParquetSource(path)


def test_open_source_refuses_unknown_sources(tmp_path):
  with pytest.raises(DataError, match="neither a built-in task"):
    open_source("prompts.csv")
  with pytest.raises(DataError, match="does not exist"):
    open_source(str(tmp_path / "missing.jsonl"))
  assert isinstance(open_source("countdown"), TaskSource)


def test_stream_is_deterministic_covers_epochs_and_resumes(tmp_path):
  rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(12)]
  source = JsonlSource(_jsonl(tmp_path / "d.jsonl", rows))
  prompts = lambda batch: [r["prompt"] for r in batch]
  first = [prompts(b) for b in PromptStream(source, batch_size=4, seed=3, num_epochs=2)]
  again = [prompts(b) for b in PromptStream(source, batch_size=4, seed=3, num_epochs=2)]
  other = [prompts(b) for b in PromptStream(source, batch_size=4, seed=4, num_epochs=2)]
  assert first == again and first != other
  assert len(first) == 6
  epoch1, epoch2 = sum(first[:3], []), sum(first[3:], [])
  assert sorted(epoch1) == sorted(epoch2) == sorted(r["prompt"] for r in rows)
  assert epoch1 != epoch2  # each epoch is a fresh shuffle
  stream = PromptStream(source, batch_size=4, seed=3)
  next(stream), next(stream)
  state = json.loads(json.dumps(stream.get_state()))  # survives a checkpoint
  expected = [prompts(next(stream)) for _ in range(3)]
  resumed = PromptStream(source, batch_size=4, seed=3)
  resumed.set_state(state)
  assert [prompts(next(resumed)) for _ in range(3)] == expected


@pytest.mark.parametrize("seed", range(6))
def test_a_state_with_rows_in_flight_resumes_each_row_once(tmp_path, seed):
  """A consumer that takes rows and uses them out of order (continuous admission: groups
  complete in any order), checkpointed at random moments and resumed from the last checkpoint
  after a crash, over several restarts and past an epoch: the rows used are the stream's
  first rows, each once, none lost, none twice."""
  rng = random.Random(seed)
  rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(40)]
  source = JsonlSource(_jsonl(tmp_path / "d.jsonl", rows))
  used, state, restarts = [], None, 0
  while True:  # one process's life, from the last checkpoint
    stream = PromptStream(source, batch_size=rng.choice([2, 3, 4]), seed=1)
    if state is not None:
      stream.set_state(json.loads(json.dumps(state)))
    flight: list[tuple[int, dict]] = []
    checkpoint_used = len(used)
    for _ in range(rng.randint(1, 12)):
      if len(flight) < 5 and rng.random() < 0.6:
        flight += stream.take(rng.randint(1, 3))
      elif flight:  # one in flight completes, any of them
        used.append(flight.pop(rng.randrange(len(flight)))[1]["prompt"])
      if rng.random() < 0.4:  # a checkpoint; what is in flight is pending
        state, checkpoint_used = stream.get_state(pending=[s for s, _ in flight]), len(used)
    if len(used) >= 60:  # the last life: everything in flight completes
      used += [row["prompt"] for _, row in flight]
      break
    del used[checkpoint_used:]  # a crash: what was used after the checkpoint is done again
    restarts += 1
  order = [r["prompt"] for b in PromptStream(source, batch_size=1, seed=1, num_epochs=3)
           for r in b]
  assert restarts and len(used) > 40
  assert collections.Counter(used) == collections.Counter(order[:len(used)])


def test_a_state_with_nothing_pending_is_the_dataset_position(tmp_path):
  """Batch by batch (nothing pending) the state is the dataset's own, as before (older
  checkpoints resume)."""
  source = JsonlSource(_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}", "answer": "1"}
                                                      for i in range(8)]))
  stream = PromptStream(source, batch_size=2, seed=0)
  next(stream)
  assert set(stream.get_state(pending=[1])) == {"rlx_used_after", "rlx_position"}
  assert stream.get_state() == stream._iterator.get_state()
  # another thread asking the position (the learner's, at its start) loses the producer none
  assert set(stream.get_state(pending=[1])) == {"rlx_used_after", "rlx_position"}


def test_shards_of_a_stream_split_the_rows_between_them(tmp_path):
  rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(12)]
  source = JsonlSource(_jsonl(tmp_path / "d.jsonl", rows))
  shards = [[r["prompt"] for batch in PromptStream(source, batch_size=2, seed=3, num_epochs=1,
                                                     shard=(i, 3)) for r in batch]
            for i in range(3)]
  assert [sorted(shard, key=lambda p: int(p[1:])) for shard in shards] == [
      [f"p{j}" for j in range(i, 12, 3)] for i in range(3)]
  with pytest.raises(ValueError, match="shard 3 of 3 does not exist"):
    PromptStream(source, batch_size=2, shard=(3, 3))


def test_stream_tokenizes_prompts():
  stream = PromptStream(TaskSource("arithmetic"), batch_size=2, encode=lambda text: [len(text)])
  batch = next(stream)
  assert all(row["prompt_tokens"] == [len(row["prompt"])] for row in batch)


@pytest.mark.parametrize("long_prompt", ["x" * 40, "y" * 100_000])
def test_an_over_long_prompt_is_a_bad_row_met_when_read(tmp_path, long_prompt):
  rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(7)]
  rows.insert(4, {"prompt": long_prompt, "answer": "0"})
  path = _jsonl(tmp_path / "d.jsonl", rows)
  encode = lambda text: [ord(c) for c in text]
  stream = PromptStream(JsonlSource(path), batch_size=2, num_epochs=1, encode=encode,
                        max_prompt_tokens=16)
  with pytest.raises(DataError, match=r"d.jsonl:5: the prompt has \d+ (tokens|characters), more "
                                      r"than config.rollout.max_prompt_len=16"):
    list(stream)
  stream = PromptStream(JsonlSource(path), batch_size=2, num_epochs=1, encode=encode,
                        max_prompt_tokens=16, on_bad_row="skip")
  batches = list(stream)
  read = [row["prompt"] for batch in batches for row in batch]
  assert len(read) == 6 and long_prompt not in read  # 7 good rows, batches of 2
  assert stream.skipped == 1 and "d.jsonl:5" in stream.first_skipped
  # over many epochs with read-ahead, the one bad row is still one row
  stream = PromptStream(JsonlSource(path), batch_size=2, num_epochs=20, encode=encode,
                        max_prompt_tokens=16, on_bad_row="skip")
  for _ in range(40):
    next(stream)
  assert stream.skipped == 1


def test_a_data_file_changed_or_deleted_mid_run_is_a_data_error(tmp_path):
  rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(8)]
  path = _jsonl(tmp_path / "d.jsonl", rows)
  source = JsonlSource(path)
  assert source[3]["prompt"] == "p3"
  _jsonl(path, [dict(row, prompt=row["prompt"] + "!") for row in rows])  # same rows, rewritten
  with pytest.raises(DataError, match="d.jsonl:4: .*changed while the run was reading it"):
    source[3]
  source = JsonlSource(path)
  path.unlink()
  stream = PromptStream(source, batch_size=2, encode=lambda text: [1])
  with pytest.raises(DataError, match="cannot read the data file .*went away"):
    next(stream)


def test_fingerprint_tells_a_changed_file(tmp_path):
  rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(4)]
  path = _jsonl(tmp_path / "d.jsonl", rows)
  before = JsonlSource(path).fingerprint()
  assert JsonlSource(path).fingerprint() == before
  _jsonl(path, rows[:3])
  assert JsonlSource(path).fingerprint() != before


def test_chat_message_prompts_go_through_the_chat_template(tmp_path):
  from rlx.models import builtin_tokenizer, load_tokenizer

  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
  path = _jsonl(tmp_path / "chat.jsonl", [{"messages": messages, "answer": "4", "id": 7}] * 2)
  source = JsonlSource(path, prompt_field="messages")
  assert source[0]["prompt"] == messages and source[0]["id"] == 7
  tokenizer = load_tokenizer("tests/fixtures/hf/qwen2")
  stream = PromptStream(source, batch_size=1, encode=tokenizer.encode_prompt)
  assert next(stream)[0]["prompt_tokens"] == tokenizer.apply_chat_template(messages)
  stream = PromptStream(source, batch_size=1, encode=builtin_tokenizer().encode_prompt)
  with pytest.raises(DataError, match="chat.jsonl:1: the prompt is a list of chat messages, but "
                                      "the tokenizer has no chat template"):
    next(stream)
  bad = _jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user"}], "answer": "4"}])
  with pytest.raises(DataError, match="bad.jsonl:1: field 'messages' holds a list, but not of "
                                      "chat messages"):
    JsonlSource(bad, prompt_field="messages")


def test_rows_without_an_answer_need_answer_field_empty(tmp_path):
  path = _jsonl(tmp_path / "code.jsonl", [{"prompt": "write f", "tests": ["assert f(1)"]}])
  with pytest.raises(DataError, match="answer_field=''"):
    JsonlSource(path)
  row = JsonlSource(path, answer_field="")[0]
  assert row["answer"] == "" and row["tests"] == ["assert f(1)"]


def test_gsm8k_answers_read_as_their_final_number(tmp_path):
  from rlx.data.sources import extract_answer, open_source

  rationale = "She sold 48 clips in April and half as many in May.\n48 + 24 = 72\n#### 1,072"
  assert extract_answer(rationale, "gsm8k") == "1072"
  assert extract_answer(rationale, "plain") == rationale
  assert extract_answer("72", "gsm8k") == "72"  # no '####': kept whole
  path = tmp_path / "gsm8k.jsonl"
  path.write_text(json.dumps({"question": "How many?", "answer": rationale}) + "\n")
  row = open_source(str(path), prompt_field="question", answer_format="gsm8k")[0]
  assert row["answer"] == "1072" and row["prompt"] == "How many?"


def test_a_data_file_deleted_mid_run_is_a_data_error_and_its_fingerprint_stays(tmp_path):
  # the save before stopping stat-ed the deleted file for its metadata: a raw traceback, and
  # the last completed step was not saved
  path = tmp_path / "d.jsonl"
  path.write_text('{"prompt": "1 + 1?", "answer": "2"}\n{"prompt": "2 + 2?", "answer": "4"}\n')
  source = JsonlSource(path)
  before = source.fingerprint()
  path.unlink()
  assert source.fingerprint() == before
  with pytest.raises(DataError, match="went away while the run was reading it"):
    source[1]
