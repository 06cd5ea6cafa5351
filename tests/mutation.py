"""Mutation check: does the suite fail when the code has a realistic bug?

Each mutant replaces one exact piece of source text (it must occur exactly once, else the mutant
is reported ``stale``: the code moved and the list needs updating; ``--list`` says which are
stale now, and marks ``moving`` the mutants anchored in files other work is reshaping). The tree
(``distconv``, ``distkfac``, ``tests``, ``examples`` and ``pyproject.toml``) is copied to a
temporary directory and the mutant is applied there; the working tree is never touched. The
mutant's tests (named per mutant: the ones that kill it) run on the copy (``PYTHONPATH`` puts the
copy first, and the test worlds' workers inherit it). A mutant whose tests still pass *survived*:
the suite has a gap there.

Every mutant runs in its own time budget (``--budget``, default 300 s for its tests; a healthy
run takes 4-70 s, most of it starting Python and importing torch). A run past its budget is
stopped and reported as ``timeout``, apart from killed and survived: it is neither proof of a
gap nor of a kill (the tests' own communicator timeouts end a hang in 30 s, so it usually means
an overloaded machine). The score counts it as not killed and the exit status is 1, as for a
survivor; rerun it alone, or with a larger budget.

How long (the shared 2-core development machine, ``nice``, ``OMP_NUM_THREADS=1``; mutants run
one after another, each 4-70 s): the whole list of 113 mutants took 874 s and 972 s in two
runs (15-16 min; the second killed all 113), the 51 of the last two waves (``--from
bucket-zero-first-slot``) 450 s (7.5 min); at a busier moment the same 51 took 23 min. A killed mutant stops at its first failing test; a survivor runs all
of its tests, so a list with survivors takes longer.

    python tests/mutation.py                 # every mutant
    python tests/mutation.py --list          # what each one breaks; stale / moving ones marked
    python tests/mutation.py 'sampler-*' ring-broadcast-from-rank0   # names or shell patterns
    python tests/mutation.py --from bucket-zero-first-slot   # the last two waves' mutants
    python tests/mutation.py --from sync-from-the-last-rank  # construction broadcast to Swin (31)
    python tests/mutation.py --baseline --out results.json   # the tests pass unmutated first
"""
from __future__ import annotations

import argparse
import fnmatch
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
#: seconds one mutant's tests may take before the run is stopped and reported as ``timeout``
BUDGET = 300.0


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
           ("tests/test_pins_ring.py::"
            "test_gloo_reduce_scatter_without_the_ring_sums_in_rank_order",),
           "gloo reduce-scatter (all-to-all + local sum) sums in reverse rank order (the "
           "all-to-all path runs only without the shared-memory ring, on 3 ranks or more: "
           "two floats sum alike either way)"),
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
    Mutant("allreduce-bytes", "distconv/comm/buffers.py",
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
    Mutant("pad-not-zeroed", "distconv/redistribute/steps.py",
           "out = x.new_zeros(_with(x.shape, self.dim, n))",
           "out = x.new_empty(_with(x.shape, self.dim, n))",
           ("tests/test_redistribute.py",),
           "the adjoint of a slice pads with garbage instead of zeros"),
    Mutant("stationary-w-output-layout", "distconv/nn/conv_layout.py",
           '"stationary-w": both(f, c)}[algorithm]',
           '"stationary-w": both(c, f)}[algorithm]',
           ("tests/nn/test_conv.py", "tests/nn/test_conv_layouts.py"),
           "stationary-w's output y[o,o_{F×C},o,o] becomes y[o,o_{C×F},o,o]"),
    Mutant("stationary-w-output-layout-and-model", "distconv/nn/conv_layout.py",
           '"stationary-w": both(f, c)}[algorithm]',
           '"stationary-w": both(c, f)}[algorithm]',
           ("tests/nn/test_conv.py", "tests/nn/test_conv_layouts.py"),
           "the same wrong output layout, with the performance model moved along",
           also=(("distconv/pricing/traffic.py", "fy, fw, cw = _blk2(Fo, [pf, pc], [f, c])",
                  "fy, fw, cw = _blk2(Fo, [pc, pf], [c, f])"),)),
    Mutant("stationary-w-input-layout", "distconv/nn/conv_layout.py",
           'x_in = {"stationary-x": c, "stationary-y": f, "stationary-w": both(c, f)}[algorithm]',
           'x_in = {"stationary-x": c, "stationary-y": f, "stationary-w": both(f, c)}[algorithm]',
           ("tests/nn/test_conv.py", "tests/nn/test_conv_layouts.py"),
           "stationary-w's input x[o,o_{C×F},o,o] becomes x[o,o_{F×C},o,o]"),
    Mutant("conv-halo-span", "distconv/conv_geometry.py",
           "one output row reads: ``dilation * (kernel - 1) + 1``.\"\"\"\n"
           "        return self.dilation * (self.kernel - 1) + 1",
           "one output row reads: ``dilation * (kernel - 1) + 1``.\"\"\"\n"
           "        return self.dilation * (self.kernel - 1) + 1 - (self.dilation > 1)",
           ("tests/nn/test_conv.py", "tests/test_halo.py"),
           "a dilated kernel reads one row too few"),
    Mutant("sample-path-ignores-global-shape", "distconv/nn/conv_forward.py",
           "if layer._local and global_shape is None and layer.input_shape is None:",
           "if layer._local:",
           ("tests/test_validation.py",),
           "a grid splitting only samples ignores a contradicting global_shape"),
    Mutant("scatter-no-debug-check", "distconv/redistribute/execution.py",
           "    if get_debug():\n        agree_on_value(",
           "    if False:\n        agree_on_value(",
           ("tests/test_validation.py",),
           "debug mode no longer catches a scatter of data that differs across ranks"),
    Mutant("kfac-ema-decay", "distkfac/factors.py",
           "self.value.mul_(decay).add_(new, alpha=1.0 - decay)",
           "self.value.mul_(1.0 - decay).add_(new, alpha=decay)",
           ("tests/kfac/test_exactness.py",),
           "K-FAC's running average weighs the new factor with decay"),
    Mutant("allgather-adjoint-allgather", "distconv/redistribute/steps.py",
           "    def adjoint(self) -> ReduceScatter:\n        return ReduceScatter(",
           "    def adjoint(self) -> ReduceScatter:\n        return AllGather(",
           ("tests/test_redistribute.py", "tests/nn/test_pipeline.py"),
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
    Mutant("debug-check-ignores-alltoall-pairs", "distconv/comm/signature.py",
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
    Mutant("value-check-shape-only", "distconv/comm/signature.py",
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
    Mutant("bn-chan-drops-between-term", "distconv/nn/batchnorm_statistics.py",
           "m2 = torch.add(m2, part[1 + c:]).addcmul_(delta, delta, value=total * nb / both)",
           "m2 = torch.add(m2, part[1 + c:])",
           ("tests/nn/test_batchnorm.py",),
           "the combined variance drops the between-block term Σ n_r (mean_r - mean)²"),
    Mutant("bn-running-var-biased", "distconv/nn/batchnorm.py",
           "                unbiased = var * (count / (count - 1))\n",
           "                unbiased = var\n",
           ("tests/nn/test_batchnorm.py",),
           "the running variance takes the biased batch variance (no count/(count-1))"),
    Mutant("bn-segment-drops-w", "distconv/nn/batchnorm.py",
           "segment = [g for d in over for g in split_dims(grid, self._dist, d)]",
           "segment = [g for d in over[:-1] for g in split_dims(grid, self._dist, d)]",
           ("tests/nn/test_batchnorm.py",),
           "the statistics are reduced over the grid dims of N and H only, not W"),
    Mutant("bn-local-count-global", "distconv/nn/batchnorm.py",
           "count = x.shape[0] * spatial  # this sample block's values per channel",
           "count = shape[0] * spatial  # this sample block's values per channel",
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
           "self._root = all(self.data_grid.coords[d] == 0 for d, e in self.data_grid.layout\n"
           "                         if d != \"N\" and e > 1)",
           "self._root = all(self.data_grid.coords[d] == 0 for d, e in [\n"
           "                         (d, e) for d, e in self.data_grid.layout\n"
           "                         if d != \"N\" and e > 1][:1])",
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
    Mutant("graph-call-order-params", "distconv/parallel/capture.py",
           "    _order_like(gm, model)  # fx registers modules in call order; "
           "users expect theirs\n",
           "",
           ("tests/parallel/test_parallelize.py", "tests/test_idioms.py"),
           "parameters() lists shards in call order: optimizer state by position is renamed"),
    Mutant("placement-replica-first-holder", "distconv/parallel/placement.py",
           "if t != rank and mine[t % len(mine)] == rank:",
           "if t != rank and mine[0] == rank:",
           ("tests/test_ops.py", "tests/parallel/test_parallelize.py"),
           "repartition's sent bytes (its adjoint's) have every target read from the first "
           "holder, not t % k"),
    Mutant("meeting-tie-to-second", "distconv/ops/elementwise.py",
           "return cost_to_b < cost_to_a",
           "return cost_to_b <= cost_to_a",
           ("tests/test_pins_parallel.py::"
            "test_operands_that_cost_the_same_meet_where_the_first_is",),
           "operands that cost the same to move meet at the second's placement, not the first's"),
    Mutant("bn-price-drops-m2", "distconv/ops/norm.py",
           "            params = max(params, 2 * c if bn.affine else 0)\n"
           "            fwd[r] = (s - 1) * (1 + 2 * c) * isz",
           "            params = max(params, 2 * c if bn.affine else 0)\n"
           "            fwd[r] = (s - 1) * (1 + c) * isz",
           ("tests/test_ops.py",),
           "BatchNorm's statistics allgather is priced without the M2 term"),
    Mutant("mean-local-count", "distconv/ops/pool.py",
           "count = math.prod(in_shape[d] for d in dims)",
           "count = math.prod(args[0].shape[d] for d in dims)",
           ("tests/test_ops.py",),
           "x.mean over split dims divides each block's sum by its local count"),
    Mutant("pool-price-drops-corners", "distconv/ops/pool.py",
           "widths[j] if j < i else local[2 + j] for j in range(nd) if j != i)",
           "local[2 + j] for j in range(nd) if j != i)",
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
    Mutant("sharded-bias-g-offset", "distkfac/sharded/statistics.py",
           "return g_cov(gy[:, self.offset: self.offset + self.g_dim], 1, dtype)",
           "return g_cov(gy[:, : self.g_dim], 1, dtype)",
           ("tests/kfac/test_sharded.py",),
           "a bias shard's G reads the first filters of its block, not its own"),
    Mutant("sharded-layout-bias-offset", "distkfac/sharded/geometry.py",
           '"G": (flo + slo, flo + slo + sn)',
           '"G": (slo, slo + sn)',
           ("tests/test_blindspots_kfac.py",),
           "a bias block's G range in the checkpoint layout forgets its filter block's offset"),
    Mutant("sharded-g-scale-unsquared", "distkfac/sharded/statistics.py",
           "return 1.0 if self.prescaled else (rows / self.positions) ** 2",
           "return 1.0 if self.prescaled else rows / self.positions",
           ("tests/kfac/test_sharded.py",),
           "G of a shard is scaled by N instead of N²"),
    Mutant("exact-bias-row-offset", "distkfac/sharded/exact.py",
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
    Mutant("placement-sources-first-replica", "distconv/parallel/placement.py",
           "j = rank % math.prod(e for _, e in redundant)",
           "j = 0",
           ("tests/test_blindspots_ops.py", "tests/test_ops.py"),
           "explain and the planner price every cross-grid read from replica 0, not rank % "
           "replicas"),
]

#: Files other work is reshaping while these mutants are written: a mutant anchored there may go
#: stale when that work lands (``--list`` says which are stale now); they are marked ``moving``.
MOVING = ("distconv/ops/", "distconv/parallel/graph.py", "distconv/parallel/shapes.py",
          "distconv/parallel/program.py", "distconv/parallel/explain.py", "distconv/planner.py",
          "distconv/pricing/", "distconv/parallel/auto.py", "distconv/parallel/model.py",
          "distconv/nn/clip.py", "distconv/launch.py")

PINS_LAYERS = "tests/test_pins_layers.py"
PINS_PARALLEL = "tests/test_pins_parallel.py"
PINS_STATE = "tests/test_pins_state.py"
PINS_KFAC = "tests/test_pins_kfac.py"

# The modules of the last two waves: gradient buckets, clip, overlap, resampling, norms, dropout,
# grouped statistics, async checkpoints, sampler state, N-d K-FAC, the shared-memory ring,
# placement, and (moving) op handlers, pricing and the generated program.
MUTANTS += [
    # ---- gradient buckets (distconv/nn/grad_sync.py)
    Mutant("bucket-zero-first-slot", "distconv/nn/grad_sync.py",
           "                flat[offset:offset + p.numel()].zero_()",
           "                flat[:p.numel()].zero_()",
           (f"{PINS_LAYERS}::test_a_parameter_one_rank_never_reaches_anywhere_in_its_bucket",),
           "an unreached parameter's slot is zeroed at the bucket's start, not at its offset"),
    Mutant("bucket-reached-flags-zero", "distconv/nn/grad_sync.py",
           "flat[self._sizes[b]:].fill_(1.0)",
           "flat[self._sizes[b]:].fill_(0.0)",
           (f"{PINS_LAYERS}::test_a_parameter_one_rank_never_reaches_anywhere_in_its_bucket",),
           "a rank that reached a whole bucket sends flags 'not reached': a parameter only it "
           "reached is dropped on the ranks that missed it"),
    Mutant("bucket-accumulate-overwrites", "distconv/nn/grad_sync.py",
           "                else:\n                    p.grad.add_(part)",
           "                else:\n                    p.grad.copy_(part)",
           ("tests/nn/test_grad_sync.py::"
            "test_bucketed_gradients_the_user_keeps_never_change_and_accumulation_adds",),
           "a second backward pass's bucketed gradient replaces the accumulated one"),
    Mutant("bucket-later-pass-adds-local-part", "distconv/nn/grad_sync.py",
           "            self._start(self._slot[id(param)][0])\n"
           "            return grad if first else torch.zeros_like(grad)",
           "            self._start(self._slot[id(param)][0])\n"
           "            return grad",
           ("tests/nn/test_grad_sync.py::"
            "test_bucketed_gradients_the_user_keeps_never_change_and_accumulation_adds",),
           "a later pass adds its local (unreduced) part to .grad besides the reduced sum"),
    Mutant("bucket-plan-full-at-equal", "distconv/nn/grad_sync.py",
           "if not buckets or (size + sizes[i] > bucket_bytes and buckets[-1]):",
           "if not buckets or (size + sizes[i] >= bucket_bytes and buckets[-1]):",
           ("tests/parallel/test_config.py::test_plan_buckets_fills_in_reverse_order",),
           "a bucket is closed when the next tensor would fill it exactly"),
    Mutant("gradsync-launch-past-unreached", "distconv/nn/grad_sync.py",
           "            if got is None and not flush:\n                return",
           "            if got is None and not flush:\n                continue",
           ("tests/nn/test_grad_sync.py::"
            "test_allreduces_pair_by_parameter_whatever_order_the_hooks_fire_in",),
           "GradSync skips a parameter whose gradient has not arrived yet instead of waiting "
           "for it: ranks pair different parameters' allreduces"),
    # ---- clip (distconv/nn/clip.py, moving)
    Mutant("clip-coefficient-unclamped", "distconv/nn/clip.py",
           "coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)",
           "coef = max_norm / (total + 1e-6)",
           (f"{PINS_LAYERS}::"
            "test_clip_with_max_norm_above_the_total_norm_leaves_the_gradients_as_they_are",),
           "a norm below max_norm scales the gradients up"),
    Mutant("clip-counts-every-replica", "distconv/nn/clip.py",
           "    return all(coords[d] == 0 for d in spec.dist.redundant(spec.grid))",
           "    return True",
           ("tests/test_idioms.py::test_clip_really_clips_and_counts_every_shard_once",),
           "a block replicated over grid dims enters the norm once per replica"),
    # ---- overlapped halos (distconv/nn/halo_conv.py)
    Mutant("overlap-interior-low-rounds-down", "distconv/nn/halo_conv.py",
           "    lo = -(-before // stride)\n",
           "    lo = before // stride\n",
           ("tests/nn/test_overlap.py::test_overlapped_layer_equals_the_unoverlapped_one",),
           "with a stride, the first interior output row is rounded down: its window reads a "
           "halo row before the halo has arrived"),
    Mutant("overlap-backward-drops-bottom-border", "distconv/nn/halo_conv.py",
           "        back((rows.hi + 1, rows.n_out - rows.hi - 1), rows.bottom())\n",
           "",
           ("tests/nn/test_overlap.py::test_overlapped_layer_equals_the_unoverlapped_one",),
           "the overlapped backward forgets the border rows after the interior"),
    Mutant("overlap-share-of-one-more-row", "distconv/nn/halo_conv.py",
           "return 0.0 if rows is None else (rows.hi - rows.lo + 1) / rows.n_out",
           "return 0.0 if rows is None else (rows.hi - rows.lo + 1) / (rows.n_out + 1)",
           ("tests/nn/test_overlap.py::"
            "test_the_seconds_an_overlapped_layer_hides_are_priced_by_hand",),
           "the share of the convolution that hides the halo is undercounted"),
    # ---- resampling (distconv/nn/resample.py)
    Mutant("resample-two-taps-only", "distconv/nn/resample.py",
           "        for k in range(1, rows.shape[1]):\n",
           "        for k in range(1, min(2, rows.shape[1])):\n",
           ("tests/nn/test_resample.py::test_interpolation_of_split_rows_equals_one_process",),
           "an output row sums only its first two input rows (bicubic's four taps cut)"),
    Mutant("resample-ignores-non-adjoint-gradient", "distconv/nn/resample.py",
           "    if not all(m.adjoint for m in maps):\n        return None\n",
           "",
           ("tests/nn/test_resample.py::"
            "test_where_torchs_gradient_is_not_its_adjoint_torch_runs_on_whole_rows",),
           "runs in place where torch's gradient is not the adjoint of its interpolation"),
    Mutant("resample-window-offset-unscaled", "distconv/nn/resample.py",
           "kept, dtype, device), lo * int(factors[i])",
           "kept, dtype, device), lo",
           ("tests/nn/test_resample.py::test_integer_factors_run_torchs_kernel_on_the_window",),
           "the window's output offset forgets the factor"),
    Mutant("resample-halo-bytes-sent-for-received", "distconv/nn/resample.py",
           "            out.append((d, plan.halo_rows_received(c) * other * itemsize,\n"
           "                        plan.halo_rows_sent(c) * other * itemsize))",
           "            out.append((d, plan.halo_rows_sent(c) * other * itemsize,\n"
           "                        plan.halo_rows_received(c) * other * itemsize))",
           (f"{PINS_LAYERS}::test_an_interpolation_s_halo_is_priced_per_phase_as_counted",),
           "an interpolation's halo is priced by the rows a rank sends, not those it receives "
           "(and the reverse for its adjoint)"),
    Mutant("resample-short-output-in-place", "distconv/nn/resample.py",
           "        elif parts_of[d] > min(m.length, m.out_length):",
           "        elif parts_of[d] > m.length:",
           ("tests/nn/test_resample.py::test_a_dim_shorter_than_its_grid_dim_runs_on_whole_rows",
            "tests/nn/test_resample.py::test_interpolation_of_split_rows_equals_one_process"),
           "a downsampling with fewer output rows than ranks runs in place"),
    # ---- norms (distconv/nn/groupnorm.py, batchnorm.py)
    Mutant("layernorm-bias-grad-unsynced", "distconv/nn/groupnorm.py",
           "redundant_sync(grid, self.param_dist, name, (self.weight, self.bias))",
           "redundant_sync(grid, self.param_dist, name, (self.weight,))",
           (f"{PINS_LAYERS}::test_standalone_layernorm_weight_and_bias_grads_equal_torch_s",),
           "a standalone DistLayerNorm's bias gradient is left a pending sum over the replicas"),
    Mutant("groupnorm-backward-sums-local", "distconv/nn/groupnorm.py",
           "                sums = ctx.comm.allreduce(sums, meta=\"DistGroupNorm backward sums\")",
           "                pass",
           (f"{PINS_LAYERS}::test_standalone_layernorm_weight_and_bias_grads_equal_torch_s",),
           "group/layer norm's input gradient uses the local block's sums, not the segment's"),
    Mutant("instancenorm-running-var-biased", "distconv/nn/groupnorm.py",
           "unbiased = var * (count / (count - 1)) if count > 1 else var",
           "unbiased = var",
           ("tests/test_ops.py::"
            "test_tracked_instance_norm_over_split_samples_keeps_one_process_s_statistics",),
           "an instance norm's running variance takes the biased variance"),
    Mutant("bn-group-count-even-blocks", "distconv/nn/batchnorm.py",
           "            count = spatial * sum(self._dist.local_shape(shape, self.grid, c)[0]\n"
           "                                  for c in self._group)",
           "            count = spatial * x.shape[0] * len(self._group)",
           (f"{PINS_LAYERS}::"
            "test_batchnorm_groups_of_uneven_sample_blocks_are_per_group_batch_norm",),
           "a group's count is its blocks times this rank's block: wrong for uneven blocks"),
    # ---- grouped statistics (distconv/nn/_statistics.py)
    Mutant("statistics-groups-interleaved", "distconv/nn/_statistics.py",
           "key = (tuple(coords[n] for n in names if n not in segment_dims), block // k)",
           "key = (tuple(coords[n] for n in names if n not in segment_dims), block % k)",
           ("tests/test_statistics.py::"
            "test_statistics_groups_partition_the_grid_into_runs_of_k_blocks",),
           "groups take every k-th sample block instead of runs of k consecutive ones"),
    Mutant("statistics-block-minor-dim-only", "distconv/nn/_statistics.py",
           "            block = block * ext[d] + coords[d]",
           "            block = coords[d]",
           ("tests/test_statistics.py::"
            "test_statistics_groups_partition_the_grid_into_runs_of_k_blocks",),
           "the sample block over two grid dims is read from the minor one alone"),
    Mutant("statistics-all-blocks-not-global", "distconv/nn/_statistics.py",
           'return "local" if value == 1 else "global" if value == blocks else value',
           'return "local" if value == 1 else value',
           ("tests/test_statistics.py::test_groups_of_one_and_of_all_blocks_are_local_and_global",),
           "one group of every sample block runs as groups (subgroups, broadcasts), not global"),
    # ---- dropout (distconv/nn/dropout.py)
    Mutant("dropout-unscaled", "distconv/nn/dropout.py",
           "return x * noise.div_(1 - self.p)",
           "return x * noise",
           ("tests/test_dropout.py::test_split_dropout_equals_one_process",),
           "kept elements are not scaled by 1/(1-p)"),
    Mutant("dropout-keeps-with-p", "distconv/nn/dropout.py",
           "noise.bernoulli_(1 - self.p, generator=generator)",
           "noise.bernoulli_(self.p, generator=generator)",
           ("tests/test_dropout.py::test_split_dropout_equals_one_process",),
           "an element is kept with probability p instead of 1-p"),
    Mutant("dropout2d-elementwise-mask", "distconv/nn/dropout.py",
           "            shape = shape[:2] + (1,) * (len(shape) - 2)\n",
           "",
           ("tests/test_dropout.py::test_split_dropout_equals_one_process",),
           "feature dropout draws an element mask with the feature mask's Dist"),
    # ---- async checkpoints (distconv/checkpoint/_async.py)
    Mutant("async-wait-swallows-failure", "distconv/checkpoint/_async.py",
           "        if self._error is not None and not self._reported:\n"
           "            self._reported = True\n            raise self._error",
           "        if False:\n            self._reported = True\n            raise self._error",
           ("tests/test_checkpoint_fast.py::test_async_failure_is_raised_at_wait",),
           "SaveHandle.wait() returns quietly after a failed save"),
    Mutant("async-failure-reported-twice", "distconv/checkpoint/_async.py",
           "    if handle._error is not None and not handle._reported:\n"
           "        handle._reported = True\n",
           "    if handle._error is not None and not handle._reported:\n",
           (f"{PINS_STATE}::test_a_failure_the_next_save_raised_is_not_raised_again_by_wait",),
           "a failed asynchronous save the next save raised is raised again by its wait()"),
    Mutant("async-ignores-rank-error-record", "distconv/checkpoint/_async.py",
           "                    if \"error\" in got:\n",
           "                    if False:\n",
           ("tests/test_checkpoint_fast.py::test_async_failure_is_raised_at_wait",),
           "rank 0 takes a rank's error record for its shard record"),
    # ---- the save's agreement (distconv/checkpoint/_save.py)
    Mutant("save-agrees-without-dtype", "distconv/checkpoint/_save.py",
           'out[key] = {"dtype": dtype_name(t.dtype), "shape": list(spec.global_shape),',
           'out[key] = {"shape": list(spec.global_shape),',
           (f"{PINS_STATE}::"
            "test_ranks_that_differ_only_in_a_dtype_shape_or_dist_refuse_before_writing",),
           "ranks that save one tensor in different dtypes agree"),
    Mutant("save-agrees-without-shape", "distconv/checkpoint/_save.py",
           '"shape": list(spec.global_shape), "dist": text,',
           '"dist": text,',
           (f"{PINS_STATE}::"
            "test_ranks_that_differ_only_in_a_dtype_shape_or_dist_refuse_before_writing",),
           "ranks that save one tensor of different global shapes agree"),
    Mutant("save-agrees-without-dist", "distconv/checkpoint/_save.py",
           '"shape": list(spec.global_shape), "dist": text,',
           '"shape": list(spec.global_shape),',
           (f"{PINS_STATE}::"
            "test_ranks_that_differ_only_in_a_dtype_shape_or_dist_refuse_before_writing",),
           "ranks that save one tensor in different distributions agree"),
    # ---- sampler state (distconv/data.py)
    Mutant("sampler-position-past-the-end", "distconv/data.py",
           "self._next = min(start + (j + 1) * p, total)",
           "self._next = start + (j + 1) * p",
           (f"{PINS_STATE}::"
            "test_sampler_saved_at_the_end_of_a_padded_epoch_resumes_with_the_next_epoch",),
           "the position counts the padding: a save at a padded epoch's end cannot be loaded"),
    Mutant("sampler-refuses-the-end-position", "distconv/data.py",
           "0 <= position <= len(self.dataset)):",
           "0 <= position < len(self.dataset)):",
           (f"{PINS_STATE}::"
            "test_sampler_saved_at_the_end_of_a_padded_epoch_resumes_with_the_next_epoch",),
           "a state at the end of an epoch is refused"),
    Mutant("sampler-pads-with-the-last", "distconv/data.py",
           "rest + (order * math.ceil(pad / len(order)))[:pad])",
           "rest + (order * math.ceil(pad / len(order)))[-pad:])",
           (f"{PINS_STATE}::"
            "test_sampler_saved_at_the_end_of_a_padded_epoch_resumes_with_the_next_epoch",),
           "an epoch is padded with its last samples instead of its first, as "
           "DistributedSampler does"),
    Mutant("sampler-set-epoch-always-restarts", "distconv/data.py",
           "        if epoch != self.epoch:\n            self._start = self._next = 0",
           "        if True:\n            self._start = self._next = 0",
           ("tests/test_data_resume.py::"
            "test_sampler_resumes_mid_epoch_with_the_same_global_order",),
           "set_epoch of the current epoch forgets a loaded mid-epoch position"),
    Mutant("sampler-second-pass-mid-epoch", "distconv/data.py",
           "        self._start = 0  # a further pass",
           "        pass  # a further pass",
           ("tests/test_data_resume.py::test_sampler_len_counts_what_the_next_iteration_deals",),
           "every pass over a resumed epoch starts at the loaded position, not only the first"),
    # ---- N-d K-FAC (distkfac/layers.py)
    Mutant("kfac-nd-g-count-samples-only", "distkfac/layers.py",
           "        return cov * (batch * batch), n * per_sample.shape[-1]",
           "        return cov * (batch * batch), n",
           ("tests/kfac/test_conv_nd.py::"
            "test_a_layer_split_over_channels_filters_and_space_equals_single_process_kfac",),
           "an N-d convolution's G is averaged over the samples, not over samples × positions"),
    Mutant("kfac-nd-padding-first-dim-last", "distkfac/layers.py",
           "for i in reversed(range(len(k))) for p in (conv.padding[i], conv.padding[i])]",
           "for i in range(len(k)) for p in (conv.padding[i], conv.padding[i])]",
           (PINS_KFAC,),
           "F.pad's padding of an N-d convolution takes the first spatial dim's padding last"),
    Mutant("kfac-nd-windows-ignore-dilation", "distkfac/layers.py",
           "        x = x.unfold(2 + i, d * (k - 1) + 1, s)[..., ::d]  # windows as a trailing dim",
           "        x = x.unfold(2 + i, k, s)  # windows as a trailing dim",
           (PINS_KFAC,),
           "the im2col windows of a dilated N-d convolution read adjacent rows"),
    # ---- the shared-memory ring (distconv/comm/host_channel.py, host_framing.py)
    Mutant("ring-reduce-skips-third-rank", "distconv/comm/host_framing.py",
           "    for r in range(2, rows.shape[0]):\n        acc = fn(acc, rows[r], out=acc)",
           "    for r in range(3, rows.shape[0]):\n        acc = fn(acc, rows[r], out=acc)",
           ("tests/comm/test_host_channel.py::"
            "test_ops_equal_their_reference_whatever_is_in_flight",),
           "the ring's reduction forgets rank 2's payload"),
    Mutant("ring-overwrites-unread-slot", "distconv/comm/host_channel.py",
           "        if free > 0 and min(done.tolist()) < free:",
           "        if False:",
           ("tests/test_pins_ring.py",),
           "an operation writes its slot before every rank has read the one it held"),
    Mutant("ring-alltoall-reads-rank0-offsets", "distconv/comm/host_channel.py",
           "starts = rows[:, :head].view(torch.int64)[:, self.rank].tolist()",
           "starts = rows[:, :head].view(torch.int64)[:, 0].tolist()",
           ("tests/comm/test_host_channel.py::"
            "test_ops_equal_their_reference_whatever_is_in_flight",),
           "every rank reads the all-to-all chunk meant for rank 0"),
    Mutant("ring-broadcast-from-rank0", "distconv/comm/host_channel.py",
           "return self._rows_of(slot)[root, :nbytes].clone().view(t.dtype).view(t.shape)",
           "return self._rows_of(slot)[0, :nbytes].clone().view(t.dtype).view(t.shape)",
           ("tests/comm/test_host_channel.py::"
            "test_ops_equal_their_reference_whatever_is_in_flight",),
           "a broadcast through the ring hands out rank 0's payload whatever the root"),
    Mutant("ring-mismatch-unchecked", "distconv/comm/host_channel.py",
           "if any(h != heads[self.rank] for h in heads) or heads[0][0] != op.id:",
           "if heads[0][0] != op.id:",
           ("tests/comm/test_host_channel.py::"
            "test_different_collectives_raise_a_mismatch_on_every_rank",),
           "ranks that call different collectives in one slot are not told"),
    # ---- placement (distconv/parallel/placement.py)
    Mutant("placement-extents-as-a-set", "distconv/parallel/placement.py",
           "    if [e for _, e in a] != [e for _, e in b]:",
           "    if sorted(e for _, e in a) != sorted(e for _, e in b):",
           (f"{PINS_PARALLEL}::"
            "test_layouts_of_the_same_extents_under_other_names_are_not_the_same_layout",
            f"{PINS_PARALLEL}::"
            "test_a_conversion_between_those_layouts_moves_every_block_where_it_belongs"),
           "{N: 2, F: 3} is taken for {C: 3, N: 2} renamed"),
    # ---- op handlers (distconv/ops/*, moving)
    Mutant("meeting-at-the-costlier", "distconv/ops/elementwise.py",
           "return cost_to_b < cost_to_a",
           "return cost_to_b >= cost_to_a",
           (f"{PINS_PARALLEL}::"
            "test_an_add_of_a_replicated_and_a_row_split_operand_moves_no_byte",),
           "operands meet where more bytes move"),
    Mutant("new-axis-settles-a-pending-sum", "distconv/ops/shape.py",
           "        placed = Placement(p.layout, Dist(tuple(out), p.dist.pending))",
           "        placed = Placement(p.layout, Dist(tuple(out)))",
           (f"{PINS_PARALLEL}::"
            "test_se_gate_indexed_from_an_unsettled_mean_of_split_rows_equals_one_process",),
           "x.mean((2, 3))[:, :, None, None] takes a pending sum for the settled mean"),
    Mutant("broadcast-operand-kept-split", "distconv/ops/elementwise.py",
           "        if a == 1 and o != 1:\n            entries[d] = None",
           "        if False:\n            entries[d] = None",
           ("tests/test_idioms.py::test_se_broadcast_over_split_rows_is_exact_and_explained",),
           "an [N, C, 1, 1] gate meets a row-split value still split over the rows"),
    # ---- pricing (distconv/pricing/timeline.py)
    Mutant("pricing-hides-the-whole-halo", "distconv/pricing/timeline.py",
           'return {"forward": o * min(part("halo exchange"), share * part("local conv forward")),',
           'return {"forward": o * part("halo exchange"),',
           ("tests/nn/test_overlap.py::"
            "test_the_seconds_an_overlapped_layer_hides_are_priced_by_hand",),
           "an overlapped layer hides its whole halo exchange, however little compute it has"),
    Mutant("pricing-gradients-never-wait-for-backward", "distconv/pricing/timeline.py",
           "        for t in waiting.pop(lay.name, ()):\n            comm = max(comm, compute) + t",
           "        for t in waiting.pop(lay.name, ()):\n            comm = comm + t",
           ("tests/test_planner.py", "tests/parallel/test_config.py"),
           "a gradient allreduce is priced as starting before its layer's backward is done"),
    # capture on the input shape
    Mutant("capture-guards-dropped", "distconv/parallel/capture.py",
           "    if isinstance(tracer, _SizedTracer):\n        tracer.add_guards(graph)",
           "    if False:\n        tracer.add_guards(graph)",
           ("tests/parallel/test_capture.py::"
            "test_a_shape_taking_another_path_is_refused_naming_the_guard",),
           "the sizes the model's Python decided on are not checked on another input shape"),
    Mutant("capture-jit-isinstance-false", "distconv/parallel/capture.py",
           "            return real_isinstance(obj.value, target_type)",
           "            return False",
           ("tests/parallel/test_capture.py::"
            "test_python_deciding_on_sizes_is_captured_on_the_input_shape",),
           "torch.jit.isinstance of a traced tensor answered False, as fx alone does"),
    Mutant("capture-guard-after-its-consumers", "distconv/parallel/capture.py",
           "            with graph.inserting_after(node):\n                same =",
           "            with graph.inserting_before(list(graph.nodes)[-1]):\n                same =",
           ("tests/parallel/test_capture.py::"
            "test_a_shape_taking_another_path_is_refused_naming_the_guard",),
           "guards checked after the ops their decision shaped (another shape fails there, "
           "blamed on the capture)"),
    Mutant("whole-rows-ignores-the-captured-shape", "distconv/ops/conv.py",
           "    if hint is not None and row_refusal(module, choice.layout, hint) is not None:",
           "    if False:",
           ("tests/parallel/test_capture.py::"
            "test_a_default_spatial_entry_keeps_maps_too_small_to_split_whole",),
           "a default spatial entry splits maps too small to split on the captured shape"),
]

# The wave of the zoo beyond MONAI, segments and the first day: shared memos, the newest
# handlers' unpinned behaviours, recomputation, the capture's checks.
PINS_WAVE = "tests/test_pins_capture_ops.py"
MUTANTS += [
    Mutant("memo-evict-unlocked", "distconv/memo.py",
           "        with self._lock:\n            while len(self._items) >= self._bound:",
           "        if True:\n            while len(self._items) >= self._bound:",
           ("tests/test_memo.py",),
           "two thread ranks past the bound evict the same oldest key (KeyError mid-save)"),
    Mutant("memo-bound-ignored", "distconv/memo.py",
           "while len(self._items) >= self._bound:", "while len(self._items) > 1 << 30:",
           ("tests/test_memo.py",), "a bounded memo grows without bound"),
    Mutant("softmax-negative-dim", "distconv/ops/softmax.py", "        dim %= p.ndim\n", "",
           (f"{PINS_WAVE}::test_a_split_dim_is_made_whole_where_the_op_reads_it_whole",),
           "a softmax over a negative dim that is split normalises each rank's block alone"),
    Mutant("index-split-dim-complete", "distconv/ops/index.py",
           "        pending = p.dist.pending | {g for d in picked for g in p.dist.grid_dims_of(d)}",
           "        pending = p.dist.pending",
           (f"{PINS_WAVE}::test_a_split_dim_is_made_whole_where_the_op_reads_it_whole",),
           "an integer index into a split dim: each rank's pick (the owner's element, the "
           "others' zeros) taken as the whole value, never summed"),
    Mutant("recompute-replay-last-first", "distconv/nn/recompute.py",
           "copy.set_state(replaying[-1].pop(0))", "copy.set_state(replaying[-1].pop())",
           (f"{PINS_WAVE}::test_two_dropouts_in_one_recomputed_segment_replay_their_own_masks",),
           "a recomputed segment replays its generator states last-first: two dropouts swap "
           "masks"),
    Mutant("capture-output-shapes-unchecked", "distconv/parallel/capture.py",
           "    if mine != theirs:", "    if False:",
           (f"{PINS_WAVE}::test_a_capture_that_returns_other_shapes_than_the_module_is_refused",),
           "a captured graph that returns other shapes than the module runs as the model"),
    Mutant("capture-uncalled-buffers-dropped", "distconv/parallel/capture.py",
           "        if next(m.parameters(), None) is None and next(m.buffers(), None) is None:"
           "\n            continue",
           "        if next(m.parameters(), None) is None:\n            continue",
           (f"{PINS_WAVE}::test_a_never_called_module_with_only_buffers_keeps_them_in_the_state",),
           "a never-called module holding only buffers drops out of the parallel model's state"),
    Mutant("functional-bn-price-drops-m2", "distconv/ops/norm.py",
           "            c = p.dist.local_shape(ctx.in_shape, g)[1]\n"
           "            fwd[r] = (s - 1) * (1 + 2 * c) * isz",
           "            c = p.dist.local_shape(ctx.in_shape, g)[1]\n"
           "            fwd[r] = (s - 1) * (1 + c) * isz",
           ("tests/test_ops_norm_functional.py::"
            "test_functional_batch_norm_moves_the_bytes_explain_prices",),
           "F.batch_norm's statistics allgather is priced without the M2 term"),
    Mutant("planner-own-picks-dropped", "distconv/planner/plan.py",
           "    add(_own_picks(s), s.base.data)\n", "",
           ("tests/test_pins_planner.py::"
            "test_the_search_keeps_each_layers_own_cheapest_choice_as_a_starting_plan",),
           "the search no longer starts from each layer's own cheapest choice: a plan priced "
           "above it can come out"),
    Mutant("beam-keeps-first-state", "distconv/planner/search.py",
           "if key not in merged or score + add < merged[key][0]:", "if key not in merged:",
           ("tests/test_pins_planner.py::"
            "test_the_beam_keeps_the_cheapest_state_that_reaches_a_frontier",),
           "the beam keeps the first state that reaches a frontier, not the cheapest"),
]


# segmented repartitions (the send graph's groups, segment communicators, the exchange and its
# adjoint, a conversion priced over its segment) and explicit entries (DistLinear stationary-x,
# -y, -w; grouped convolutions whose blocks cut groups)
SEGMENTS = "tests/test_redistribute_segments.py"
SEGMENTED = (f"{SEGMENTS}::"
             "test_a_segmented_conversion_is_exact_adjoint_and_moves_the_whole_worlds_bytes")
GROUPS_CUT = ("tests/nn/test_conv.py::"
              "test_grouped_layers_whose_blocks_cut_groups_gather_x_and_equal_conv2d")
DIST_LINEAR = ("tests/test_explicit_entries.py::"
               "test_dist_linear_equals_the_whole_layer_under_every_algorithm")
MUTANTS += [
    Mutant("segment-exchange-subrank-as-rank", "distconv/redistribute/between_grids.py",
           "incoming = [plan.sends[s][rank] for s in group]",
           "incoming = [plan.sends[s][rank] for s in range(len(group))]",
           (SEGMENTED,),
           "a segment's exchange reads the plan by sub-rank (0..k-1) instead of world rank: "
           "every segment but the first places the first segment's boxes"),
    Mutant("segment-adjoint-overwrites", "distconv/redistribute/between_grids.py",
           "plan.src_boxes[r], True,", "plan.src_boxes[r], False,",
           (SEGMENTED,),
           "the adjoint places the returned pieces into an uninitialised block instead of "
           "summing them into zeros (a replica no target reads from gets garbage gradients)"),
    Mutant("segment-replica-first-only", "distconv/redistribute/between_grids.py",
           "if replicas[src_boxes[r]][t % len(replicas[src_boxes[r]])] == r else None",
           "if replicas[src_boxes[r]][0] == r else None",
           (SEGMENTED,),
           "every target reads a replicated source block from its first replica: exact, but "
           "the segments merge (one replica sends to every target) and the load is not spread"),
    Mutant("segment-split-skipped", "distconv/redistribute/between_grids.py",
           "return comm.split(groups), plan.group_of(comm.rank)",
           "return comm, plan.group_of(comm.rank)",
           (f"{SEGMENTS}::test_the_segment_communicators_are_made_once_by_every_rank",),
           "the segment's exchange runs on the whole communicator with the group's boxes: "
           "the split into segment communicators dropped"),
    Mutant("segment-forward-buffer-of-adjoint", "distconv/redistribute/between_grids.py",
           "plan.dst_boxes[rank], False, where, plan.most_sent)",
           "plan.dst_boxes[rank], False, where, plan.most_returned)",
           (SEGMENTED,),
           "the forward exchange sizes its buffer by the most any rank returns in the adjoint, "
           "not the most it sends (too small where a rank sends more than it gets back)"),
    Mutant("priced-segment-first-holder", "distconv/parallel/placement.py",
           "if t != rank and mine[t % len(mine)] == rank:",
           "if t != rank and mine[0] == rank:",
           (f"{SEGMENTS}::test_the_priced_segment_is_the_executed_one",),
           "the price assumes every target reads a replicated block from its first holder, "
           "unlike the executor (t % holders): a segment priced that the run never forms"),
    Mutant("priced-segment-dims-inverted", "distconv/pricing/segments.py",
           "base = base * e + (0 if name in dims else coords[name])",
           "base = base * e + (coords[name] if name in dims else 0)",
           (f"{SEGMENTS}::test_a_one_grid_conversion_runs_over_its_steps_grid_dims",),
           "a one-grid conversion's segment varies the dims its steps do NOT run over"),
    Mutant("priced-segment-alltoall-ignored", "distconv/pricing/segments.py",
           'elif kind in ("AllGather", "ReduceScatter", "AllToAll"):',
           'elif kind in ("AllGather", "ReduceScatter"):',
           (f"{SEGMENTS}::test_a_one_grid_all_to_all_runs_among_the_ranks_of_its_grid_dim",),
           "a one-grid conversion whose step is an all-to-all is priced as moving nothing "
           "among no ranks (its segment: the rank alone)"),
    Mutant("priced-segment-units-modulo", "distconv/pricing/segments.py",
           "units = max(len({r // unit.ranks for r in g}) for g in groups)",
           "units = max(len({r % unit.ranks for r in g}) for g in groups)",
           (f"{SEGMENTS}::test_a_segment_is_described_by_its_size_and_the_units_it_spans",),
           "a segment spanning nodes counts its ranks' places within a node, not its nodes"),
    Mutant("priced-segment-latency-off-by-one", "distconv/pricing/timeline.py",
           "            return max(machine.link_time(g, nbytes, len(g) - 1)",
           "            return max(machine.link_time(g, nbytes, len(g))",
           (f"{SEGMENTS}::test_a_segment_is_priced_on_its_own_ranks_and_level",),
           "a segment of k ranks pays k latencies, not the k - 1 steps of a pairwise exchange"),
    Mutant("priced-segment-whole-grid", "distconv/pricing/timeline.py",
           "        if self.groups:\n            # each segment",
           "        if False:\n            # each segment",
           (f"{SEGMENTS}::test_a_segment_is_priced_on_its_own_ranks_and_level",),
           "a conversion priced as before segments: over the first ranks of its size, not "
           "the level its segments span"),
    Mutant("priced-adjoint-without-segments", "distconv/parallel/cost.py",
           '"redistribute", bwd,\n                                     peers, groups=groups))',
           '"redistribute", bwd,\n                                     peers))',
           (f"{SEGMENTS}::test_a_conversions_adjoint_is_priced_on_its_forward_segments",),
           "the adjoint of a conversion is priced without its segments (over the first "
           "ranks), though it runs on the forward's segment communicators"),
    Mutant("group-span-floor", "distconv/conv_groups.py",
           "g0, g1 = f0 // per, -(-(f0 + n) // per)", "g0, g1 = f0 // per, (f0 + n) // per",
           (GROUPS_CUT,),
           "the groups a filter block reaches into stop before the group its last filters cut"),
    Mutant("group-window-lead-trail-swapped", "distconv/nn/conv_forward.py",
           "return torch.cat([t.new_zeros((span.lead, *t.shape[1:])), t,\n"
           "                          t.new_zeros((span.trail, *t.shape[1:]))])",
           "return torch.cat([t.new_zeros((span.trail, *t.shape[1:])), t,\n"
           "                          t.new_zeros((span.lead, *t.shape[1:]))])",
           (GROUPS_CUT,),
           "a rank's weight padded with the other ranks' filters after its own where they "
           "come before (lead and trail swapped)"),
    Mutant("group-window-channel-offset", "distconv/nn/conv_forward.py",
           "x = x.narrow(1, span.g0 * per, (span.g1 - span.g0) * per)",
           "x = x.narrow(1, span.g0, (span.g1 - span.g0) * per)",
           (GROUPS_CUT,),
           "the gathered channels of a rank's groups start at the group index, not at its "
           "first channel"),
    Mutant("group-role-w-swapped", "distconv/conv_groups.py",
           '"stationary-w": (channel, filter)}', '"stationary-w": (filter, channel)}',
           (GROUPS_CUT,),
           "stationary-w's filter blocks taken F-major instead of C×F (C major): a rank "
           "convolves another rank's groups"),
    Mutant("linear-x-pending-dropped", "distconv/nn/linear.py",
           "        pending = frozenset(names)\n", "        pending = frozenset()\n",
           (DIST_LINEAR,),
           "stationary-x's local matmul taken as the whole y: the partial sums over C never "
           "reduced"),
    Mutant("linear-w-partial-over-f", "distconv/nn/linear.py",
           "        pending = frozenset({c})\n", "        pending = frozenset({f})\n",
           (DIST_LINEAR,),
           "stationary-w's partial y summed over F (where x was gathered) instead of over C"),
    Mutant("linear-grad-sync-dropped", "distconv/nn/linear.py",
           "self.grad_sync = redundant_sync(grid, self.weight_dist, name, "
           "(self.weight, self.bias))",
           "self.grad_sync = None",
           (DIST_LINEAR,),
           "a DistLinear's weight gradient not completed over the grid dims it is replicated "
           "on (N)"),
    Mutant("linear-entry-feature-count-unchecked", "distconv/ops/linear.py",
           "            if n < blocks:\n                an.fail(",
           "            if False:\n                an.fail(",
           ("tests/test_explicit_entries.py::"
            "test_a_linear_entry_on_a_grid_it_cannot_use_is_refused_saying_what_works",),
           "a Linear entry with fewer features than its C×F blocks is not refused before the "
           "first step"),
    Mutant("linear-entry-w-roles-not-swapped", "distconv/ops/linear.py",
           "met.dist.entries[-1] == (f, c)):", "met.dist.entries[-1] == (c, f)):",
           ("tests/test_explicit_entries.py::"
            "test_stationary_w_linears_in_a_row_take_each_others_output_with_the_roles_swapped",
            ),
           "a stationary-w Linear after another one converts its y[...,o_{F×C}] back to C×F "
           "instead of taking it with the roles swapped"),
    Mutant("grouping-cut-ignored", "distconv/ops/conv.py",
           "    return True, not groups_aligned(conv.in_channels, conv.out_channels, conv.groups, "
           "extents)",
           "    return True, False",
           ("tests/test_explicit_entries.py::"
            "test_explain_states_the_linear_and_grouped_layouts_of_an_own_entry",),
           "the planner takes a grouped convolution whose blocks cut groups for a local one: "
           "its gather of x neither placed nor priced"),
]


# The wave of construction broadcast, explain's strict=False truth, the refusals' lists,
# nn.MultiheadAttention, Swin's roll and the sizes read through numpy and einops.
SYNC = "tests/parallel/test_state_sync.py"
SYNC_SEEDED = f"{SYNC}::test_ranks_seeded_differently_train_as_one_process_on_rank0s_model"
TRUTH = "tests/parallel/test_explain_truth.py"
FIX = "tests/test_refusals_lead_with_the_fix.py"
MHA = "tests/test_ops_mha.py"
SWIN = "tests/test_ops_swin.py"
MUTANTS += [
    # ---- construction broadcast (distconv/parallel/state_sync.py)
    Mutant("sync-from-the-last-rank", "distconv/parallel/state_sync.py",
           "flat = link.broadcast(flat, root=0,", "flat = link.broadcast(flat, root=comm.size - 1,",
           (SYNC_SEEDED,),
           "every rank starts from the last rank's model, not rank 0's (the reference)"),
    Mutant("sync-buffers-skipped", "distconv/parallel/state_sync.py",
           "    named = [*model.named_parameters(remove_duplicate=False),\n"
           "             *model.named_buffers(remove_duplicate=False)]",
           "    named = [*model.named_parameters(remove_duplicate=False)]",
           (SYNC_SEEDED,),
           "only parameters are broadcast: each rank keeps its own running statistics"),
    Mutant("sync-offset-not-advanced", "distconv/parallel/state_sync.py",
           "                offset += t.numel()\n", "",
           (SYNC_SEEDED,),
           "every tensor of a coalesced bucket is copied from the bucket's first elements"),
    Mutant("sync-structure-unchecked", "distconv/parallel/state_sync.py",
           "    if differ:\n        raise ValueError(", "    if False:\n        raise ValueError(",
           (f"{SYNC}::test_ranks_that_build_different_models_are_refused_naming_them",),
           "ranks that built different models broadcast mismatched buffers, unrefused"),
    Mutant("sync-digest-without-shapes", "distconv/parallel/state_sync.py",
           'text = "\\n".join(f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in state)',
           'text = "\\n".join(f"{n}:{t.dtype}" for n, t in state)',
           (f"{SYNC}::test_ranks_that_build_different_models_are_refused_naming_them",),
           "models whose layers differ only in width pass the structure check"),
    Mutant("sync-the-callers-model", "distconv/parallel/model.py",
           "        own = copy.deepcopy(model)\n        sync_module_states(own, comm)",
           "        sync_module_states(model, comm)\n        own = copy.deepcopy(model)",
           (f"{SYNC}::test_the_callers_model_is_left_as_it_was_and_the_parallel_one_holds_"
            "rank0s",),
           "the broadcast overwrites the caller's model instead of the parallel model's copy"),
    # ---- explain(strict=False) (distconv/parallel/explain.py, graph.py, shapes.py)
    Mutant("explain-listed-refusals-say-parallelize", "distconv/parallel/explain.py",
           "    result.unsupported = [(n, t, _by_explain(r)) for n, t, r in result.unsupported]\n",
           "",
           (f"{TRUTH}::test_item_is_listed_and_the_rest_explained_without_blaming_the_shape",),
           "the refusals explain lists say parallelize"),
    Mutant("explain-raised-refusal-says-parallelize", "distconv/parallel/explain.py",
           "        _said_by_explain(exc)\n        raise", "        raise",
           (f"{TRUTH}::test_explains_refusals_say_explain",),
           "the refusal explain raises says parallelize"),
    Mutant("explain-row-names-the-config-entry", "distconv/parallel/explain.py",
           "configured={str(st.node.target): _runs(st, cfg)",
           "configured={str(st.node.target): cfg.choice(str(st.node.target)).algorithm",
           (f"{TRUTH}::test_a_linear_head_on_the_sample_grid_is_labelled_sample",),
           "a Linear head on the samples alone is labelled with its spatial entry"),
    Mutant("explain-sample-label-strict-subset", "distconv/parallel/explain.py",
           'and split and split <= {"N"}:', 'and split and split < {"N"}:',
           (f"{TRUTH}::test_a_linear_head_on_the_sample_grid_is_labelled_sample",),
           "a layer split over the samples alone is never labelled sample (< for <=)"),
    Mutant("explain-tolerate-not-passed", "distconv/parallel/explain.py",
           "    propagate_shapes(meta, shape, dtype=dtype, module=model,  # is refused, not the "
           "shape\n                     tolerate=refused)",
           "    propagate_shapes(meta, shape, dtype=dtype, module=model)",
           (f"{TRUTH}::test_item_is_listed_and_the_rest_explained_without_blaming_the_shape",),
           "an .item() the analysis refused fails the shape propagation, blamed on the shape"),
    Mutant("explain-branch-taken-false", "distconv/parallel/explain.py",
           "                    \"if it were true)\")))\n                return True",
           "                    \"if it were true)\")))\n                return False",
           (f"{TRUTH}::test_a_branch_on_a_value_is_listed_where_it_is_and_the_rest_explained",),
           "past a branch on a value the rest is captured as if false: its layers go unexplained"),
    Mutant("explain-strict-lists-branches", "distconv/parallel/explain.py",
           "gm, branches = (trace(model, shape), []) if strict else "
           "_trace_listing_branches(model, shape)",
           "gm, branches = _trace_listing_branches(model, shape)",
           (f"{TRUTH}::test_a_branch_on_a_value_is_listed_where_it_is_and_the_rest_explained",),
           "explain(strict=True) goes on past a branch on a value instead of refusing it"),
    Mutant("graph-refused-reduction-keeps-its-dims", "distconv/parallel/graph.py",
           "            if shape is not None and len(shape) != p.ndim:",
           "            if False:",
           (TRUTH,),
           "a refused full reduction is placed with its input's number of dims"),
    # ---- the refusals' lists (distconv/ops/__init__.py supported())
    Mutant("supported-lists-every-form", "distconv/ops/__init__.py",
           "picked = list(dict.fromkeys(picked + _family_heads(op)))[:MAX_LISTED]",
           "picked = list(dict.fromkeys(picked + _family_heads(op)))",
           (f"{FIX}::test_at_most_ten_forms_are_listed_and_the_page_named",),
           "a refusal lists every supported form again (a 600-character line)"),
    Mutant("supported-nearest-last", "distconv/ops/__init__.py",
           "picked = list(dict.fromkeys(picked + _family_heads(op)))[:MAX_LISTED]",
           "picked = list(dict.fromkeys(_family_heads(op) + picked))[:MAX_LISTED]",
           (f"{FIX}::test_max_is_refused_pointing_to_amax_first",),
           "the forms nearest the refused one come after the families' heads (or are cut)"),
    # ---- nn.MultiheadAttention (distconv/ops/mha.py)
    Mutant("mha-keys-kept-split", "distconv/ops/mha.py",
           "needs = {q: at(rows), k: at(None), v: at(None)}",
           "needs = {q: at(rows), k: at(rows), v: at(None)}",
           (f"{MHA}::test_keys_apart_from_values_equal_one_process",),
           "keys apart from the values keep their token split: each query scores its rank's "
           "keys alone"),
    Mutant("mha-keys-and-values-kept-split", "distconv/ops/mha.py",
           "needs = {q: at(rows), k: at(None), v: at(None)}",
           "needs = {q: at(rows), k: at(rows), v: at(rows)}",
           (f"{MHA}::test_rows_attention_equals_one_process",),
           "cross-attention's keys and values keep their token split: each query attends its "
           "rank's rows alone"),
    Mutant("mha-self-attention-rows-kept", "distconv/ops/mha.py",
           "rows = None if q in (k, v) else qp.dist.entries[1 - samples]",
           "rows = qp.dist.entries[1 - samples]",
           (f"{MHA}::test_placements_follow_the_rule",),
           "a self-attention's query keeps its rows split while the same value is gathered"),
    Mutant("mha-weights-rows-whole", "distconv/ops/mha.py",
           "return Placement(p.layout, Dist((batch, *heads, rows, None))), 0",
           "return Placement(p.layout, Dist((batch, *heads, None, None))), 0",
           (f"{MHA}::test_rows_attention_equals_one_process",),
           "the attention weights of split query rows are placed as whole"),
    Mutant("mha-per-head-axis-dropped", "distconv/ops/mha.py",
           'heads = () if named["average_attn_weights"] else (None,)', "heads = ()",
           (f"{MHA}::test_placements_follow_the_rule",),
           "per-head weights [N, heads, L, S] placed as the averaged [N, L, S]"),
    Mutant("mha-dropout-allowed", "distconv/ops/mha.py",
           "        if module.dropout:\n", "        if False:\n",
           (f"{MHA}::test_what_cannot_be_exact_is_refused_naming_the_node",),
           "an attention with dropout runs, its fused draws no one process's"),
    Mutant("mha-samples-as-tokens-allowed", "distconv/ops/mha.py",
           "            if not is_constant(t) and dim != samples:",
           "            if False:",
           (f"{MHA}::test_what_cannot_be_exact_is_refused_naming_the_node",),
           "a batch_first=False attention given [N, L, E] pairs one sample's tokens with "
           "another's, unrefused"),
    # ---- Swin's roll (distconv/ops/roll.py)
    Mutant("roll-split-dim-kept", "distconv/ops/roll.py",
           "entries = tuple(None if d in dims else e for d, e in enumerate(p.dist.entries))",
           "entries = p.dist.entries",
           (f"{SWIN}::test_roll_equals_one_process",),
           "each rank rolls its own block of split rows (wraps inside the block)"),
    Mutant("roll-negative-dims-unnormalised", "distconv/ops/roll.py",
           "    return tuple(d % ndim for d in dims)", "    return tuple(dims)",
           (f"{SWIN}::test_roll_of_negative_dims_equals_one_process",),
           "a roll over dims=(-3, -2) keeps those dims split"),
    Mutant("roll-samples-allowed", "distconv/ops/roll.py",
           "        if samples in dims:\n", "        if False:\n",
           (f"{SWIN}::test_a_roll_that_cannot_be_exact_is_refused_naming_the_node",),
           "a roll of the samples moves one sample's values into another's, unrefused"),
    Mutant("roll-pending-dropped", "distconv/ops/roll.py",
           "need = Placement(p.layout, Dist(entries, p.dist.pending))",
           "need = Placement(p.layout, Dist(entries))",
           (f"{SWIN}::test_roll_of_an_unsettled_mean_over_split_rows_equals_one_process",),
           "a roll of a pending sum settles it first (an allreduce at the roll, not where a "
           "product needs it)"),
    # ---- sizes through numpy and einops (distconv/parallel/capture.py)
    Mutant("numpy-reads-tensor-values", "distconv/parallel/capture.py",
           "        if not (self.known and is_size(self.node)):\n"
           "            raise fx.proxy.TraceError(",
           "        if not self.known:\n            raise fx.proxy.TraceError(",
           (f"{SWIN}::test_numpy_reading_a_tensor_s_values_is_refused_with_the_fix",),
           "numpy reads a tensor's values at capture (one rank's block) as a constant"),
    Mutant("numpy-array-protocols-proxied", "distconv/parallel/capture.py",
           'return name.startswith("__array") and name != "__array__"', "return False",
           (f"{SWIN}::test_sizes_read_through_numpy_are_the_global_shape_s_under_guards",),
           "numpy's __array_struct__ answered with a proxy: np.array(x.shape[2:]) breaks"),
    Mutant("einops-shape-traced", "distconv/parallel/capture.py",
           "            return tuple(int(x.shape[i]) for i in range(x.value.dim()))",
           "            return x.shape",
           (f"{SWIN}::test_sizes_einops_reads_are_the_captured_shape_s_ints",),
           "einops reads traced sizes, not the captured shape's, under the sized capture"),
    Mutant("einops-only-if-imported-before", "distconv/parallel/capture.py",
           "    try:  # (a forward may import einops itself, while it is traced)\n"
           "        import einops._backends as backends\n    except ImportError:",
           '    backends = sys.modules.get("einops._backends")\n    if backends is None:',
           (f"{SWIN}::"
            "test_einops_first_imported_by_the_traced_forward_is_bound_to_traced_values",),
           "an einops the forward imports while it is traced is not bound to traced values"),
]

# ---- this stop's wave: the root's unread tensors, the host channel's failures, the planner's
# per-step records and the zoo's constant indices
MUTANTS += [
    Mutant("root-buffers-dropped", "distconv/parallel/capture.py",
           "    for name, b in model.named_buffers(recurse=False):\n        if name not in have:",
           "    for name, b in model.named_buffers(recurse=False):\n        if False:",
           (f"{PINS_WAVE}::test_a_root_buffer_the_graph_never_reads_stays_in_the_state",),
           "a root buffer the graph never reads is missing from the parallel model's state"),
    Mutant("channel-failure-names-its-setup", "distconv/comm/host_channel.py",
           'op = getattr(comm, "_op", "")',
           'op = "broadcast"',
           ("tests/comm/test_failures.py::test_missing_peer_times_out",),
           "a missing peer at the call that opens the host channel is blamed on its setup"),
    Mutant("step-record-one-conversion", "distconv/planner/search.py",
           "                    taken |= 1 << bit",
           "                    taken = 1 << bit",
           ("tests/test_planner_speed.py", "tests/test_planner_prices.py"),
           "a step converting two operands is priced with the report of one"),
    Mutant("constant-index-crashes-the-walk", "distconv/ops/extents.py",
           "    except (TypeError, ValueError):\n        return frozenset()  # an index",
           "    except ZeroDivisionError:\n        return frozenset()  # an index",
           ("tests/zoo/test_zoo.py::test_zoo_pair_is_exact_or_refused_as_stated"
            "[monai.SwinUNETR-spatial]",),
           "an index the capture made a constant crashes the unit-dims walk under split rows"),
]


def _copy_tree(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", ".hypothesis", ".pytest_cache", "output")
    for name in COPY:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        elif src.exists():
            shutil.copy2(src, dest / name)


def stale(m: Mutant, root: Path = ROOT) -> str | None:
    """Why ``m`` no longer applies to the tree at ``root`` (its text is not there exactly once),
    or None."""
    for path, old, _ in ((m.path, m.old, m.new), *m.also):
        target = root / path
        count = target.read_text().count(old) if target.exists() else 0
        if count != 1:
            return f"stale ({count} matches in {path})"
    return None


def moving(m: Mutant) -> bool:
    return any(p.startswith(MOVING) for p in (m.path, *(a[0] for a in m.also)))


def _pytest(tree: Path, tests: tuple[str, ...], budget: float) -> tuple[str, float, str]:
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    begin = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                              timeout=budget)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - begin, ""
    seconds = time.monotonic() - begin
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    return ("survived" if proc.returncode == 0 else "killed"), seconds, last


def run_mutant(m: Mutant, budget: float) -> dict:
    why_stale = stale(m)
    if why_stale is not None:
        return {"name": m.name, "result": why_stale, "seconds": 0.0, "why": m.why}
    with tempfile.TemporaryDirectory(prefix="distconv-mutant-") as tmp:
        tree = Path(tmp)
        _copy_tree(tree)
        for path, old, new in ((m.path, m.old, m.new), *m.also):
            target = tree / path
            target.write_text(target.read_text().replace(old, new))
        result, seconds, last = _pytest(tree, m.tests, budget)
    return {"name": m.name, "result": result, "seconds": round(seconds, 1), "last": last,
            "why": m.why, "tests": list(m.tests), "budget": budget}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("names", nargs="*",
                    help="mutants to run, by name or shell pattern ('sampler-*'; default: all)")
    ap.add_argument("--list", action="store_true",
                    help="list the mutants (stale ones say why, moving ones are marked) and exit")
    ap.add_argument("--from", dest="start", metavar="NAME", default=None,
                    help="run the mutants from NAME on, in list order (with names: those of them)")
    ap.add_argument("--budget", type=float, default=BUDGET,
                    help=f"seconds each mutant's tests may take (default {BUDGET:.0f})")
    ap.add_argument("--baseline", action="store_true",
                    help="first run every mutant's tests on the unmutated copy (must pass)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    unknown = [n for n in args.names if not any(fnmatch.fnmatchcase(m.name, n) for m in MUTANTS)]
    if unknown:
        ap.error(f"no mutant matches {unknown}")
    names = [m.name for m in MUTANTS]
    if args.start is not None and args.start not in names:
        ap.error(f"--from: no mutant named {args.start!r}")
    first = 0 if args.start is None else names.index(args.start)
    chosen = [m for m in MUTANTS[first:]
              if not args.names or any(fnmatch.fnmatchcase(m.name, n) for n in args.names)]
    if args.list:
        for m in chosen:
            state = stale(m) or ("moving" if moving(m) else "")
            print(f"{m.name:40s} {m.path:34s} {state:8s} {m.why}")
        return
    if args.baseline:
        tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        with tempfile.TemporaryDirectory(prefix="distconv-baseline-") as tmp:
            _copy_tree(Path(tmp))
            result, seconds, last = _pytest(Path(tmp), tests, args.budget * len(chosen))
        print(f"baseline: {'pass' if result == 'survived' else 'FAIL'} in {seconds:.0f} s ({last})")
        if result != "survived":
            sys.exit(2)
    results = []
    begin = time.monotonic()
    for m in chosen:
        r = run_mutant(m, args.budget)
        results.append(r)
        print(f"{r['name']:40s} {r['result']:18s} {r['seconds']:6.1f} s  {r['why']}", flush=True)
    by = {k: [r["name"] for r in results if r["result"].startswith(k)]
          for k in ("killed", "survived", "timeout", "stale")}
    ran = len(by["killed"]) + len(by["survived"]) + len(by["timeout"])
    rest = "".join(f"; {len(by[k])} {k}: {', '.join(by[k])}"
                   for k in ("survived", "timeout", "stale") if by[k])
    score = 100 * len(by["killed"]) / max(ran, 1)
    print(f"\n{len(by['killed'])} killed of {ran} run ({score:.0f}%) in "
          f"{time.monotonic() - begin:.0f} s{rest}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    sys.exit(1 if by["survived"] or by["timeout"] else 0)


if __name__ == "__main__":
    main()

