"""Every code block of the README runs as written and prints what its comments claim.

Rules for README blocks (new sections follow them too):

- A ```python block is a complete program: it imports and defines everything it uses.
- A multi-rank block defines ``main(comm)`` and ends with ``if __name__ == "__main__":
  launch(main, P)``. The test runs ``main`` on P thread ranks (``run_threads``), so ranks must not
  rely on torch's global random generator (use ``distconv.testing.rank_generator``). A first line
  ``# readme: world`` runs the block as a script instead (real processes through ``launch``).
- Any other python block is run as a script, in a subprocess.
- ``# prints: TEXT`` at the end of a line claims that the block prints the line TEXT; the printed
  lines must equal the claims, in order (multi-rank blocks print on rank 0 only).
- A first line ``# readme: skip <reason>`` exempts a block (it needs a cluster, a GPU...).
- A ```bash block holds commands; ``make`` targets must exist in the Makefile and programs be one
  of make, python, torchrun, mpiexec, pip.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from distconv.testing import run_threads

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _blocks(lang: str) -> list[tuple[int, str]]:
    text = README.read_text()
    return [(text[: m.start()].count("\n") + 1, m.group(2)) for m in _FENCE.finditer(text)
            if m.group(1) == lang]


def _claims(code: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"#\s*prints:\s*(.*)$", code, re.M)]


PYTHON = _blocks("python")


def test_readme_has_python_blocks():
    assert len(PYTHON) >= 4


@pytest.mark.parametrize("line, code", PYTHON, ids=[f"line{n}" for n, _ in PYTHON])
def test_python_block_runs_and_prints_what_it_claims(line, code, tmp_path):
    first = code.splitlines()[0].strip()
    if first.startswith("# readme: skip"):
        assert first.removeprefix("# readme: skip").strip(), "a skipped block must say why"
        pytest.skip(first)
    claims = _claims(code)
    launched = re.search(r"^\s+launch\(main, (\d+)\)", code, re.M)
    if launched and "def main(comm)" in code and first != "# readme: world":
        namespace: dict = {"__name__": f"readme_line{line}"}
        exec(compile(code, f"README.md:{line}", "exec"), namespace)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            run_threads(namespace["main"], int(launched.group(1)))
        printed = out.getvalue()
    else:
        script = tmp_path / f"readme_line{line}.py"
        script.write_text(code)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                              timeout=240, env=env, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        printed = proc.stdout
    assert [p.strip() for p in printed.splitlines() if p.strip()] == claims


@pytest.mark.parametrize("line, code", _blocks("bash"), ids=[f"line{n}" for n, _ in _blocks("bash")])
def test_bash_block_names_real_commands(line, code):
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    for cmd in code.splitlines():
        cmd = cmd.split("#", 1)[0].strip()
        if not cmd:
            continue
        words = cmd.split()
        assert words[0] in ("make", "python", "torchrun", "mpiexec", "pip"), cmd
        if words[0] == "make":
            assert words[1] in targets, f"README.md:{line}: no make target {words[1]!r}"
