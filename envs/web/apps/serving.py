"""Helpers the local web apps share: free ports, starting and stopping a server process, the cache folder."""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path
from typing import Sequence

from longhorizon.common.paths import user_cache
from longhorizon.common.processes import TiedProcess, remove_tied_folder, tied_folder

DATA_DIR = Path(__file__).resolve().parent / "data"

# Sites still running when the interpreter exits normally are stopped then, so an env that was
# never closed leaves no server behind (and no working folder). Other exits are covered by the
# watchdog of start_process.
_running_sites: "weakref.WeakSet[LocalSite]" = weakref.WeakSet()


@atexit.register
def _stop_running_sites() -> None:
    for site in list(_running_sites):
        site.stop()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def cache_dir(*parts: str) -> Path:
    """A folder under the user's cache (common/paths.py), created on demand."""
    path = user_cache(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def fingerprint(*items: bytes | str) -> str:
    """A short hash of everything a cached build depends on, so a change rebuilds it."""
    digest = hashlib.sha256()
    for item in items:
        digest.update(item.encode("utf-8") if isinstance(item, str) else item)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def require_program(program: str, install_hint: str) -> str:
    """The full path of an executable, or RuntimeError naming how to install it."""
    found = shutil.which(program)
    if found is None:
        raise RuntimeError(f"{program!r} is not installed; install it with: {install_hint}")
    return found


def wait_for_http(url: str, process: subprocess.Popen, log_path: Path, timeout_s: float = 20.0) -> None:
    """Block until `url` answers (any HTTP status), or raise RuntimeError with the server's log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with code {process.returncode}: {read_tail(log_path)}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            time.sleep(0.05)
    raise RuntimeError(f"server did not answer at {url} within {timeout_s:.0f} s: {read_tail(log_path)}")


def read_tail(path: Path, limit: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return "(no log)"


def start_process(command: Sequence[str], log_path: Path, *, cwd: Path | None = None,
                  env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a server in its own session, tied to this process (common.processes.TiedProcess).

    The session means stopping it never touches anything else. The tie means the server and all
    it started end within seconds when this process dies, even by SIGKILL, when the atexit hook
    above never runs; and a process the server leaves behind (Fossil's backoffice) ends with it.
    """
    log_file = open(log_path, "ab")
    try:
        return TiedProcess(list(command), cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log_file,
                           stderr=subprocess.STDOUT)
    finally:
        log_file.close()


def stop_process(process: subprocess.Popen | None, timeout_s: float = 5.0) -> None:
    """Terminate a process this module started (by its own handle), killing it if it lingers."""
    if process is None or process.poll() is not None:
        return
    # The server runs in its own process group (start_new_session), so signalling the group also
    # ends any worker it forked (Fossil forks one per connection), and nothing outside it.
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(timeout=timeout_s)


def replace_file(source: Path, target: Path) -> None:
    """Copy `source` over `target` atomically: a server reading `target` sees the old or the new file."""
    descriptor, staging = tempfile.mkstemp(prefix=target.name + ".", suffix=".copying", dir=target.parent)
    os.close(descriptor)
    try:
        shutil.copyfile(source, staging)
        os.replace(staging, target)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise


class LocalSite:
    """A web application served by a child process on 127.0.0.1 from a private working folder.

    Subclasses fill the folder (`prepare`), name the server command (`server_command`), restore
    the snapshot (`restore`) and score checks (`check_state`). start() prepares once and starts
    the server; reset() restores the snapshot without restarting it; stop() ends the process and
    deletes the folder. The folder is a common.processes.tied_folder: if this process dies without
    stopping the site (SIGKILL), its janitor deletes the folder.
    """

    name = "site"
    ready_path = "/"
    """A path that answers once the server is up."""

    def __init__(self) -> None:
        self.workdir: Path | None = None
        self.port: int | None = None
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise RuntimeError(f"site {self.name!r} is not started")
        return f"http://127.0.0.1:{self.port}"

    @property
    def allowed_origins(self) -> tuple[str, ...]:
        return (self.base_url,)

    @property
    def log_path(self) -> Path:
        assert self.workdir is not None
        return self.workdir / "server.log"

    def prepare(self, workdir: Path) -> None:
        raise NotImplementedError

    def server_command(self, port: int) -> tuple[list[str], Path | None, dict[str, str] | None]:
        """(argv, cwd, environment) of the server process."""
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        if self.process is not None and self.process.poll() is None:
            return
        if self.workdir is None:
            self.workdir = Path(tied_folder(f"longhorizon-{self.name}-"))
            try:
                self.prepare(self.workdir)
            except BaseException:
                self.stop()
                raise
        # A port can be taken between choosing and binding it; a second try with a new port covers that.
        for attempt in range(2):
            self.port = free_port()
            argv, cwd, env = self.server_command(self.port)
            self.process = start_process(argv, self.log_path, cwd=cwd, env=env)
            try:
                wait_for_http(self.base_url + self.ready_path, self.process, self.log_path)
                _running_sites.add(self)
                return
            except RuntimeError:
                stop_process(self.process)
                self.process = None
                if attempt == 1:
                    message = read_tail(self.log_path)
                    self.stop()
                    raise RuntimeError(f"site {self.name!r} did not start: {message}") from None

    def reset(self) -> None:
        if self.workdir is None:
            raise RuntimeError(f"site {self.name!r} is not started")
        self.restore()
        if self.process is None or self.process.poll() is not None:
            self.start()  # the server died since the last episode: serve the restored state again

    def stop(self) -> None:
        _running_sites.discard(self)
        stop_process(self.process)
        self.process = None
        self.port = None
        if self.workdir is not None:
            remove_tied_folder(self.workdir)
            self.workdir = None

    def __enter__(self) -> "LocalSite":
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def check_sql(database: Path, check: dict) -> tuple[bool, str]:
    """Score {"type": "sql", "query": ..., "expected": value, "match": "exact"|"contains"} on a SQLite file.

    The first column of the first row is compared with "expected" (numbers numerically, text after
    stripping; "contains" is a case-insensitive substring test); no row reads as None.
    """
    import sqlite3

    query = check.get("query")
    if not isinstance(query, str) or not query.strip():
        raise ValueError(f"an sql check needs a 'query' string, got {check!r}")
    if "expected" not in check:
        raise ValueError(f"an sql check needs an 'expected' value, got {check!r}")
    match = check.get("match", "exact")
    if match not in ("exact", "contains"):
        raise ValueError(f"unknown sql match {match!r}; valid: exact, contains")
    connection = sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=10)
    try:
        row = connection.execute(query).fetchone()
    finally:
        connection.close()
    actual = None if row is None else row[0]
    expected = check["expected"]
    if match == "contains":
        passed = actual is not None and str(expected).lower() in str(actual).lower()
    elif isinstance(expected, (int, float)) and isinstance(actual, (int, float)):
        passed = abs(float(actual) - float(expected)) < 1e-9
    elif expected is None or actual is None:
        passed = expected is None and actual is None
    else:
        passed = str(actual).strip() == str(expected).strip()
    verdict = "passed" if passed else "failed"
    return passed, f"sql check {verdict}: got {actual!r}, expected {match} {expected!r}"
