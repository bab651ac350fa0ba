"""The search env's Python tool: run a snippet in a separate, limited process without network access.

Two independent barriers keep the snippet off the network: the child runs in a fresh network
namespace (`unshare --net`, or `unshare --user --map-root-user --net` for a non-root user) when the
kernel allows it, and, always, an audit hook installed before the snippet runs refuses socket,
process-creation (including importing subprocess, multiprocessing, pty and their C helper, which
would start programs that carry no hook), signal and ctypes operations, and file changes outside
the snippet's scratch folder.
Audit hooks cannot be removed from inside Python, so the guard holds even where namespaces are
unavailable (as in many containers); the namespace also covers code that escapes Python.

Limits: CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS), output size (stdout and stderr go to a
file capped by RLIMIT_FSIZE, then truncated to a number of characters), and a wall-clock timeout
after which the whole process group is killed. The limits are set by the trusted launcher inside
the child before the snippet starts, so no preexec_fn runs in a threaded parent.

The child is a common.processes.TiedProcess: if the process running the tool dies (even by
SIGKILL) while a snippet runs, a watchdog ends the snippet, and anything it started, within seconds.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass

from longhorizon.common.processes import TiedProcess, remove_tied_folder, tied_folder

# Runs in the child before the snippet: limits, then the guard, then the snippet itself.
_LAUNCHER = r'''
import ctypes, os, resource, sys  # ctypes opens the process's own symbols at import: do it before the guard
cpu_seconds, memory_bytes, file_bytes, program = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
use_guard = sys.argv[5] == "guard"
resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
scratch = os.path.realpath(os.getcwd())
source = open(program, encoding="utf-8").read()
_blocked_prefixes = ("socket.", "ctypes.", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.kill",
                     "os.killpg", "signal.pthread_kill", "subprocess.", "pty.", "os.system", "os.setuid",
                     "os.chroot", "sys.remote_exec", "resource.setrlimit", "resource.prlimit", "fcntl.ioctl")
_blocked_modules = ("_posixsubprocess", "subprocess", "multiprocessing", "pty")
_write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_path_events = ("os.remove", "os.rmdir", "os.rename", "os.link", "os.symlink", "os.chmod", "os.chown",
                "os.truncate", "os.mkdir", "shutil.rmtree", "os.utime")

def _inside_scratch(path):
    try:
        if isinstance(path, int):
            return True
        return os.path.realpath(os.fsdecode(path)).startswith(scratch + os.sep)
    except Exception:
        return False

def _inside_python(name):
    if not isinstance(name, (str, bytes)):
        return False
    path = os.path.realpath(os.fsdecode(name))
    return any(path.startswith(os.path.realpath(root) + os.sep) for root in _python_roots)

_python_roots = {sys.prefix, sys.base_prefix, sys.exec_prefix}
_extension_suffixes = tuple(__import__("importlib.machinery").machinery.EXTENSION_SUFFIXES) + (".so",)

def _is_directory(path):
    try:
        return not isinstance(path, int) and os.path.isdir(os.fsdecode(path))
    except Exception:
        return True  # refuse what cannot be checked

def _is_extension_module(path):
    # Importing a shared library from the working folder would run native code no audit event sees.
    return not isinstance(path, int) and os.fsdecode(path).endswith(_extension_suffixes)

def _guard(event, args):
    if event == "ctypes.dlopen" and _inside_python(args[0] if args else None):
        return  # packages such as numpy may load libraries they ship; no symbol can be looked up (dlsym)
    if event == "import" and args and args[0] in _blocked_modules:
        raise PermissionError(f"the python tool does not allow importing {args[0]} (it starts processes unaudited)")
    if event.startswith(_blocked_prefixes):
        raise PermissionError(f"the python tool does not allow {event} (no network, processes or ctypes)")
    if event == "open" and args:
        if not _inside_scratch(args[0]) and _is_directory(args[0]):
            # A directory descriptor would let os.open(..., dir_fd=) and friends reach past the
            # path checks below, which only see the relative name.
            raise PermissionError(f"the python tool may not open folders outside its working folder ({args[0]!r})")
        if len(args) >= 3 and isinstance(args[2], int) and args[2] & _write_flags:
            if not _inside_scratch(args[0]):
                raise PermissionError(f"the python tool may only write inside its working folder, not {args[0]!r}")
            if _is_extension_module(args[0]):
                raise PermissionError("the python tool may not write native extension modules")
    elif event in _path_events:
        paths = [arg for arg in args[:2] if isinstance(arg, (str, bytes, os.PathLike))]
        if not all(_inside_scratch(path) for path in paths):
            raise PermissionError(f"the python tool may only change files inside its working folder ({event})")
        if any(_is_extension_module(path) for path in paths):
            raise PermissionError("the python tool may not create native extension modules")

if use_guard:
    sys.addaudithook(_guard)
exec(compile(source, "<python>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
'''


@dataclass(frozen=True)
class PythonLimits:
    """What one snippet may use."""

    cpu_seconds: int = 5
    """CPU time; past it the kernel stops the process (SIGXCPU)."""
    wall_seconds: float = 10.0
    """Elapsed time; past it the process group is killed (catches sleeping or blocked programs)."""
    memory_mb: int = 512
    """Address space (RLIMIT_AS); allocations beyond it raise MemoryError."""
    output_chars: int = 2000
    """Characters of combined stdout and stderr shown to the model."""
    output_file_kb: int = 256
    """Bytes the output file may reach; a program writing more is stopped (SIGXFSZ)."""

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "wall_seconds", "memory_mb", "output_chars", "output_file_kb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"python tool limit {name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class PythonResult:
    """What happened to one snippet."""

    output: str
    """Combined stdout and stderr, truncated to the character limit."""
    exit_code: int | None
    """The process's exit status; negative for a signal (as subprocess reports it)."""
    stopped_by: str | None
    """Why the program was stopped: "wall time", "cpu time", "output size", another signal's name, or None."""
    truncated: bool
    network_namespace: bool
    """Whether the child ran in its own network namespace (the audit-hook guard runs regardless)."""


_namespace_prefix: list[str] | None = None
_namespace_lock = threading.Lock()


def namespace_prefix() -> list[str]:
    """The command prefix that gives a child an empty network namespace here, or [] when none works."""
    global _namespace_prefix
    with _namespace_lock:
        if _namespace_prefix is None:
            _namespace_prefix = []
            unshare = shutil.which("unshare")
            candidates = [[unshare, "--net"]] if os.geteuid() == 0 else []
            candidates.append([unshare, "--user", "--map-root-user", "--net"])
            for prefix in candidates if unshare else []:
                try:
                    probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
                except (OSError, subprocess.TimeoutExpired):
                    continue
                if probe.returncode == 0:
                    _namespace_prefix = prefix
                    break
        return list(_namespace_prefix)


def run_python(code: str, limits: PythonLimits = PythonLimits(), *, use_namespace: bool = True,
               use_guard: bool = True) -> PythonResult:
    """Run `code` under the limits and guards and report its output; blocks until it ends or is killed.

    use_namespace / use_guard switch one barrier off so tests can show that each holds on its own.
    """
    prefix = namespace_prefix() if use_namespace else []
    # Deleted below, or by the folder janitor if this process dies first.
    scratch = tied_folder("longhorizon-python-")
    try:
        program = os.path.join(scratch, "snippet.py")
        with open(program, "w", encoding="utf-8") as file:
            file.write(code)
        output_path = os.path.join(scratch, "output.txt")
        command = [*prefix, sys.executable, "-I", "-c", _LAUNCHER, str(int(limits.cpu_seconds)),
                   str(int(limits.memory_mb) * 2**20), str(int(limits.output_file_kb) * 1024), program,
                   "guard" if use_guard else "no-guard"]
        environment = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": scratch, "LANG": "C.UTF-8",
                       "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
        with open(output_path, "wb") as output_file:
            # Its own session (the group id is process.pid), under a watchdog that ends the snippet
            # if this process dies mid-run, SIGKILL included.
            process = TiedProcess(command, stdin=subprocess.DEVNULL, stdout=output_file,
                                  stderr=subprocess.STDOUT, cwd=scratch, env=environment)
            timed_out = False
            try:
                process.wait(timeout=limits.wall_seconds)
            except subprocess.TimeoutExpired:
                timed_out = True
            # Kill the whole group either way: nothing the snippet started may outlive it.
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
        with open(output_path, "rb") as output_file:
            raw = output_file.read(limits.output_chars * 4 + 4)
        text = raw.decode("utf-8", errors="replace")
        output_bytes = os.path.getsize(output_path)
        truncated = len(text) > limits.output_chars or output_bytes > len(raw)
        text = text[: limits.output_chars]
        stopped_by = _stop_reason(process.returncode, timed_out)
        if stopped_by is None and output_bytes >= limits.output_file_kb * 1024:
            # Python ignores SIGXFSZ, so a flood ends with a failed write rather than the signal.
            stopped_by = "output size"
        return PythonResult(text, process.returncode, stopped_by, truncated, bool(prefix))
    finally:
        remove_tied_folder(scratch)


def _stop_reason(exit_code: int | None, timed_out: bool) -> str | None:
    if timed_out:
        return "wall time"
    if exit_code is None or exit_code >= 0:
        return None
    signal_number = -exit_code
    if signal_number == signal.SIGXCPU or signal_number == signal.SIGKILL:
        # The soft CPU limit sends SIGXCPU, the hard one a SIGKILL a second later.
        return "cpu time"
    if signal_number == signal.SIGXFSZ:
        return "output size"
    try:
        return signal.Signals(signal_number).name
    except ValueError:
        return f"signal {signal_number}"


def format_result(result: PythonResult, limits: PythonLimits) -> str:
    """The observation shown to the model for one snippet."""
    notes = []
    if result.stopped_by == "wall time":
        notes.append(f"killed: the program ran longer than {limits.wall_seconds:g} s")
    elif result.stopped_by == "cpu time":
        notes.append(f"killed: the program used more than {limits.cpu_seconds} s of CPU time")
    elif result.stopped_by == "output size":
        notes.append(f"killed: the program wrote more than {limits.output_file_kb} KB of output")
    elif result.stopped_by is not None:
        notes.append(f"killed by {result.stopped_by}")
    elif result.exit_code:
        notes.append(f"exit status {result.exit_code}")
    if result.truncated:
        notes.append(f"output truncated to {limits.output_chars} characters")
    body = result.output if result.output else "(no output)"
    footer = f"\n[{'; '.join(notes)}]" if notes else ""
    return f"<result>\n{body}{footer}\n</result>"
