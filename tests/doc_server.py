"""A warm ``daopsim`` for the documentation examples (tests/test_doc_examples.py).

Starting ``daopsim`` costs a second or more of imports (numpy, pandas, pyarrow, matplotlib, the
commands) before any work; the examples call it about a hundred times. This server imports the
command line once, then runs each call in a child forked from itself: the child takes the
caller's working directory, environment, stdin, stdout and stderr (passed over a Unix socket,
so pipes, redirections and ``$(...)`` behave as with a program), runs the same entry point as
the ``daopsim`` program (``main`` of simulator/cli.py) with the caller's arguments, and its exit
code is the caller's. Shell syntax, ``cd``, environment variables and files stay the shell's:
the examples still run under bash; only the ``daopsim`` program is replaced by
tests/doc_client.py, which talks to this server.

A call whose environment changes what an import decides (``IMPORT_ENV``: the compiled or pure
build, the module path) cannot reuse the server's imports; the client runs a fresh
``python -m daopsim`` for it.

    python tests/doc_server.py SOCKET     # prints "ready" once it listens
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import selectors
import signal
import socket
import struct
import sys
import traceback

#: environment variables read when modules are imported: a call that sets them differently
#: from the server runs in a fresh interpreter instead (tests/doc_client.py)
IMPORT_ENV = (
    "DAOPSIM_PURE_PYTHON",
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONSAFEPATH",
    "PYTHONNOUSERSITE",
)
#: a request: a 4-byte length, then that many bytes of JSON; stdin, stdout, stderr ride along
HEADER = struct.Struct("!I")


def recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """The request's JSON and the three file descriptors sent with it."""
    fds = array.array("i")
    data, anc, _flags, _addr = conn.recvmsg(65536, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    while len(data) < HEADER.size:
        data += conn.recv(65536)
    (n,) = HEADER.unpack_from(data)
    while len(data) < HEADER.size + n:
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("request cut short")
        data += chunk
    return json.loads(data[HEADER.size : HEADER.size + n]), list(fds)


def _child(request: dict, fds: list[int]) -> int:
    """Run one ``daopsim`` call as the caller would (in the forked child)."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    from daopsim.simulator.cli import main

    sys.argv = ["daopsim", *request["argv"]]
    code: int = 0
    try:
        main(args=request["argv"], prog_name="daopsim")
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError):  # a reader gone (BrokenPipeError) included
            stream.flush()
    return code


def warm_up() -> None:
    """Import what the commands import, so that no call pays for it."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib.pyplot  # noqa: F401
    import numpy  # noqa: F401
    import pandas  # noqa: F401
    import pyarrow.parquet  # noqa: F401

    import daopsim.simulator.cli  # every command module
    import daopsim.simulator.plots
    import daopsim.simulator.regress
    import daopsim.simulator.runner
    import daopsim.simulator.sweep
    import daopsim.simulator.validation

    del daopsim


def serve(path: str) -> None:
    """Listen on the Unix socket ``path``; fork a child per request; answer its exit code."""
    warm_up()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    sel = selectors.DefaultSelector()
    sel.register(server, selectors.EVENT_READ)
    running: dict[int, socket.socket] = {}  # child pid -> its caller's connection
    print("ready", flush=True)
    while True:
        for key, _ in sel.select(timeout=0.01):
            if key.fileobj is server:
                conn, _ = server.accept()
                try:
                    request, fds = recv_request(conn)
                except (ConnectionError, ValueError, OSError):
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    server.close()
                    conn.close()
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    os._exit(_child(request, fds))
                for fd in fds:
                    os.close(fd)
                running[pid] = conn
                sel.register(conn, selectors.EVENT_READ, pid)
            else:  # the caller went away (killed, timed out): so does its child
                pid = key.data
                try:
                    gone = key.fileobj.recv(1, socket.MSG_PEEK) == b""
                except OSError:
                    gone = True
                if not gone:
                    continue
                sel.unregister(key.fileobj)
                if pid in running:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = running.pop(pid, None)
            if conn is None:
                continue
            with contextlib.suppress(KeyError):
                sel.unregister(conn)
            try:
                code = os.waitstatus_to_exitcode(status)
                conn.sendall(b"%d\n" % (code if code >= 0 else 128 - code))
            except OSError:
                pass
            conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
