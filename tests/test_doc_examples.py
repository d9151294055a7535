"""Every example in README.md and docs/*.md runs as written.

Each fenced block tagged ``sh``, ``bash``, ``shell``, ``console`` or ``python`` is executed:

* shell blocks run under ``bash -e`` (every command must succeed); in a ``console`` block only
  the lines starting with ``$ `` (and their ``\\`` continuation lines) are commands, the rest is
  shown output. ``python`` is the current interpreter. ``daopsim`` is the same entry point as
  the installed program, run in a child forked from a warm interpreter that has imported the
  command line once (tests/doc_server.py, tests/doc_client.py): the call gets the shell's
  working directory, environment, stdin, stdout and stderr, and its exit code is the shell's,
  so pipes, redirections, ``cd`` and variables behave as with a program, without a second of
  imports per call. A call that sets a variable read at import (``DAOPSIM_PURE_PYTHON``,
  ``PYTHONPATH``) runs ``python -m daopsim`` afresh.
* python blocks run as a plain script file (``python block.py``), as a user would save and run
  one: a ``daopsim.sweep()`` with worker processes at the top level of the script, without an
  ``if __name__ == "__main__":`` guard, must work (docs/sweeps.md, "Executors").

The blocks of one document run in order, in one temporary folder laid out like the repository
root (copies of ``experiments/``, ``baselines/``, ``validation/`` and ``hardware_profiles/``),
so a later block may read what an earlier one wrote (``results.parquet`` then ``daopsim plot``):
one test per document runs its blocks one after another and names the block that failed.

A block that cannot run in a test (it needs a GPU, the network, real model weights, or it
installs software) is marked by the line ``<!-- not run: REASON -->`` directly above its fence;
the reason is required. Slow examples are made cheaper in the document itself (``--sequences 1``,
the small ``ci-small`` trace), never by editing the command here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from doc_server import IMPORT_ENV

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL = {"sh", "bash", "shell", "console"}
PYTHON = {"python", "py"}
#: repository folders the examples read from the repository root (small; copied per document)
ROOT_FOLDERS = ("experiments", "baselines", "validation", "hardware_profiles")
MARKER = re.compile(r"^\s*<!--\s*not run\s*:(?P<reason>.*?)-->\s*$")
#: a line that starts like a marker (prose quoting the marker in backticks is not one)
LOOSE_MARKER = re.compile(r"^\s*<!--\s*not\s+run", re.IGNORECASE)
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)")
#: seconds one block may take before it counts as hung
TIMEOUT_S = 900


@dataclass(frozen=True)
class Block:
    """One fenced code block of a document."""

    doc: Path
    line: int  #: 1-based line of the opening fence
    lang: str
    text: str
    skip_reason: str | None  #: the ``not run`` marker's reason, or None

    @property
    def id(self) -> str:
        """``README.md:27`` style id (path relative to the repository)."""
        return f"{self.doc.relative_to(REPO)}:{self.line}"

    @property
    def runnable(self) -> bool:
        """A shell or Python block not marked ``not run``."""
        return self.skip_reason is None and (self.lang in SHELL or self.lang in PYTHON)


def parse_blocks(doc: Path) -> list[Block]:
    """Every fenced block of ``doc`` with its language and ``not run`` marker."""
    lines = doc.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent = m.group("fence"), len(m.group("indent"))
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        body = [ln[indent:] if ln[:indent].strip() == "" else ln for ln in lines[i + 1 : j]]
        prev = MARKER.match(lines[i - 1]) if i > 0 else None
        blocks.append(
            Block(
                doc=doc,
                line=i + 1,
                lang=m.group("lang").lower(),
                text="\n".join(body) + "\n",
                skip_reason=prev.group("reason").strip() if prev else None,
            )
        )
        i = j + 1
    return blocks


def marker_problems(doc: Path) -> list[str]:
    """Markers without a reason, or not directly above a fence (they would silently not apply)."""
    lines = doc.read_text(encoding="utf-8").splitlines()
    problems = []
    for n, line in enumerate(lines):
        if not LOOSE_MARKER.search(line):
            continue
        where = f"{doc.relative_to(REPO)}:{n + 1}"
        m = MARKER.match(line)
        if m is None:
            problems.append(f"{where}: malformed marker (write <!-- not run: REASON -->)")
        elif not m.group("reason").strip():
            problems.append(f"{where}: 'not run' marker without a reason")
        elif n + 1 >= len(lines) or not FENCE.match(lines[n + 1]):
            problems.append(f"{where}: 'not run' marker is not directly above a code fence")
    return problems


def shell_script(block: Block) -> str:
    """The commands of a shell block (for ``console``: the ``$`` lines and continuations)."""
    if block.lang != "console":
        return block.text
    out: list[str] = []
    continuing = False
    for line in block.text.splitlines():
        if continuing:
            out.append(line)
        elif line.startswith("$ "):
            out.append(line[2:])
        else:
            continue
        continuing = line.rstrip().endswith("\\")
    return "\n".join(out) + "\n"


ALL_BLOCKS = [b for doc in DOCS for b in parse_blocks(doc)]
RUNNABLE = [b for b in ALL_BLOCKS if b.runnable]


@pytest.fixture(scope="module")
def doc_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[Path, Path]:
    """One working folder per document, created on first use (shared by its blocks)."""
    return {}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The warm ``daopsim`` (tests/doc_server.py) for this worker; the variables that point the
    ``daopsim`` shim at it."""
    folder = tmp_path_factory.mktemp("doc-server")
    sock = folder / "daopsim.sock"
    env = {**os.environ, "MPLBACKEND": "Agg"}
    proc = subprocess.Popen(
        [sys.executable, str(TESTS / "doc_server.py"), str(sock)],
        cwd=folder,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield {
            "DAOPSIM_DOC_SERVER": str(sock),
            "DAOPSIM_DOC_SERVER_ENV": json.dumps({k: env.get(k) for k in IMPORT_ENV}),
            "DAOPSIM_DOC_PYTHON": sys.executable,
        }
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def bin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``daopsim`` (the warm server's client) and ``python`` (the current interpreter)."""
    folder = tmp_path_factory.mktemp("doc-bin")
    shims = {
        "daopsim": f'exec "{sys.executable}" -S -E "{TESTS / "doc_client.py"}" "$@"\n',
        "python": f'exec "{sys.executable}" "$@"\n',
    }
    for name, body in shims.items():
        shim = folder / name
        shim.write_text("#!/bin/sh\n" + body)
        shim.chmod(0o755)
    return folder


def _workdir(doc: Path, dirs: dict[Path, Path], factory: pytest.TempPathFactory) -> Path:
    if doc not in dirs:
        work = factory.mktemp(re.sub(r"\W", "-", doc.stem))
        for name in ROOT_FOLDERS:
            if (REPO / name).is_dir():
                shutil.copytree(REPO / name, work / name)
        dirs[doc] = work
    return dirs[doc]


def _env(bin_dir: Path, work: Path, server: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["MPLBACKEND"] = "Agg"
    env["HOME"] = str(work)  # nothing an example writes lands in the real home
    env.pop("PYTHONSTARTUP", None)
    env.update(server)
    return env


#: documents with runnable blocks, each with its blocks in document order
DOC_BLOCKS = {d: [b for b in RUNNABLE if b.doc == d] for d in DOCS}
DOC_BLOCKS = {d: bs for d, bs in DOC_BLOCKS.items() if bs}


def run_block(block: Block, work: Path, env: dict[str, str]) -> None:
    """Run one block in ``work``; a failure names the block with its output's tail."""
    if block.lang in SHELL:
        cmd = ["bash", "-e", "-o", "pipefail", "-c", shell_script(block)]
    else:
        # a script file: __main__ has a file, which a spawn-started worker would re-run
        script = work / f".{block.doc.stem}-{block.line}.py"
        script.write_text(block.text)
        cmd = [sys.executable, str(script)]
    res = subprocess.run(
        cmd,
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert res.returncode == 0, (
        f"{block.id} ({block.lang}) exited {res.returncode}\n--- block\n{block.text}"
        f"--- stdout (tail)\n{res.stdout[-3000:]}\n--- stderr (tail)\n{res.stderr[-3000:]}"
    )


@pytest.mark.parametrize(
    "doc", list(DOC_BLOCKS), ids=[str(d.relative_to(REPO)) for d in DOC_BLOCKS]
)
@pytest.mark.slow
def test_example_runs(
    doc: Path,
    doc_dirs: dict[Path, Path],
    bin_dir: Path,
    server: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A document's blocks, in order, in one folder: a later block may read what an earlier one
    wrote, whichever worker runs the document."""
    work = _workdir(doc, doc_dirs, tmp_path_factory)
    env = _env(bin_dir, work, server)
    for block in DOC_BLOCKS[doc]:
        run_block(block, work, env)


def test_docs_have_runnable_examples() -> None:
    # the harness finds the README's examples (a parser bug would silently run nothing)
    readme = [b for b in RUNNABLE if b.doc.name == "README.md"]
    assert {b.lang for b in readme} >= {"sh", "python"}
    assert any("daopsim sweep" in b.text for b in readme)
    # the README's Python example runs a sweep at the top level of a script (no main guard)
    (example,) = [b for b in readme if b.lang in PYTHON]
    assert "daopsim.sweep(" in example.text and "__main__" not in example.text


#: a private module imported (``from simulator.x import``, ``import policies.y``)
PRIVATE_IMPORT = re.compile(
    r"^\s*(from|import)\s+(daopsim\.)?(simulator|policies|hardware_profiles|traces)\b", re.MULTILINE
)


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_examples_import_only_daopsim(doc: Path) -> None:
    """Every example imports the public API, ``daopsim``, never an internal module."""
    for block in parse_blocks(doc):
        if block.lang in PYTHON:
            assert not PRIVATE_IMPORT.search(block.text), block.id


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_not_run_markers_have_reasons(doc: Path) -> None:
    assert marker_problems(doc) == []


def test_marker_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    doc = tmp_path / "x.md"
    doc.write_text(
        "<!-- not run: needs a GPU -->\n```sh\nnvidia-smi\n```\n"
        "<!-- not run: -->\n```sh\ntrue\n```\n"
        "<!-- not run: far away -->\n\n```python\npass\n```\n"
        "```console\n$ daopsim a \\\n  --b\noutput line\n$ daopsim c\n```\n"
        "Prose may quote the marker, `<!-- not run: REASON -->`, without effect.\n"
    )
    blocks = parse_blocks(doc)
    assert [(b.line, b.skip_reason) for b in blocks] == [
        (2, "needs a GPU"),
        (6, ""),
        (11, None),
        (14, None),
    ]
    assert not blocks[0].runnable and blocks[2].runnable
    assert shell_script(blocks[3]) == "daopsim a \\\n  --b\ndaopsim c\n"
    problems = marker_problems(doc)
    assert len(problems) == 2
    assert "x.md:5" in problems[0] and "without a reason" in problems[0]
    assert "x.md:9" in problems[1] and "not directly above" in problems[1]
