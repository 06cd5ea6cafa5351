"""Every optimizer state resumes: ``k`` steps, a checkpoint through ``distconv.save``, fresh
objects, ``distconv.load`` and ``m`` more steps end bit for bit where ``k + m`` uninterrupted
steps end (fp64, thread ranks, the same layout).  Where a state reshards onto another world size
or layout, the loaded global state is the saved one and the refusals name what differs."""
from __future__ import annotations

import copy
import math

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


def test_a_hybrid_optimizer_given_as_optimizer_is_refused_naming_states(tmp_path):
    """FOSI's state is not torch.optim.Optimizer's per-position layout: optimizer= (which keys
    state by parameter name) refuses it at save and at load, naming states=, where it belongs."""
    model = copy.deepcopy(HYBRID_MODEL)
    opt = FOSI(model.parameters(), BASES["momentum"], k=2, l=1)
    refusal = r"FOSI.state_dict\(\) is not laid out .* states="
    with pytest.raises(TypeError, match=refusal):
        distconv.save(model, tmp_path / "ck", optimizer=opt, comm=SingleCommunicator())
    assert not (tmp_path / "ck").exists()  # refused before anything was written
    distconv.save(model, tmp_path / "ck", states={"fosi": opt}, comm=SingleCommunicator())
    with pytest.raises(TypeError, match=refusal):
        distconv.load(model, tmp_path / "ck", optimizer=opt)
    distconv.load(model, tmp_path / "ck", states={"fosi": opt})


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


# ---------------------------------------------------------------- K-FAC
N, CI, HW = 6, 5, 4
KFAC_STEPS = 6


def _conv_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(CI, 6, 3, padding=1), nn.Tanh(), nn.Flatten(),
                         nn.Linear(6 * HW * HW, 3)).double()


CONV_MODEL = _conv_model()


def batch(step: int):
    g = torch.Generator().manual_seed(50 + step)
    return (torch.randn(N, CI, HW, HW, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (N,), generator=g))


def kfac_run(comm, grid, algorithm, *, until, save_at=None, path=None, load=None, **kw):
    """SGD with K-FAC on a parallelized model (layer 0 on ``grid``) up to step ``until``;
    ``load``: start from that checkpoint; ``save_at``: write one after that many steps.
    Returns this rank's parameters and the preconditioner."""
    import distkfac
    from distconv.data import sample_block
    from distconv.parallel import parallelize

    pm = parallelize(copy.deepcopy(CONV_MODEL),
                     {"layers": [{"match": "0", "grid": grid, "algorithm": algorithm}]},
                     comm=comm)
    kfac = distkfac.KFAC(pm, **{**dict(factor_dtype=torch.float64, inv_update_steps=2,
                                       damping=1e-2, factor_sharding="block"), **kw})
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    if load is not None:
        distconv.load(pm, load, states={"kfac": kfac})
    while kfac.steps < until:
        x, y = batch(kfac.steps)
        mine = sample_block(N, pm.data_grid)
        opt.zero_grad()
        F.cross_entropy(pm(x[mine]), y[mine]).backward()
        kfac.step()
        opt.step()
        if kfac.steps == save_at:
            distconv.save(pm, path, states={"kfac": kfac}, comm=comm)
    return [p.detach().clone() for p in pm.parameters()], kfac


def _size(grid):
    return math.prod(grid.values())


@pytest.mark.parametrize("grid, algorithm, kw", [
    ({"C": 2, "F": 2}, "stationary-w", {}),
    ({"N": 2, "C": 2}, "stationary-x", {"stale_threshold": 0.05, "factor_decay": 0.5,
                                        "inv_update_steps": 1}),
])
def test_block_kfac_resumes_bitwise(tmp_path, grid, algorithm, kw):
    """'block' K-FAC saved after 3 steps (a decomposition in use, each shard its own blocks,
    its bias blocks apart; with stale statistics, their intervals), resumed for 3 more on the
    same layout: every rank's parameters equal the uninterrupted run's bit for bit."""
    path = str(tmp_path / "ckpt")
    size = _size(grid)
    whole = run_threads(kfac_run, size, grid, algorithm, until=KFAC_STEPS, save_at=3,
                        path=path, **kw)
    resumed = run_threads(kfac_run, size, grid, algorithm, until=KFAC_STEPS, load=path, **kw)
    for (params, kfac), (params2, kfac2) in zip(whole, resumed):
        assert kfac2.steps == KFAC_STEPS
        for p, q in zip(params, params2):
            assert torch.equal(p, q)
        for ly, ly2 in zip(kfac.layers, kfac2.layers):
            assert torch.equal(ly.a.value, ly2.a.value) and torch.equal(ly.g.value, ly2.g.value)
    if kw:  # the schedule was running: some factor skipped a decomposition after the resume
        assert any(k.stale_counts["skipped"] for _, k in resumed)


def _blocks_of(kfac):
    """{(layer name, "A" | "G"): (value, (lo, hi))} of this rank's block layers."""
    from distkfac.sharded import BlockLayout

    out = {}
    for ly in kfac.layers:
        ad = ly.adapter
        if not hasattr(ad, "geo") or ad.geo.C * ad.geo.F == 1:
            continue
        part = "bias" if ly.name.endswith(".bias") else "weight"
        ranges = BlockLayout.of(ad.geo).ranges(part, ad.geo.f, ad.geo.c)
        for key, factor in (("A", ly.a), ("G", ly.g)):
            out[(ly.name, key)] = (factor.value[0], ranges[key], ly.a_payload)
    return out


@pytest.mark.parametrize("saved_on, loaded_on", [
    (({"C": 2}, "stationary-x"), ({"C": 4}, "stationary-x")),      # a finer channel split
    (({"C": 2}, "stationary-x"), ({"N": 2, "C": 2}, "stationary-x")),  # the same blocks
    (({"F": 2}, "stationary-y"), ({"C": 2, "F": 2}, "stationary-w")),  # G alike, A split
])
def test_block_state_reshards_where_the_saved_blocks_hold_the_new_ones(tmp_path, saved_on,
                                                                       loaded_on):
    """Loaded on another layout whose blocks lie inside the saved ones, every rank's factors
    are the diagonal sub-blocks of the saved blocks, bit for bit (checked against the saved
    global stack), and the decompositions are recomputed at the next step."""
    from distkfac.sharded import BlockLayout

    path = str(tmp_path / "ckpt")
    run_threads(kfac_run, _size(saved_on[0]), *saved_on, until=3, save_at=3, path=path)
    state = distconv.consolidate(path, section="kfac")
    (entry,) = state["block"]["0"].values()
    saved = BlockLayout(**entry["layout"])

    def loaded(comm):
        _, kfac = kfac_run(comm, *loaded_on, until=3, load=path)
        return _blocks_of(kfac)

    same = saved.key == "C{C}xF{F}".format(**{"C": 1, "F": 1, **loaded_on[0]})
    for blocks in run_threads(loaded, _size(loaded_on[0])):
        for (name, key), (value, (lo, hi), payload) in blocks.items():
            assert (payload is not None) == same  # kept on the same blocks, else recomputed
            part, f, c, start = saved.holder(
                key, lo, hi, prefer="bias" if name.endswith(".bias") else "weight")
            want = entry[part][key][f, c][lo - start: hi - start, lo - start: hi - start]
            assert torch.equal(value, want), (name, key)
    # and the run goes on from there
    run_threads(kfac_run, _size(loaded_on[0]), *loaded_on, until=4, load=path)


def test_exact_state_loads_as_block_diagonals(tmp_path):
    """Whole factors (saved under 'exact') load into 'block' on any split: each block is the
    diagonal block of the saved global factor."""
    path = str(tmp_path / "ckpt")
    run_threads(kfac_run, 2, {"C": 2}, "stationary-x", until=3, save_at=3, path=path,
                factor_sharding="exact")
    whole = distconv.consolidate(path, section="kfac")["factors"]["0"]

    def loaded(comm):
        _, kfac = kfac_run(comm, {"C": 3}, "stationary-x", until=3, load=path)
        return _blocks_of(kfac)

    for blocks in run_threads(loaded, 3):
        for (name, key), (value, (lo, hi), _) in blocks.items():
            assert torch.equal(value, whole[key]["value"][0, lo:hi, lo:hi]), (name, key)


@pytest.mark.parametrize("loaded_on, factor_sharding, match", [
    (({"C": 3}, "stationary-x"), "block",
     r"K-FAC layer '0': the state holds its factors under factor_sharding='block' over C=2 "
     r"channel blocks x F=1 filter blocks; this preconditioner keeps factor_sharding='block' "
     r"over C=3 channel blocks x F=1 filter blocks, and the A block \[18:36\) of shard "
     r"\(f=0, c=1\) lies in no saved block"),
    (({"C": 3}, "stationary-x"), "exact",
     r"K-FAC layer '0': the state holds its factors under factor_sharding='block' over C=2 "
     r"channel blocks x F=1 filter blocks; this preconditioner keeps whole factors"),
    (({"N": 2}, "sample"), "block",
     r"K-FAC layer '0': the state holds its factors under factor_sharding='block' over C=2 .* "
     r"keeps whole factors"),
])
def test_block_state_onto_a_layout_it_cannot_give_is_refused_naming_both(
        tmp_path, loaded_on, factor_sharding, match):
    path = str(tmp_path / "ckpt")
    run_threads(kfac_run, 2, {"C": 2}, "stationary-x", until=2, save_at=2, path=path)
    grid, algorithm = loaded_on
    with pytest.raises(ValueError, match=match):
        run_threads(kfac_run, _size(grid), grid, algorithm, until=2, load=path,
                    factor_sharding=factor_sharding)


@pytest.mark.parametrize("grid, algorithm", [({"C": 2}, "stationary-x"), ({"N": 2}, "sample")])
def test_exact_and_whole_factor_kfac_resume_bitwise(tmp_path, grid, algorithm):
    """'exact' row blocks and whole factors (sample parallelism, the Linear head): saved after
    3 steps, between decompositions (the uninterrupted run reuses the damped inverses it
    formed at the decomposition's second use), resumed for 3 more: bit for bit."""
    path = str(tmp_path / "ckpt")
    kw = dict(factor_sharding="exact")
    whole = run_threads(kfac_run, 2, grid, algorithm, until=KFAC_STEPS, save_at=3, path=path,
                        **kw)
    resumed = run_threads(kfac_run, 2, grid, algorithm, until=KFAC_STEPS, load=path, **kw)
    for (params, _), (params2, _) in zip(whole, resumed):
        for p, q in zip(params, params2):
            assert torch.equal(p, q)
