"""K-FAC on a model from ``distconv.parallelize``: exact against single-process K-FAC on the
gathered model, with the user's loop of the training contract (each rank's loss a mean over its
own samples; no gradient allreduce in the loop)."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import distkfac
from distconv.data import sample_block
from distconv.parallel import parallelize
from tests.parallel.cases import RESNET_CONFIG, _gathered_grads, resnet_case

KW = dict(factor_dtype=torch.float64, damping=1e-2, kl_clip=1e-2, factor_decay=0.6)


def reference(steps: int):
    model, x, y = resnet_case()
    kfac = distkfac.KFAC(model, comm=None, **KW)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        kfac.step()
        opt.step()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def parallel_run(comm, steps: int, layout: str):
    model, x, y = resnet_case()
    pmodel = parallelize(copy.deepcopy(model), RESNET_CONFIG, comm=comm)
    kfac = distkfac.KFAC(pmodel, factor_sharding=layout, **KW)
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.05)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(pmodel(x[rows]), y[rows]).backward()
        kfac.step()
        opt.step()
    return _gathered_grads(pmodel), len(kfac.exact_layers), len(kfac.layers)


def test_exact_on_parallelized_resnet_equals_single_process():
    from distconv.testing.threads import run_threads

    want = reference(2)
    for grads, exact, plain in run_threads(parallel_run, 4, 2, "exact"):
        assert exact > 0 and plain > 0
        for k, g in want.items():
            torch.testing.assert_close(grads[k], g, rtol=1e-9, atol=1e-11, msg=k)



# ---------------------------------------------------------------- replicated layers inside
def _mlp_head():
    from torch import nn

    gen = torch.Generator().manual_seed(4)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 4 * 4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    x = torch.randn(6, 3, 4, 4, generator=gen, dtype=torch.float64)
    return model, x, torch.randint(0, 3, (6,), generator=gen)


MLP_CONFIG = {"layers": [{"match": "0", "grid": {"C": 2}, "algorithm": "stationary-x"}]}


def _mlp_run(comm, data):
    model, x, y = _mlp_head()
    config = dict(MLP_CONFIG, **({"data": data} if data else {}))
    pmodel = parallelize(copy.deepcopy(model), config, comm=comm)
    kfac = distkfac.KFAC(pmodel, **KW)
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.05)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(pmodel(x[rows]), y[rows]).backward()
        kfac.step()
        opt.step()
    return _gathered_grads(pmodel), [ly.name for ly in kfac.layers]


def test_replicated_layers_inside_a_sample_parallel_model_equal_single_process():
    """The Linear '3' feeds another layer, not the output: on a data grid of N only its
    output's gradient is complete for each rank's samples, so its K-FAC is data-parallel."""
    from distconv.testing.threads import run_threads

    model, x, y = _mlp_head()
    kfac = distkfac.KFAC(model, comm=None, **KW)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        kfac.step()
        opt.step()
    for grads, names in run_threads(_mlp_run, 2, None):
        assert names == ["3", "5"]
        for k, p in model.named_parameters():
            torch.testing.assert_close(grads[k], p.grad, rtol=1e-9, atol=1e-11, msg=k)


def test_replicated_layer_inside_with_replicas_is_refused_by_name():
    import pytest

    from distconv.testing.threads import run_threads

    with pytest.raises(NotImplementedError, match=r"layer '3' inside a parallelized model whose "
                                                  r"data grid has replicas \(\{'C': 2\}\)"):
        run_threads(_mlp_run, 2, {"N": 1, "C": 2})
