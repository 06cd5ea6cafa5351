"""Every optimizer state resumes: ``k`` steps, a checkpoint through ``distconv.save``, fresh
objects, ``distconv.load`` and ``m`` more steps end bit for bit where ``k + m`` uninterrupted
steps end (fp64, thread ranks, the same layout).  Where a state reshards onto another world size
or layout, the loaded global state is the saved one and the refusals name what differs."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import distconv
from distconv.comm import SingleCommunicator
from distconv.distribution import balanced_block
from distconv.testing.threads import run_threads
from distkfac.hybrid import DHO2, FOSI
from distkfac.hybrid.space import flatten

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _save(comm, model, path, **states):
    distconv.save(model, path, states=states, comm=comm or SingleCommunicator())


# ---------------------------------------------------------------- FOSI and DHO2
HYBRID_STEPS, SAVED_AT = 8, 4  # ESE before steps 1, 4 and 7: one before the save, two after
N_SAMPLES = 23
SPLITS = {1: [23], 2: [9, 14], 3: [5, 13, 5], 4: [5, 8, 1, 9]}
BASES = {
    "momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
}


def _hybrid_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()  # n = 57


HYBRID_MODEL = _hybrid_model()  # built once: thread ranks share torch's global generator
G = torch.Generator().manual_seed(1)
XS = torch.randn(HYBRID_STEPS, N_SAMPLES, 5, generator=G, dtype=torch.float64)
YS = torch.randint(0, 3, (HYBRID_STEPS, N_SAMPLES), generator=G)
X_ESE = torch.randn(N_SAMPLES, 5, generator=G, dtype=torch.float64)
Y_ESE = torch.randint(0, 3, (N_SAMPLES,), generator=G)


def hybrid(comm, base, *, until, save=None, load=None):
    """FOSI (``comm`` None) or DHO2 on this rank's rows, up to step ``until``; ``load``: start
    from that checkpoint, ``save``: write one after ``SAVED_AT`` steps.  Returns the final
    parameters and the optimizer."""
    rank, size = (0, 1) if comm is None else (comm.rank, comm.size)
    sizes = SPLITS[size]
    lo = sum(sizes[:rank])
    rows = slice(lo, lo + sizes[rank])
    model = copy.deepcopy(HYBRID_MODEL)
    kw = dict(ese_closure=lambda: F.cross_entropy(model(X_ESE[rows]), Y_ESE[rows]),
              ese_samples=sizes[rank], k=2, l=1, ese_every=3, warmup=2, seed=4)
    opt = (FOSI(model.parameters(), BASES[base], **kw) if comm is None
           else DHO2(model.parameters(), BASES[base], comm=comm, **kw))
    if load is not None:
        distconv.load(model, load, states={"opt": opt})
    while opt.steps < until:
        t = opt.steps
        opt.zero_grad()
        F.cross_entropy(model(XS[t][rows]), YS[t][rows]).backward()
        opt.step(num_samples=sizes[rank])
        if save is not None and opt.steps == SAVED_AT:
            _save(comm, model, save, opt=opt)
    return flatten(list(model.parameters())), opt


def _in_world(size, fn, *args, **kw):
    if size == 1:
        return [fn(None, *args, **kw)]
    return run_threads(fn, size, *args, **kw)


@pytest.mark.parametrize("base", sorted(BASES))
@pytest.mark.parametrize("size", [1, 3])
def test_fosi_and_dho2_resume_bitwise(tmp_path, size, base):
    """FOSI (one process) and DHO2 (3 ranks, uneven batches): saved after 4 steps (an ESE
    behind, velocity and base state in flight), resumed for 4 more (two ESEs): the parameters,
    velocity, eigenpairs and base state equal the uninterrupted run's bit for bit."""
    path = str(tmp_path / "ckpt")
    whole = _in_world(size, hybrid, base, until=HYBRID_STEPS, save=path)
    resumed = _in_world(size, hybrid, base, until=HYBRID_STEPS, load=path)
    for (theta, opt), (theta2, opt2) in zip(whole, resumed):
        assert opt2.steps == HYBRID_STEPS and len(opt2.eigenvalues) == 3
        assert torch.equal(theta, theta2)
        for name in ("velocity", "eigenvalues", "eigenvectors", "eta"):
            assert torch.equal(getattr(opt, name), getattr(opt2, name)), name
        assert opt.scaling == opt2.scaling
        for key, value in opt.base.state[opt.flat].items():
            assert torch.equal(value, opt2.base.state[opt2.flat][key]), key


def _global_state(path):
    return distconv.consolidate(path, section="opt")


@pytest.mark.parametrize("saved_on, loaded_on", [(4, 2), (2, 4), (3, 1)])
def test_dho2_state_reshards_onto_another_world_size(tmp_path, saved_on, loaded_on):
    """DHO2 saved on P ranks loads on P' (or FOSI on one process): each rank holds its balanced
    block of the saved global velocity, eigenvectors and base state bit for bit, the
    eigenvalues, rates, scaling and step count are the saved ones, and the continuation equals
    the uninterrupted P-rank run up to the order of floating-point sums."""
    path = str(tmp_path / "ckpt")
    whole = _in_world(saved_on, hybrid, "adam", until=HYBRID_STEPS, save=path)
    saved = _global_state(path)

    def loaded(comm):
        theta, opt = hybrid(comm, "adam", until=SAVED_AT, load=path)
        return opt.space.start, opt.space.local, opt.state_dict()

    n = 57
    for rank, (start, local, state) in enumerate(_in_world(loaded_on, loaded)):
        assert (start, local) == balanced_block(n, loaded_on, rank)
        mine = slice(start, start + local)
        assert torch.equal(state["velocity"], saved["velocity"][mine])
        assert torch.equal(state["eigenvectors"], saved["eigenvectors"][:, mine])
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state["base"]["state"][0][key], saved["base"]["state"][0][key][mine])
        for key in ("eigenvalues", "eta", "steps", "q", "scaling"):
            assert torch.equal(torch.as_tensor(state[key]), torch.as_tensor(saved[key])), key
    theta = whole[0][0]
    for theta2, _ in _in_world(loaded_on, hybrid, "adam", until=HYBRID_STEPS, load=path):
        torch.testing.assert_close(theta2, theta, rtol=1e-10, atol=1e-12)


def test_hybrid_state_of_another_model_is_refused():
    _, opt = hybrid(None, "momentum", until=SAVED_AT)
    state = opt.state_dict()
    other = FOSI(nn.Linear(5, 3).double().parameters(), BASES["momentum"], k=2, l=1)
    with pytest.raises(ValueError, match="the state is of 57 parameters, this FOSI has 18"):
        other.load_state_dict(state)
    fewer = FOSI(copy.deepcopy(HYBRID_MODEL).parameters(), BASES["momentum"], k=2)
    with pytest.raises(ValueError, match=r"k \+ l = 3 eigenpairs, this FOSI has k \+ l = 2"):
        fewer.load_state_dict(state)


# ---------------------------------------------------------------- MR-DHO2
# f_r(theta) = 1/2 theta^T H theta - b_r^T theta (tests/kfac/test_dho2.py's quadratic)
MR_N, MR_PERIOD, MR_STEPS = 13, 4, 12
H_DIAG = torch.tensor([10.0] + [2.0] * 6 + [0.5] * 6, dtype=torch.float64)
B = torch.randn(8, MR_N, generator=torch.Generator().manual_seed(11), dtype=torch.float64)


def mr_dho2(comm, fraction, *, until, saved_at=None, save=None, load=None):
    from distkfac.hybrid import MRDHO2

    theta = nn.Parameter(torch.linspace(-1, 1, MR_N, dtype=torch.float64))
    holder = nn.ParameterList([theta])
    b = B[comm.rank]

    def f():
        return 0.5 * (H_DIAG * theta * theta).sum() - b @ theta

    opt = MRDHO2([theta], lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.5), comm=comm,
                 accelerator_fraction=fraction, period=MR_PERIOD, ese_closure=f, k=2, l=1,
                 alpha=0.1, lr_clip=3.0, seed=3)
    if load is not None:
        distconv.load(holder, load, states={"opt": opt})
    while opt.steps < until:
        if opt.needs_gradient:
            opt.zero_grad()
            f().backward()
        opt.step(num_samples=comm.rank + 1)
        if opt.steps == saved_at:
            distconv.save(holder, save, states={"opt": opt}, comm=comm)
    return opt.role, theta.detach().clone(), opt.eigenvalues, opt


@pytest.mark.parametrize("saved_at", [4, 6])
def test_mr_dho2_resumes_bitwise_at_and_between_period_ends(tmp_path, saved_at):
    """Saved at a period's end (step 4) or in the middle of one (step 6: the accelerators'
    ESE of the period is still to be used, the workers' theta_0 and gradient sum are half
    way), resumed on fresh objects: every rank's parameters and eigenvalues after 12 steps
    equal the uninterrupted run's bit for bit."""
    path = str(tmp_path / "ckpt")
    whole = run_threads(mr_dho2, 4, 0.5, until=MR_STEPS, saved_at=saved_at, save=path)
    resumed = run_threads(mr_dho2, 4, 0.5, until=MR_STEPS, load=path)
    for (role, theta, vals, _), (role2, theta2, vals2, opt2) in zip(whole, resumed):
        assert role == role2 and len(vals) == 3
        if role == "worker":
            assert torch.equal(theta, theta2)
        assert torch.equal(vals, vals2)


def test_mr_dho2_state_loads_onto_another_world_and_fraction(tmp_path):
    """Saved mid-period on 4 ranks (2 accelerators), loaded on 3 (1 accelerator): the state
    the loaded run gives back is the saved one, tensor for tensor, bit for bit."""
    path = str(tmp_path / "ckpt")
    run_threads(mr_dho2, 4, 0.5, until=6, saved_at=6, save=path)
    saved = distconv.consolidate(path, section="opt")

    def again(comm):
        opt = mr_dho2(comm, 1 / 3, until=6, load=path)[3]
        return opt.role, opt.state_dict()

    for role, state in run_threads(again, 3):
        _assert_same_tree(state, saved)


def _assert_same_tree(got, want, where="state"):
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, where
        assert torch.equal(got, want), where
    elif isinstance(want, dict):
        assert sorted(got, key=str) == sorted(want, key=str), where
        for key in want:
            _assert_same_tree(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            _assert_same_tree(a, b, f"{where}/{i}")
    else:
        assert got == want, where
