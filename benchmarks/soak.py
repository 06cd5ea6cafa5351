"""Repetition soak: run the 4-process example under ``torchrun`` and ``mpiexec`` many times.

Each run is the short script a user writes (``init()``, a ``{N: 2, C: 2}`` grid,
``DistConv2d.from_conv2d``, one forward, a print, end of script), half of the runs ending with an
explicit ``distconv.comm.shutdown()`` and half simply ending. A run passes when the launcher exits
0 within the time limit, every rank printed the expected line and no process of the run is left
behind. The summary counts exit codes per launcher; the tails of failing logs are printed and
saved with the JSON results.

    python benchmarks/soak.py --runs 200            # 100 torchrun + 100 mpiexec runs
    python benchmarks/soak.py --runs 20 --jobs 2 --launchers torchrun

``--faults N`` soaks elastic resume instead (``examples/elastic.py`` on 4 ranks): N runs, each
SIGKILLing a random rank at a random step (or while a random checkpoint is written, synchronously
or asynchronously), under ``torchrun --max-restarts 3`` or under ``mpiexec`` rerun as a scheduler
would (the launchers alternate). A run is recovered when it finishes within ``--limit`` with no
process left behind, every checkpoint directory left is complete and loads with its hashes
checked (or has no index: an interrupted save, ignored), it resumed from its last complete
checkpoint, and its final state (parameters, momentum, scheduler, sampler, RNG, losses) equals an
uninterrupted run's on the same launcher bit for bit. Beside them: worlds started without a
launcher that would kill the survivors, to time how long the survivors of a SIGKILL take to leave
on their own (the communicator timeout bounds it), and a run killed on 4 ranks and resumed on 2
with the config re-planned, whose loss curve is plotted beside the uninterrupted one.

    python benchmarks/soak.py --faults 50           # 25 torchrun + 25 mpiexec fault runs
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
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


def launch_once(cmd: list[str], env: dict[str, str], limit: float) -> tuple[int | str, str, float, bool]:
    """Run ``cmd`` in a session of its own: (exit code or "hang", output, seconds, leaked)."""
    begin = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, text=True)
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
    return code, out, seconds, leaked


def one_run(i: int, launcher: str, explicit: bool, limit: float, tree: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=tree)
    code, out, seconds, leaked = launch_once(command(launcher, explicit), env, limit)
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


# ------------------------------------------------------------------ --faults: elastic resume
SECTIONS = ("model", "optimizer", "sampler", "scheduler", "extra")
RANKS = 4
_RESUMED = re.compile(r"resumed from step (\d+) on (\d+) ranks")
_IGNORED = re.compile(r"ignored (step-\d+): no index")


def elastic_env(tree: str) -> dict[str, str]:
    # torchrun's shared rendezvous store as it comes: init keys each attempt apart in it
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=tree)
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    return env


def elastic_command(launcher: str, tree: str, nproc: int, restarts: int, args: list[str]) -> list[str]:
    script = [str(Path(tree) / "examples" / "elastic.py"), *args]
    if launcher == "torchrun":
        return [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(nproc),
                "--max-restarts", str(restarts), *script]
    mpiexec = BIN / "mpiexec" if (BIN / "mpiexec").exists() else Path("mpiexec")
    return [str(mpiexec), "-n", str(nproc), sys.executable, *script]


def same(a, b) -> bool:
    """Bitwise equality of two checkpoint sections (tensors, dicts, lists, plain values)."""
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def final_state(directory: Path, steps: int) -> dict | None:
    import distconv

    path = directory / f"step-{steps:06d}"
    try:
        return {s: distconv.consolidate(path, section=s, verify=True) for s in SECTIONS}
    except Exception:
        return None


def check_dirs(directory: Path) -> dict:
    """Every checkpoint directory left: complete (its index there, every section loads with its
    SHA-256s checked), incomplete (no index: ignored by a resume) or corrupt (an index, but it
    does not load)."""
    import distconv
    from distconv.checkpoint import INDEX_NAME

    complete, incomplete, corrupt = [], [], []
    for d in sorted(directory.glob("step-*")):
        if not (d / INDEX_NAME).is_file():
            incomplete.append(d.name)
            continue
        try:
            for s in SECTIONS:
                distconv.consolidate(d, section=s, verify=True)
            complete.append(d.name)
        except Exception as exc:
            corrupt.append(f"{d.name}: {type(exc).__name__}: {exc}")
    return {"complete": complete, "incomplete": incomplete, "corrupt": corrupt}


def elastic_world(launcher: str, tree: str, directory: Path, args: list[str], limit: float,
                  nproc: int = RANKS, restarts: int = 3) -> dict:
    """One job: torchrun restarts the world itself; an mpiexec job is rerun (up to
    ``restarts`` more times) as a scheduler would, until it exits 0."""
    cmd = elastic_command(launcher, tree, nproc, restarts, ["--dir", str(directory), *args])
    attempts, outs, seconds, leaked = 0, [], 0.0, False
    while True:
        code, out, took, leak = launch_once(cmd, elastic_env(tree), limit)
        attempts, seconds, leaked = attempts + 1, seconds + took, leaked or leak
        outs.append(out)
        if launcher == "torchrun" or code in (0, "hang") or attempts > restarts:
            break
    out = "\n".join(outs)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "launcher.log", "a") as log:  # the whole output, kept for a post-mortem
        log.write(out)
    return {"exit": code, "attempts": attempts, "seconds": round(seconds, 2), "leaked": leaked,
            "finished": f"finished {_steps_of(args)} steps" in out, "out": out}


def _steps_of(args: list[str]) -> int:
    return int(args[args.index("--steps") + 1])


def fault_run(i: int, launcher: str, rng: random.Random, opts: argparse.Namespace,
              work: Path, baseline: dict) -> dict:
    steps, every = opts.fault_steps, opts.fault_every
    point = rng.choice(("step", "save"))
    step = rng.choice(range(every, steps + 1, every)) if point == "save" else rng.randint(1, steps)
    rank, asynchronous = rng.randrange(RANKS), rng.random() < 0.5
    fault = {"rank": rank, "step": step, "point": point, "async_save": asynchronous}
    directory = work / f"fault-{i:03d}-{launcher}"
    args = ["--steps", str(steps), "--every", str(every), "--timeout", str(opts.fault_timeout),
            "--die-at-step", str(step), "--die-rank", str(rank), "--die-point", point]
    args += ["--async-save"] if asynchronous else []
    run = elastic_world(launcher, opts.tree, directory, args, opts.limit)
    out = run.pop("out")
    resumed = [int(m.group(1)) for m in _RESUMED.finditer(out)]
    # the resume starts from the newest checkpoint complete at the kill: the last one before
    # the kill, or the one before that if the kill caught its save in flight (the kill's own
    # save, or an asynchronous one still writing); 0 is a fresh start
    before = step if point == "save" else step - 1
    newest = before - before % every
    caught = point == "save" or asynchronous
    allowed = {newest, max(newest - every, 0)} if caught else {newest}
    resume_ok = (resumed[0] if resumed else 0) in allowed
    dirs = check_dirs(directory)
    got = final_state(directory, steps)
    bitwise = got is not None and same(got, baseline[launcher])
    killed = f"rank {rank}: SIGKILL at step {step}" in out
    ok = (run["exit"] == 0 and run["finished"] and not run["leaked"] and killed and resume_ok
          and bitwise and not dirs["corrupt"])
    return {
        "run": i, "launcher": launcher, "fault": fault, **run, "killed": killed,
        "resumed_from": resumed, "ignored_incomplete": _IGNORED.findall(out),
        "resume_ok": resume_ok, "bitwise": bitwise, "dirs": dirs, "ok": ok,
        "survivors_raised": len(set(re.findall(r"\[rank(\d)\]: distconv\.comm\.errors\.Comm", out))),
        "tail": None if ok else _tail(out, 40),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def survivor_run(j: int, opts: argparse.Namespace, work: Path, rng: random.Random) -> dict:
    """A 4-rank gloo world started without a launcher (nothing kills the survivors): one rank
    SIGKILLs itself; each survivor must leave by itself, within the communicator timeout."""
    steps, every, timeout = opts.fault_steps, opts.fault_every, opts.fault_timeout
    asynchronous = j % 2 == 1  # odd runs: killed as an asynchronous save is in flight
    step = rng.choice(range(every, steps, every)) if asynchronous else rng.randint(2, steps - 1)
    rank = rng.randrange(RANKS)
    directory = work / f"survivors-{j:02d}"
    args = [str(Path(opts.tree) / "examples" / "elastic.py"), "--dir", str(directory),
            "--steps", str(steps), "--every", str(every), "--timeout", str(timeout),
            "--die-at-step", str(step), "--die-rank", str(rank)]
    args += ["--async-save", "--die-point", "save"] if asynchronous else []
    port = free_port()
    procs = []
    for r in range(RANKS):
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")}
        env.update(OMP_NUM_THREADS="1", PYTHONPATH=opts.tree, RANK=str(r), LOCAL_RANK=str(r),
                   WORLD_SIZE=str(RANKS), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True))
    ended: dict[int, float] = {}
    deadline = time.monotonic() + opts.limit
    while len(ended) < RANKS and time.monotonic() < deadline:
        for r, p in enumerate(procs):
            if r not in ended and p.poll() is not None:
                ended[r] = time.time()
        time.sleep(0.05)
    for r, p in enumerate(procs):
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    marker = directory / f".died-step{step}-rank{rank}"
    killed_at = float(marker.read_text()) if marker.exists() else None
    left = {r: round(t - killed_at, 2) for r, t in ended.items() if r != rank} if killed_at else {}
    ok = killed_at is not None and len(left) == RANKS - 1 and all(
        s <= timeout + opts.survivor_slack for s in left.values()) and all(
        procs[r].returncode != 0 for r in left)
    return {"run": j, "fault": {"rank": rank, "step": step, "async_save": asynchronous},
            "survivors_left_after_s": left, "exit_codes": [p.returncode for p in procs],
            "timeout": timeout, "ok": ok}


def reshard_run(opts: argparse.Namespace, work: Path, baseline: dict, rng: random.Random) -> dict:
    """Killed on 4 ranks (no restart), resumed on 2 with the config re-planned for 2."""
    import torch

    steps, every = opts.fault_steps, opts.fault_every
    step, rank = rng.randint(every + 1, steps - 1), rng.randrange(RANKS)
    directory = work / "reshard"
    common = ["--steps", str(steps), "--every", str(every), "--timeout", str(opts.fault_timeout)]
    first = elastic_world("torchrun", opts.tree, directory,
                          [*common, "--die-at-step", str(step), "--die-rank", str(rank)],
                          opts.limit, restarts=0)
    second = elastic_world("torchrun", opts.tree, directory, common, opts.limit, nproc=2,
                           restarts=0)
    resumed = [int(m.group(1)) for m in _RESUMED.finditer(second["out"])]
    got = final_state(directory, steps)
    want = baseline["torchrun"]
    result = {"fault": {"rank": rank, "step": step}, "first_exit": first["exit"],
              "exit": second["exit"], "resumed_from": resumed, "dirs": check_dirs(directory),
              "losses_4_ranks": want["extra"]["losses"]}
    if got is None or not resumed:
        return {**result, "ok": False, "tail": _tail(second["out"], 60)}
    at = resumed[0]
    mine, theirs = got["extra"]["losses"], want["extra"]["losses"]
    param = max(float((got["model"][k].double() - want["model"][k].double()).abs().max())
                for k in want["model"])
    return {**result, "losses_resumed_on_2": mine,
            "history_kept_bitwise": mine[:at] == theirs[:at],
            "max_loss_diff_after_resume": max(abs(a - b) for a, b in zip(mine[at:], theirs[at:])),
            "max_param_diff_at_end": param,
            "final_loss": {"4_ranks": theirs[-1], "resumed_on_2": mine[-1]},
            "ok": second["exit"] == 0 and second["finished"] and mine[:at] == theirs[:at]
            and not result["dirs"]["corrupt"] and torch.isfinite(torch.tensor(mine)).all().item()}


def plot_reshard(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    whole = result["losses_4_ranks"]
    ax.plot(range(1, len(whole) + 1), whole, "k-", label="4 ranks, uninterrupted")
    if "losses_resumed_on_2" in result:
        at, mine = result["resumed_from"][0], result["losses_resumed_on_2"]
        ax.plot(range(at + 1, len(mine) + 1), mine[at:], "C1--", marker=".",
                label=f"killed at step {result['fault']['step']}, resumed on 2 ranks")
        ax.axvline(at, color="gray", lw=0.8, ls=":")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (global batch)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def fault_soak(opts: argparse.Namespace) -> bool:
    from tqdm import tqdm

    sys.path.insert(0, opts.tree)  # check the checkpoints with the distconv that wrote them
    rng = random.Random(opts.seed)
    launchers = [name for name in opts.fault_launchers.split(",") if name]
    work = Path(opts.work or tempfile.mkdtemp(prefix="distconv-soak-"))
    common = ["--steps", str(opts.fault_steps), "--every", str(opts.fault_every),
              "--timeout", str(opts.fault_timeout)]
    baseline, base_seconds = {}, {}
    for name in sorted(set(launchers) | {"torchrun"}):
        run = elastic_world(name, opts.tree, work / f"uninterrupted-{name}", common, opts.limit)
        baseline[name] = final_state(work / f"uninterrupted-{name}", opts.fault_steps)
        base_seconds[name] = run["seconds"]
        if run["exit"] != 0 or baseline[name] is None:
            print(f"the uninterrupted {name} run failed:\n{_tail(run['out'], 40)}")
            return False
        print(f"uninterrupted {name} run: {run['seconds']} s", flush=True)
    results = []
    bar = tqdm(range(opts.faults), desc="fault runs", unit="run")
    for i in bar:
        r = fault_run(i, launchers[i % len(launchers)], rng, opts, work, baseline)
        results.append(r)
        bar.set_postfix(recovered=sum(x["ok"] for x in results),
                        hangs=sum(x["exit"] == "hang" for x in results),
                        corrupt=sum(len(x["dirs"]["corrupt"]) for x in results))
        if not r["ok"]:
            tqdm.write(f"--- fault run {i} ({r['launcher']}, {r['fault']}, exit {r['exit']}, "
                       f"resumed {r['resumed_from']}, bitwise {r['bitwise']}, dirs {r['dirs']}):"
                       f"\n{r['tail']}")
    survivors = [survivor_run(j, opts, work, rng)
                 for j in tqdm(range(opts.survivors), desc="survivor runs", unit="run")]
    reshard = reshard_run(opts, work, baseline, rng)
    out = Path(opts.faults_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot_reshard(reshard, out.with_suffix(".png"))

    summary = {}
    for name in launchers:
        mine = [r for r in results if r["launcher"] == name]
        summary[name] = {
            "runs": len(mine), "recovered": sum(r["ok"] for r in mine),
            "hangs": sum(r["exit"] == "hang" for r in mine),
            "corrupt_checkpoints": sum(len(r["dirs"]["corrupt"]) for r in mine),
            "bitwise": sum(r["bitwise"] for r in mine),
            "leaked": sum(r["leaked"] for r in mine),
            "incomplete_saves_skipped": sum(len(r["ignored_incomplete"]) for r in mine),
            "uninterrupted_s": base_seconds[name],
            "mean_s": round(sum(r["seconds"] for r in mine) / max(len(mine), 1), 2),
            "max_s": max((r["seconds"] for r in mine), default=0.0),
        }
        s = summary[name]
        print(f"{name:9s} recovered {s['recovered']}/{s['runs']}, hangs {s['hangs']}, corrupt "
              f"checkpoints {s['corrupt_checkpoints']}, final state bitwise {s['bitwise']}/"
              f"{s['runs']}, leaked {s['leaked']}; interrupted saves skipped on resume "
              f"{s['incomplete_saves_skipped']}; {s['mean_s']} s per run (max {s['max_s']}, "
              f"uninterrupted {s['uninterrupted_s']})")
    total = {k: sum(s[k] for s in summary.values())
             for k in ("runs", "recovered", "hangs", "corrupt_checkpoints")}
    print(f"all       recovered {total['recovered']}/{total['runs']}, hangs {total['hangs']}, "
          f"corrupt checkpoints {total['corrupt_checkpoints']}")
    left = [t for s in survivors for t in s["survivors_left_after_s"].values()]
    print(f"survivors without a launcher to kill them: {sum(s['ok'] for s in survivors)}/"
          f"{len(survivors)} runs left within the {opts.fault_timeout} s timeout (+"
          f"{opts.survivor_slack} s); slowest survivor {max(left, default=float('nan')):.1f} s "
          "after the kill")
    if "losses_resumed_on_2" in reshard:
        print(f"4 -> 2 ranks: killed at step {reshard['fault']['step']}, resumed from step "
              f"{reshard['resumed_from'][0]}; history kept bitwise "
              f"{reshard['history_kept_bitwise']}; largest loss difference after the resume "
              f"{reshard['max_loss_diff_after_resume']:.2e}, largest parameter difference at "
              f"the end {reshard['max_param_diff_at_end']:.2e}; final loss "
              f"{reshard['final_loss']['resumed_on_2']:.6f} (4 ranks: "
              f"{reshard['final_loss']['4_ranks']:.6f})")
    else:
        print(f"4 -> 2 ranks: FAILED (exit {reshard['exit']}):\n{reshard.get('tail')}")
    out.write_text(json.dumps({"summary": summary, "total": total, "runs": results,
                               "survivors": survivors, "reshard": reshard,
                               "work": str(work), "seed": opts.seed}, indent=1))
    print(f"wrote {out} and {out.with_suffix('.png')} (checkpoints under {work})")
    return (total["recovered"] == total["runs"] and all(s["ok"] for s in survivors)
            and reshard["ok"])


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
    ap.add_argument("--faults", type=int, default=0,
                    help="soak elastic resume instead: N runs of examples/elastic.py, each "
                         "killing a random rank with SIGKILL at a random step")
    ap.add_argument("--fault-launchers", default="torchrun,mpiexec",
                    help="launchers the fault runs alternate over (default torchrun,mpiexec)")
    ap.add_argument("--fault-steps", type=int, default=24, help="steps per fault run (24)")
    ap.add_argument("--fault-every", type=int, default=4, help="checkpoint interval (4)")
    ap.add_argument("--fault-timeout", type=float, default=20.0,
                    help="communicator timeout of the elastic runs, seconds (20)")
    ap.add_argument("--survivors", type=int, default=2,
                    help="worlds without a launcher, timing the survivors' exit (default 2)")
    ap.add_argument("--survivor-slack", type=float, default=10.0,
                    help="seconds a survivor may take beyond the timeout (start-up, exit)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random faults")
    ap.add_argument("--work", default=None, help="checkpoint directories (default: a new temp dir)")
    ap.add_argument("--faults-out", default=str(HERE / "results" / "soak_faults.json"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--explicit-shutdown", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        example(args.explicit_shutdown)
        return
    if args.faults:
        sys.exit(0 if fault_soak(args) else 1)
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
