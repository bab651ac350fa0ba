"""The search env's Python tool: limits, no network, runaway programs killed and reported."""

import socket
import threading
import time

import pytest

from longhorizon.envs.base import Task, make_env
from longhorizon.envs.search.pytool import PythonLimits, format_result, namespace_prefix, run_python

FAST = PythonLimits(cpu_seconds=1, wall_seconds=3.0, memory_mb=256, output_chars=200, output_file_kb=64)
WIDE = PythonLimits(cpu_seconds=2, wall_seconds=5.0, output_chars=5000)  # room for a whole traceback


@pytest.fixture
def listening_server():
    """A TCP server on 127.0.0.1 that counts the connections it accepts."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    accepted = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                connection, _ = server.accept()
            except (TimeoutError, OSError):
                continue
            accepted.append(connection)
            connection.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join(timeout=2)
    server.close()


def connect_code(port: int) -> str:
    return (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "s.sendall(b'hello')\nprint('CONNECTED')\n")


def test_the_server_is_reachable_from_an_ordinary_child(listening_server):
    # Control: without either barrier the snippet does connect, so the tests below can fail.
    port, accepted = listening_server
    result = run_python(connect_code(port), WIDE, use_namespace=False, use_guard=False)
    assert "CONNECTED" in result.output
    time.sleep(0.3)
    assert len(accepted) == 1


def test_the_guard_alone_blocks_the_network(listening_server):
    port, accepted = listening_server
    result = run_python(connect_code(port), WIDE, use_namespace=False)
    assert "CONNECTED" not in result.output and "PermissionError" in result.output
    assert result.network_namespace is False
    time.sleep(0.3)
    assert accepted == []


def test_the_namespace_alone_blocks_the_network(listening_server):
    if not namespace_prefix():
        pytest.skip("network namespaces are not available to this user here")
    port, accepted = listening_server
    result = run_python(connect_code(port), WIDE, use_guard=False)
    assert result.network_namespace is True
    assert "CONNECTED" not in result.output and "Error" in result.output
    time.sleep(0.3)
    assert accepted == []


def test_a_normal_program_runs_and_can_use_its_folder():
    code = "import math\nopen('notes.txt', 'w').write('ok')\nprint(math.factorial(10), open('notes.txt').read())"
    result = run_python(code, FAST)
    assert (result.output, result.exit_code, result.stopped_by) == ("3628800 ok\n", 0, None)
    assert format_result(result, FAST) == "<result>\n3628800 ok\n\n</result>"


def test_a_cpu_runaway_is_killed_and_reported():
    # A generous wall clock, so the CPU limit is what stops it even on a busy machine.
    limits = PythonLimits(cpu_seconds=1, wall_seconds=30.0)
    started = time.monotonic()
    result = run_python("x = 0\nwhile True:\n    x += 1\n", limits)
    assert result.stopped_by == "cpu time"
    assert time.monotonic() - started < limits.wall_seconds
    assert "more than 1 s of CPU time" in format_result(result, limits)


def test_a_sleeping_program_is_killed_at_the_wall_clock_with_its_children():
    # The wall clock leaves room for the interpreter to start and print on a busy machine (a
    # loaded 2-core runner has taken over a second), far below the snippets' 60 s of sleep.
    limits = PythonLimits(cpu_seconds=5, wall_seconds=5.0)
    started = time.monotonic()
    result = run_python("import time\nprint('start', flush=True)\ntime.sleep(60)\n", limits)
    assert result.stopped_by == "wall time" and result.output == "start\n"
    assert time.monotonic() - started < 15
    assert "killed: the program ran longer than 5 s" in format_result(result, limits)
    # With the guard off a snippet can start a process; the group kill still takes it down.
    spawner = ("import subprocess\nchild = subprocess.Popen(['sleep', '60'])\n"
               "print(child.pid, flush=True)\nchild.wait()\n")
    result = run_python(spawner, limits, use_guard=False)
    assert result.stopped_by == "wall time"
    child_pid = int(result.output.split()[0])
    time.sleep(0.2)
    assert _process_state(child_pid) in (None, "Z")  # gone, or dead and waiting for init to reap it


def _process_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def test_memory_output_and_escape_limits():
    memory = run_python("x = bytearray(1024 * 1024 * 1024)\nprint('allocated')", FAST)
    assert "MemoryError" in memory.output and "allocated" not in memory.output
    flood = run_python("while True:\n    print('y' * 1000)\n", FAST)
    assert flood.stopped_by == "output size" and flood.truncated and len(flood.output) == FAST.output_chars
    assert "output truncated to 200 characters" in format_result(flood, FAST)
    for escape in ("import os\nos.system('echo escaped')", "import subprocess\nsubprocess.run(['true'])",
                   "import ctypes\nctypes.CDLL(None).getpid()", "open('/tmp/longhorizon-escape', 'w')",
                   "import os\nos.kill(1, 0)", "import _posixsubprocess",
                   "import os\nopen('a', 'w').close()\nos.rename('a', '/tmp/longhorizon-escape')",
                   # a descriptor of an outside folder would let dir_fd= reach past the path checks
                   "import os\nfolder = os.open('/tmp', os.O_RDONLY)\n"
                   "os.open('longhorizon-escape', os.O_WRONLY | os.O_CREAT, dir_fd=folder)",
                   "import os\nos.open('/proc/self', os.O_RDONLY)",
                   # a shared library in the working folder would be importable native code
                   "open('sneaky' + __import__('importlib.machinery').machinery.EXTENSION_SUFFIXES[0], 'wb')",
                   "import os\nopen('a', 'w').close()\nos.rename('a', 'sneaky.so')"):
        result = run_python(escape, WIDE)
        assert "PermissionError" in result.output and "escaped" not in result.output, escape


async def test_the_env_runs_python_as_an_observation():
    env = make_env("search", python_tool=True, python_cpu_seconds=1, python_wall_seconds=30.0)
    task = Task(env_name="search", task_id="hand-1", split="test",
                data={"question": "What is 12 times 12?", "golden_answers": ["144"]})
    await env.reset(task)
    observation, reward, terminated, _, info = await env.step("<python>\n```python\nprint(12 * 12)\n```\n</python>")
    assert observation == "<result>\n144\n\n</result>"
    assert (reward, terminated, info["invalid_action"]) == (0.0, False, False)
    observation, *_, info = await env.step("<python>while True: pass</python>")
    assert info["python_stopped_by"] == "cpu time" and "killed" in observation
    _, reward, terminated, _, info = await env.step("<answer>144</answer>")
    assert (reward, terminated, info["success"]) == (1.0, True, True)
