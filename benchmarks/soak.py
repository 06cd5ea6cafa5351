"""Repetition soak: run the 4-process example under ``torchrun`` and ``mpiexec`` many times.

Each run is the short script a user writes (``init()``, a ``{N: 2, C: 2}`` grid,
``DistConv2d.from_conv2d``, one forward, a print, end of script), half of the runs ending with an
explicit ``distconv.comm.shutdown()`` and half simply ending. A run passes when the launcher exits
0 within the time limit, every rank printed the expected line and no process of the run is left
behind. The summary counts exit codes per launcher; the tails of failing logs are printed and
saved with the JSON results.

    python benchmarks/soak.py --runs 200            # 100 torchrun + 100 mpiexec runs
    python benchmarks/soak.py --runs 20 --jobs 2 --launchers torchrun
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BIN = Path(sys.executable).parent
EXPECTED = "y[o,o_C,o,o] (2, 2, 6, 6)"
_TELLING = re.compile(r"terminate called|Traceback|Error|Abort|Signal \d+|exitcode")


def example(explicit_shutdown: bool) -> None:
    """The user's script (run on every rank)."""
    import torch
    from torch import nn

    from distconv import ProcessorGrid
    from distconv.comm import init
    from distconv.nn import DistConv2d

    comm = init()
    grid = ProcessorGrid({"N": 2, "C": 2}, comm=comm)
    torch.manual_seed(0)
    conv = DistConv2d.from_conv2d(nn.Conv2d(4, 4, 3, padding=1), grid=grid,
                                  algorithm="stationary-x")
    x = torch.randn(4, 4, 6, 6)
    y = conv(x[conv.input_dist.local_slices(x.shape, grid)], global_shape=x.shape)
    print(f"rank {comm.rank}: {conv.output_dist.format('y')} {tuple(y.shape)}", flush=True)
    if explicit_shutdown:
        from distconv.comm import shutdown

        shutdown()


def command(launcher: str, explicit: bool) -> list[str]:
    child = [str(Path(__file__).resolve()), "--child"] + (["--explicit-shutdown"] if explicit else [])
    if launcher == "torchrun":
        return [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "4"] + child
    mpiexec = BIN / "mpiexec" if (BIN / "mpiexec").exists() else Path("mpiexec")
    return [str(mpiexec), "-n", "4", sys.executable] + child


def leftover(pgid: int) -> bool:
    """Whether a process of the run's process group is still alive."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def one_run(i: int, launcher: str, explicit: bool, limit: float, tree: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=tree)
    begin = time.monotonic()
    proc = subprocess.Popen(
        command(launcher, explicit), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
        start_new_session=True, text=True,
    )
    try:
        out, _ = proc.communicate(timeout=limit)
        code: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        code = "hang"
    seconds = time.monotonic() - begin
    time.sleep(0.2)  # let the launcher's children finish exiting before looking for leftovers
    leaked = leftover(proc.pid)
    if leaked:
        os.killpg(proc.pid, signal.SIGKILL)
    printed = out.count(EXPECTED)  # ranks' lines may interleave
    ok = code == 0 and printed == 4 and not leaked
    return {
        "run": i, "launcher": launcher, "explicit_shutdown": explicit, "exit": code,
        "ranks_printed": printed, "leaked": leaked, "seconds": round(seconds, 2), "ok": ok,
        "tail": None if ok else _tail(out),
    }


def _tail(out: str, n: int = 25) -> str:
    """The last ``n`` lines, after the telling lines from earlier in the log (the launcher's
    summary of a failure is long and names no cause)."""
    lines = out.splitlines()
    telling = [line for line in lines[:-n] if _TELLING.search(line)]
    return "\n".join(telling[:10] + (["..."] if telling else []) + lines[-n:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=200, help="runs in all, split over the launchers")
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1)")
    ap.add_argument("--launchers", default="torchrun,mpiexec")
    ap.add_argument("--ending", choices=("both", "simple", "shutdown"), default="both",
                    help="how the runs end: half and half (default), all simply ending, or all "
                         "calling distconv.comm.shutdown()")
    ap.add_argument("--limit", type=float, default=180.0, help="seconds before a run is a hang")
    ap.add_argument("--out", default=str(HERE / "results" / "soak.json"))
    ap.add_argument("--tree", default=str(ROOT),
                    help="directory holding the distconv package to run (default: this checkout;"
                         " a copy keeps edits made during a long soak out of it)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--explicit-shutdown", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        example(args.explicit_shutdown)
        return
    launchers = [name for name in args.launchers.split(",") if name]
    def explicit(i: int) -> bool:
        return {"simple": False, "shutdown": True}.get(args.ending, (i // len(launchers)) % 2 == 1)

    plan = [(i, launchers[i % len(launchers)], explicit(i)) for i in range(args.runs)]
    results = []
    with ThreadPoolExecutor(args.jobs) as ex:
        futures = [ex.submit(one_run, i, name, explicit, args.limit, args.tree) for i, name, explicit in plan]
        for f in futures:
            r = f.result()
            results.append(r)
            if not r["ok"]:
                print(f"--- run {r['run']} ({r['launcher']}, exit {r['exit']}, "
                      f"printed {r['ranks_printed']}/4, leaked {r['leaked']}):\n{r['tail']}",
                      flush=True)
    summary = {}
    for name in launchers:
        mine = [r for r in results if r["launcher"] == name]
        codes = collections.Counter(str(r["exit"]) for r in mine)
        summary[name] = {
            "runs": len(mine), "ok": sum(r["ok"] for r in mine), "exit_codes": dict(codes),
            "leaked": sum(r["leaked"] for r in mine),
            "mean_s": round(sum(r["seconds"] for r in mine) / max(len(mine), 1), 2),
        }
        print(f"{name:9s} {summary[name]['ok']}/{len(mine)} clean; exit codes {dict(codes)}; "
              f"leaked {summary[name]['leaked']}; mean {summary[name]['mean_s']} s per run")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"summary": summary, "runs": results}, indent=1))
    print(f"wrote {args.out}")
    sys.exit(0 if all(r["ok"] for r in results) else 1)


if __name__ == "__main__":
    main()
