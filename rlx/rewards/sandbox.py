"""The ``code`` reward: a response's program, run against its row's tests in a sandbox.

    code_reward(response, row, options)   # {"reward", "correct", "tests_passed"}
    run_tests(program, tests, ...)         # RunResult: passed per test, exit status, output
    capabilities()                          # which isolation this system provides

The program is the last fenced code block of the response (a response without one scores
0). Tests are assert statements, or stdin/stdout pairs (the program run once per input, in
a fresh interpreter, its output compared line by line, trailing whitespace aside).

The sandbox never judges. The expected outputs never enter it: it returns the program's
outputs, and for assert tests the values of the expressions that call the program, as plain
data (built-in types only, read here by a strict decoder). This process compares them and
evaluates the asserts (``rlx.rewards.checker``), or, for an assert beyond its evaluator, a
second sandbox does, one that holds the values but no line of the program. A program that
reaches into the harness, patches the assert machinery, returns objects that claim to equal
anything, or prints what a passing run would print passes nothing.

Isolation (see ``_jail.py``, which builds it): each run is its own process tree in fresh
mount, network, PID, IPC and UTS namespaces, with a tmpfs as its root (``pivot_root``; the
host's tree is unmounted) that holds only the interpreter's read-only directories and the
program's size-capped ``/sandbox``; it runs as
an unprivileged uid of its own with no new privileges, rlimits on CPU seconds, address
space, file size, open files and processes, a seccomp filter against the system calls
that would widen its world (new namespaces, mount, ptrace, bpf...), and an empty
environment; a wall-clock timeout
kills its whole process group, and the namespace's processes die with it; its output is
captured and capped. A system where namespaces cannot be created (no root and no
unprivileged user namespaces) refuses the ``code`` reward with ``SandboxUnavailable``
instead of running programs unconfined.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import pathlib
import re
import secrets
import selectors
import signal
import subprocess
import sys
import tempfile
import time

from rlx.rewards import checker
from rlx.rewards.jail_scripts import CHECK as _CHECK, HARNESS as _HARNESS
from rlx.rewards.jail_scripts import OUTPUT_CAP as _OUTPUT_CAP
from rlx.rewards.jail_scripts import SETUP as _SETUP
from rlx.rewards.limits import (_PROCESSES_WITHOUT_CGROUP, _RunCgroup, memory_cgroup,
                                memory_limit)

_JAIL = pathlib.Path(__file__).with_name("_jail.py")
_FENCE = re.compile(r"```[ \t]*([\w+.-]*)[ \t]*\r?\n(.*?)```", re.DOTALL)
_RESULTS_CAP = 16 * 2**20  # bytes of the values the jail reports (a probe's large result)
_PROGRAM_CAP = 64 * 1024  # characters of a program; a longer one scores 0 unrun
_UID_BASE, _UIDS = 200_000, 100_000  # each run's uid: its own, so rlimits never add up


class SandboxUnavailable(RuntimeError):
  """This system cannot isolate a program; the message says what is missing."""


@dataclasses.dataclass
class RunResult:
  """What a sandboxed run did."""

  passed: list[bool]
  """One per test, in order: whether the harness saw it pass."""
  status: int | None
  """The jail's exit status (the program's; 128 + signal when killed); None after a timeout."""
  timed_out: bool
  stdout: bytes
  stderr: bytes
  truncated: bool
  """The program wrote more than the output cap and was stopped."""
  seconds: float
  uid: int
  """The uid the program ran as on the host (without root: the caller's own)."""


def extract_program(response: str) -> str | None:
  """The last fenced code block of ``response``, or None."""
  blocks = _FENCE.findall(response)
  return blocks[-1][1] if blocks else None


def normalize_tests(tests) -> list[dict]:
  """Tests as ``[{"assert": str}]`` or ``[{"input": str, "output": str}]`` from the forms a row
  may hold: a list of assert statements, a list of {"input", "output"} pairs, or
  {"inputs": [...], "outputs": [...]}; ValueError for anything else."""
  if isinstance(tests, str):
    tests = json.loads(tests)
  if isinstance(tests, dict) and "inputs" in tests and "outputs" in tests:
    if len(tests["inputs"]) != len(tests["outputs"]):
      raise ValueError(f"tests have {len(tests['inputs'])} inputs but "
                       f"{len(tests['outputs'])} outputs")
    tests = [{"input": i, "output": o} for i, o in zip(tests["inputs"], tests["outputs"])]
  if not isinstance(tests, list) or not tests:
    raise ValueError("tests must be a non-empty list of assert statements or of "
                     '{"input", "output"} pairs, or {"inputs": [...], "outputs": [...]}')
  normalized = []
  for test in tests:
    if isinstance(test, str):
      normalized.append({"assert": test})
    elif isinstance(test, dict) and "input" in test and "output" in test:
      normalized.append({"input": _text(test["input"]), "output": _text(test["output"])})
    else:
      raise ValueError(f"a test must be an assert statement or an {{'input', 'output'}} pair, "
                       f"got {str(test)[:80]!r}")
  return normalized


def check_rows(rows, options) -> None:
  """Raises ValueError, naming the row and the fix, when a row the ``code`` reward would score
  has no tests, malformed tests, or an assert the trusted checker cannot split (run at the
  start of a run on a sample of its rows: a test that can never pass is a bug in the data,
  not a reward of 0 every step)."""
  for row in rows:
    where = row.get("where", "a row")
    if options.tests_field not in row:
      raise ValueError(f"reward.name=code: {where} has no field {options.tests_field!r} with "
                       f"tests (its fields: {', '.join(map(repr, row))}); set "
                       "config.reward.code_tests_field to the field that holds them, or use "
                       "another reward")
    try:
      tests = normalize_tests(row[options.tests_field])
      for test in tests:
        if "assert" in test:
          plan = checker.plan_asserts(test["assert"])
          if test_arguments(test["assert"], plan, timeout_s=options.timeout_s,
                            memory_mb=options.memory_mb) is None:
            raise ValueError(f"the test {test['assert'][:200]!r} gives the program an input "
                             "that raises or is not plain data (numbers, text, containers, "
                             "dates...): write it out")
    except SyntaxError as error:
      raise ValueError(f"reward.name=code: {where}: a test does not parse: {error}") from None
    except ValueError as error:
      raise ValueError(f"reward.name=code: {where}: {error}") from None


def _text(value) -> str:
  return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def code_reward(response: str, row: dict, options) -> dict:
  """The ``code`` reward of one response: the share of its row's tests the program passes
  (``options.scoring='all'``: 1 only when every test passes); correct when all pass."""
  field = options.tests_field
  if field not in row:
    raise ValueError(f"{row.get('where', 'the row')} has no field {field!r} with tests; set "
                     "config.reward.code_tests_field")
  tests = normalize_tests(row[field])
  program = extract_program(response)
  if program is None or len(program) > _PROGRAM_CAP:
    return {"reward": 0.0, "correct": False, "tests_passed": 0.0, "ran": 0.0, "timed_out": 0.0}
  result = run_tests(program, tests, timeout_s=options.timeout_s, memory_mb=options.memory_mb)
  share = sum(result.passed) / len(tests)
  every = all(result.passed)
  reward = share if options.scoring == "fraction" else float(every)
  return {"reward": reward, "correct": every, "tests_passed": share, "ran": 1.0,
          "timed_out": float(result.timed_out)}


def _python() -> tuple[str, str]:
  """The base interpreter (never a virtualenv's launcher) and its prefix."""
  executable = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
  return executable, sys.base_prefix


def _binds(prefix: str) -> list[str]:
  paths = ["/usr", "/bin", "/lib", "/lib64", "/lib32", "/libx32"]
  if not any(prefix == p or prefix.startswith(p + "/") for p in paths):
    paths.append(prefix)
  return paths


_ARGUMENTS: collections.OrderedDict[str, dict | None] = collections.OrderedDict()
_ARGUMENTS_KEPT = 4096  # tests whose arguments are remembered (a row's tests recur every epoch)


def test_arguments(test: str, plan: checker.AssertPlan, *, timeout_s: float = 3.0,
                   memory_mb: int = 512) -> dict | None:
  """What the probes of ``test`` take from it, as literals for the program's sandbox
  (``{name: source}``): computed by the trusted evaluator, or, where the test's setup needs
  more (a helper it defines), in a jail that holds no line of the program; remembered per test.
  None when the test's inputs raise or are not plain data: the test cannot be checked."""
  if test in _ARGUMENTS:
    _ARGUMENTS.move_to_end(test)
    return _ARGUMENTS[test]
  values = checker.arguments(plan)
  if values is None:
    names = sorted({name for probe in plan.named for name in probe if name not in plan.aliases})
    job = [0, plan.setup, names, plan.anonymous, plan.imports]
    found, _, _, _, _ = jailed({"setup.py": _SETUP, "setup.json": json.dumps([job])},
                               "setup.py", timeout_s=timeout_s, memory_mb=memory_mb)
    record = checker.records(found["results"]).get(("test", 0), {})
    try:
      values = {name: checker.decode(value) for name, value in record["arguments"].items()}
    except (KeyError, AttributeError, ValueError, TypeError, RecursionError):
      values = None
  try:
    literals = None if values is None else {name: checker.literal(value)
                                            for name, value in values.items()}
  except TypeError:  # a value that is not plain data (a test's own object)
    literals = None
  _ARGUMENTS[test] = literals
  if len(_ARGUMENTS) > _ARGUMENTS_KEPT:
    _ARGUMENTS.popitem(last=False)
  return literals


def run_tests(program: str, tests: list[dict], *, timeout_s: float = 3.0,
              memory_mb: int = 512) -> RunResult:
  """Runs ``program`` against ``tests`` (as ``normalize_tests`` gives them): the sandbox
  computes outputs and values, this process judges them (``rlx.rewards.checker``). A
  stdin/stdout test passes when the program's own output, in a fresh interpreter, matches;
  an assert test when it holds with the values the program returned. Nothing the test
  computes reaches the program's process but the inputs its calls take."""
  uid = _UID_BASE + secrets.randbelow(_UIDS) if os.geteuid() == 0 else os.geteuid()
  plans: dict[int, checker.AssertPlan] = {}
  inputs: dict[int, dict] = {}
  for index, test in enumerate(tests):
    if "assert" in test:
      try:
        plans[index] = checker.plan_asserts(test["assert"])
      except (SyntaxError, ValueError, RecursionError, MemoryError):
        continue  # a test that cannot be split this way fails (check_rows refuses it at start)
      found = test_arguments(test["assert"], plans[index], timeout_s=timeout_s,
                             memory_mb=memory_mb)
      if found is None:
        del plans[index]
      else:
        inputs[index] = found
  plan = {"inputs": [[i, t["input"]] for i, t in enumerate(tests) if "input" in t],
          "probes": [[i, inputs[i], sorted(p.aliases.items()),
                      [[probe, names] for probe, names in zip(p.probes, p.named)]]
                     for i, p in plans.items()]}
  outputs, status, timed_out, truncated, seconds = jailed(
      {"harness.py": _HARNESS, "main.py": program, "plan.json": json.dumps(plan)},
      "harness.py", timeout_s=timeout_s, memory_mb=memory_mb, uid=uid)
  records = checker.records(outputs["results"])
  passed = [False] * len(tests)
  for index, test in enumerate(tests):
    record = records.get(("io", index))
    if "input" in test and record and isinstance(record.get("stdout"), str):
      passed[index] = record.get("status") == 0 and (
          _lines(record["stdout"]) == _lines(test["output"]))
  later = {}
  if records.get(("ran", None), {}).get("ran") is True:
    for index, assert_plan in plans.items():
      found = checker.probe_values(records.get(("test", index)), len(assert_plan.probes))
      if found is None:
        continue
      values, afters = found
      verdict = checker.evaluate(assert_plan, values, afters)
      if verdict is None:
        later[index] = checker.render(assert_plan, values, afters)
      passed[index] = bool(verdict)
  if later:  # tests beyond the trusted evaluator: a second jail, without the program
    checked, _, _, _, more = jailed({"check.py": _CHECK, "checks.json": json.dumps(
        list(later.items()))}, "check.py", timeout_s=timeout_s, memory_mb=memory_mb, uid=uid)
    seconds += more
    for (kind, index), record in checker.records(checked["results"]).items():
      if kind == "test" and index in later:
        passed[index] = record.get("ok") is True
  return RunResult(passed, status, timed_out, outputs["stdout"], outputs["stderr"], truncated,
                   seconds, uid)


def _lines(text: str) -> list[str]:
  return [line.rstrip() for line in text.strip().splitlines()]


def jailed(files: dict[str, str], main: str, *, timeout_s: float = 3.0,
           memory_mb: int = 512, open_files: int = 64, file_mb: int = 16,
           disk_mb: int = 32, uid: int | None = None, cgroup: pathlib.Path | None | bool = True):
  """Runs ``python main`` over ``files`` in the jail: (outputs {"stdout", "stderr",
  "results"}, exit status or None after a timeout, timed_out, truncated, seconds). The program
  may report on fd 3 ("results"). As root it runs as ``uid``
  (default: a random one of its own, so that no two runs share an rlimit on processes).
  ``memory_mb`` bounds the whole run (``memory_limit``); ``cgroup`` is where its memory
  cgroup goes (True: ``memory_cgroup()``; None: none, the process limit is lowered)."""
  python, prefix = _python()
  started = time.monotonic()
  base = memory_cgroup() if cgroup is True else cgroup
  limit = memory_limit(memory_mb, base)
  run_cgroup = _RunCgroup(base, memory_mb, limit["processes"])
  try:
    return _jailed(files, main, python, prefix, started, timeout_s, limit, open_files, file_mb,
                   disk_mb, uid, run_cgroup.path)
  finally:
    run_cgroup.remove()


def _jailed(files, main, python, prefix, started, timeout_s, limit, open_files, file_mb, disk_mb,
            uid, cgroup_path):
  with tempfile.TemporaryDirectory(prefix="rlx-jail-") as scratch:
    read_results, write_results = os.pipe()
    spec = {
        "root": os.path.join(scratch, "root"), "python": python, "binds": _binds(prefix),
        "argv": [main], "results_fd": write_results,
        "uid": _UID_BASE + secrets.randbelow(_UIDS) if uid is None else uid,
        "disk_mb": disk_mb, "inodes": 256,
        "files": files,
        "limits": {"cpu_s": max(int(timeout_s) + 1, 1), "memory_mb": limit["process_mb"],
                   "file_mb": file_mb, "open_files": open_files,
                   "processes": limit["processes"]},
        "cgroup": None if cgroup_path is None else str(cgroup_path),
    }
    try:
      jail = subprocess.Popen(
          [python, "-I", "-S", "-B", str(_JAIL)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
          stderr=subprocess.PIPE, pass_fds=(write_results,), start_new_session=True, env={},
          cwd=scratch)
    finally:
      os.close(write_results)
    try:
      jail.stdin.write(json.dumps(spec).encode())
      jail.stdin.close()
    except BrokenPipeError:
      pass
    outputs, truncated, timed_out = _collect(jail, read_results, started + timeout_s + 1.0)
  status = None if timed_out else jail.returncode
  if status == 125 and b"rlx-jail:" in outputs["stderr"]:
    message = outputs["stderr"].decode(errors="replace").strip().splitlines()[-1]
    raise SandboxUnavailable(f"the code sandbox could not be built: {message}")
  return outputs, status, timed_out, truncated, time.monotonic() - started


def _collect(jail: subprocess.Popen, results_fd: int, deadline: float):
  """Reads the jail's stdout, stderr and results (each capped) until it exits or the deadline;
  kills its process group on either, or when it writes past the cap."""
  selector = selectors.DefaultSelector()
  outputs = {"stdout": b"", "stderr": b"", "results": b""}
  selector.register(jail.stdout, selectors.EVENT_READ, "stdout")
  selector.register(jail.stderr, selectors.EVENT_READ, "stderr")
  selector.register(results_fd, selectors.EVENT_READ, "results")
  truncated = timed_out = False
  try:
    while selector.get_map():
      remaining = deadline - time.monotonic()
      if remaining <= 0:
        timed_out = True
        break
      for key, _ in selector.select(timeout=remaining):
        fd = key.fd if isinstance(key.fileobj, int) else key.fileobj.fileno()
        chunk = os.read(fd, 65536)
        if not chunk:
          selector.unregister(key.fileobj)
          continue
        outputs[key.data] += chunk
        cap = _RESULTS_CAP if key.data == "results" else _OUTPUT_CAP
        if len(outputs[key.data]) > cap:
          outputs[key.data] = outputs[key.data][:cap]
          truncated = True
      if truncated:
        break
  finally:
    selector.close()
    _kill_group(jail)
    os.close(results_fd)
    jail.stdout.close()
    jail.stderr.close()
  return outputs, truncated, timed_out


def _kill_group(jail: subprocess.Popen) -> None:
  """Stops the jail and reaps it. SIGTERM first: the jail kills its namespace's init and exits
  once every process of the namespace is gone; SIGKILL to its whole process group if the jail
  itself is stuck."""
  if jail.poll() is not None:
    return
  try:
    jail.send_signal(signal.SIGTERM)
    jail.wait(timeout=5)
  except subprocess.TimeoutExpired:
    os.killpg(jail.pid, signal.SIGKILL)  # not yet reaped: the group id is still the jail's
    jail.wait()


_PROBE = r'''
import json, os, socket
found = {"uid": os.getuid(), "cwd": os.getcwd(),
         "host_files_visible": any(os.path.exists(p) for p in ("/etc/passwd", "/proc/1", "/home"))}
try:
    socket.create_connection(("127.0.0.1", 9), timeout=0.5).close()
    found["network"] = True
except PermissionError:  # no sockets at all (the filter refuses them)
    found["network"] = False
except OSError as error:
    found["network"] = "unreachable" not in str(error).lower()
print(json.dumps(found))
'''


@functools.lru_cache(maxsize=1)
def capabilities() -> dict:
  """What isolation this system gives a program, found by running one in the sandbox; raises
  SandboxUnavailable (saying what to do) when the sandbox cannot be built or leaks."""
  try:
    if not sys.platform.startswith("linux"):
      raise SandboxUnavailable(f"this is {sys.platform}, not Linux")
    outputs, status, _, _, _ = jailed({"main.py": _PROBE}, "main.py", timeout_s=10)
    if status != 0:
      raise SandboxUnavailable(f"a probe program failed in it (exit status {status}): "
                               f"{outputs['stderr'].decode(errors='replace')[-300:]}")
    found = json.loads(outputs["stdout"].decode())
    if found["network"] or found["host_files_visible"]:
      raise SandboxUnavailable(f"it is not isolated on this system: {found}")
  except (SandboxUnavailable, OSError) as error:
    raise SandboxUnavailable(
        f"the code sandbox is unavailable: {error}. It runs untrusted programs only inside "
        "Linux namespaces (mount, network, PID): run rlx as root, or allow unprivileged user "
        "namespaces (sysctl kernel.unprivileged_userns_clone=1 and user.max_user_namespaces > "
        "0; in a container, a seccomp profile that permits unshare)") from None
  in_user_namespace = found["uid"] == 0
  return {
      "namespaces": ["mount", "network", "pid", "ipc", "uts"] + (["user"] if in_user_namespace
                                                                 else []),
      "user": ("uid 0 of its own user namespace, without capabilities" if in_user_namespace
               else f"an unprivileged uid of its own (e.g. {found['uid']})"),
      "filesystem": "pivot_root into a tmpfs (the host tree unmounted): read-only interpreter "
                    "directories, /sandbox (size-capped tmpfs); no /etc, /home, /proc or host /tmp",
      "network": "none (empty network namespace)",
      "cgroup": memory_cgroup() is not None,
      "memory": (f"cgroup v2 under {memory_cgroup()}: memory_mb for the whole run (children, "
                 "memfd and shared memory counted)" if memory_cgroup() else
                 f"no memory cgroup available: at most {_PROCESSES_WITHOUT_CGROUP} processes of "
                 f"memory_mb / {_PROCESSES_WITHOUT_CGROUP} address space each; memfd and "
                 "shared memory refused"),
      "limits": "rlimits on CPU seconds, address space, file size, open files, processes; "
                "no new privileges; wall-clock timeout kills the process group; output capped",
      "environment": "empty but for PATH, HOME, TMPDIR, LANG",
      "seccomp": "new namespaces, mount, chroot, ptrace, bpf, keyrings, perf, userfaultfd, "
                 "cross-process memory calls, memfd, SysV shared memory and message queues "
                 "refused",
  }


if __name__ == "__main__":  # python -m rlx.rewards.sandbox: what this system provides
  print(json.dumps(capabilities(), indent=2))
