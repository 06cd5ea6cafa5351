"""Bad inputs to the public API are refused with TypeError/ValueError naming the argument and the
value received; inputs that must agree across ranks are checked in debug mode."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from distconv import (
    Dist, ProcessorGrid, balanced_block, gather, nested_block, plan_redistribution, redistribute,
    repartition, scatter,
)
from distconv.comm import CollectiveMismatchError, SingleCommunicator, init, set_debug
from distconv.launch import launch
from distconv import clip_grad_norm_, parallelize
from distconv.parallel import ParallelConfig, load_config
from distconv.parallel.explain import explain
from distconv.nn import DistConv2d
from tests.optional import need
from distconv.testing import WorkerPool, run_threads

ONE = SingleCommunicator()
GRID = ProcessorGrid({"N": 1}, comm=ONE)
D2 = Dist.parse("x[o,*]", "NC")
X = torch.zeros(1, 1)


def _conv(**kw):
    return DistConv2d(2, 2, 3, grid=GRID, algorithm="stationary-x", **kw)


def _rank_fn(comm):
    return comm.rank


def _fosi_step(**kw):
    from distkfac.hybrid import FOSI

    opt = FOSI(nn.Linear(3, 2).parameters(), lambda ps: torch.optim.SGD(ps, lr=0.1), k=1)
    opt.step(**kw)


def _fosi_estimate(**kw):
    from distkfac.hybrid import FOSI

    lin = nn.Linear(3, 2)
    opt = FOSI(lin.parameters(), lambda ps: torch.optim.SGD(ps, lr=0.1), k=1)
    opt.estimate(lambda: lin(torch.ones(4, 3)).pow(2).sum(), **kw)


def _dho2_step(**kw):
    from distkfac.hybrid import DHO2

    opt = DHO2(nn.Linear(3, 2).parameters(), lambda ps: torch.optim.SGD(ps, lr=0.1), comm=ONE,
               k=1)
    opt.step(**kw)


def _mr_dho2_rank(comm, num_samples):
    from distkfac.hybrid import MRDHO2

    lin = nn.Linear(3, 2)
    opt = MRDHO2(lin.parameters(), lambda ps: torch.optim.SGD(ps, lr=0.1), comm=comm, k=1,
                 ese_closure=lambda: lin(torch.ones(2, 3)).pow(2).sum())
    opt.step(num_samples=num_samples)


def _kfac(**kw):
    import distkfac

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    return distkfac.KFAC(model, comm=ONE, **kw)


def _net():
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 8 * 8, 2))


_CFG = {"default": {"grid": {"N": 2}, "algorithm": "sample"}}
_AUTO = {"default": {"grid": {"N": 2}, "algorithm": "auto"},
         "layers": [{"match": "3", "grid": {"N": 2}, "algorithm": "sample"}]}


def _explain(shape=(2, 3, 8, 8), config=None, **kw):
    return explain(_net(), _CFG if config is None else config, shape, **kw)


def _plan(shape=(2, 3, 8, 8), **kw):
    from distconv.planner import plan_network

    return plan_network(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1)), shape, world_size=2,
                        **{"machine": "lassen", **kw})


def _predict(**kw):
    from distconv.planner import predict

    return predict(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1)), _CFG, (2, 3, 8, 8),
                   world_size=2, **kw)


def _broken_yaml():
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "broken.yaml")
        with open(path, "w", encoding="utf-8") as f:
            f.write("default:\n  grid: {N: 2\n  algorithm: sample\n")
        ParallelConfig(path, world_size=2)


def _resolve(machine):
    from distconv.machines import resolve_machine

    return resolve_machine(machine)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x).mean((2, 3)))


def _pmodel(**kw):
    return parallelize(_Tiny(), {"default": {"grid": {"N": 1}}}, comm=ONE, **kw)


def _sample_parallel_rank(comm, dtype):
    pmodel = parallelize(_net(), _CFG, comm=comm)
    return pmodel(torch.zeros(1, 3, 8, 8, dtype=dtype))


def _sample_parallel(dtype):
    """Two thread ranks of a float32 sample-parallel model fed ``dtype`` inputs."""
    return run_threads(_sample_parallel_rank, 2, dtype, timeout=30.0)


def _conv_on_cuda_without_cuda():
    from unittest import mock

    with mock.patch.object(torch.cuda, "is_available", lambda: False):  # as a CPU-only torch
        _conv(device="cuda")


def _scatter_differing_in_debug_mode():
    set_debug(True)
    try:
        run_threads(_scatter_rank_data, 3, False)
    finally:
        set_debug(os.environ.get("DISTCONV_DEBUG", "") not in ("", "0", "false", "no", "off"))


def _grad_param(value: float = 1.0) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.full((2,), value)
    return p


def _load_plain_wrong_shape():
    state = _Tiny().state_dict()
    state["conv.weight"] = torch.zeros(4, 3, 5, 5)
    _pmodel().load_state_dict(state)


# (id, call, exception type, substrings the message must contain: the argument and the value)
CATALOG = [
    # wrong types
    ("parse-none", lambda: Dist.parse(None), TypeError, ["spec", "None"]),
    ("parse-dims-int", lambda: Dist.parse("x[o]", 5), TypeError, ["tensor_dims", "5"]),
    ("dist-entries-str", lambda: Dist("NC"), TypeError, ["entries", "'NC'", "Dist.parse"]),
    ("dist-pending-str", lambda: Dist((None,), "C"), TypeError, ["pending", "'C'"]),
    ("grid-none", lambda: ProcessorGrid(None, comm=ONE), TypeError, ["dims", "None"]),
    ("grid-triple", lambda: ProcessorGrid([("N", 1, 3)], comm=ONE), TypeError,
     ["('N', 1, 3)", "pair"]),
    ("grid-comm-str", lambda: ProcessorGrid({"N": 1}, comm="world"), TypeError,
     ["comm", "'world'"]),
    ("grid-subcomm-int", lambda: GRID.subcomm(3), TypeError, ["dims", "3"]),
    ("redistribute-list", lambda: redistribute([[0.0]], GRID, D2, D2, (1, 1)), TypeError,
     ["x", "list"]),
    ("redistribute-dist-str", lambda: redistribute(X, GRID, "x[o,*]", D2, (1, 1)), TypeError,
     ["src", "'x[o,*]'", "Dist.parse"]),
    ("redistribute-grid-str", lambda: redistribute(X, "grid", D2, D2, (1, 1)), TypeError,
     ["grid", "'grid'"]),
    ("redistribute-shape-none", lambda: redistribute(X, GRID, D2, D2, None), TypeError,
     ["global_shape", "None"]),
    ("scatter-list", lambda: scatter([0.0], D2, GRID), TypeError, ["x", "list"]),
    ("scatter-dist-str", lambda: scatter(X, "x[o,*]", GRID), TypeError, ["dist", "'x[o,*]'"]),
    ("gather-list", lambda: gather([0.0], D2, GRID, (1, 1)), TypeError, ["x", "list"]),
    ("repartition-grid-str", lambda: repartition(X, GRID, D2, "g", D2, (1, 1)), TypeError,
     ["dst_grid", "'g'"]),
    ("plan-grid-not-layout", lambda: plan_redistribution(GRID, D2, D2, (1, 1)), TypeError,
     ["layout"]),
    ("conv-forward-list", lambda: _conv()([0.0]), TypeError, ["x", "list"]),
    ("conv-dtype", lambda: _conv()(torch.zeros(1, 2, 4, 4, dtype=torch.float64)), TypeError,
     ["torch.float64", "torch.float32"]),
    ("conv-bias-str", lambda: _conv(bias="yes"), TypeError, ["bias", "'yes'"]),
    ("conv-seed-float", lambda: _conv(init_seed=1.5), TypeError, ["init_seed", "1.5"]),
    ("conv-role-int", lambda: _conv(channel_dim=3), TypeError, ["channel_dim", "3"]),
    ("comm-allreduce-list", lambda: ONE.allreduce([1.0]), TypeError, ["t", "list"]),
    ("run-threads-fn", lambda: run_threads(None, 2), TypeError, ["fn", "None"]),
    ("launch-fn", lambda: launch("f", 1, backend="single"), TypeError, ["fn", "'f'"]),
    ("pool-timeout-str", lambda: WorkerPool("gloo", 2, timeout="5"), TypeError,
     ["timeout", "'5'"]),
    # numbers that are not sizes
    ("balanced-negative", lambda: balanced_block(-5, 2, 0), ValueError, ["n", "-5"]),
    ("balanced-float", lambda: balanced_block(5.5, 2, 0), TypeError, ["n", "5.5"]),
    ("nested-short-coords", lambda: nested_block(10, [2, 2], [1]), ValueError,
     ["extents (2, 2)", "coords (1,)"]),
    ("local-shape-negative", lambda: D2.local_shape((-4, 2), GRID), ValueError,
     ["global_shape", "-4"]),
    ("local-shape-float", lambda: D2.local_shape((4.7, 2), GRID), TypeError,
     ["global_shape", "4.7"]),
    ("redistribute-float-shape", lambda: redistribute(X, GRID, D2, D2, (1.5, 1)), TypeError,
     ["global_shape", "1.5"]),
    ("gather-negative-shape", lambda: gather(X, D2, GRID, (-1, 1)), ValueError,
     ["global_shape", "-1"]),
    ("conv-input-shape-negative", lambda: _conv(input_shape=(-1, 2, 4, 4)), ValueError,
     ["input_shape", "-1"]),
    ("conv-global-shape-float",
     lambda: _conv()(torch.zeros(1, 2, 4, 4), global_shape=(1.0, 2, 4, 4)), TypeError,
     ["global_shape", "1.0"]),
    ("conv-global-shape-contradicts",
     lambda: _conv()(torch.zeros(1, 2, 4, 4), global_shape=(3, 2, 4, 4)), ValueError,
     ["(1, 2, 4, 4)", "(3, 2, 4, 4)"]),
    # non-finite or non-positive timeouts
    ("comm-timeout-nan", lambda: SingleCommunicator(timeout=math.nan), ValueError,
     ["timeout", "nan"]),
    ("comm-timeout-inf", lambda: SingleCommunicator(timeout=math.inf), ValueError,
     ["timeout", "inf"]),
    ("init-timeout-nan", lambda: init("single", timeout=math.nan), ValueError,
     ["timeout", "nan"]),
    ("split-timeout-nan", lambda: ONE.split([[0]], timeout=math.nan), ValueError,
     ["timeout", "nan"]),
    ("run-threads-timeout-nan", lambda: run_threads(_rank_fn, 2, timeout=math.nan), ValueError,
     ["timeout", "nan"]),
    ("launch-timeout-nan", lambda: launch(_rank_fn, 1, backend="single", timeout=math.nan),
     ValueError, ["timeout", "nan"]),
    # hybrid-order optimizers: the sample count weights the gradient (0 or < 0 gave NaN/Inf)
    ("fosi-num-samples-zero", lambda: _fosi_step(num_samples=0), ValueError,
     ["num_samples", "got 0", "> 0"]),
    ("fosi-num-samples-negative", lambda: _fosi_step(num_samples=-3), ValueError,
     ["num_samples", "-3"]),
    ("fosi-num-samples-nan", lambda: _fosi_step(num_samples=math.nan), ValueError,
     ["num_samples", "nan"]),
    ("fosi-num-samples-inf", lambda: _fosi_step(num_samples=math.inf), ValueError,
     ["num_samples", "inf"]),
    ("fosi-num-samples-bool", lambda: _fosi_step(num_samples=True), TypeError,
     ["num_samples", "True"]),
    ("fosi-num-samples-str", lambda: _fosi_step(num_samples="8"), TypeError,
     ["num_samples", "'8'"]),
    ("fosi-num-samples-tensor", lambda: _fosi_step(num_samples=torch.tensor(8)), TypeError,
     ["num_samples", "tensor(8)"]),
    ("fosi-estimate-num-samples-negative", lambda: _fosi_estimate(num_samples=-1.0), ValueError,
     ["num_samples", "-1.0"]),
    ("dho2-num-samples-zero", lambda: _dho2_step(num_samples=0), ValueError,
     ["num_samples", "got 0"]),
    ("dho2-num-samples-negative", lambda: _dho2_step(num_samples=-2.5), ValueError,
     ["num_samples", "-2.5"]),
    ("mr-dho2-num-samples-zero", lambda: run_threads(_mr_dho2_rank, 2, 0, timeout=10),
     ValueError, ["num_samples", "got 0"]),
    ("mr-dho2-num-samples-none", lambda: run_threads(_mr_dho2_rank, 2, None, timeout=10),
     TypeError, ["num_samples", "None"]),
    # K-FAC factor sharding: a key naming no layer was ignored
    ("kfac-sharding-unknown-layer", lambda: _kfac(factor_sharding={"unknown_layer": "exact"}),
     ValueError, ["factor_sharding", "unknown_layer", "'0', '2'"]),
    ("kfac-sharding-mixed-keys", lambda: _kfac(factor_sharding={"0": "exact", "fc": "block"}),
     ValueError, ["factor_sharding", "['fc']"]),
    ("kfac-sharding-bad-layout", lambda: _kfac(factor_sharding={"0": "rows"}), ValueError,
     ["factor_sharding", "'rows'", "exact"]),
    ("kfac-sharding-int", lambda: _kfac(factor_sharding=3), TypeError,
     ["factor_sharding", "3"]),
    # explain's options
    ("explain-model-str", lambda: explain("net", _CFG, (2, 3, 8, 8)), TypeError,
     ["model", "'net'"]),
    ("explain-optimizer-states-negative", lambda: _explain(optimizer_states=-1), ValueError,
     ["optimizer_states", "-1", ">= 0"]),
    ("explain-optimizer-states-float", lambda: _explain(optimizer_states=1.5), TypeError,
     ["optimizer_states", "1.5"]),
    ("explain-optimizer-states-bool", lambda: _explain(optimizer_states=True), TypeError,
     ["optimizer_states", "True"]),
    ("explain-itemsize-zero", lambda: _explain(itemsize=0), ValueError, ["itemsize", "0"]),
    ("explain-itemsize-float", lambda: _explain(itemsize=4.0), TypeError, ["itemsize", "4.0"]),
    ("explain-bucket-bytes-negative", lambda: _explain(bucket_bytes=-1), ValueError,
     ["bucket_bytes", "-1"]),
    ("explain-bucket-bytes-str", lambda: _explain(bucket_bytes="25MB"), TypeError,
     ["bucket_bytes", "'25MB'"]),
    ("explain-world-size-zero", lambda: _explain(world_size=0), ValueError,
     ["world_size", "0"]),
    ("explain-world-size-str", lambda: _explain(world_size="2"), TypeError,
     ["world_size", "'2'"]),
    ("explain-world-size-contradicts-grid", lambda: _explain(world_size=4), ValueError,
     ["world_size=4", "{'N': 2}"]),
    # explain's machine: a flat or hierarchical machine, a factory or a known name
    ("explain-machine-int", lambda: _explain(machine=3), TypeError,
     ["machine", "3", "lassen", "factory"]),
    ("explain-machine-dict", lambda: _explain(machine={"alpha": 1e-6}), TypeError,
     ["machine", "{'alpha': 1e-06}"]),
    ("explain-machine-unknown-name", lambda: _explain(machine="frontier"), ValueError,
     ["machine", "'frontier'", "lassen"]),
    ("explain-machine-factory-returns-junk", lambda: _explain(machine=lambda: 5), TypeError,
     ["machine", "returned 5"]),
    ("explain-machine-factory-needs-args", lambda: _explain(machine=lambda n: n), TypeError,
     ["machine", "no arguments"]),
    ("resolve-machine-none", lambda: _resolve(None), TypeError, ["machine", "None"]),
    # explain's input shape
    ("explain-shape-3-dims", lambda: _explain((3, 8, 8)), ValueError,
     ["input_shape", "(3, 8, 8)", "4-dim", "3 channels"]),
    ("explain-shape-5-dims", lambda: _explain((2, 3, 8, 8, 1)), ValueError,
     ["input_shape", "(2, 3, 8, 8, 1)", "4-dim"]),
    ("explain-shape-channels", lambda: _explain((2, 5, 8, 8)), ValueError,
     ["input_shape", "(2, 5, 8, 8)", "3 channels"]),
    ("explain-shape-later-layer", lambda: _explain((2, 3, 10, 10)), ValueError,
     ["input_shape", "(2, 3, 10, 10)", "3 channels", "'3' (Linear)"]),
    ("explain-auto-shape-later-layer", lambda: _explain((2, 3, 10, 10), _AUTO), ValueError,
     ["input_shape", "(2, 3, 10, 10)", "'3' (Linear)"]),
    ("explain-verbose-int", lambda: _explain(verbose=1), TypeError, ["verbose", "1"]),
    ("explain-shape-float", lambda: _explain((2, 3.0, 8, 8)), TypeError,
     ["input_shape", "(2, 3.0, 8, 8)"]),
    ("explain-shape-negative", lambda: _explain((2, -3, 8, 8)), ValueError,
     ["input_shape", "(2, -3, 8, 8)"]),
    ("explain-shape-str", lambda: _explain("2,3,8,8"), TypeError,
     ["input_shape", "'2,3,8,8'"]),
    # the planner's machine and input shape
    ("plan-network-machine-int", lambda: _plan(machine=3), TypeError, ["machine", "3"]),
    ("plan-network-machine-unknown-name", lambda: _plan(machine="frontier"), ValueError,
     ["machine", "'frontier'"]),
    ("plan-network-shape-channels", lambda: _plan((2, 5, 8, 8)), ValueError,
     ["input_shape", "(2, 5, 8, 8)", "3 channels"]),
    ("predict-machine-none", lambda: _predict(machine=None), TypeError, ["machine", "None"]),
    # configs
    ("config-yaml-syntax", _broken_yaml, ValueError, ["config file", "broken.yaml", "line 3"]),
    ("config-world-size-contradicts-grid",
     lambda: ParallelConfig({"default": {"grid": {"N": 2}}}, world_size=4), ValueError,
     ["world_size=4", "'N': 2"]),
    ("config-int", lambda: load_config(5), TypeError, ["config", "int"]),
    # gradient clipping of sharded parameters
    ("clip-max-norm-negative", lambda: clip_grad_norm_([_grad_param()], -1.0), ValueError,
     ["max_norm", "-1.0"]),
    ("clip-max-norm-str", lambda: clip_grad_norm_([_grad_param()], "1"), TypeError,
     ["max_norm", "'1'"]),
    ("clip-norm-type-zero", lambda: clip_grad_norm_([_grad_param()], 1.0, 0), ValueError,
     ["norm_type", "0"]),
    ("clip-norm-type-str", lambda: clip_grad_norm_([_grad_param()], 1.0, "2"), TypeError,
     ["norm_type", "'2'"]),
    ("clip-nonfinite-flag-str",
     lambda: clip_grad_norm_([_grad_param()], 1.0, error_if_nonfinite="yes"), TypeError,
     ["error_if_nonfinite", "'yes'"]),
    ("clip-parameters-int", lambda: clip_grad_norm_(3, 1.0), TypeError, ["parameters", "int"]),
    ("clip-parameters-of-str", lambda: clip_grad_norm_(["w"], 1.0), TypeError,
     ["parameters[0]", "str"]),
    ("clip-nonfinite-gradient",
     lambda: clip_grad_norm_([_grad_param(math.inf)], 1.0, error_if_nonfinite=True),
     RuntimeError, ["non-finite", "error_if_nonfinite"]),
    # parallelize and the parallel model
    ("parallelize-model-str", lambda: parallelize("resnet", {}, comm=ONE), TypeError,
     ["model", "str"]),
    ("parallelize-loss-reduction", lambda: _pmodel(loss_reduction="avg"), ValueError,
     ["loss_reduction", "'avg'"]),
    ("parallelize-bucket-bytes-zero", lambda: _pmodel(bucket_bytes=0), ValueError,
     ["bucket_bytes", "0"]),
    ("parallelize-input-shape-str", lambda: _pmodel(input_shape="2,3,8,8"), TypeError,
     ["input_shape", "'2,3,8,8'"]),
    ("parallelize-machine-int", lambda: _pmodel(machine=3), TypeError, ["machine", "3"]),
    ("pmodel-input-list", lambda: _pmodel()([[0.0]]), TypeError, ["input", "list"]),
    ("pmodel-input-channels", lambda: _pmodel()(torch.zeros(2, 5, 8, 8)), ValueError,
     ["(2, 5, 8, 8)", "3 channels"]),
    ("pmodel-load-state-dict-list", lambda: _pmodel().load_state_dict([1]), TypeError,
     ["state_dict", "list"]),
    ("pmodel-load-plain-wrong-shape", _load_plain_wrong_shape, ValueError,
     ["conv.weight", "(4, 3, 5, 5)"]),
    ("pmodel-input-float64", lambda: _sample_parallel(torch.float64), TypeError,
     ["input", "torch.float64", "torch.float32", "x.to(torch.float32)"]),
    ("pmodel-input-int", lambda: _pmodel()(torch.zeros(2, 3, 8, 8, dtype=torch.int64)), TypeError,
     ["input", "floating point", "torch.int64", "torch.float32"]),
    ("parse-unclosed-brace", lambda: Dist.parse("x[o,o_{F,C,o,o]", "NCHW"), ValueError,
     ["'x[o,o_{F,C,o,o]'", "never closed", "'}'"]),
    ("parse-unopened-brace", lambda: Dist.parse("x[o,o_F,C},o,o]", "NCHW"), ValueError,
     ["'x[o,o_F,C},o,o]'", "not opened"]),
    ("conv-device-cuda-without-cuda", _conv_on_cuda_without_cuda, ValueError,
     ["DistConv2d", "device='cuda'", "device='cpu'"]),
    ("conv-device-str", lambda: _conv(device="gpu0"), ValueError, ["device", "'gpu0'"]),
    ("conv-dtype-int", lambda: _conv(dtype=torch.int64), TypeError,
     ["DistConv2d", "dtype", "floating point", "torch.int64"]),
    ("conv-one-rank-channels", lambda: _conv()(torch.zeros(1, 3, 5, 5)), ValueError,
     ["DistConv2d(in_channels=2", "(1, 3, 5, 5)", "(N, 2, H, W)"]),
    ("scatter-differing-data-debug", _scatter_differing_in_debug_mode, CollectiveMismatchError,
     ["scatter", "must be the same on every rank"]),
    ("pmodel-clip-max-norm-negative", lambda: _pmodel().clip_grad_norm_(-2.0), ValueError,
     ["max_norm", "-2.0"]),
]


@pytest.mark.parametrize("call, exc, words", [c[1:] for c in CATALOG],
                         ids=[c[0] for c in CATALOG])
def test_bad_input_is_refused_naming_argument_and_value(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    for word in words:
        assert word in message, (word, message)


def test_good_inputs_still_pass():
    """The checks accept every form the API documents (numpy/torch ints, torch.Size, pairs)."""
    np = need("numpy")
    assert balanced_block(np.int64(5), 2, torch.tensor(1).item()) == (3, 2)
    assert nested_block(10, (2, 2), (1, 0)) == (5, 3)
    assert D2.local_shape(torch.Size([4, 2]), GRID) == (4, 2)
    assert ProcessorGrid([("N", 1)], comm=ONE).shape == {"N": 1}
    assert torch.equal(gather(X, D2, GRID, torch.Size([1, 1])), X)


def _wait_forever(comm, never):
    if comm.rank < comm.size - 1:
        return comm.rank  # the others finish; the last waits where no communicator reaches it
    never.wait()


@pytest.mark.parametrize("size", [1, 2])
def test_run_threads_raises_within_its_timeout_when_ranks_block_outside_the_communicator(size):
    """Threads cannot be killed: the blocked ranks are named and left behind as daemons."""
    import threading
    import time

    from distconv.comm import CommTimeoutError

    never = threading.Event()
    begin = time.monotonic()
    try:
        with pytest.raises(CommTimeoutError, match=rf"rank\(s\) {size - 1} of {size} still "
                                                   r"running with no communication"):
            run_threads(_wait_forever, size, never, timeout=0.5)
        assert time.monotonic() - begin < 0.5 + 30.0  # raised, not hung (a loaded machine)
    finally:
        never.set()


def _sample_only_conv(comm, given):
    grid = ProcessorGrid({"N": 2}, comm=comm)
    conv = DistConv2d(2, 2, 3, grid=grid, algorithm="stationary-x", init_seed=0)
    x = torch.zeros(2, 2, 5, 5)  # each rank holds 2 samples: the global batch is 4
    return tuple(conv(x, global_shape=given).shape)


def test_sample_parallel_conv_checks_given_global_shape():
    """The fast path of a grid that splits only samples used to ignore ``global_shape``."""
    assert run_threads(_sample_only_conv, 2, (4, 2, 5, 5)) == [(2, 2, 3, 3)] * 2
    with pytest.raises(ValueError, match=r"\(2, 2, 5, 5\).*\(6, 2, 5, 5\)"):
        run_threads(_sample_only_conv, 2, (6, 2, 5, 5))


def _scatter_rank_data(comm, same):
    grid = ProcessorGrid({"C": comm.size}, comm=comm)
    x = torch.arange(6.0).reshape(2, 3) + (0 if same else comm.rank)
    return scatter(x, Dist.parse("x[*,o_C]"), grid)


@pytest.fixture
def debug_mode():
    set_debug(True)
    try:
        yield
    finally:
        set_debug(os.environ.get("DISTCONV_DEBUG", "") not in ("", "0", "false", "no", "off"))


def test_scatter_of_different_data_is_caught_in_debug_mode(debug_mode):
    got = run_threads(_scatter_rank_data, 3, True)
    want = torch.arange(6.0).reshape(2, 3)
    assert all(torch.equal(g, want[:, r : r + 1]) for r, g in enumerate(got))
    with pytest.raises(CollectiveMismatchError, match="must be the same on every rank"):
        run_threads(_scatter_rank_data, 3, False)


_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    import atexit
    import torch
    import torch.distributed as dist
    from distconv.comm import init
    # registered first, so it runs last: by then distconv must have released the groups
    atexit.register(lambda: print("initialized at exit:", dist.is_initialized()))
    comm = init()
    sub = comm.split([[0]])
    print(float(comm.allreduce(torch.ones(3)).sum()))
    assert sub.size == 1
""")


def test_script_that_simply_ends_exits_cleanly(tmp_path):
    """One gloo rank, a sub-communicator, a collective, and the end of the script, with no
    shutdown call (benchmarks/soak.py repeats 4-process versions, with and without
    ``distconv.comm.shutdown()``, hundreds of times)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "ends.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.run([sys.executable, str(script), str(port)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[:2] == ["3.0", "initialized at exit: False"], proc.stdout


def _close_world(comm):
    sub = comm.split([[0, 1], [2, 3]])
    total = float(sub.allreduce(torch.ones(2)).sum())
    comm.close()
    comm.close()  # idempotent
    return total, len(comm._splits)


def test_close_releases_sub_communicators():
    assert run_threads(_close_world, 4) == [(4.0, 0)] * 4


def _from_rank_conv(comm):
    conv = nn.Conv2d(4, 4, 3)
    with torch.no_grad():
        conv.weight.fill_(comm.rank)  # as if every rank had seeded the shared generator itself
    return DistConv2d.from_conv2d(conv, grid=ProcessorGrid({"C": 2}, comm=comm),
                                  algorithm="stationary-x").weight.shape


def test_from_conv2d_of_different_layers_is_caught_in_debug_mode(debug_mode):
    with pytest.raises(CollectiveMismatchError, match="global weight must be the same"):
        run_threads(_from_rank_conv, 2)


@pytest.mark.parametrize("coords, exc", [({"N": 1}, ValueError), ({"Q": 0}, ValueError),
                                         ([0], TypeError), ({"N": 0.0}, ValueError)])
def test_rank_of_refuses_coordinates_outside_the_grid(coords, exc):
    with pytest.raises(exc, match="coords|not in"):
        GRID.rank_of(coords)


@pytest.mark.parametrize("op, args", [
    ("allreduce", (torch.ones(2),)), ("allgather", (torch.ones(2),)),
    ("reduce_scatter", ([torch.ones(2)],)), ("alltoall", ([torch.ones(2)],)),
])
def test_collectives_refuse_a_non_bool_async_op(op, args):
    with pytest.raises(TypeError, match="async_op must be a bool, got 'yes'"):
        getattr(ONE, op)(*args, async_op="yes")
    with pytest.raises(TypeError, match="async_op"):
        ONE.broadcast(torch.ones(1), root=0, async_op=1)


def _use_closed_sub(comm):
    # the pool's world must stay usable, so close a sub-communicator of it
    groups = [list(range(comm.size))]
    sub = comm.split(groups, timeout=7.0)
    sub.close()
    try:
        sub.allreduce(torch.ones(1))
        said = None
    except Exception as exc:  # noqa: BLE001 - the type is the point
        said = (type(exc).__name__, "closed" in str(exc))
    again = comm.split(groups, timeout=7.0)  # a new one in place of the closed one
    return said, again is not sub, float(again.allreduce(torch.ones(1)).sum())


@pytest.mark.parametrize("name", [pytest.param("gloo2", marks=pytest.mark.gloo),
                                  pytest.param("mpi4", marks=pytest.mark.mpi)])
def test_a_closed_communicator_says_so(request, name):
    pool = request.getfixturevalue(name)
    assert pool.run(_use_closed_sub) == [(("CommError", True), True, float(pool.size))] * pool.size
