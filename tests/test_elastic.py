"""A world that loses a rank resumes from its last complete checkpoint and ends where an
uninterrupted run ends, bit for bit: ``examples/elastic.py`` on 2 gloo ranks under ``torchrun
--max-restarts 1``, rank 1 SIGKILLed as its asynchronous save of step 6 is in flight, against the
same run without the kill (both started at once, to share the start-up time)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import distconv

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "elastic.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
ARGS = ["--steps", "8", "--every", "2", "--samples", "24", "--batch", "8", "--async-save",
        "--timeout", "20"]

pytestmark = [
    pytest.mark.gloo,
    pytest.mark.timeout(400),  # a hang guard, generous for a loaded machine
    pytest.mark.skipif(not (TORCHRUN.exists() or shutil.which("torchrun")),
                       reason="needs torchrun beside python or on PATH"),
]


def _start(directory: Path, *extra: str) -> subprocess.Popen:
    torchrun = str(TORCHRUN) if TORCHRUN.exists() else shutil.which("torchrun")
    # torchrun's shared rendezvous store as it comes: init keys each attempt apart in it
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
           str(EXAMPLE), "--dir", str(directory), *ARGS, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)


def _finish(proc: subprocess.Popen) -> str:
    try:
        out, _ = proc.communicate(timeout=360)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        pytest.fail(f"the run hung:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    return out


def _sections(path: Path) -> dict:
    return {s: distconv.consolidate(path, section=s, verify=True)
            for s in ("model", "optimizer", "sampler", "scheduler", "extra")}


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_run_killed_mid_save_resumes_to_the_uninterrupted_parameters_bitwise(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    procs = [_start(whole), _start(killed, "--die-at-step", "6", "--die-rank", "1",
                                   "--die-point", "save")]
    out_whole, out_killed = (_finish(p) for p in procs)
    assert "resumed" not in out_whole
    assert "rank 1: SIGKILL at step 6 (save)" in out_killed
    assert ("resumed from step 4 on 2 ranks" in out_killed
            or "resumed from step 6 on 2 ranks" in out_killed), out_killed[-3000:]
    assert (killed / ".died-step6-rank1").exists()
    want, got = _sections(whole / "step-000008"), _sections(killed / "step-000008")
    assert _equal(got, want)
    assert len(got["extra"]["losses"]) == 8
