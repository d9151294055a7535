"""``daopsim`` for the documentation examples: the call runs in tests/doc_server.py's warm
interpreter (a forked child with this process's working directory, environment, stdin, stdout
and stderr), and this process exits with its exit code.

Run as ``python -S -E tests/doc_client.py ARGS...`` (no site packages: it starts in tens of
milliseconds). ``DAOPSIM_DOC_SERVER`` is the server's socket, ``DAOPSIM_DOC_SERVER_ENV`` the
JSON of the server's own values of the import-time variables (doc_server.IMPORT_ENV): a call
that changes one of them runs ``python -m daopsim`` afresh instead.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys

HEADER = struct.Struct("!I")


def main(argv: list[str]) -> int:
    """Send the call to the server; its exit code."""
    server_env: dict[str, str | None] = json.loads(os.environ["DAOPSIM_DOC_SERVER_ENV"])
    if any(os.environ.get(k) != v for k, v in server_env.items()):
        python = os.environ["DAOPSIM_DOC_PYTHON"]
        os.execv(python, [python, "-m", "daopsim", *argv])
    env = {k: v for k, v in os.environ.items() if not k.startswith("DAOPSIM_DOC_")}
    body = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": env}).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(os.environ["DAOPSIM_DOC_SERVER"])
        message = HEADER.pack(len(body)) + body
        sent = socket.send_fds(sock, [message], [0, 1, 2])
        sock.sendall(message[sent:])
        answer = b""
        while not answer.endswith(b"\n"):
            chunk = sock.recv(64)
            if not chunk:
                print("daopsim (doc examples): the server went away", file=sys.stderr)
                return 70
            answer += chunk
    return int(answer)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
