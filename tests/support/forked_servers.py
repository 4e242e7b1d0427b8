"""`courier serve` processes forked from one that has already imported the server, for end-to-end tests.

A test server's start took ~4.2 s of CPU on the CI machine (AMD EPYC, 2 cores), ~3 s of it importing (transformers
alone reads every model file it knows, ~1.4 s) and probing the BLAS, and the suite starts ~100 of them; forked, a
start takes ~1.5 s, and pytest's part of `./dev test` went from 823 s to 587 s. A launcher process per pytest
process chooses the BLAS and imports the server once, as `courier serve` does (`courier/server/cli.py`), and then
forks: each child runs the same `main()` with the test's arguments, environment, working directory and standard
streams, so everything from parsing the flags on (settings, model load, Hypercorn on its port, shutdown, exit code)
is the real server's, but for the tokenizer: the launcher loads each model directory's tokenizer once and its
children reuse it (`shared_tokenizers.py`), which takes a start from ~1.4 s of CPU to ~0.5 s. What the launcher
cannot reproduce is what a process reads from its environment while it imports or starts; `forkable` sends those
starts (another BLAS, another library variable, a launcher command such as a mount namespace) to a fresh interpreter
instead.

Protocol, one Unix SEQPACKET connection per server: the test sends its request (JSON) with the three file
descriptors for the child's stdin, stdout and stderr; the launcher answers `{"pid": N}` once forked and
`{"exit": code}` once the child is reaped (`subprocess`'s convention: minus the signal's number when killed). A
connection closed before its child exits kills the child, and the launcher ends with its stdin (its test process)
and kills any child left.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from tests.support import shared_tokenizers

# Variables a test may set for a forked server: the server reads them from the environment `main()` is given. Any
# other variable a test sets (the BLAS's, the allocator's, a library's read as it is imported) needs a fresh
# interpreter, as does the BLAS flag: the launcher chose the BLAS and imported MLX before any test asked.
_READ_BY_THE_SERVER = ("COURIER_", "OTEL_")
_READ_AT_START = ("COURIER_BLAS",)
DISABLE_VARIABLE = "COURIER_TEST_FORKED_SERVERS"  # "0": every test server starts in a fresh interpreter
_MAX_REQUEST_BYTES = 1 << 20
_STREAMS = 3  # stdin, stdout, stderr
_FROM_THE_TESTS = 0  # the launcher's stdin: a pipe its test process closes as it exits


def _read_by_the_server(key: str) -> bool:
    return key.startswith(_READ_BY_THE_SERVER) and not key.startswith(_READ_AT_START)


class ForkedServer:
    """The part of `subprocess.Popen` the tests use, for a server the launcher forked: its exit code comes over the
    connection rather than from `waitpid` (the launcher is its parent)."""

    def __init__(self, connection: socket.socket, stderr: IO[str] | None) -> None:
        self._connection = connection
        self.stderr = stderr
        self.returncode: int | None = None
        self.pid: int = self._receive(None)["pid"]

    def _receive(self, timeout: float | None) -> dict[str, Any]:
        self._connection.settimeout(timeout)
        message = self._connection.recv(4096)
        if not message:
            raise ConnectionError("the server launcher closed the connection without an exit code")
        reply: dict[str, Any] = json.loads(message)
        return reply

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = self._receive(0)["exit"]
            except (BlockingIOError, TimeoutError):
                return None
            self._connection.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                self.returncode = self._receive(timeout)["exit"]
            except TimeoutError:
                raise subprocess.TimeoutExpired(["courier", "serve"], timeout or 0) from None
            self._connection.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Launcher:
    """The launcher process of this test process, started on the first server that can use it."""

    def __init__(self, cwd: Path) -> None:
        self._directory = tempfile.TemporaryDirectory(prefix="courier-launcher-")
        self.address = str(Path(self._directory.name) / "socket")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.support.forked_servers", self.address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,
            text=True,
            env={key: value for key, value in os.environ.items() if not key.startswith(_READ_BY_THE_SERVER)},
            cwd=cwd,
        )
        assert self.process.stdout is not None
        self.failure = "" if self.process.stdout.readline().strip() == "ready" else self._exited()

    def _exited(self) -> str:
        assert self.process.stdout is not None
        return f"the launcher exited ({self.process.wait()}): {self.process.stdout.read()}"

    def start(self, args: Sequence[str], environment: Mapping[str, str], cwd: Path) -> ForkedServer:
        """`courier serve <args>` with stdin and stdout on /dev/null and stderr on a pipe, as `running_server`."""
        read_end, write_end = os.pipe()
        with open(os.devnull, "wb") as null_out:
            try:
                connection = self._send(args, environment, cwd, [null_out.fileno(), write_end])
            except BaseException:
                os.close(read_end)
                raise
            finally:
                os.close(write_end)
        return ForkedServer(connection, open(read_end, encoding="utf-8", errors="replace"))

    def start_logged(
        self, args: Sequence[str], environment: Mapping[str, str], cwd: Path, log: IO[bytes]
    ) -> ForkedServer:
        """`courier serve <args>` with stdin on /dev/null and stdout and stderr appended to `log`, as a cluster's
        replica (`courier.cluster.replica_process`)."""
        return ForkedServer(self._send(args, environment, cwd, [log.fileno(), log.fileno()]), None)

    def _send(
        self, args: Sequence[str], environment: Mapping[str, str], cwd: Path, outputs: list[int]
    ) -> socket.socket:
        """Ask for a child; `outputs`: its stdout and stderr. The connection its pid and exit code come on."""
        with open(os.devnull, "rb") as null_in:
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                connection.connect(self.address)
                request = {"args": list(args), "environment": dict(environment), "cwd": str(cwd)}
                socket.send_fds(connection, [json.dumps(request).encode()], [null_in.fileno(), *outputs])
            except BaseException:
                connection.close()
                raise
        return connection

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()  # the launcher kills what it still runs and exits
        self.process.wait(timeout=30)
        self._directory.cleanup()


_launcher: Launcher | None = None
_launcher_lock = threading.Lock()


def forking_allowed() -> bool:
    """Whether test servers may be forked at all here (Linux, and not turned off by DISABLE_VARIABLE)."""
    return sys.platform == "linux" and os.environ.get(DISABLE_VARIABLE) != "0"


def forkable(args: Sequence[str], variables: Mapping[str, str], cwd: Path) -> Launcher | None:
    """The launcher that starts `courier serve <args>`, with the test's own `variables` on top of this process's
    environment, as a fresh interpreter would; None where it cannot.

    This process's environment may have changed since the launcher started (libraries the tests import set
    variables of their own, such as mlx-vlm's TRANSFORMERS_VERBOSITY, and pytest names the running test): the child
    gets the environment of the moment all the same, as its `os.environ` and `main()`'s."""
    global _launcher
    if not forking_allowed() or any(arg.startswith(("--blas", "--no-blas")) for arg in args):  # read at start
        return None
    if not all(map(_read_by_the_server, variables)):
        return None
    with _launcher_lock:
        if _launcher is None:
            _launcher = Launcher(cwd)
            atexit.register(_launcher.close)
    return None if _launcher.failure else _launcher


def launcher_failure() -> str:
    """Why servers start in fresh interpreters though forking was allowed ("" when they do not)."""
    return _launcher.failure if _launcher is not None else ""


# The launcher process itself.


# What every child would otherwise import again as it starts (~0.1 s of CPU of its ~1.7 s): the asyncio backend that
# `anyio.run` loads on first use, and the modules transformers loads lazily as it reads a llama-family config and fast
# tokenizer (SmolLM2 and the tiny models are llama). Importing them starts no thread.
_LOADED_ON_FIRST_USE = (
    "anyio._backends._asyncio",
    "transformers.models.llama.configuration_llama",
    "transformers.tokenization_utils_tokenizers",
    "transformers.utils.type_validators",
)


def _import_the_server() -> None:
    """What `courier serve` does before it parses its settings: choose the BLAS, then import MLX and the server.

    Nothing here may evaluate an MLX array: that starts MLX's CPU stream thread, which a forked child does not have,
    and the child's first evaluation then waits for it forever (so the CPU attention is installed by each child).
    """
    from courier.platform.blas import load_optimized_blas

    load_optimized_blas()
    shared_tokenizers.install()
    import anyio  # noqa: F401

    import courier.server.cli
    import courier.server.errors
    import courier.server.supervisor  # noqa: F401

    for module in _LOADED_ON_FIRST_USE:
        importlib.import_module(module)


def _run_child(request: dict[str, Any], streams: list[int], inherited: list[socket.socket]) -> None:
    """In the forked child: become the requested `courier serve` and exit as it would."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for inherited_socket in inherited:
            inherited_socket.close()
        for target, descriptor in enumerate(streams):
            os.dup2(descriptor, target)
        for descriptor in streams:
            os.close(descriptor)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["environment"])
        sys.argv = ["courier", "serve", *request["args"]]
        from courier.server.cli import main

        code = main(sys.argv[1:])
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        if code == -signal.SIGINT:  # as Python does for an uncaught KeyboardInterrupt
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


def _serve(address: str) -> None:
    _import_the_server()
    if (threads := threading.active_count()) != 1:  # forking a process with threads can leave a lock held
        print(f"not forking: importing the server started {threads - 1} threads", flush=True)
        return
    gc.freeze()  # the imported objects stay shared with every child (collection would write to their pages)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address)
    listener.listen(64)
    wake_read, wake_write = socket.socketpair()
    for end in (wake_read, wake_write):
        end.setblocking(False)
    signal.set_wakeup_fd(wake_write.fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    selector.register(_FROM_THE_TESTS, selectors.EVENT_READ)
    connections: dict[socket.socket, int | None] = {}  # each connection's child, once forked
    children: dict[int, socket.socket] = {}
    print("ready", flush=True)
    try:
        while True:
            for key, _ in selector.select():
                ready = key.fileobj
                if ready is listener:
                    accepted, _ = listener.accept()
                    connections[accepted] = None
                    selector.register(accepted, selectors.EVENT_READ)
                elif ready is wake_read:
                    _drain(wake_read)
                    _reap(children, connections, selector)
                elif ready == _FROM_THE_TESTS:
                    if not os.read(_FROM_THE_TESTS, 4096):
                        return  # the test process is gone
                else:
                    assert isinstance(ready, socket.socket)
                    _answer(ready, connections, children, selector, [listener, wake_read, wake_write])
    finally:
        for pid in children:
            os.kill(pid, signal.SIGKILL)


def _answer(
    connection: socket.socket,
    connections: dict[socket.socket, int | None],
    children: dict[int, socket.socket],
    selector: selectors.BaseSelector,
    own: list[socket.socket],
) -> None:
    """A request to fork, or (from a connection whose child runs) its closing."""
    message, streams, _, _ = socket.recv_fds(connection, _MAX_REQUEST_BYTES, _STREAMS)
    pid = connections[connection]
    if message and pid is None and len(streams) == _STREAMS:
        request = json.loads(message)
        shared_tokenizers.share(request["args"])
        gc.freeze()  # what it loaded stays shared with the children too
        sys.stdout.flush()
        sys.stderr.flush()
        with contextlib.suppress(OSError):  # one that cannot fork fails its test's start with ConnectionError
            pid = os.fork()
            if pid == 0:
                _run_child(request, streams, [*own, *connections])
            connections[connection] = pid
            children[pid] = connection
            connection.send(json.dumps({"pid": pid}).encode())
    for descriptor in streams:
        os.close(descriptor)
    if connections[connection] is None:
        _forget(connection, connections, selector)
    elif not message and (running := connections[connection]) in children:
        os.kill(running, signal.SIGKILL)  # its test is gone; reaped as any other child, nobody left to tell
        del children[running]
        _forget(connection, connections, selector)


def _forget(
    connection: socket.socket, connections: dict[socket.socket, int | None], selector: selectors.BaseSelector
) -> None:
    selector.unregister(connection)
    del connections[connection]
    connection.close()


def _drain(wake_read: socket.socket) -> None:
    with contextlib.suppress(BlockingIOError):
        while wake_read.recv(4096):
            pass


def _reap(
    children: dict[int, socket.socket],
    connections: dict[socket.socket, int | None],
    selector: selectors.BaseSelector,
) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if (connection := children.pop(pid, None)) is not None:
            with contextlib.suppress(OSError):  # the test process is gone
                connection.send(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())
            _forget(connection, connections, selector)


if __name__ == "__main__":
    _serve(sys.argv[1])
