"""Scale you can see: a ResNet-style chain spatial -> stationary-x -> stationary-y -> spatial on
16 thread ranks (grids {N: 4, H: 4}, {N: 4, C: 4}, {N: 4, F: 4}; the samples arrive over all 16),
every collective of a training step journaled with the size of the group it ran on. No
collective runs on more ranks than the data it moves requires: the conversions between layouts
run on the 4 ranks of one sample row; the whole-world ones are named here, each with its
reason. The step is exact against one process."""

from __future__ import annotations

from collections import Counter

import pytest

from distconv.testing import run_threads
from tests.parallel.chain import journaled_step, reference_outputs

P = 16
ROW = 4  # the ranks of one sample row: P / (N = 4)

#: every collective of a step that runs on all 16 ranks, with why it must (each appears as
#: many times per step as counted here)
WHOLE_WORLD = {
    # the entry's agreement on the global batch: the samples arrive spread over all 16 ranks
    # (the data grid {N: 16}), and a rank's local batch does not tell the global one (the last
    # batch of an epoch is smaller), so every rank's count is needed, every step
    "ParallelModel entry: local input shapes": 1,
    # BatchNorm after the spatial stem normalises over samples and rows, which {N: 4, H: 4}
    # spreads over all 16 ranks: its statistics forward and their sums backward are global
    "DistBatchNorm statistics": 1,
    "DistBatchNorm backward sums": 1,
    # the head (a Linear, sample-parallel on {N: 16}) is replicated on every rank
    "gradient bucket 0 over every rank": 1,
    # the spatial convolutions' weights are replicated over N×H of {N: 4, H: 4}: every rank
    "gradient bucket 0 over N×H of {N: 4, H: 4}": 1,
}


@pytest.fixture(scope="module")
def journals():
    return run_threads(journaled_step, P, timeout=120)


def test_the_chain_trains_exactly_as_one_process(journals):
    ref = reference_outputs(2, P)
    for got in journals:
        assert (got["out"] - ref[got["rows"]]).abs().max() < 1e-12


def test_no_collective_of_a_step_runs_on_more_ranks_than_its_data_needs(journals):
    for rank, got in enumerate(journals):
        whole = Counter()
        for op, size, what in got["calls"]:
            if size == P:
                key = next((k for k in WHOLE_WORLD if what.startswith(k)), what)
                whole[key] += 1
            else:
                assert size <= ROW, (rank, op, size, what)
        assert whole == Counter(WHOLE_WORLD), rank


def test_every_conversion_runs_among_its_sample_row(journals):
    """Both layouts split the samples over N = 4 alike (and the data grid's 16 sample blocks
    are 4 per row), so each conversion, forward and adjoint, is an all-to-all among the 4 ranks
    of this rank's row: ranks 4n .. 4n + 3, which the journal's description lists."""
    for rank, got in enumerate(journals):
        moves = [(op, size, what) for op, size, what in got["calls"] if "repartition" in what]
        # into the stem, stem -> mid, late -> last: forward; the last two also backward (the
        # input needs no gradient)
        assert len(moves) == 5, moves
        row = list(range(rank // ROW * ROW, rank // ROW * ROW + ROW))
        for op, size, what in moves:
            assert (op, size) == ("alltoall", ROW)
            assert what.endswith(f"(segment of 4 ranks: {row})"), what
