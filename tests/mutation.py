"""Mutation check: does the suite fail when the code has a realistic bug?

Each mutant replaces one exact piece of source text (it must occur exactly once, else the mutant
is reported ``stale``: the code moved and the list needs updating). The tree (``distconv``,
``distkfac``, ``tests``, ``examples`` and ``pyproject.toml``) is copied to a temporary directory
and the mutant is applied there; the working tree is never touched. The mutant's tests run on
the copy (``PYTHONPATH`` puts the copy first, and the test worlds' workers inherit it). A mutant
whose tests still pass *survived*: the suite has a gap there.

    python tests/mutation.py                 # every mutant
    python tests/mutation.py --list
    python tests/mutation.py threads-reduce-order allreduce-contiguity
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPY = ("distconv", "distkfac", "tests", "examples", "pyproject.toml")


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    why: str
    also: tuple[tuple[str, str, str], ...] = ()  # further (path, old, new) edits of one bug


MUTANTS = [
    Mutant("threads-reduce-order", "distconv/comm/threads.py",
           "return Work.completed(reduce_in_order(parts, op, self.size))",
           "return Work.completed(reduce_in_order(parts[::-1], op, self.size))",
           ("tests/comm/test_contracts.py", "tests/comm/test_threads.py"),
           "thread allreduce sums in reverse rank order (determinism promised)"),
    Mutant("gloo-reduce-scatter-order", "distconv/comm/torch_backend.py",
           "reduce_in_order(work.wait(), op, self.size)",
           "reduce_in_order(work.wait()[::-1], op, self.size)",
           ("tests/comm/test_contracts.py",),
           "gloo reduce-scatter (all-to-all + local sum) sums in reverse rank order"),
    Mutant("allreduce-contiguity", "distconv/comm/base.py",
           't = self._tensor(t, "t").contiguous()\n        op = self._reduce_op(op, t.dtype)',
           't = self._tensor(t, "t")\n        op = self._reduce_op(op, t.dtype)',
           ("tests/comm/test_contracts.py",),
           "allreduce hands a non-contiguous tensor to the backend"),
    Mutant("threads-ignore-timeout", "distconv/comm/threads.py",
           "self._group.barrier.wait(timeout=self.timeout)",
           "self._group.barrier.wait()",
           ("tests/comm/test_contracts.py",),
           "a thread rank waits at the barrier forever"),
    Mutant("run-threads-unbounded-join", "distconv/testing/threads.py",
           "    _join(threads, group, comms, timeout)\n",
           "    [t.join() for t in threads]\n",
           ("tests/comm/test_contracts.py",),
           "run_threads waits forever for a rank that ignores its timeout"),
    Mutant("allreduce-bytes", "distconv/comm/base.py",
           "return ((size - 1) * b + (n - b)) * itemsize",
           "return ((size - 1) * b + n) * itemsize",
           ("tests/comm/test_threads.py", "tests/comm/test_contracts.py"),
           "the byte counter of an allreduce counts the own block too"),
    Mutant("mpi-avg-undivided", "distconv/comm/mpi_backend.py",
           "        if op == \"avg\":\n            res = res / size\n",
           "",
           ("tests/comm/test_backends.py", "tests/comm/test_contracts.py"),
           "MPI avg returns the sum"),
    Mutant("balanced-remainder-last", "distconv/distribution.py",
           "return index * q + min(index, r), q + (index < r)",
           "return index * q + max(0, index - (parts - r)), q + (index >= parts - r)",
           ("tests/test_distribution.py", "tests/test_redistribute.py"),
           "the remainder goes to the last blocks instead of the first"),
    Mutant("nested-block-short-coords", "distconv/distribution.py",
           "    if len(extents) != len(coords):\n",
           "    if False:\n",
           ("tests/test_validation.py",),
           "nested_block silently truncates to the shorter of extents and coords"),
    Mutant("pad-not-zeroed", "distconv/redistribute.py",
           "out = x.new_zeros(_with(x.shape, self.dim, n))",
           "out = x.new_empty(_with(x.shape, self.dim, n))",
           ("tests/test_redistribute.py",),
           "the adjoint of a slice pads with garbage instead of zeros"),
    Mutant("stationary-w-output-layout", "distconv/nn/conv.py",
           '"stationary-w": both(f, c)}[algorithm]',
           '"stationary-w": both(c, f)}[algorithm]',
           ("tests/nn/test_conv.py", "tests/nn/test_conv_layouts.py"),
           "stationary-w's output y[o,o_{F×C},o,o] becomes y[o,o_{C×F},o,o]"),
    Mutant("stationary-w-output-layout-and-model", "distconv/nn/conv.py",
           '"stationary-w": both(f, c)}[algorithm]',
           '"stationary-w": both(c, f)}[algorithm]',
           ("tests/nn/test_conv.py", "tests/nn/test_conv_layouts.py"),
           "the same wrong output layout, with the performance model moved along",
           also=(("distconv/perfmodel.py", "fy, fw, cw = _blk2(Fo, [pf, pc], [f, c])",
                  "fy, fw, cw = _blk2(Fo, [pc, pf], [c, f])"),)),
    Mutant("stationary-w-input-layout", "distconv/nn/conv.py",
           '"stationary-w": both(c, f)}[algorithm]',
           '"stationary-w": both(f, c)}[algorithm]',
           ("tests/nn/test_conv.py", "tests/nn/test_conv_layouts.py"),
           "stationary-w's input x[o,o_{C×F},o,o] becomes x[o,o_{F×C},o,o]"),
    Mutant("conv-halo-span", "distconv/conv_geometry.py",
           "return self.dilation * (self.kernel - 1) + 1",
           "return self.dilation * (self.kernel - 1) + 1 - (self.dilation > 1)",
           ("tests/nn/test_conv.py", "tests/test_halo.py"),
           "a dilated kernel reads one row too few"),
    Mutant("sample-path-ignores-global-shape", "distconv/nn/conv.py",
           "if self._local and global_shape is None and self.input_shape is None:",
           "if self._local:",
           ("tests/test_validation.py",),
           "a grid splitting only samples ignores a contradicting global_shape"),
    Mutant("scatter-no-debug-check", "distconv/redistribute.py",
           "    if get_debug():\n        agree_on_value(",
           "    if False:\n        agree_on_value(",
           ("tests/test_validation.py",),
           "debug mode no longer catches a scatter of data that differs across ranks"),
    Mutant("kfac-ema-decay", "distkfac/factors.py",
           "self.value.mul_(decay).add_(new, alpha=1.0 - decay)",
           "self.value.mul_(1.0 - decay).add_(new, alpha=decay)",
           ("tests/kfac/test_exactness.py",),
           "K-FAC's running average weighs the new factor with decay"),
    Mutant("allgather-adjoint-allgather", "distconv/redistribute.py",
           "    def adjoint(self) -> ReduceScatter:\n        return ReduceScatter(",
           "    def adjoint(self) -> ReduceScatter:\n        return AllGather(",
           ("tests/test_redistribute.py",),
           "the adjoint of an allgather is taken to be an allgather"),
    Mutant("halo-accumulate-overwrites", "distconv/halo.py",
           ".index_add_(dim, index, g)",
           ".index_copy_(dim, index, g)",
           ("tests/test_halo.py", "tests/nn/test_conv.py"),
           "halo gradients overwrite each other instead of adding"),
    Mutant("grid-column-major", "distconv/grid.py",
           "        for name, extent in reversed(self._layout):\n            rank, coords[name]",
           "        for name, extent in self._layout:\n            rank, coords[name]",
           ("tests/test_grid.py",),
           "ranks laid out column-major instead of row-major"),
    Mutant("tuple-entry-minor-first", "distconv/distribution.py",
           "    names = _split_names(m.group(1), spec)\n    return names[0] if len(names) == 1 else names",
           "    names = _split_names(m.group(1), spec)[::-1]\n    return names[0] if len(names) == 1 else names",
           ("tests/test_distribution.py",),
           "Dist.parse reads o_{F×C} minor first, as the paper prints it"),
    Mutant("threads-allgather-shares-buffers", "distconv/comm/threads.py",
           "return Work.completed([p.clone() for p in parts])",
           "return Work.completed(list(parts))",
           ("tests/comm/test_threads.py", "tests/comm/test_contracts.py", "tests/comm/test_api.py"),
           "thread allgather hands every rank the same result tensors"),
    Mutant("debug-check-ignores-alltoall-pairs", "distconv/comm/base.py",
           "    if not bad and sigs[0].sends is not None:",
           "    if False:",
           ("tests/comm/test_failures.py", "tests/comm/test_contracts.py"),
           "debug mode misses all-to-all send/receive shapes that do not pair up"),
    Mutant("grad-sync-double-count", "distconv/nn/grad_sync.py",
           "# later ones must not add their local part to an already complete gradient.\n"
           "            return grad if first else torch.zeros_like(grad)",
           "# later ones must not add their local part to an already complete gradient.\n"
           "            return grad",
           ("tests/nn/test_grad_sync.py", "tests/nn/test_conv.py"),
           "a second contribution to a synchronised gradient is added twice"),
    Mutant("rank-generator-ignores-rank", "distconv/testing/rng.py",
           'f"{seed}/{rank}"',
           'f"{seed}/0"',
           ("tests/test_rng.py",),
           "distinct=True gives every rank the same stream"),
    Mutant("value-check-shape-only", "distconv/comm/base.py",
           'desc = f"dtype={t.dtype}, shape={tuple(t.shape)}, sha1 {digest}"',
           'desc = f"dtype={t.dtype}, shape={tuple(t.shape)}"',
           ("tests/test_validation.py",),
           "debug mode compares only dtype and shape of inputs that must agree"),
    Mutant("no-shutdown-at-exit", "distconv/comm/__init__.py",
           "        _register_shutdown()\n        return _world\n",
           "        return _world\n",
           ("tests/test_validation.py",),
           "process groups are left to interpreter finalization (it aborts only sometimes; "
           "benchmarks/soak.py measures how often)"),
    Mutant("bn-chan-drops-between-term", "distconv/nn/batchnorm.py",
           "m2 = m2s.sum(0) + (ns * (means - mean).square()).sum(0)",
           "m2 = m2s.sum(0)",
           ("tests/nn/test_batchnorm.py",),
           "the combined variance drops the between-block term Σ n_r (mean_r - mean)²"),
    Mutant("bn-running-var-biased", "distconv/nn/batchnorm.py",
           "self._send_running(torch.cat([mean, var * (count / (count - 1))]), factor)",
           "self._send_running(torch.cat([mean, var]), factor)",
           ("tests/nn/test_batchnorm.py",),
           "the running variance takes the biased batch variance (no count/(count-1))"),
    Mutant("bn-segment-drops-w", "distconv/nn/batchnorm.py",
           'over = (0, 2, 3) if statistics == "global" else (2, 3)',
           'over = (0, 2) if statistics == "global" else (2,)',
           ("tests/nn/test_batchnorm.py",),
           "the statistics are reduced over the grid dims of N and H only, not W"),
    Mutant("bn-local-count-global", "distconv/nn/batchnorm.py",
           "count = x.shape[0] * shape[2] * shape[3]  # this sample block's values per channel",
           "count = shape[0] * shape[2] * shape[3]  # this sample block's values per channel",
           ("tests/test_statistics.py",),
           "local statistics divide a sample block's sums by the global batch's count"),
    Mutant("bn-settle-first-slice", "distconv/nn/batchnorm.py",
           "self._update_running(shared.result()[offset:offset + n], factor)",
           "self._update_running(shared.result()[:n], factor)",
           ("tests/test_statistics.py",),
           "every local-statistics layer settles the first layer's slice of the shared broadcast"),
    Mutant("bn-from-drops-bias-flag", "distconv/nn/batchnorm.py",
           'keep_requires_grad(out, layer, ("weight", "bias"))',
           'keep_requires_grad(out, layer, ("weight",))',
           ("tests/nn/test_batchnorm.py", "tests/test_idioms.py"),
           "from_batchnorm2d forgets a frozen bias (it trains again)"),
    Mutant("avgpool-ceil-overhang-counted", "distconv/nn/pool.py",
           "stop = min(start + k, n + p)",
           "stop = start + k",
           ("tests/nn/test_pool.py",),
           "a ceil_mode window's overhang past the padding is counted in the divisor"),
    Mutant("avgpool-exclude-pad-lead", "distconv/nn/pool.py",
           "else min(stop, n) - max(start, 0))",
           "else min(stop, n) - start)",
           ("tests/nn/test_pool.py",),
           "count_include_pad=False still counts the leading padding"),
    Mutant("pool-nested-blocks-minor-first", "distconv/nn/pool.py",
           "start, size = nested_block(n, self.extents, coords[::-1])",
           "start, size = nested_block(n, self.extents, coords)",
           ("tests/nn/test_pool.py",),
           "pooling over o_{P×Q} rows takes the block coordinates minor first"),
    Mutant("global-avgpool-local-count", "distconv/nn/pool.py",
           "return x.sum((2, 3), keepdim=True) / (shape[2] * shape[3])",
           "return x.sum((2, 3), keepdim=True) / (x.shape[2] * x.shape[3])",
           ("tests/nn/test_pool.py",),
           "global average pooling divides each block's sum by its local H·W, not the global"),
    Mutant("exit-scale-even-blocks", "distconv/parallel/model.py",
           'scale = 1.0 if self.loss_reduction == "sum" else n_local / self.global_batch_size',
           'scale = 1.0 if self.loss_reduction == "sum" else 1.0 / self.data_grid.extent("N")',
           ("tests/parallel/test_parallelize.py::test_uneven_blocks_and_sum_reduction",),
           "the exit scales the cotangent by 1/P_N instead of n_local/N (wrong for uneven blocks)"),
    Mutant("exit-root-first-replica-dim", "distconv/parallel/model.py",
           "root = all(grid.coords[d] == 0 for d in replicas)",
           "root = all(grid.coords[d] == 0 for d in replicas[:1])",
           ("tests/test_blindspots_parallel.py",),
           "with two replica dims in the data grid, the second's replicas keep their cotangent"),
    Mutant("config-last-entry-wins", "distconv/parallel/config.py",
           "for pattern, choice in self.layers:\n"
           "            if choice.algorithm and fnmatch",
           "for pattern, choice in reversed(self.layers):\n"
           "            if choice.algorithm and fnmatch",
           ("tests/parallel/test_config.py",),
           "the last matching config entry wins instead of the first"),
    Mutant("config-statistics-last-entry-wins", "distconv/parallel/config.py",
           "for pattern, choice in self.layers:\n"
           "            if choice.statistics is not None",
           "for pattern, choice in reversed(self.layers):\n"
           "            if choice.statistics is not None",
           ("tests/parallel/test_config.py", "tests/test_blindspots_parallel.py"),
           "a BatchNorm takes the statistics of the last matching entry instead of the first"),
    Mutant("graph-call-order-params", "distconv/parallel/graph.py",
           "    _order_like(gm, model)  # fx registers modules in call order; "
           "users expect theirs\n",
           "",
           ("tests/parallel/test_parallelize.py", "tests/test_idioms.py"),
           "parameters() lists shards in call order: optimizer state by position is renamed"),
    Mutant("placement-replica-first-holder", "distconv/parallel/placement.py",
           "if t != rank and mine[t % len(mine)] == rank)",
           "if t != rank and mine[0] == rank)",
           ("tests/test_ops.py", "tests/parallel/test_parallelize.py"),
           "repartition's sent bytes (its adjoint's) have every target read from the first "
           "holder, not t % k"),
    Mutant("meeting-tie-to-second", "distconv/ops/elementwise.py",
           "return b if cost_to_b < cost_to_a else a",
           "return b if cost_to_b <= cost_to_a else a",
           ("tests/test_planner.py", "tests/test_ops.py"),
           "operands that cost the same to move meet at the second's placement, not the first's"),
    Mutant("bn-price-drops-m2", "distconv/ops/norm.py",
           "fwd[r] = (s - 1) * (1 + 2 * c) * isz",
           "fwd[r] = (s - 1) * (1 + c) * isz",
           ("tests/test_ops.py",),
           "BatchNorm's statistics allgather is priced without the M2 term"),
    Mutant("mean-local-count", "distconv/ops/pool.py",
           "count = math.prod(in_shape[d % len(in_shape)] for d in dims)",
           "count = math.prod(args[0].shape[d] for d in dims)",
           ("tests/test_ops.py",),
           "x.mean over split dims divides each block's sum by its local count"),
    Mutant("pool-price-drops-corners", "distconv/ops/pool.py",
           "widths = (w, hi - lo)",
           "widths = (w, h)",
           ("tests/test_blindspots_ops.py",),
           "pooling's W halo exchange is priced without the corner rows the H exchange brought"),
    Mutant("cat-keeps-split-dim", "distconv/ops/elementwise.py",
           "            entries[dim] = None\n"
           "            return Placement(p.layout, Dist(tuple(entries)))",
           "            return Placement(p.layout, Dist(tuple(entries)))",
           ("tests/test_ops.py",),
           "torch.cat joins along a dim its operands keep split"),
    Mutant("ckpt-verify-skips-hash", "distconv/checkpoint/_load.py",
           "if digest != shard.sha256:",
           "if False:",
           ("tests/test_checkpoint.py",),
           "load(verify=True) never compares a shard's SHA-256"),
    Mutant("ckpt-piece-box-offset", "distconv/checkpoint/_plan.py",
           "(block.box[0][0] + rows[0], block.box[0][0] + rows[1])",
           "(rows[0], rows[1])",
           ("tests/test_checkpoint_fast.py", "tests/test_blindspots_checkpoint.py"),
           "a split block's row ranges are recorded from 0, not from the block's first row"),
    Mutant("ckpt-optimizer-sorted-names", "distconv/checkpoint/_sections.py",
           "order = [n for names in self.groups for n in names]",
           "order = sorted(n for names in self.groups for n in names)",
           ("tests/test_checkpoint.py", "tests/test_blindspots_checkpoint.py"),
           "optimizer state is named by sorted parameter names, not torch's group order"),
    Mutant("sharded-bias-g-offset", "distkfac/sharded.py",
           "return _g_cov(gy[:, self.offset: self.offset + self.g_dim], 1, dtype)",
           "return _g_cov(gy[:, : self.g_dim], 1, dtype)",
           ("tests/kfac/test_sharded.py",),
           "a bias shard's G reads the first filters of its block, not its own"),
    Mutant("sharded-layout-bias-offset", "distkfac/sharded.py",
           '"G": (flo + slo, flo + slo + sn)',
           '"G": (slo, slo + sn)',
           ("tests/test_blindspots_kfac.py",),
           "a bias block's G range in the checkpoint layout forgets its filter block's offset"),
    Mutant("sharded-g-scale-unsquared", "distkfac/sharded.py",
           "return 1.0 if self.prescaled else (rows / self.positions) ** 2",
           "return 1.0 if self.prescaled else rows / self.positions",
           ("tests/kfac/test_sharded.py",),
           "G of a shard is scaled by N instead of N²"),
    Mutant("exact-bias-row-offset", "distkfac/sharded.py",
           "            e[lo: lo + n] = vb\n",
           "            e[:n] = vb\n",
           ("tests/kfac/test_sharded.py",),
           "'exact' places a rank's bias shard at the first rows of its filter block"),
    Mutant("lowprec-owner-block-offset", "distkfac/lowprec.py",
           "mine = owner[lo: lo + m]",
           "mine = owner[:m]",
           ("tests/test_blindspots_kfac.py",),
           "the P>=3 reduce-scatter weights block j's means by the factors of block 0"),
    Mutant("lowprec-first-factor-rows", "distkfac/lowprec.py",
           "* r.to(device, torch.float32)[owner]",
           "* r.to(device, torch.float32)[0]",
           ("tests/test_blindspots_kfac.py",),
           "low-precision means are weighted by the first factor's rows for every factor"),
    Mutant("hybrid-unweighted-mean", "distkfac/hybrid/space.py",
           "chunks = [torch.cat([full[s: s + b] * w, w]) for s, b in self.blocks]",
           "chunks = [torch.cat([full[s: s + b], w / w]) for s, b in self.blocks]",
           ("tests/kfac/test_dho2.py",),
           "DHO2's gradient is the plain mean of the ranks' means, not weighted by their samples"),
    Mutant("fosi-local-block-offset", "distkfac/hybrid/fosi.py",
           "return t[..., self.space.start: self.space.start + self.space.local]",
           "return t[..., : self.space.local]",
           ("tests/test_blindspots_kfac.py",),
           "a whole saved vector loaded by hand gives every rank the first block"),
    Mutant("fosi-scaling-first-eta", "distkfac/hybrid/fosi.py",
           "float(eta[l] / eta[q - 1])",
           "float(eta[0] / eta[q - 1])",
           ("tests/test_blindspots_kfac.py",),
           "the scaling s takes eta of the smallest eigenvalue instead of the first largest"),
    Mutant("fosi-drops-complement-projection", "distkfac/hybrid/fosi.py",
           "delta = delta - c[:, 1] @ e",
           "delta = delta",
           ("tests/kfac/test_fosi.py",),
           "the base step is not projected off the eigen-subspace (step 5 dropped)"),
    Mutant("planner-meet-tie", "distconv/planner.py",
           "self._meets[key] = to_main <= to_skip if main_first else to_main < to_skip",
           "self._meets[key] = to_main < to_skip if main_first else to_main <= to_skip",
           ("tests/test_planner.py",),
           "the planner breaks a tie between an add's operands toward the second, not the first"),
    Mutant("placement-sources-first-replica", "distconv/parallel/placement.py",
           "j = rank % math.prod(e for _, e in redundant)",
           "j = 0",
           ("tests/test_blindspots_ops.py", "tests/test_ops.py"),
           "explain and the planner price every cross-grid read from replica 0, not rank % "
           "replicas"),
]


def _copy_tree(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", ".hypothesis", ".pytest_cache", "output")
    for name in COPY:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        elif src.exists():
            shutil.copy2(src, dest / name)


def _pytest(tree: Path, tests: tuple[str, ...], limit: float) -> tuple[str, float, str]:
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    begin = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                              timeout=limit)
    except subprocess.TimeoutExpired:
        return "killed (timeout)", time.monotonic() - begin, ""
    seconds = time.monotonic() - begin
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    return ("survived" if proc.returncode == 0 else "killed"), seconds, last


def run_mutant(m: Mutant, limit: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="distconv-mutant-") as tmp:
        tree = Path(tmp)
        _copy_tree(tree)
        for path, old, new in ((m.path, m.old, m.new), *m.also):
            target = tree / path
            text = target.read_text()
            if text.count(old) != 1:
                return {"name": m.name, "result": f"stale ({text.count(old)} matches in {path})",
                        "seconds": 0.0, "why": m.why}
            target.write_text(text.replace(old, new))
        result, seconds, last = _pytest(tree, m.tests, limit)
    return {"name": m.name, "result": result, "seconds": round(seconds, 1), "last": last,
            "why": m.why, "tests": list(m.tests)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("names", nargs="*", help="mutants to run (default: all)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--limit", type=float, default=600.0, help="seconds per mutant's tests")
    ap.add_argument("--baseline", action="store_true",
                    help="first run every mutant's tests on the unmutated copy (must pass)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    unknown = set(args.names) - {m.name for m in MUTANTS}
    if unknown:
        ap.error(f"unknown mutants: {sorted(unknown)}")
    if args.list:
        for m in chosen:
            print(f"{m.name:34s} {m.path:32s} {m.why}")
        return
    if args.baseline:
        tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        with tempfile.TemporaryDirectory(prefix="distconv-baseline-") as tmp:
            _copy_tree(Path(tmp))
            result, seconds, last = _pytest(Path(tmp), tests, args.limit * 2)
        print(f"baseline: {'pass' if result == 'survived' else 'FAIL'} in {seconds:.0f} s ({last})")
        if result != "survived":
            sys.exit(2)
    results = []
    for m in chosen:
        r = run_mutant(m, args.limit)
        results.append(r)
        print(f"{r['name']:34s} {r['result']:18s} {r['seconds']:6.1f} s  {r['why']}", flush=True)
    survivors = [r["name"] for r in results if r["result"] == "survived"]
    stale = [r["name"] for r in results if r["result"].startswith("stale")]
    print(f"\n{len(results) - len(survivors) - len(stale)} killed, {len(survivors)} survived"
          f"{': ' + ', '.join(survivors) if survivors else ''}"
          f"{f', {len(stale)} stale: ' + ', '.join(stale) if stale else ''}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
