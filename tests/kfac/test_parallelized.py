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

