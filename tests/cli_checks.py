"""A check the attack corpora share (tests/test_attacks.py, tests/test_attacks_surfaces.py):
a user mistake ends in one clear error line and its exit code, never a traceback."""

from __future__ import annotations

from click.testing import Result


def one_error(res: Result, code: int, *words: str) -> str:
    """Exactly one ``error:`` line, the last on stderr (progress may come before it), the exit
    code ``code``, no traceback, and each of ``words`` in the line; returns the line."""
    text = res.output + res.stderr
    assert "Traceback" not in text, text
    assert res.exit_code == code, (res.exit_code, res.stdout, res.stderr, res.exception)
    lines = res.stderr.splitlines()
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], res.stderr
    for w in words:
        assert w in errors[0], (w, errors[0])
    return errors[0]
