"""Tools: schemas from hints and docstrings, the call parsers of each format, and hostile tools
in the workers: each failure is an observation, counted, and the run goes on."""

import concurrent.futures
import functools
import pathlib
import time
from typing import Literal

import pytest

from rlx.envs import MalformedCall, ToolCall, ToolRunner, Toolbox, parse, schema
from rlx.envs.calls import bind

HOSTILE = "tests.envs.hostile_tools"


def lookup(query: str, limit: int = 3, mode: Literal["fast", "exact"] = "fast",
           tags: list[str] | None = None) -> str:
  """Looks something up.

  Args:
    query: what to look for.
    limit: how many results,
      at most.
    mode: how hard to look.
  """
  return query


def test_schema_from_hints_and_docstring():
  got = schema(lookup)["function"]
  assert got["name"] == "lookup" and got["description"] == "Looks something up."
  props = got["parameters"]["properties"]
  assert props["query"] == {"type": "string", "description": "what to look for."}
  assert props["limit"] == {"type": "integer", "description": "how many results, at most."}
  assert props["mode"]["enum"] == ["fast", "exact"]
  assert props["tags"] == {"type": "array", "items": {"type": "string"}}
  assert got["parameters"]["required"] == ["query"]


def test_schema_refuses_what_it_cannot_describe():
  def untyped(x):
    """Doc."""
  def undocumented(x: str) -> str:
    return x
  with pytest.raises(ValueError, match="type hint"):
    schema(untyped)
  with pytest.raises(ValueError, match="no docstring"):
    schema(undocumented)


def test_partial_tools_hide_their_fixed_arguments():
  box = Toolbox.of([functools.partial(lookup, limit=1)])
  assert "limit" not in box.schemas[0]["function"]["parameters"]["properties"]
  assert box.bound == {"lookup": {"limit": 1}} and "limit" not in box.parameters["lookup"]


@pytest.mark.parametrize("text, calls", [
    ('<call>calculator("12*3")</call>', [ToolCall("calculator", {"*": ["12*3"]})]),
    ('a<call>f(1, b="x")</call>b<call>g()</call>', [ToolCall("f", {"*": [1], "b": "x"}),
                                                      ToolCall("g", {})]),
    ("<answer>3</answer>", []),
])
def test_builtin_calls(text, calls):
  assert parse(text, "builtin") == calls


def test_qwen_and_llama_calls():
  qwen = ('I will look.\n<tool_call>\n{"name": "lookup", "arguments": {"query": "x"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "echo", "arguments": "{\\"x\\": 1}"}\n</tool_call>')
  assert parse(qwen, "qwen") == [ToolCall("lookup", {"query": "x"}), ToolCall("echo", {"x": 1})]
  llama = '<|python_tag|>{"name": "lookup", "parameters": {"query": "y"}}<|eom_id|>'
  assert parse(llama, "llama") == [ToolCall("lookup", {"query": "y"})]
  assert parse("The answer is 4.", "llama") == [] == parse("no call", "qwen")


@pytest.mark.parametrize("text, format", [
    ("<call>calculator(</call>", "builtin"), ("<call>calculator(x)</call>", "builtin"),
    ('<call>f("a")', "builtin"), ("<tool_call>{not json}</tool_call>", "qwen"),
    ('<tool_call>{"name": "f"}', "qwen"), ('{"parameters": {}}', "llama"),
])
def test_malformed_calls_say_what_is_wrong(text, format):
  with pytest.raises(MalformedCall):
    parse(text, format)


def test_bind_matches_positional_arguments_and_refuses_unknown_ones():
  assert bind(ToolCall("f", {"*": ["q"], "limit": 2}), ["query", "limit"]) == {"query": "q",
                                                                               "limit": 2}
  with pytest.raises(MalformedCall, match="no parameter"):
    bind(ToolCall("f", {"nope": 1}), ["query"])


def test_hostile_tools_become_observations_and_the_runner_goes_on(tmp_path):
  marker = tmp_path / "orphan-wrote-this"
  # 8 s: a loaded machine (two CI workers and their runs) may take seconds to import a tool in
  # a fresh worker
  with ToolRunner(num_workers=2, timeout_s=8.0, memory_mb=1024, max_chars=100) as runner:
    results = {name: runner.call(f"{HOSTILE}:{name}", {"x": str(marker)}) for name in
               ("raises", "hangs", "exits", "floods", "not_text", "forks", "hogs")}
    assert results["raises"].status == "error" and "tool broke" in results["raises"].text
    assert results["hangs"].status == "timeout" and results["hangs"].seconds < 16
    assert results["exits"].status == "error" and "died" in results["exits"].text
    assert results["floods"].status == "ok" and len(results["floods"].text) < 200
    assert "cut" in results["floods"].text
    assert results["not_text"].status == "error" and "not text" in results["not_text"].text
    assert results["forks"].status == "ok"
    assert results["hogs"].status == "error"
    # the workers were replaced: calls still work
    assert runner.call(f"{HOSTILE}:echo", {"x": "still here"}).text == "still here"
    assert runner.call("no_such_module:f", {}).status == "error"
  time.sleep(4.5)
  assert not marker.exists(), "a process the tool left behind outlived its call"


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, not yet reaped
  except OSError:
    return False


def test_a_tool_that_forks_cannot_answer_another_call_and_leaves_nothing_behind(tmp_path):
  # the forked copies once went on serving later calls (116 of 251 results went to the wrong
  # call), and setsid children outlived a worker killed on a timeout
  with ToolRunner(num_workers=2, timeout_s=3.0) as runner:
    for i in range(12):
      assert runner.call(f"{HOSTILE}:forks_and_returns", {"x": str(i)}).text == f"forked {i}"
      assert runner.call(f"{HOSTILE}:echo", {"x": f"echo {i}"}).text == f"echo {i}"
    pidfile = tmp_path / "pid"
    assert runner.call(f"{HOSTILE}:spawns_and_hangs", {"x": str(pidfile)}).status == "timeout"
    spawned = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while _alive(spawned) and time.monotonic() < deadline:
      time.sleep(0.1)
    assert not _alive(spawned), "a setsid child outlived its killed worker"
    assert runner.call(f"{HOSTILE}:echo", {"x": "after"}).text == "after"


_FAILS_WITH_AN_OPEN_RUNNER = f"""
import threading
from rlx.envs import ToolRunner

if __name__ == "__main__":
  runner = ToolRunner(num_workers=2, timeout_s=600)
  assert runner.call("{HOSTILE}:echo", {{"x": "up"}}).text == "up"
  threading.Thread(target=runner.call, args=("{HOSTILE}:hangs", {{"x": ""}}), daemon=True).start()
  raise RuntimeError("the environment's reset failed")
"""


def test_a_process_that_fails_with_its_runner_open_exits(tmp_path):
  # the workers ignore SIGTERM, and multiprocessing's exit handler terminated them with it and
  # joined them: a failed run whose runner was never closed waited forever (one worker idle,
  # one in a call that never returns)
  import os
  import subprocess
  import sys

  script = tmp_path / "fails.py"
  script.write_text(_FAILS_WITH_AN_OPEN_RUNNER)
  root = str(pathlib.Path(__file__).parents[2])
  started = time.monotonic()
  result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60, cwd=root, env={**os.environ, "PYTHONPATH": root})
  assert result.returncode == 1, result.stderr[-2000:]
  assert "the environment's reset failed" in result.stderr
  assert time.monotonic() - started < 30


def test_a_call_reports_its_wait_for_a_free_worker_apart_from_its_run():
  with (ToolRunner(num_workers=1, timeout_s=10.0) as runner,
        concurrent.futures.ThreadPoolExecutor(2) as pool):
    first = pool.submit(runner.call, f"{HOSTILE}:sleeps", {"x": "0.6"})
    time.sleep(0.05)  # the first holds the only worker
    second = pool.submit(runner.call, f"{HOSTILE}:sleeps", {"x": "0.6"})
    a, b = first.result(), second.result()
  assert a.status == b.status == "ok"
  assert a.waited < 0.2 and b.waited > 0.3  # most of the first's 0.6 s
  # its run alone: as long as the first's (however loaded the machine), not that plus its wait
  assert b.seconds > 0.5 and abs(b.seconds - a.seconds) < 0.25, (a, b)
