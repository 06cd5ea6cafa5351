"""Every code block of the README and of the guide in docs/ runs as written and prints what its
comments claim.

Rules for the blocks (new pages and sections follow them too):

- A ```python block is a complete program: it imports and defines everything it uses.
- A multi-rank block defines ``main(comm)`` and ends with ``if __name__ == "__main__":
  launch(main, P)`` (so it runs unchanged under ``python``, ``torchrun`` and ``mpiexec``:
  tests/test_launch.py). The test runs ``main`` on P thread ranks (``run_threads``), so ranks must not
  rely on torch's global random generator (use ``distconv.testing.rank_generator``). A first line
  ``# run: processes`` runs the block as a script instead (real processes through ``launch``).
- A block with an ``if __name__ == "__main__":`` entry point otherwise runs as a script, in a
  subprocess; any other python block is executed in the test's process.
- ``# prints: TEXT`` at the end of a line claims that the block prints the line TEXT; the printed
  lines must equal the claims, in order (multi-rank blocks print on rank 0 only).
- A first line ``# not run: <reason>`` exempts a block (it needs a cluster, a GPU...).
- A ```bash block holds commands; ``make`` targets must exist in the Makefile and programs be one
  of make, python, torchrun, mpiexec, pip.
- A ```yaml block holding a ``default`` entry is a config: ``explain`` accepts it for
  ``distconv.models.resnet_mini`` on 4 ranks.
- README lines are at most 100 columns; its relative links name files that exist.
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
from tests.optional import need

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("**/*.md"))]
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _blocks(lang: str) -> list[tuple[str, str]]:
    """``(where, code)`` of every ``lang`` block: ``where`` is ``path:line`` of the fence."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in _FENCE.finditer(text):
            if m.group(1) == lang:
                line = text[: m.start()].count("\n") + 1
                found.append((f"{page.relative_to(ROOT)}:{line}", m.group(2)))
    return found


def _claims(code: str) -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"#\s*prints:\s*(.*)$", code, re.M)]


PYTHON = _blocks("python")
_LAUNCH = re.compile(r"^\s+launch\(main, (\d+)\)", re.M)


def test_readme_has_a_complete_program():
    assert any(where.startswith("README.md:") and "# prints:" in code for where, code in PYTHON)


@pytest.mark.parametrize("where, code", PYTHON, ids=[w for w, _ in PYTHON])
def test_python_block_runs_and_prints_what_it_claims(where, code, tmp_path):
    first = code.splitlines()[0].strip()
    if first.startswith("# not run:"):
        assert first.removeprefix("# not run:").strip(), "a block not run must say why"
        pytest.skip(first)
    claims = _claims(code)
    launched = _LAUNCH.search(code)
    if launched and "def main(comm)" in code and first != "# run: processes":
        namespace: dict = {"__name__": "docs_block"}
        exec(compile(code, where, "exec"), namespace)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            run_threads(namespace["main"], int(launched.group(1)))
        printed = out.getvalue()
    elif "__main__" not in code:                     # a plain script: run it in this process
        namespace = {"__name__": "__main__"}
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, where, "exec"), namespace)
        printed = out.getvalue()
    else:                                              # its own entry point: a fresh process
        script = tmp_path / "block.py"
        script.write_text(code)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                              timeout=240, env=env, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        printed = proc.stdout
    assert [p.strip() for p in printed.splitlines() if p.strip()] == claims


@pytest.mark.parametrize("where, code", _blocks("bash"), ids=[w for w, _ in _blocks("bash")])
def test_bash_block_names_real_commands(where, code):
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    for cmd in code.splitlines():
        cmd = cmd.split("#", 1)[0].strip()
        if not cmd:
            continue
        words = cmd.split()
        prog = words[0].removeprefix(".venv/bin/")
        assert prog in ("make", "python", "torchrun", "mpiexec", "pip", "source"), cmd
        if prog == "make":
            assert words[1] in targets, f"{where}: no make target {words[1]!r}"


CONFIGS = [(w, c) for w, c in _blocks("yaml") if re.search(r"^default:", c, re.M)]


@pytest.mark.parametrize("where, code", CONFIGS, ids=[w for w, _ in CONFIGS])
def test_yaml_config_is_accepted(where, code):
    yaml = need("yaml")
    from distconv import explain
    from distconv.models import resnet_mini

    explain(resnet_mini(), yaml.safe_load(code), (8, 3, 32, 32), world_size=4)


def test_readme_lines_fit_100_columns():
    long = [n for n, line in enumerate(README.read_text().splitlines(), 1) if len(line) > 100]
    assert not long, f"README.md lines over 100 columns: {long}"


def test_readme_links_name_existing_files():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert not missing, f"README.md links to missing files: {missing}"
