"""The code sandbox against hostile programs: each attack scores 0 (or its honest score), and
none escapes — after every run the host is checked: no file written or read outside the
sandbox, no connection reached a host listener, no sandbox process left alive, no scratch
directory left behind.

Most attacks are written so that if they succeeded, the program would go on to define a
correct ``f`` and pass: a score of 0 is the proof that the attack failed inside the sandbox.
"""

import os
import pathlib
import socket
import sys
import tempfile
import textwrap
import time

import pytest

from rlx.rewards import CodeOptions, sandbox

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux namespaces")

PASS = "\ndef f(x):\n    return x + 1\n"  # what a successful attack goes on to define
TESTS = ["assert f(1) == 2", "assert f(5) == 6"]
TIMEOUT_S = 1.5

ATTACKS = {
    # resources
    "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "memory_bomb": "x = bytearray(8 * 2**30)" + PASS,
    "memory_creep": "chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))",
    "infinite_loop": "while True:\n    pass",
    "sleep_past_timeout": "import time\ntime.sleep(60)" + PASS,
    "cpu_threads": ("import threading\ndef burn():\n    while True:\n        pass\n"
                    "for _ in range(8):\n    threading.Thread(target=burn).start()\nburn()"),
    "ignore_sigterm": ("import signal\nfor s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):\n"
                       "    signal.signal(s, signal.SIG_IGN)\nwhile True:\n    pass"),
    "huge_output": "while True:\n    print('x' * 10000)",
    "huge_file": "open('big', 'wb').write(b'x' * (100 << 20))" + PASS,
    "fill_disk": ("for i in range(100):\n    open('fill' + str(i), 'wb').write(b'x' * (8 << 20))" + PASS),
    "inode_exhaustion": "for i in range(100000):\n    open('i' + str(i), 'w').close()" + PASS,
    "deep_recursion": ("import sys\nsys.setrecursionlimit(10**7)\ndef r(n):\n    return r(n + 1)\n"
                       "r(0)" + PASS),
    "fork_children_that_allocate": (
        "import os\nkids = []\nfor _ in range(6):\n    pid = os.fork()\n    if pid == 0:\n"
        "        try:\n            x = bytearray(200 << 20)\n            os._exit(0)\n"
        "        except BaseException:\n            os._exit(1)\n    kids.append(pid)\n"
        "assert all(os.waitpid(k, 0)[1] == 0 for k in kids)" + PASS),
    "memfd_outside_the_address_space": (
        "import os\nfds = [os.memfd_create('m') for _ in range(40)]\nfor fd in fds:\n"
        "    os.write(fd, b'x' * (15 << 20))" + PASS),  # 600 MiB, each file under file_mb
    "socket_buffers_outside_the_address_space": (  # 4 x 225 MiB held under 256 MiB once
        "import socket\npairs = [socket.socketpair() for _ in range(4)]\nfor a, b in pairs:\n"
        "    a.setblocking(False)\n    try:\n        while True:\n"
        "            a.send(b'x' * 65536)\n    except BlockingIOError:\n        pass" + PASS),
    "x32_system_call": ("import ctypes\nctypes.CDLL(None).syscall(0x40000000 | 39)" + PASS),
    "raise_rlimits": ("import resource\nfor name in ('RLIMIT_AS', 'RLIMIT_CPU', 'RLIMIT_NPROC'):\n"
                      "    r = getattr(resource, name)\n"
                      "    resource.setrlimit(r, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))"
                      + PASS),
    # the host's files
    "read_etc_shadow": "open('/etc/shadow').read()" + PASS,
    "read_etc_passwd": "open('/etc/passwd').read()" + PASS,
    "read_run_directory": "open({secret!r}).read()" + PASS,
    "read_model_weights": "open({weights!r}, 'rb').read(16)" + PASS,
    "list_home_and_root": "import os\nassert os.listdir('/home') or os.listdir('/root')" + PASS,
    "read_proc_environ": "open('/proc/1/environ').read()" + PASS,
    "write_outside_sandbox": "open({escaped!r}, 'w').write('out')" + PASS,
    "write_host_tmp": "open({host_tmp!r}, 'w').write('out')\nassert open({host_tmp!r}).read()",
    "write_usr": "open('/usr/rlx-escape', 'w').write('out')" + PASS,
    "symlink_to_host": ("import os\nos.symlink({secret!r}, 'link')\nopen('link').read()" + PASS),
    "dev_block_devices": "import os\nassert [d for d in os.listdir('/dev') if 'sd' in d or 'vd' in d or d == 'mem']" + PASS,
    "read_own_tests": "open('tests.json').read()" + PASS,
    # network
    "tcp_to_host": ("import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)"
                    + PASS),
    "udp_to_host": ("import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                    "s.sendto(b'x', ('127.0.0.1', {port}))" + PASS),
    "unix_socket_to_host": ("import socket\ns = socket.socket(socket.AF_UNIX)\n"
                            "s.connect({unix!r})" + PASS),
    "abstract_socket_to_host": ("import socket\ns = socket.socket(socket.AF_UNIX)\n"
                                "s.connect('\\0' + {abstract!r})" + PASS),
    "dns_lookup": "import socket\nsocket.getaddrinfo('pypi.org', 443)" + PASS,
    # processes and privileges
    "orphan_outlives_parent": ("import os, time\nif os.fork() == 0:\n    os.setsid()\n"
                               "    if os.fork() == 0:\n        time.sleep(30)\n    os._exit(0)"
                               + PASS),
    "kill_parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)" + PASS,
    "kill_everyone": "import os, signal\nos.kill(-1, signal.SIGKILL)" + PASS,
    "kill_host_process": "import os, signal\nos.kill({host_pid}, signal.SIGKILL)" + PASS,
    "setuid_root": "import os\nos.setuid(0)" + PASS,
    "ctypes_setuid": ("import ctypes\nassert ctypes.CDLL(None).setuid(0) == 0" + PASS),
    "ctypes_new_user_namespace": ("import ctypes\nassert ctypes.CDLL(None).unshare(0x10000000) == 0"
                                  + PASS),
    "ctypes_ptrace_init": ("import ctypes\nassert ctypes.CDLL(None).ptrace(16, 1, 0, 0) == 0"
                           + PASS),
    "chroot_escape": ("import os\nos.mkdir('x')\nos.chroot('x')\nfor _ in range(20):\n"
                      "    os.chdir('..')\nos.chroot('.')\nopen('/etc/passwd').read()" + PASS),
    "mount_proc": ("import subprocess, os\nos.mkdir('p')\n"
                   "subprocess.run(['mount', '-t', 'proc', 'proc', 'p'])\n"
                   "assert os.path.exists('p/1')" + PASS),
    "setuid_binary": ("import subprocess\nr = subprocess.run(['su', '-c', 'id -u'], capture_output=True)\n"
                      "assert r.stdout.strip() == b'0'" + PASS),
    "environment_secret": "import os\nos.environ['RLX_TEST_SECRET']" + PASS,
    # the harness
    "exit_early": "import sys\nsys.exit(0)",
    "hard_exit": "import os\nos._exit(0)",
    "forge_results": "import os\nos.write(3, b'0' * 32 + b' 0 1\\n' + b'0' * 32 + b' 1 1\\n')",
    "close_all_fds": "import os\nfor fd in range(64):\n    try:\n        os.close(fd)\n    except OSError:\n        pass" + PASS,
}

# the honest score where surviving the attack is no escape (the attack is caught in its own process)
HONEST = {"orphan_outlives_parent": 1.0}
# without root the program is uid 0 of its own user namespace (no capabilities): becoming uid 0
# changes nothing, and killing the namespace's init (same uid) only ends its own run
HONEST_IN_USER_NAMESPACE = {"setuid_root": 1.0, "ctypes_setuid": 1.0, "kill_parent": 1.0}


@pytest.fixture(scope="module")
def host(tmp_path_factory):
  """What a program would reach if it escaped: files, listeners, this process."""
  root = tmp_path_factory.mktemp("host")
  secret = root / "run" / "metrics.jsonl"
  secret.parent.mkdir()
  secret.write_text("secret run data\n")
  weights = root / "model" / "model.safetensors"
  weights.parent.mkdir()
  weights.write_bytes(b"\x00weights" * 8)
  tcp = socket.socket()
  tcp.bind(("127.0.0.1", 0))
  tcp.listen()
  tcp.setblocking(False)
  udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
  udp.bind(("127.0.0.1", tcp.getsockname()[1]))
  udp.setblocking(False)
  unix = socket.socket(socket.AF_UNIX)
  unix_path = str(root / "host.sock")
  unix.bind(unix_path)
  unix.listen()
  unix.setblocking(False)
  abstract_name = f"rlx-test-{os.getpid()}"
  abstract = socket.socket(socket.AF_UNIX)
  abstract.bind("\0" + abstract_name)
  abstract.listen()
  abstract.setblocking(False)
  values = {"secret": str(secret), "weights": str(weights), "escaped": str(root / "escaped"),
            "host_tmp": f"/tmp/rlx-escape-{os.getpid()}", "port": tcp.getsockname()[1],
            "unix": unix_path, "abstract": abstract_name, "host_pid": os.getpid()}
  os.environ["RLX_TEST_SECRET"] = "do not leak"
  yield {"values": values, "listeners": (tcp, unix, abstract), "udp": udp,
         "files": {secret: secret.read_bytes(), weights: weights.read_bytes()}}
  del os.environ["RLX_TEST_SECRET"]
  for s in (tcp, udp, unix, abstract):
    s.close()


def _left_behind(uid: int, grace_s: float = 2.0) -> list[int]:
  """Host processes of a run: running as its uid (root: a uid of its own), or, without root
  (where the program runs as the caller's uid), in another PID namespace than ours; looked for
  until none is left or ``grace_s`` passes (a process the jail's teardown killed can still be on
  its way out on a loaded machine: one was seen once under the whole suite)."""
  deadline = time.monotonic() + grace_s
  while True:
    found = _processes_of(uid)
    if not found or time.monotonic() >= deadline:
      return found
    time.sleep(0.05)


def _processes_of(uid: int) -> list[int]:
  ours = os.readlink("/proc/self/ns/pid")
  found = []
  for entry in pathlib.Path("/proc").iterdir():
    if not entry.name.isdigit():
      continue
    try:
      uids = next(line for line in (entry / "status").read_text().splitlines()
                  if line.startswith("Uid:"))
      namespace = os.readlink(entry / "ns" / "pid")
    except (OSError, StopIteration):
      continue
    if int(uids.split()[1]) == uid and (uid != os.getuid() or namespace != ours):
      found.append(int(entry.name))
  return found


@pytest.fixture
def scratch(tmp_path, monkeypatch):
  """A temporary directory of this test's own for the sandbox's scratch directories."""
  directory = tmp_path / "scratch"
  directory.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(directory))
  return directory


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_a_hostile_program_scores_zero_and_escapes_nothing(name, host, available, scratch):
  program = ATTACKS[name].format(**host["values"])
  assert sandbox.extract_program(f"```python\n{program}\n```") == program + "\n"
  result = sandbox.run_tests(program, sandbox.normalize_tests(TESTS), timeout_s=TIMEOUT_S,
                             memory_mb=256)
  honest = dict(HONEST, **(HONEST_IN_USER_NAMESPACE if "user" in available["namespaces"] else {}))
  assert sum(result.passed) / len(TESTS) == honest.get(name, 0.0), (name, result)
  # the host afterwards
  assert not _left_behind(result.uid), f"{name}: sandbox processes outlived the run"
  for path, content in host["files"].items():
    assert path.read_bytes() == content
  values = host["values"]
  assert not pathlib.Path(values["escaped"]).exists()
  assert not pathlib.Path(values["host_tmp"]).exists()
  assert not pathlib.Path("/usr/rlx-escape").exists()
  for listener in host["listeners"]:
    with pytest.raises(BlockingIOError):
      listener.accept()  # nobody connected
  with pytest.raises(BlockingIOError):
    host["udp"].recv(16)
  assert not list(scratch.iterdir()), "a scratch directory was left behind"


def test_memory_is_bounded_per_run_not_per_process(available, tmp_path):
  without = sandbox.memory_limit(256, None)
  assert without["processes"] * without["process_mb"] <= 256
  with_cgroup = sandbox.memory_limit(256, tmp_path)
  assert with_cgroup["process_mb"] == 256 and "cgroup v2" in with_cgroup["how"]
  # the wiring of a run's cgroup, on a stand-in directory (a real one needs cgroup v2 with the
  # memory controller delegated): its limit written, and the jail joined it before forking
  outputs, status, *_ = sandbox.jailed({"main.py": "print(1)"}, "main.py", memory_mb=256,
                                       cgroup=tmp_path)
  assert status == 0 and outputs["stdout"] == b"1\n"
  (run,) = tmp_path.iterdir()
  assert (run / "memory.max").read_text() == str(256 << 20)
  assert (run / "cgroup.procs").read_text().strip().isdigit()


def test_the_suite_covers_thirty_attacks():
  assert len(ATTACKS) >= 30


def test_honest_programs_score_what_they_pass(available):
  options = CodeOptions(timeout_s=TIMEOUT_S)
  row = {"tests": TESTS}
  assert sandbox.code_reward("```python\ndef f(x):\n    return x + 1\n```", row, options)[
      "reward"] == 1.0
  half = "```python\ndef f(x):\n    return 2 if x == 1 else 0\n```"
  assert sandbox.code_reward(half, row, options)["reward"] == 0.5
  assert sandbox.code_reward(half, row, CodeOptions(timeout_s=TIMEOUT_S, scoring="all"))[
      "reward"] == 0.0
  # the last fenced block is the program; none scores 0 without running
  two = "```python\ndef f(x):\n    return 0\n```\nfixed:\n```\ndef f(x):\n    return x + 1\n```"
  assert sandbox.code_reward(two, row, options)["correct"]
  assert sandbox.code_reward("def f(x): return x + 1", row, options)["ran"] == 0.0


@pytest.mark.parametrize("tests", [
    [{"input": "3\n", "output": "6"}, {"input": "5\n", "output": "10\n"}],
    {"inputs": ["3\n", "5\n"], "outputs": ["6", "10"]},
])
def test_stdin_stdout_tests(tests, available):
  program = textwrap.dedent("""\
      import sys
      n = int(sys.stdin.readline())
      print(n * 2)
  """)
  options = CodeOptions(timeout_s=TIMEOUT_S)
  result = sandbox.code_reward(f"```python\n{program}```", {"tests": tests}, options)
  assert result["reward"] == 1.0 and result["correct"]
  wrong = sandbox.code_reward("```python\nprint(6)\n```", {"tests": tests}, options)
  assert wrong["reward"] == 0.5 and not wrong["correct"]


def test_malformed_tests_are_an_error_not_a_score():
  with pytest.raises(ValueError, match="has no field 'tests'"):
    sandbox.code_reward("```\nx\n```", {"where": "d.jsonl:3"}, CodeOptions())
  with pytest.raises(ValueError, match="non-empty list"):
    sandbox.normalize_tests([])
  with pytest.raises(ValueError, match="2 inputs but 1 outputs"):
    sandbox.normalize_tests({"inputs": ["1", "2"], "outputs": ["1"]})
  # at the start of a run, on a sample of the rows
  options = CodeOptions()
  sandbox.check_rows([{"tests": ["assert f(1) == 2"]}, {"tests": [{"input": "1", "output": "2"}]}],
                     options)
  with pytest.raises(ValueError, match="d.jsonl:3 has no field 'tests'.*code_tests_field"):
    sandbox.check_rows([{"where": "d.jsonl:3", "prompt": "p"}], options)
  with pytest.raises(ValueError, match="d.jsonl:4: a test does not parse"):
    sandbox.check_rows([{"where": "d.jsonl:4", "tests": ["assert f(1) =="]}], options)
  with pytest.raises(ValueError, match="one assert per input"):
    sandbox.check_rows([{"tests": ["for x in [1]:\n    assert f(x) == 2"]}], options)


def test_a_stuck_jail_is_killed_with_its_process_group(available):
  result = sandbox.run_tests("import time\ntime.sleep(60)", [{"assert": "True"}], timeout_s=0.5)
  assert result.timed_out and result.status is None and result.seconds < 10
  assert not _left_behind(result.uid)
