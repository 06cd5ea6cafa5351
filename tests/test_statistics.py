"""BatchNorm statistics as the config chooses: ``global`` is one process's semantics (the whole
suite checks it); ``local`` is DDP's plain BatchNorm: each sample block normalises by its own
statistics, gradients are averaged over the blocks, and the running statistics are sample block
0's (DDP's broadcast buffers). The reference here is that loop written out by hand on one
process; on gloo it is torch's DistributedDataParallel itself."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from distconv.data import sample_block
from distconv.parallel import parallelize
from distconv.parallel.explain import explain
from distconv.testing import run_threads
from tests.parallel.cases import TOL, resnet_case

STEPS = 2
LOCAL = {"default": {"grid": {"N": 2}, "algorithm": "sample", "statistics": "local"}}
#: local statistics under a hybrid: rows split in the stem (statistics reduced over H), channels
#: split in the last stage; sample blocks over N everywhere
HYBRID_LOCAL = {"default": {"grid": {"N": 2, "C": 2}, "algorithm": "stationary-x",
                            "statistics": "local"},
                "layers": [{"match": "conv1", "grid": {"N": 2, "H": 2}, "algorithm": "spatial"},
                           {"match": "layer1.*", "grid": {"N": 2, "H": 2},
                            "algorithm": "spatial"}]}


def _batches(x: torch.Tensor, y: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    perm = torch.arange(x.shape[0] - 1, -1, -1)
    return [(x, y), (x[perm], y[perm])]


def ddp_reference(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, blocks: int
                  ) -> dict[str, torch.Tensor]:
    """DDP's step by hand: each block's mean loss on a replica whose buffers are block 0's,
    gradients averaged over the blocks, SGD with momentum; the state of block 0's replica."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for bx, by in _batches(x, y):
        grads: dict[str, torch.Tensor] = {}
        for b in range(blocks):
            rows = slice(b * bx.shape[0] // blocks, (b + 1) * bx.shape[0] // blocks)
            replica = model if b == 0 else copy.deepcopy(model)  # block 0's buffers survive
            replica.zero_grad()
            F.cross_entropy(replica(bx[rows]), by[rows]).backward()
            for k, p in replica.named_parameters():
                grads[k] = grads.get(k, 0) + p.grad / blocks
        for k, p in model.named_parameters():
            p.grad = grads[k]
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def ours(comm: Any, model: torch.nn.Module, config: dict, x: torch.Tensor, y: torch.Tensor
         ) -> dict[str, Any]:
    pmodel = parallelize(copy.deepcopy(model), config, comm=comm)
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.1, momentum=0.9)
    counted = []
    for bx, by in _batches(x, y):
        rows = sample_block(bx.shape[0], pmodel.data_grid)
        b0 = comm.stats.total_bytes()
        out = pmodel(bx[rows])
        b1 = comm.stats.total_bytes()
        F.cross_entropy(out, by[rows]).backward()
        counted.append((b1 - b0, comm.stats.total_bytes() - b1))
        opt.step()
        opt.zero_grad()
    return {"state": pmodel.gather_state_dict(), "counted": counted[0]}


def check_equals_ddp(model: torch.nn.Module, config: dict, x: torch.Tensor, y: torch.Tensor,
                     world: int, blocks: int) -> str:
    """Two steps of ``config`` on ``world`` thread ranks against DDP's loop by hand over
    ``blocks`` blocks: every parameter and buffer on every rank, and each rank's bytes against
    explain's. Returns explain's text."""
    ref = ddp_reference(model, x, y, blocks=blocks)
    plan = explain(model, config, tuple(x.shape), world_size=world, itemsize=8)
    for r, got in enumerate(run_threads(ours, world, model, config, x, y)):
        for k, v in ref.items():
            assert (got["state"][k].double() - v.double()).abs().max() < TOL, (r, k)
        assert got["counted"] == tuple(plan.rank_bytes(r).values()), r
    return str(plan)


@pytest.mark.parametrize("world,config", [(2, LOCAL), (4, HYBRID_LOCAL)], ids=["sample", "hybrid"])
def test_local_statistics_equal_ddp_by_hand(world: int, config: dict) -> None:
    model, x, y = resnet_case(seed=9)
    x, y = x[:6], y[:6]  # two sample blocks of 3
    check_equals_ddp(model, config, x, y, world, blocks=2)


def test_local_statistics_of_a_3d_network_equal_ddp_by_hand() -> None:
    """BatchNorm3d and BatchNorm1d (a volume's and a head's) with each sample block's own
    statistics, as DDP's plain BatchNorm: two steps, every parameter and buffer."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(
        torch.nn.Conv3d(2, 4, 3, padding=1), torch.nn.BatchNorm3d(4), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool3d(1), torch.nn.Flatten(), torch.nn.Linear(4, 5),
        torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 3)).double()
    x = torch.randn(6, 2, 3, 4, 3, dtype=torch.float64)
    y = torch.randint(0, 3, (6,))
    check_equals_ddp(model, LOCAL, x, y, 2, blocks=2)


def test_local_statistics_move_fewer_bytes_than_global() -> None:
    model, x, _ = resnet_case()
    shape = tuple(x.shape)
    glob = {"default": {"grid": {"N": 2}, "algorithm": "sample"}}
    local = explain(model, LOCAL, shape, world_size=2).totals()
    full = explain(model, glob, shape, world_size=2).totals()
    assert local["max_bytes_backward"] < full["max_bytes_backward"]
    assert local["max_bytes_forward"] < full["max_bytes_forward"]


def test_statistics_option_is_checked_naming_the_entry() -> None:
    from distconv.parallel.config import ParallelConfig

    for bad in ("batch", 0, -2, True, 1.5):
        with pytest.raises(ValueError, match=r"default: statistics must be 'global', 'local' or "
                                             r"a positive int k \(groups of k consecutive sample "
                                             r"blocks\), got "):
            ParallelConfig({"default": {"grid": {"N": 2}, "statistics": bad}}, world_size=2)
    model = resnet_case()[0]
    with pytest.raises(ValueError, match="matches no BatchNorm module"):
        explain(model, {"default": {"grid": {"N": 2}},
                        "layers": [{"match": "nothing*", "statistics": "local"}]},
                (4, 3, 16, 16), world_size=2)


#: groups of 2 sample blocks out of 4: two groups of 4 samples each
GROUPS = {"default": {"grid": {"N": 4}, "algorithm": "sample", "statistics": 2}}
#: the same groups under a spatial split of the volume's rows: statistics reduced over N×H
GROUPS_SPATIAL = {"default": {"grid": {"N": 4, "H": 2}, "algorithm": "spatial", "statistics": 2}}


def test_groups_of_sample_blocks_equal_ddp_over_the_groups_by_hand() -> None:
    """``statistics: 2`` on 4 sample blocks is DDP's plain BatchNorm on 2 replicas, each given
    one group's samples: every parameter and buffer after two steps, bytes as explain says."""
    model, x, _ = resnet_case(seed=9)
    gen = torch.Generator().manual_seed(10)  # four sample blocks of 2; two groups of 4
    x = torch.randn((8,) + tuple(x.shape[1:]), generator=gen, dtype=torch.float64)
    y = torch.randint(0, 10, (8,), generator=gen)
    text = check_equals_ddp(model, GROUPS, x, y, 4, blocks=2)
    assert "(groups of 2 sample blocks)" in text and "running statistics" in text


def test_groups_of_sample_blocks_under_a_spatial_split() -> None:
    """A volume network over N×H (8 ranks): each group's statistics are reduced over its two
    sample blocks and the rows. (Sample blocks are those of each layer's own grid: a
    BatchNorm1d after the head's Linear, which runs over {N: 8}, would group blocks of 1.)"""
    torch.manual_seed(4)
    model = torch.nn.Sequential(
        torch.nn.Conv3d(2, 4, 3, padding=1), torch.nn.BatchNorm3d(4), torch.nn.ReLU(),
        torch.nn.Conv3d(4, 4, 3, padding=1), torch.nn.BatchNorm3d(4), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool3d(1), torch.nn.Flatten(), torch.nn.Linear(4, 3)).double()
    x = torch.randn(8, 2, 3, 4, 3, dtype=torch.float64)
    y = torch.randint(0, 3, (8,))
    check_equals_ddp(model, GROUPS_SPATIAL, x, y, 8, blocks=2)


def test_groups_of_one_and_of_all_blocks_are_local_and_global() -> None:
    model, x, _ = resnet_case()
    shape = (8,) + tuple(x.shape[1:])

    def steps(statistics: Any) -> list[Any]:
        cfg = {"default": {"grid": {"N": 4}, "algorithm": "sample", "statistics": statistics}}
        return [(s.op, s.bytes) for lay in explain(model, cfg, shape, world_size=4).layers
                for s in lay.steps]

    assert steps(1) == steps("local")
    assert steps(4) == steps("global")
    assert steps(2) != steps("local") and steps(2) != steps("global")


def test_groups_that_do_not_divide_the_sample_blocks_are_refused() -> None:
    model, x, _ = resnet_case()
    cfg = {"default": {"grid": {"N": 4}, "algorithm": "sample", "statistics": 3}}
    with pytest.raises(ValueError, match=r"node 'bn1' .*statistics 3 groups sample blocks 3 by "
                                         r"3, but the layer has 4 sample block\(s\)"):
        explain(model, cfg, (8,) + tuple(x.shape[1:]), world_size=4)


def _ddp_and_ours(comm: Any, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor
                  ) -> dict[str, Any]:
    """On a real gloo world: torch's DistributedDataParallel and the parallel model, same loop."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(copy.deepcopy(model))  # broadcast_buffers=True, as by default
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for bx, by in _batches(x, y):
        rows = sample_block(bx.shape[0], ddp_grid(comm))
        F.cross_entropy(ddp(bx[rows]), by[rows]).backward()
        opt.step()
        opt.zero_grad()
    mine = ours(comm, model, LOCAL, x, y)["state"]
    theirs = {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}
    return {"ours": mine, "ddp": theirs}


def ddp_grid(comm: Any) -> Any:
    from distconv.grid import ProcessorGrid

    return ProcessorGrid({"N": comm.size}, comm=comm)


@pytest.mark.gloo
def test_local_statistics_equal_torch_ddp_on_gloo(gloo2) -> None:
    model, x, y = resnet_case(seed=9)
    x, y = x[:6], y[:6]
    got = gloo2.run(_ddp_and_ours, model, x, y)
    for k, v in got[0]["ddp"].items():  # rank 0's DDP state: block 0's running statistics
        for r in got:
            assert (r["ours"][k].double() - v.double()).abs().max() < TOL, k


@pytest.mark.mpi
def test_local_statistics_under_a_hybrid_on_mpi(mpi4) -> None:
    model, x, y = resnet_case(seed=9)
    x, y = x[:6], y[:6]
    ref = ddp_reference(model, x, y, blocks=2)
    for got in mpi4.run(ours, model, HYBRID_LOCAL, x, y):
        for k, v in ref.items():
            assert (got["state"][k].double() - v.double()).abs().max() < TOL, k


@pytest.mark.mpi
def test_groups_of_sample_blocks_on_mpi(mpi4) -> None:
    model, x, _ = resnet_case(seed=9)
    gen = torch.Generator().manual_seed(10)
    x = torch.randn((8,) + tuple(x.shape[1:]), generator=gen, dtype=torch.float64)
    y = torch.randint(0, 10, (8,), generator=gen)
    ref = ddp_reference(model, x, y, blocks=2)
    for got in mpi4.run(ours, model, GROUPS, x, y):
        for k, v in ref.items():
            assert (got["state"][k].double() - v.double()).abs().max() < TOL, k


@settings(max_examples=60)
@given(extents=st.lists(st.integers(1, 3), min_size=4, max_size=4),
       names=st.permutations(["N", "D", "H", "C"]), k_index=st.integers(0, 8),
       sample_two=st.booleans())
def test_statistics_groups_partition_the_grid_into_runs_of_k_blocks(extents, names, k_index,
                                                                    sample_two):
    """Over random layouts: every group holds the ranks that agree outside the segment and whose
    sample blocks (nested over one or two grid dims) form one run of k consecutive blocks."""
    import math

    from distconv.nn._statistics import statistics_groups

    layout = tuple(zip(names, extents))
    ext = dict(layout)
    sample_dims = ["N", "D"] if sample_two else ["N"]  # D as a second grid dim of the samples
    segment = sample_dims + ["H"]
    blocks = math.prod(ext[d] for d in sample_dims)
    divisors = [d for d in range(1, blocks + 1) if blocks % d == 0]
    k = divisors[k_index % len(divisors)]
    groups = statistics_groups(layout, sample_dims, segment, k)

    def coords(rank):  # row-major over the layout, written out independently
        out = {}
        for name, e in zip(reversed(names), reversed(extents)):
            rank, out[name] = divmod(rank, e)
        return out

    def block(c):
        return c["N"] * ext["D"] + c["D"] if sample_two else c["N"]

    assert sorted(r for g in groups for r in g) == list(range(math.prod(extents)))
    for g in groups:
        assert list(g) == sorted(g)
        cs = [coords(r) for r in g]
        assert len({tuple(c[d] for d in names if d not in segment) for c in cs}) == 1
        runs = sorted({block(c) for c in cs})
        assert runs == list(range(runs[0], runs[0] + k)) and runs[0] % k == 0
        assert len(g) == k * ext["H"] * math.prod(ext[d] for d in sample_dims) // blocks
