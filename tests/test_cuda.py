"""CUDA: the exactness subset of ``benchmarks/gpu_check.py`` on thread ranks sharing one GPU, and
the communicators' device rules. The CUDA tests skip where CUDA is not available (CI has no GPU);
``make gpu-check`` runs the same checks and the timings on a GPU machine.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from distconv.comm import SingleCommunicator
from distconv.comm.errors import CollectiveMismatchError
from distconv.testing import run_threads

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _gpu_check():
    """The check script as a module (benchmarks/ is not a package)."""
    name = "distconv_gpu_check"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture
def no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _assert_on_cuda(result: dict) -> None:
    assert result["ok"], result
    devices = result["devices"]
    values = [v for vs in devices.values() for v in vs] if isinstance(devices, dict) else devices
    assert set(values) <= {"cuda"}, devices


# ---------------------------------------------------------------- the device rules (any machine)
def _mixed(comm, devices):  # noqa: ANN001, ANN202
    return comm.allreduce(torch.ones(3, device=devices[comm.rank]))


def test_thread_ranks_on_different_devices_raise_naming_both() -> None:
    """The 'meta' device stands in for a second device where there is no GPU."""
    with pytest.raises(CollectiveMismatchError) as info:
        run_threads(_mixed, 2, ["cpu", "meta"], timeout=10.0)
    assert "device=cpu" in str(info.value) and "device=meta" in str(info.value)


def test_single_communicator_keeps_the_device() -> None:
    comm = SingleCommunicator()
    t = torch.ones(4, device="meta")
    assert comm.allreduce(t).device.type == "meta"
    assert comm.allgather(t)[0].device.type == "meta"


# ---------------------------------------------------------------- CUDA
def _collectives(comm):  # noqa: ANN001, ANN202
    t = torch.full((comm.size + 1,), float(comm.rank + 1), device="cuda")
    outs = [comm.allreduce(t), *comm.allgather(t), comm.broadcast(t, root=0),
            comm.reduce_scatter(list(t.new_ones(comm.size, 2).unbind(0))),
            *comm.alltoall(list(t.new_ones(comm.size, 2).unbind(0)),
                           recv_shapes=[(2,)] * comm.size)]
    return [o.device.type for o in outs], comm.allreduce(t).cpu()


@cuda
def test_thread_collectives_keep_cuda_tensors_on_the_device() -> None:
    for devices, total in run_threads(_collectives, 3, timeout=30.0):
        assert set(devices) == {"cuda"}
        assert torch.equal(total, torch.full((4,), 6.0))


@cuda
def test_cuda_and_cpu_ranks_raise_naming_both() -> None:
    with pytest.raises(CollectiveMismatchError) as info:
        run_threads(_mixed, 2, ["cuda:0", "cpu"], timeout=10.0)
    assert "device=cuda:0" in str(info.value) and "device=cpu" in str(info.value)


@cuda
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_dist_conv2d_xyw_with_halos_equal_conv2d_on_cuda(dtype, no_tf32) -> None:  # noqa: ANN001
    _assert_on_cuda(_gpu_check().check_conv(torch.device("cuda"), dtype))


@cuda
def test_parallelized_resnet_with_bn_trains_like_one_process_on_cuda() -> None:
    result = _gpu_check().check_resnet(torch.device("cuda"))
    _assert_on_cuda(result)
    assert result["state_devices"] == ["cuda"]


@cuda
def test_sharded_exact_kfac_equals_single_process_on_cuda() -> None:
    _assert_on_cuda(_gpu_check().check_kfac(torch.device("cuda")))


@cuda
def test_checkpoint_saved_from_cuda_loads_on_cpu_and_back() -> None:
    result = _gpu_check().check_checkpoint(torch.device("cuda"))
    assert result["ok"], result["problems"]


@cuda
def test_nccl_world_of_one() -> None:
    import torch.distributed as dist

    if not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialised in this process")
    result = _gpu_check().check_nccl(torch.device("cuda"))
    assert result["ok"], result["parts"]
