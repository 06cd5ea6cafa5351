"""A module registered under several paths (a U-Net's skip list holding the encoder's blocks):
the parallel model's state dicts, ``gather_module``, checkpoints and K-FAC keep every path torch's
``state_dict`` keeps, each the same tensor as its first path, after training exactly."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import distconv
import distkfac
from distconv.data import sample_block
from distconv.parallel import parallelize
from distconv.parallel.explain import explain
from distconv.testing import run_threads
from tests.optional import need
from tests.parallel.cases import LR, MOMENTUM, TOL, reference_step, seeded

SPLIT_C = {"default": {"grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"}}
SPLIT_H = {"default": {"grid": {"N": 2, "H": 2}, "algorithm": "spatial"}}
DEEP_C = {"default": {"grid": {"N": 4}, "algorithm": "sample"},
          "layers": [{"match": "bottleneck.*", "grid": {"N": 2, "C": 2},
                      "algorithm": "stationary-x"}]}
SPLIT_F = {"default": {"grid": {"N": 2, "F": 2}, "algorithm": "stationary-y"}}


class Skips(nn.Module):
    """``skips[0]`` is ``enc[1]``: torch's state dict lists its tensors under both paths,
    ``named_parameters()`` once."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.ModuleList([nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)])
        self.skips = nn.ModuleList([self.enc[1]])
        self.head = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.enc[0](x))
        h = h + self.skips[0](h)
        return self.head(h.mean((2, 3)))


def skips_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    model = seeded(Skips().double(), gen)
    return (model, torch.randn(4, 3, 8, 8, generator=gen, dtype=torch.float64),
            torch.randint(0, 5, (4,), generator=gen))


def dynunet_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    nets = need("monai.networks.nets")
    gen = torch.Generator().manual_seed(5)
    model = nets.DynUNet(spatial_dims=2, in_channels=1, out_channels=2, kernel_size=[3, 3, 3],
                         strides=[1, 2, 2], upsample_kernel_size=[2, 2], filters=[4, 8, 8])
    model = seeded(model.double(), gen)
    return (model, torch.randn(4, 1, 16, 16, generator=gen, dtype=torch.float64),
            torch.randint(0, 2, (4, 16, 16), generator=gen))


def _train_save_load(comm, model, config, x, y, path, other):  # noqa: ANN001, ANN202
    """One SGD step of the user's loop; the gathered state and module; a checkpoint of the
    trained model loaded onto the ``other`` config, gathered again."""
    pmodel = parallelize(copy.deepcopy(model), config, comm=comm)
    opt = torch.optim.SGD(pmodel.parameters(), lr=LR, momentum=MOMENTUM)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    F.cross_entropy(pmodel(x[rows]), y[rows]).backward()
    opt.step()
    keys = list(pmodel.state_dict())
    state = pmodel.gather_state_dict()
    module = pmodel.gather_module()
    distconv.save(pmodel, path, comm=comm)
    moved = parallelize(copy.deepcopy(model), other, comm=comm)
    distconv.load(moved, path)
    return keys, state, module, moved.gather_state_dict()


@pytest.mark.parametrize("case, config, other", [
    (skips_case, SPLIT_C, SPLIT_F), (dynunet_case, SPLIT_H, DEEP_C)],
    ids=["skips", "dynunet"])
def test_aliased_modules_keep_every_path_through_training_gathering_and_checkpoints(
        case, config, other, tmp_path) -> None:  # noqa: ANN001
    model, x, y = case()
    ref = reference_step(model, x, y)["state"]
    aliased = {k for k in ref if k not in dict(model.named_parameters())
               and k not in dict(model.named_buffers())}
    assert aliased, "the case must alias a module"
    for keys, state, module, moved in run_threads(_train_save_load, 4, model, config, x, y,
                                                  tmp_path / "ckpt", other):
        assert set(keys) == set(ref) and set(state) == set(ref) and set(moved) == set(ref)
        for k, v in ref.items():
            torch.testing.assert_close(state[k], v, rtol=TOL, atol=TOL, msg=k)
            assert torch.equal(moved[k], state[k]), k
        mine = module.state_dict(keep_vars=True)
        assert set(mine) == set(ref)
        for k in aliased:  # one tensor behind every path, as in the single-process model
            first = next(n for n, t in model.state_dict(keep_vars=True).items()
                         if t is model.state_dict(keep_vars=True)[k])
            assert state[k] is state[first] and mine[k] is mine[first], k


def _kfac_naming_an_alias(comm, model, x, y, options):  # noqa: ANN001, ANN202
    pmodel = parallelize(copy.deepcopy(model), SPLIT_C, comm=comm)
    kfac = distkfac.KFAC(pmodel, factor_dtype=torch.float64, **options)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    F.cross_entropy(pmodel(x[rows]), y[rows]).backward()
    kfac.step()
    return sorted({ly.name for ly in [*kfac.layers, *kfac.exact_layers]}), kfac.factor_sharding


@pytest.mark.parametrize("options, layers, sharding", [
    ({"skip_layers": ["skips.0"]}, ["enc.0", "head"], "exact"),
    ({"factor_sharding": {"skips.0": "block"}}, ["enc.0", "enc.1", "enc.1.bias", "head"],
     {"enc.1": "block"})])
def test_kfac_names_an_aliased_module_by_any_of_its_paths(  # noqa: ANN001
        options, layers, sharding) -> None:
    """``skip_layers`` and ``factor_sharding`` may name ``enc.1`` as ``skips.0``: one layer,
    known by its first path."""
    model, x, y = skips_case()
    for names, got in run_threads(_kfac_naming_an_alias, 4, model, x, y, options):
        assert names == layers and got == sharding


def _block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU())


class SkipBlocks(nn.Module):
    """DynUNet in miniature: ``skip_layers`` holds the encoder's second block, and the forward
    calls it by that path, the one a user reads in their code."""

    def __init__(self) -> None:
        super().__init__()
        self.downsamples = nn.ModuleList([_block(3, 4), _block(4, 4)])
        self.skip_layers = nn.ModuleList([self.downsamples[1]])
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.downsamples[0](x)
        return self.head(torch.cat([h, self.skip_layers[0](h)], 1)).mean((2, 3))


def skip_blocks_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    model = seeded(SkipBlocks().double(), gen)
    return (model, torch.randn(4, 3, 8, 8, generator=gen, dtype=torch.float64),
            torch.randint(0, 2, (4,), generator=gen))


#: configured by the alias paths only: the aliased convolution channel-parallel, its block
#: checkpointed
BY_ALIAS = {"default": {"grid": {"N": 4}, "algorithm": "sample"},
            "layers": [{"match": "skip_layers.0.0", "grid": {"N": 2, "C": 2},
                        "algorithm": "stationary-x"},
                       {"match": "skip_layers.0", "checkpoint": True}]}


def _train_by_alias(comm, model, x, y):
    pmodel = parallelize(copy.deepcopy(model), BY_ALIAS, comm=comm)
    opt = torch.optim.SGD(pmodel.parameters(), lr=LR, momentum=MOMENTUM)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    F.cross_entropy(pmodel(x[rows]), y[rows]).backward()
    opt.step()
    layers = {str(s.node.target): (dict(s.layer.layout), s.layer.algorithm, s.layer.source)
              for s in pmodel._analysis.steps if s.layer is not None and s.layer.algorithm}
    checkpointed = sorted(str(s.node.target) for s in pmodel._analysis.steps
                          if s.segment is not None)
    return pmodel.gather_state_dict(), layers, checkpointed


def test_a_config_naming_the_alias_path_places_the_module_and_trains_exactly() -> None:
    model, x, y = skip_blocks_case()
    ref = reference_step(model, x, y)["state"]
    for state, layers, checkpointed in run_threads(_train_by_alias, 4, model, x, y):
        assert set(state) == set(ref)
        for k, v in ref.items():
            torch.testing.assert_close(state[k], v, rtol=TOL, atol=TOL, msg=k)
        assert layers["downsamples.1.0"] == ({"N": 2, "C": 2}, "stationary-x",
                                             "layers[0] ('skip_layers.0.0')")
        assert layers["downsamples.0.0"][::2] == ({"N": 4}, "default")
        assert checkpointed == ["downsamples.1.0", "downsamples.1.1", "downsamples.1.2"]
    rows = {lay.name: lay for lay in explain(model, BY_ALIAS, tuple(x.shape),
                                             world_size=4).layers}
    assert rows["downsamples.1.0"].algorithm == "stationary-x"  # named by its first path
    assert not any(name.startswith("skip_layers") for name in rows)


@pytest.mark.parametrize("entries, first, second", [
    ([{"match": "downsamples.*", "grid": {"N": 4}, "algorithm": "sample"},
      {"match": "skip_layers.0.0", "grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"}],
     "layers[0] ('downsamples.*')", "layers[1] ('skip_layers.0.0')"),
    ([{"match": "skip_layers.0", "checkpoint": True},
      {"match": "downsamples.1", "checkpoint": False}],
     "layers[1] ('downsamples.1')", "layers[0] ('skip_layers.0')")],
    ids=["grid", "checkpoint"])
def test_entries_that_set_one_module_differently_by_its_paths_are_refused_naming_both(
        entries, first, second) -> None:
    model, x, _ = skip_blocks_case()
    config = {"default": {"grid": {"N": 4}, "algorithm": "sample"}, "layers": entries}
    with pytest.raises(ValueError) as info:
        explain(model, config, tuple(x.shape), world_size=4)
    msg = str(info.value)
    assert first in msg and second in msg and "several paths" in msg, msg


def test_an_auto_config_refuses_an_entry_by_a_path_the_planner_does_not_read() -> None:
    """The planner plans ``downsamples.1.0`` by its first path: an entry naming it only as
    ``skip_layers.0.0`` next to an ``auto`` default would be planned over; it is refused before
    the search, naming the entry and the path to match."""
    model, x, _ = skip_blocks_case()
    config = {"default": {"algorithm": "auto"}, "layers": [
        {"match": "skip_layers.0.0", "grid": {"N": 2, "C": 2}, "algorithm": "stationary-x"}]}
    with pytest.raises(ValueError, match=r"layers\[0\] \('skip_layers.0.0'\) sets "
                       r"'downsamples.1.0' by its other path .* match 'downsamples.1.0'"):
        explain(model, config, tuple(x.shape), world_size=4)
