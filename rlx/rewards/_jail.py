"""The jail the ``code`` reward runs programs in: a standalone script (standard library only,
started as ``python -I -S _jail.py`` by ``rlx.rewards.sandbox``), never imported.

It reads a JSON spec on stdin, then:

1. ``unshare``s new mount, network, PID, IPC and UTS namespaces (and a user namespace when
   it is not root), so the program sees no network (not even loopback), no host process and
   no host IPC;
2. forks the namespace's init, which builds a new root on a tmpfs: the interpreter's
   directories bound read-only (``/usr`` and the Python prefix), ``/dev/null``,
   ``/dev/zero`` and ``/dev/urandom``, and a small size-capped tmpfs ``/sandbox`` holding the
   program — no ``/etc``, ``/home``, ``/root``, ``/proc``, ``/tmp`` or run directory — and
   ``pivot_root``s into it, unmounting the host's tree from the namespace altogether;
3. forks the program: an unprivileged uid of its own (or, in a user namespace, root without
   capabilities), no new privileges, rlimits on CPU seconds, address space, file size, open
   files and processes, a scrubbed environment, and a seccomp filter that refuses the
   system calls that would widen its world (new namespaces, mount, ptrace, bpf, keyrings,
   perf, userfaultfd, and memfd, SysV shared memory and message queues, whose memory no
   process's address-space limit counts), then ``exec``s the interpreter on it.

When the program exits, init exits and the kernel kills whatever the program left behind
in its PID namespace. On SIGTERM (the caller's wall-clock timeout) this script kills init
and returns once the namespace is empty; if it is killed outright, init dies with it
(``PR_SET_PDEATHSIG``) and takes the namespace down the same way, asynchronously.

Exit status: the program's (128 + signal when killed); 125 with a line on stderr starting
``rlx-jail:`` when the jail itself could not be built.
"""

import ctypes
import json
import os
import platform
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT = 1, 2, 4, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 1, 24, 28, 38
SECBITS_LOCKED_NOROOT = 0x2F  # NOROOT, NO_SETUID_FIXUP and their locks: no caps from uid 0
MNT_DETACH = 2
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
CLONE_NEW_ANY = 0x7E020080  # every CLONE_NEW* flag, CLONE_NEWTIME (0x80) too
# system calls a program never needs and that would widen its world: arch -> {name: number}
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
SYSCALLS = {
    "x86_64": {"unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155,
               "chroot": 161, "ptrace": 101, "bpf": 321, "keyctl": 250, "add_key": 248,
               "request_key": 249, "perf_event_open": 298, "userfaultfd": 323,
               "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsmount": 432,
               "process_vm_readv": 310, "process_vm_writev": 311,
               # memory no process's address-space limit counts
               "memfd_create": 319, "memfd_secret": 447, "shmget": 29, "mq_open": 240,
               # socket buffers: kernel memory too (the jail has no network to reach anyway)
               "socket": 41, "socketpair": 53},
    "aarch64": {"unshare": 97, "setns": 268, "mount": 40, "umount2": 39, "pivot_root": 41,
                "chroot": 51, "ptrace": 117, "bpf": 280, "keyctl": 219, "add_key": 217,
                "request_key": 218, "perf_event_open": 241, "userfaultfd": 282,
                "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsmount": 432,
                "process_vm_readv": 270, "process_vm_writev": 271,
                "memfd_create": 279, "memfd_secret": 447, "shmget": 194, "mq_open": 180,
                "socket": 198, "socketpair": 199},
}
CLONE = {"x86_64": 56, "aarch64": 220}
X32_SYSCALL_BIT = 0x40000000
CLONE3 = 435
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}
SETUP_FAILED = 125

_libc = ctypes.CDLL(None, use_errno=True)


class JailError(Exception):
  pass


def _call(what: str, result: int) -> None:
  if result != 0:
    error = ctypes.get_errno()
    raise JailError(f"{what} failed: {os.strerror(error)} (errno {error})")


def _mount(source, target, fstype, flags, data=None) -> None:
  _call(f"mount {target}", _libc.mount(
      None if source is None else source.encode(), target.encode(),
      None if fstype is None else fstype.encode(), ctypes.c_ulong(flags),
      None if data is None else data.encode()))


def _bind(source: str, target: str, read_only: bool = True) -> None:
  if os.path.isdir(source):
    os.makedirs(target, exist_ok=True)
  else:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    open(target, "a").close()
  _mount(source, target, None, MS_BIND | MS_REC)
  if read_only:
    _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _build_root(spec: dict, in_user_namespace: bool) -> None:
  """The new root, entered with chroot; the program's files in /sandbox."""
  _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates to the host
  root = spec["root"]
  os.makedirs(root, exist_ok=True)
  _mount("rlx-jail", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
  for path in spec["binds"]:
    if os.path.islink(path):  # merged /usr: /bin -> usr/bin
      os.symlink(os.readlink(path), root + path)
    elif os.path.exists(path):
      _bind(path, root + path)
  os.makedirs(root + "/dev", exist_ok=True)
  for device in ("null", "zero", "urandom", "random"):
    _bind(f"/dev/{device}", f"{root}/dev/{device}", read_only=False)
  sandbox = root + "/sandbox"
  os.makedirs(sandbox)
  _mount("rlx-sandbox", sandbox, "tmpfs", MS_NOSUID | MS_NODEV,
         f"size={spec['disk_mb']}m,nr_inodes={spec['inodes']},mode=0700")
  for name, text in spec["files"].items():
    with open(f"{sandbox}/{name}", "w") as f:
      f.write(text)
  if not in_user_namespace:  # (in a user namespace, its root, which wrote them, owns them)
    for directory, _, names in os.walk(sandbox):
      for path in [directory, *(os.path.join(directory, name) for name in names)]:
        os.chown(path, spec["uid"], spec["uid"])
  os.symlink("/sandbox", root + "/tmp")
  number = SYS_PIVOT_ROOT.get(platform.machine())
  if number is None:
    raise JailError(f"pivot_root: no syscall number known for {platform.machine()}")
  os.makedirs(root + "/.host")
  _call("pivot_root", _libc.syscall(number, root.encode(), (root + "/.host").encode()))
  os.chdir("/")
  _call("umount the host tree", _libc.umount2(b"/.host", MNT_DETACH))
  os.rmdir("/.host")
  _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
  os.chdir("/sandbox")


def _drop_privileges(spec: dict, in_user_namespace: bool) -> None:
  limits = spec["limits"]
  for name, value in (("RLIMIT_CPU", limits["cpu_s"]), ("RLIMIT_AS", limits["memory_mb"] << 20),
                      ("RLIMIT_FSIZE", limits["file_mb"] << 20),
                      ("RLIMIT_NOFILE", limits["open_files"]),
                      ("RLIMIT_NPROC", limits["processes"]), ("RLIMIT_CORE", 0)):
    resource.setrlimit(getattr(resource, name), (value, value))
  if in_user_namespace:  # uid 0 of a namespace of its own: take away what uid 0 would give
    _call("securebits", _libc.prctl(PR_SET_SECUREBITS, SECBITS_LOCKED_NOROOT, 0, 0, 0))
    for capability in range(64):
      _libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0)
  else:
    uid = spec["uid"]
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
  _call("no_new_privs", _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))
  # credentials changed: the parent-death signal was cleared, so set it again
  _call("pdeathsig", _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0))
  _seccomp()


class _Filter(ctypes.Structure):
  _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
              ("k", ctypes.c_uint32)]


class _Program(ctypes.Structure):
  _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Filter))]


def _seccomp() -> None:
  """Installs the filter: the listed system calls, and clone with a CLONE_NEW* flag, fail with
  EPERM; clone3 fails with ENOSYS (so that the C library falls back to clone, whose flags the
  filter can see); a call from another architecture's ABI, or x86_64's x32 ABI, kills the
  process."""
  machine = platform.machine()
  if machine not in SYSCALLS:
    raise JailError(f"seccomp: no system call table for {machine}")
  ld_w_abs, jeq_k, jset_k, ret_k = 0x20, 0x15, 0x45, 0x06
  allow, kill = 0x7FFF0000, 0x80000000
  eperm, enosys = 0x00050000 | 1, 0x00050000 | 38
  blocked = sorted(SYSCALLS[machine].values())
  code = [(ld_w_abs, 0, 0, 4), (jeq_k, 1, 0, AUDIT_ARCH[machine]), (ret_k, 0, 0, kill),
          (ld_w_abs, 0, 0, 0)]
  if machine == "x86_64":  # the x32 ABI shares x86_64's audit arch: its bit says it is x32
    code += [(jset_k, 0, 1, X32_SYSCALL_BIT), (ret_k, 0, 0, kill)]
  for number in blocked:
    code += [(jeq_k, 0, 1, number), (ret_k, 0, 0, eperm)]
  code += [(jeq_k, 0, 1, CLONE3), (ret_k, 0, 0, enosys),
           (jeq_k, 0, 3, CLONE[machine]), (ld_w_abs, 0, 0, 16),  # clone's flags (low 32 bits)
           (jset_k, 0, 1, CLONE_NEW_ANY), (ret_k, 0, 0, eperm),
           (ret_k, 0, 0, allow)]
  filters = (_Filter * len(code))(*[_Filter(*instruction) for instruction in code])
  program = _Program(len(code), filters)
  _call("seccomp", _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(program), 0, 0))


def _status(wait_status: int) -> int:
  if os.WIFSIGNALED(wait_status):
    return 128 + os.WTERMSIG(wait_status)
  return os.WEXITSTATUS(wait_status)


def _init(spec: dict, in_user_namespace: bool) -> int:
  """PID 1 of the new namespace: builds the root, runs the program, returns its status."""
  _call("pdeathsig", _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0))
  _build_root(spec, in_user_namespace)
  child = os.fork()
  if child == 0:
    try:
      null = os.open("/dev/null", os.O_RDONLY)
      os.dup2(null, 0)
      for fd in (0, 1, 2, 3):
        os.set_inheritable(fd, True)
      os.closerange(4, 65536)
      _drop_privileges(spec, in_user_namespace)
      env = {"PATH": "/usr/bin:/bin", "HOME": "/sandbox", "TMPDIR": "/sandbox",
             "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
      os.execve(spec["python"], [spec["python"], "-I", "-S", "-B", *spec["argv"]], env)
    except BaseException as error:  # noqa: BLE001 - reported through the exit status
      print(f"rlx-jail: starting the program failed: {error}", file=sys.stderr, flush=True)
      os._exit(SETUP_FAILED)
  while True:
    pid, wait_status = os.waitpid(child, 0)
    if pid == child:
      return _status(wait_status)


def main() -> int:
  spec = json.loads(sys.stdin.read())
  os.dup2(spec["results_fd"], 3)
  if spec.get("cgroup"):  # before anything forks: every process of the run is charged there
    try:
      with open(os.path.join(spec["cgroup"], "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    except OSError as error:
      print(f"rlx-jail: joining the memory cgroup failed: {error}", file=sys.stderr, flush=True)
      return SETUP_FAILED
  in_user_namespace = os.geteuid() != 0
  uid, gid = os.geteuid(), os.getegid()
  flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
  try:
    _call("unshare", _libc.unshare(flags | (CLONE_NEWUSER if in_user_namespace else 0)))
    if in_user_namespace:
      for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"),
                         ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
          f.write(text)
  except (JailError, OSError) as error:
    print(f"rlx-jail: {error}", file=sys.stderr, flush=True)
    return SETUP_FAILED
  child = os.fork()
  if child == 0:
    try:
      os._exit(_init(spec, in_user_namespace))
    except BaseException as error:  # noqa: BLE001 - reported through the exit status
      print(f"rlx-jail: {error}", file=sys.stderr, flush=True)
      os._exit(SETUP_FAILED)
  os.close(3)
  # SIGTERM (the caller's timeout) kills init; waiting for init returns only once the kernel has
  # killed every process of the namespace, so the caller knows nothing is left running
  signal.signal(signal.SIGTERM, lambda *_: os.kill(child, signal.SIGKILL))
  _, wait_status = os.waitpid(child, 0)
  return _status(wait_status)


if __name__ == "__main__":
  sys.exit(main())
