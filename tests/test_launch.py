"""One program, unchanged, under ``python``, ``torchrun --nproc-per-node 2`` and ``mpiexec -n 2``:
``launch(main, 2)`` starts two local ranks by itself, or joins the launcher's world; every rank
sees the script's ``sys.argv``. A job of another size is refused at once, saying what to run."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import distconv.comm as dcomm
from distconv.launch import launch
from distconv.testing import find_mpiexec

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

PROGRAM = '''\
import sys

import torch

import distconv
from distconv.launch import launch


def main(comm):
    total = comm.allreduce(torch.ones(1) * (comm.rank + 1))
    print(f"rank {comm.rank} of {comm.size}: {total.item()} {sys.argv[1:]}", flush=True)


if __name__ == "__main__":
    launch(main, 2)
'''


def _run(tmp_path: Path, *launcher: str) -> list[str]:
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                *dcomm._MPI_RANK_VARS):
        env.pop(var, None)
    proc = subprocess.run([*launcher, str(script), "--steps", "3"], capture_output=True,
                          text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # two processes share the pipe: a launcher may interleave their lines, so read the records
    return sorted(re.findall(r"rank \d+ of \d+: [^\[]*\[[^\]]*\]", proc.stdout))


EXPECTED = [f"rank {r} of 2: 3.0 ['--steps', '3']" for r in range(2)]


@pytest.mark.gloo
def test_a_launch_program_runs_unchanged_under_python_and_torchrun(tmp_path: Path) -> None:
    assert _run(tmp_path, sys.executable) == EXPECTED
    torchrun = BIN / "torchrun" if (BIN / "torchrun").exists() else shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("needs torchrun beside python or on PATH")
    assert _run(tmp_path, str(torchrun), "--standalone", "--nproc-per-node", "2") == EXPECTED


@pytest.mark.mpi
def test_a_launch_program_runs_unchanged_under_mpiexec(tmp_path: Path) -> None:
    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.skip("needs an mpiexec beside python or on PATH (pip install mpich)")
    assert _run(tmp_path, mpiexec, "-n", "2", sys.executable) == EXPECTED


def _never_called(comm):  # pragma: no cover - the launch is refused before
    raise AssertionError("launch ran fn in a job of the wrong size")


def test_launch_in_a_job_of_another_size_is_refused_at_once(monkeypatch) -> None:
    """A torchrun job of one process (its variables set here): ``launch(fn, 2)`` joins it and
    refuses, naming both ways out, instead of starting processes of its own."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(dcomm, "_world", None)
    for var in dcomm._MPI_RANK_VARS:
        monkeypatch.delenv(var, raising=False)
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port))):
        monkeypatch.setenv(var, value)
    try:
        with pytest.raises(ValueError) as info:
            launch(_never_called, 2, timeout=20.0)
    finally:
        dcomm.shutdown()
    msg = str(info.value)
    assert "job of 1 processes" in msg and "torchrun --nproc-per-node 2" in msg
    assert "fn(distconv.comm.init())" in msg


def test_an_uncaught_refusal_in_a_job_is_one_line_per_rank(tmp_path: Path) -> None:
    """Under a launcher (torchrun's variables for a job of one process), the wrong job size is
    reported as one line (torch prefixes it with the rank) naming the fix, with no traceback,
    and torchrun's error file carries the same line for its summary."""
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    error_file = tmp_path / "error.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               TORCHELASTIC_ERROR_FILE=str(error_file))
    for var in (*dcomm._MPI_RANK_VARS, "DISTCONV_TRACEBACK"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert re.fullmatch(r"\[rank0\]: ValueError: launch\(fn, 2\) runs in a job of 1 processes .*"
                        r"start it with `torchrun --nproc-per-node 2`.*", lines[0]), lines[0]
    assert "ValueError: launch(fn, 2) runs in a job of 1" in error_file.read_text()


@pytest.mark.gloo
def test_distconv_run_ends_a_failed_job_in_one_line_per_rank(tmp_path: Path) -> None:
    """``python -m distconv.run`` is torchrun whose failed job prints no traceback: each rank's
    refusal (a program of 2 ranks in a job of 3) is its own line, then one line per failed
    rank from the runner, and the job's exit code is the ranks'."""
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                "DISTCONV_TRACEBACK", *dcomm._MPI_RANK_VARS):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-m", "distconv.run", "--standalone",
                           "--nproc-per-node", "3", str(script)], capture_output=True,
                          text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr
    refusal = (r"ValueError: launch\(fn, 2\) runs in a job of 3 processes .*start it with "
               r"`torchrun --nproc-per-node 2`.*")
    # torchrun stops the other ranks once one fails: one that was stopped before it reached
    # its refusal has no line of its own; every line there is is the refusal
    own = [ln for ln in proc.stderr.splitlines() if ln.startswith("[rank")]
    assert own and all(re.fullmatch(r"\[rank\d\]: " + refusal, ln) for ln in own), proc.stderr
    summary = [ln for ln in proc.stderr.splitlines() if ln.startswith("distconv.run:")]
    failed = [ln for ln in summary if "(exit code 1)" in ln]
    assert failed and all(re.fullmatch(r"distconv\.run: rank \d failed \(exit code 1\): "
                                       + refusal, ln) for ln in failed), proc.stderr
    assert all("(stopped by SIGTERM)" in ln for ln in summary if ln not in failed), proc.stderr
    assert len({ln.split()[2] for ln in summary}) == len(summary), proc.stderr
