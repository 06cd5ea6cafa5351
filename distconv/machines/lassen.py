"""Lassen (LLNL), the machine of Dryden et al. (SC'19): published figures, one source per number.

Node: 2 IBM POWER9 sockets, 4 NVIDIA V100 (SXM2, 16 GB), 2 GPUs per socket; inside a socket the
two GPUs (and the CPU) are joined by three NVLink2 bricks each; the sockets by the POWER9 X-bus;
nodes by dual-rail Mellanox EDR InfiniBand.

Bandwidths and sizes are published peaks. Latencies are **not** published per level for Lassen:
the values below are stated assumptions (the order of magnitude of one step of a GPU collective,
dominated by kernel launch and synchronisation rather than by the wire), and the scale model
reports how its conclusions move when they change.
"""

from __future__ import annotations

from distconv.machines.base import Level, Machine, Roofline

__all__ = ["LASSEN", "LASSEN_SOURCES", "lassen"]

_LLNL = "LLNL, 'Lassen', hpc.llnl.gov/hardware/compute-platforms/lassen"
_AC922 = ("IBM Redpaper REDP-5472, 'IBM Power System AC922: Introduction and Technical Overview', "
          "§1 and §2 (4-GPU configuration)")
_V100 = "NVIDIA Tesla V100 GPU datasheet (SXM2: 15.7 TFLOP/s FP32, 16 GB HBM2)"
_PAPER = "Dryden et al., SC'19, §5 (experimental setup on Lassen)"

#: Every number of the profile and where it comes from.
LASSEN_SOURCES: dict[str, str] = {
    "ranks per socket = 2": f"{_LLNL}; {_PAPER}",
    "ranks per node = 4": f"{_LLNL}; {_PAPER}",
    "socket bandwidth = 75 GB/s": (
        f"{_AC922}: three NVLink 2.0 bricks of 25 GB/s per direction between the GPUs of a socket"
    ),
    "node bandwidth = 64 GB/s": f"{_AC922}: POWER9 X-bus between the two sockets, 64 GB/s",
    "network bandwidth = 25 GB/s per node": (
        f"{_LLNL}: dual-rail Mellanox EDR InfiniBand; EDR is 100 Gb/s = 12.5 GB/s per rail "
        "(InfiniBand Trade Association roadmap), two rails per node"
    ),
    "socket alpha = 5 us": (
        "assumption: one step of an NCCL-style ring inside a node is a few microseconds (CUDA "
        "launch and synchronisation), far above the NVLink wire latency"
    ),
    "node alpha = 7 us": "assumption: socket alpha plus a hop through the POWER9 X-bus",
    "network alpha = 10 us": (
        "assumption: EDR adapters and switches add about 1 us (Mellanox ConnectX-5 product brief: "
        "sub-microsecond latency); the GPU-side step overhead dominates"
    ),
    "flop_rate = 9.4 TFLOP/s": (
        f"{_V100}, times an assumed 60% sustained cuDNN efficiency on ResNet convolutions"
    ),
    "memory = 16 GiB": f"{_V100}; {_LLNL}",
    "memory_bandwidth = 900 GB/s": f"{_V100} (HBM2, 900 GB/s)",
    "parallelism = 163840": (
        "NVIDIA Tesla V100 GPU architecture whitepaper (2017): 80 SMs x 2048 resident threads"
    ),
    "overhead = 10 us": "assumption: one cuDNN kernel launch and its synchronisation",
    "comm_overlap = 1": (
        "assumption: collectives run on their own CUDA stream (NCCL kernels) and the network "
        "adapters move the bytes, beside the compute stream, as the paper's Aluminum library "
        "overlaps them"
    ),
    "schedule = tree": (
        "NVIDIA developer blog, 'Massively Scale Your Deep Learning Training with NCCL 2.4' "
        "(2019): double binary trees give logarithmic allreduce latency at scale; the paper's "
        "Aluminum library runs on NCCL"
    ),
}


def lassen(*, socket_alpha: float = 5e-6, node_alpha: float = 7e-6,
           network_alpha: float = 10e-6, efficiency: float = 0.6,
           schedule: str = "tree", occupancy: bool = True) -> Machine:
    """The Lassen profile; the latency assumptions, compute efficiency and collective schedule
    (``"tree"``: NCCL's logarithmic latency; ``"ring"``) can be varied. ``occupancy`` prices
    local convolutions with the V100 :class:`Roofline` (few outputs leave the GPU partly idle);
    ``False`` uses the plain FLOP rate."""
    if not 0 < efficiency <= 1:
        raise ValueError(f"lassen: efficiency must be in (0, 1], got {efficiency}")
    levels = (
        Level("socket", 2, socket_alpha, 75e9, shared=False,
              source=LASSEN_SOURCES["socket bandwidth = 75 GB/s"]),
        Level("node", 4, node_alpha, 64e9, shared=True,
              source=LASSEN_SOURCES["node bandwidth = 64 GB/s"]),
        Level("network", 0, network_alpha, 25e9, shared=True,
              source=LASSEN_SOURCES["network bandwidth = 25 GB/s per node"]),
    )
    rate = 15.7e12 * efficiency
    roof = Roofline(rate, 900e9, 80 * 2048, 10e-6) if occupancy else None
    return Machine("Lassen", levels, flop_rate=rate, memory=16 * 2**30, conv_time=roof,
                   sources=LASSEN_SOURCES, schedule=schedule)


LASSEN = lassen()
