"""Capture: sizes read in a model's forward are the global tensor's (constants of the program
generated per global input shape) on every distribution, and a captured graph that is not the
module's forward is refused saying so, never blamed on the input."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distconv import ops
from distconv.parallel import parallelize
from distconv.parallel.explain import explain
from distconv.parallel.graph import UntraceableModelError, trace
from distconv.testing import run_threads
from tests.optional import need
from tests.parallel.cases import TOL, max_errors, reference_step, seeded, train_step

SAMPLE = {"default": {"grid": {"N": 2}, "algorithm": "sample"}}
SPATIAL = {"default": {"grid": {"H": 2}, "algorithm": "spatial"}, "data": {"H": 2}}
SPLITS = pytest.mark.parametrize("config", [SAMPLE, SPATIAL], ids=["sample", "spatial-H"])


class Decoder(nn.Module):
    """segmentation-models-pytorch's decoder step: the coarse map interpolated to the skip's
    size read from the skip (``h, w = skip.shape[2:]``, or ``size=skip.shape[2:]``), then
    concatenated with it; timm's ``torch._assert(x.ndim == 4)`` in front."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv2d(2, 4, 3, padding=1)
        self.down = nn.MaxPool2d(2)
        self.mid = nn.Conv2d(4, 4, 3, padding=1)
        self.dec = nn.Conv2d(8, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._assert(x.ndim == 4, "BatchNormAct2d: expected a 4-d input")
        skip = self.enc(x)
        y = self.mid(self.down(skip))
        h, w = skip.shape[2:]
        y = F.interpolate(y, size=(h, w), mode="nearest") + F.interpolate(
            y, size=skip.shape[2:], mode="bilinear", align_corners=False)
        return self.dec(torch.cat([y, skip], 1)).mean((2, 3))


class Sizes(nn.Module):
    """Every way of reading a size, in arithmetic that the output depends on: a block's
    sizes instead of the global ones give another output."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        b, c, h, w = y.size()
        rows = y.view(b, c, h * w).mean(2) * (h * w) / (y.size(2) * w)  # by the global count
        scale = (len(x) + x.dim() + x.ndim + y.shape[3]) / (y.numel() // (c * h))
        big = (h == 8) + (w > 5) + (c // 2 != 2)
        return self.head(rows) * scale + big


def _case(make, shape: tuple[int, ...], classes: int = 3, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    model = seeded(make().double(), gen)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    y = torch.randint(0, classes, (shape[0],), generator=gen)
    return model, x, y


def _exact(model: nn.Module, config: dict, x: torch.Tensor, y: torch.Tensor) -> None:
    ref = reference_step(model, x, y)
    for got in run_threads(train_step, 2, model, config, x, y):
        err = max_errors(ref, got)
        assert max(err.values()) < TOL, err


@SPLITS
def test_decoder_interpolating_to_the_skip_size_equals_one_process(config: dict) -> None:
    model, x, y = _case(Decoder, (4, 2, 8, 6))
    _exact(model, config, x, y)


@SPLITS
def test_sizes_and_arithmetic_on_them_equal_one_process(config: dict) -> None:
    model, x, y = _case(Sizes, (4, 2, 8, 6))
    _exact(model, config, x, y)


class AsTensor(nn.Module):
    """``x_conv + torch.as_tensor(self.pad(x))`` as MONAI's ``HighResBlock`` writes it: a tensor
    as a tensor is itself (fx alone would ask the traced value for an array interface)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.head = nn.Linear(2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x) + torch.as_tensor(torch.relu(x))
        return self.head(y.mean((2, 3)))


@SPLITS
def test_as_tensor_of_a_traced_value_is_the_value(config: dict) -> None:
    model, x, y = _case(AsTensor, (4, 2, 8, 6))
    assert not any(n.target is torch.as_tensor for n in trace(model).graph.nodes)
    _exact(model, config, x, y)


class Returns(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1)

    def forward(self, x: torch.Tensor):  # noqa: ANN201
        y = self.conv(x)
        return y.mean((2, 3)), y.shape[2] * 10 + y.size(0), (len(y), x.numel())


@SPLITS
def test_sizes_the_program_binds_are_the_global_ones(config: dict) -> None:
    def rank(comm):  # noqa: ANN001, ANN202
        pmodel = parallelize(Returns().double(), config, comm=comm)
        block = 2 if "N" in config["default"]["grid"] else 4  # this rank's samples
        return pmodel(torch.randn(block, 2, 8, 6, dtype=torch.float64))[1:]

    # the global input is (4, 2, 8, 6) on both: a block would have 4 rows or 2 samples
    assert run_threads(rank, 2) == [(84, (4, 384))] * 2


class Checked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(2, 2, 1))
        self.inner = _Asserts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.block(x)).mean((1, 2, 3))


class _Asserts(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._assert(x.shape[2] % 8 == 0, "rows must be a multiple of 8")
        return x


def test_a_false_assert_on_sizes_is_refused_naming_node_and_module() -> None:
    def rank(comm):  # noqa: ANN001, ANN202
        pmodel = parallelize(Checked().double(), SPATIAL, comm=comm)
        pmodel(torch.randn(2, 2, 8, 4, dtype=torch.float64))  # 8 rows: passes (a rank has 4)
        with pytest.raises(ValueError, match=r"node '_assert' \(torch._assert\) in module "
                                             r"'inner': rows must be a multiple of 8"):
            pmodel(torch.randn(2, 2, 12, 4, dtype=torch.float64))  # 12 rows

    run_threads(rank, 2)


class Item(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y.mean((2, 3)) * y.abs().mean((1, 2, 3)).item()


class ValueAssert(Item):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        torch._assert(y.abs().mean((1, 2, 3)), "all zero")  # a tensor as the condition
        return y.mean((2, 3))


class Data(Item):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).data.mean((2, 3))  # a tensor-valued attribute: an op, not a size


def test_values_read_into_python_are_refused_by_name() -> None:
    def rank(comm):  # noqa: ANN001, ANN202
        # the fix first (keep it a tensor), then the reason
        with pytest.raises(ops.Unsupported, match=r"node 'item' \(call_method item\): Keep it a "
                                                  r"tensor.*\.item\(\) reads the tensor's values"):
            parallelize(Item(), SAMPLE, comm=comm)
        with pytest.raises(ops.Unsupported, match=r"node '_assert'.*torch._assert on a "
                                                  "tensor's values"):
            parallelize(ValueAssert(), SAMPLE, comm=comm)
        with pytest.raises(ops.Unsupported, match=r"node 'getattr_1' \(call_function getattr\)"):
            parallelize(Data(), SAMPLE, comm=comm)

    run_threads(rank, 2)


class Flat(nn.Module):
    """``x.view(x.size(0), -1)`` inside a checkpointed module: the global batch is the
    program's constant, the view takes this rank's samples."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.ReLU())
        self.head = _Head()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.ReLU()
        self.fc = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pre(x)
        return self.fc(x.view(x.size(0), -1))


@pytest.mark.parametrize("checkpoint", [False, True])
def test_a_view_by_the_global_batch_takes_the_local_samples(checkpoint: bool) -> None:
    config = {**SAMPLE, "layers": [{"match": "head", "checkpoint": checkpoint}]}
    model, x, y = _case(Flat, (5, 2, 4, 4))  # blocks of 3 and 2 samples
    _exact(model, config, x, y)


class TensorBranch(nn.Module):
    """Python fx cannot follow: fx answers ``isinstance`` for its proxy (False), so the graph
    takes the other branch; both branches have one convolution of the same shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(2, 4, 1)
        self.join = nn.Conv2d(4, 3, 1)
        self.alone = nn.Conv2d(4, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        if isinstance(y, torch.Tensor):
            return self.join(y).mean((2, 3))
        return self.alone(y).mean((2, 3))


class DroppedCat(nn.Module):
    """As MONAI's ``UpCat`` under fx: the skip is concatenated only where the check (here
    ``isinstance``) says it is a tensor; the captured graph feeds the conv the wrong channels."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(2, 4, 1)
        self.convs = nn.Conv2d(8, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        if isinstance(y, torch.Tensor):
            y = torch.cat([y, y], 1)
        return self.convs(y).mean((2, 3))


class JitIsinstance(DroppedCat):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        if torch.jit.isinstance(y, torch.Tensor):
            y = torch.cat([y, y], 1)
        return self.convs(y).mean((2, 3))


def _first_step_refusal(make, config: dict = SAMPLE) -> str:  # noqa: ANN001
    def rank(comm):  # noqa: ANN001, ANN202
        pmodel = parallelize(make(), config, comm=comm)
        with pytest.raises(UntraceableModelError) as info:
            pmodel(torch.randn(2, 2, 4, 4))
        return str(info.value)

    return run_threads(rank, 2)[0]


def test_an_unfaithful_capture_is_refused_naming_the_model_not_the_input() -> None:
    skipped = _first_step_refusal(TensorBranch)
    assert "graph torch.fx captured of TensorBranch is not its forward" in skipped
    assert "calls ['join']" in skipped, skipped
    failed = _first_step_refusal(DroppedCat)
    assert "graph torch.fx captured of DroppedCat is not its forward" in failed
    assert "fails at node 'convs'" in failed, failed
    for message in (skipped, failed):
        assert "input_shape" not in message and "does not fit" not in message, message
    for make in (TensorBranch, DroppedCat):  # explain, as parallelize
        with pytest.raises(UntraceableModelError, match=f"captured of {make.__name__} is not"):
            explain(make(), SAMPLE, (4, 2, 4, 4), world_size=2)


class Faithful(nn.Module):
    """What the capture check must not refuse: a module under two paths (MONAI's DynUNet), a
    branch on ``self.training`` (fx captures the mode it is in: here training, with the
    auxiliary head the eval forward skips)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv2d(2, 4, 1)
        self.skips = nn.ModuleList([self.enc])
        self.head = nn.Conv2d(4, 3, 1)
        self.aux = nn.Conv2d(4, 3, 1)

    def forward(self, x: torch.Tensor):  # noqa: ANN201
        y = self.skips[0](x)
        if self.training:
            return self.head(y).mean((2, 3)), self.aux(y).mean((2, 3))
        return self.head(y).mean((2, 3))


def test_the_capture_check_passes_aliases_and_the_training_mode() -> None:
    model, x, _ = _case(Faithful, (4, 2, 4, 4))

    def rank(comm):  # noqa: ANN001, ANN202
        pmodel = parallelize(copy.deepcopy(model), SAMPLE, comm=comm)
        return comm.rank, pmodel(x[2 * comm.rank:2 * comm.rank + 2])

    before = {k: v.clone() for k, v in model.state_dict().items()}
    explain(model, SAMPLE, (4, 2, 4, 4), world_size=2)  # checks the capture on the model itself
    after = model.state_dict(keep_vars=True)
    assert all(torch.equal(before[k], v) and v.device.type == "cpu" for k, v in after.items())
    want = model(x)
    for r, got in run_threads(rank, 2):
        for g, w in zip(got, want):
            assert (g - w[2 * r:2 * r + 2]).abs().max() < TOL


def test_torch_jit_isinstance_of_a_traced_value_is_refused_where_it_is() -> None:
    with pytest.raises(UntraceableModelError, match=r"JitIsinstance calls torch.jit.isinstance "
                                                    r"on a traced value \(stem\) in module "
                                                    r"'\(the root\)' at .*test_capture.py:\d+"):
        run_threads(lambda comm: parallelize(JitIsinstance(), SAMPLE, comm=comm), 2)


def test_monai_basic_unet_is_refused_naming_the_construct() -> None:
    BasicUNet = need("monai.networks.nets").BasicUNet  # noqa: N806 - the class, as MONAI names it

    model = BasicUNet(spatial_dims=2, in_channels=1, out_channels=2, features=(4, 4, 8, 8, 8, 4))
    with pytest.raises(UntraceableModelError, match=r"BasicUNet calls torch.jit.isinstance on a "
                                                    r"traced value .* in module 'upcat_4' at "
                                                    r".*basic_unet.py"):
        run_threads(lambda comm: parallelize(copy.deepcopy(model), SAMPLE, comm=comm), 2)


class UpCat(nn.Module):
    """MONAI's ``UpCat`` as it is written: ``torch.jit.isinstance`` of the skip, a loop over
    ``range(len(x.shape) - 2)`` and an ``if`` on the skip's and the upsampled map's sizes that
    pads the map by a row where the skip is odd. fx alone follows none of it."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv2d(2, 4, 3, padding=1)
        self.down = nn.MaxPool2d(2)
        self.up = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.cat_conv = nn.Conv2d(8, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_e = self.enc(x)
        x_0 = self.up(self.down(x_e))
        if x_e is not None and torch.jit.isinstance(x_e, torch.Tensor):
            dims = len(x.shape) - 2
            sp = [0] * (dims * 2)
            for i in range(dims):
                if x_e.shape[-i - 1] != x_0.shape[-i - 1]:
                    sp[i * 2 + 1] = 1
            x_0 = F.pad(x_0, sp, "replicate")
            y = self.cat_conv(torch.cat([x_e, x_0], 1))
        else:
            y = self.cat_conv(x_0)
        return y.mean((2, 3))


def _sized_step(comm, model, config, x, y):  # noqa: ANN001, ANN202
    return train_step(comm, model, config, x, y, input_shape=tuple(x.shape))


@pytest.mark.parametrize("shape", [(4, 2, 8, 6), (4, 2, 9, 7)], ids=["even", "odd-padded"])
@SPLITS
def test_python_deciding_on_sizes_is_captured_on_the_input_shape(config: dict, shape) -> None:
    model, x, y = _case(UpCat, shape)
    ref = reference_step(model, x, y)
    for got in run_threads(_sized_step, 2, model, config, x, y):
        err = max_errors(ref, got)
        assert max(err.values()) < TOL, err


def test_a_shape_taking_another_path_is_refused_naming_the_guard() -> None:
    model, x, _ = _case(UpCat, (4, 2, 8, 6))

    def rank(comm):  # noqa: ANN001, ANN202
        pmodel = parallelize(copy.deepcopy(model), SAMPLE, comm=comm, input_shape=(4, 2, 8, 6))
        fewer = pmodel(x[comm.rank:comm.rank + 1])  # the batch decides nothing: it runs
        with pytest.raises(ValueError) as info:  # 9 rows: the skip is odd, the map is padded
            pmodel(torch.randn(2, 2, 9, 6, dtype=torch.float64))
        return fewer, str(info.value)

    for r, (fewer, message) in enumerate(run_threads(rank, 2)):
        assert (fewer - model(x[r:r + 1])).abs().max() < TOL
        assert "captured on the global input shape (4, 2, 8, 6)" in message, message
        assert "is False" in message and "test_capture.py" in message, message
        assert "module '(the root)'" in message and "input_shape=" in message, message


def test_without_the_input_shape_the_refusal_says_it_would_help() -> None:
    with pytest.raises(UntraceableModelError, match=r"with input_shape= given, the capture "
                                                    r"follows Python that decides on sizes"):
        run_threads(lambda comm: parallelize(UpCat(), SAMPLE, comm=comm), 2)


class Deep(nn.Module):
    """A stride-2 stack down to maps of one row: under a default spatial entry on H=2 the
    deepest convolutions cannot give each rank a row."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.Sequential(*[nn.Conv2d(2, 2, 3, stride=2, padding=1) for _ in range(3)])
        self.last = nn.Conv2d(2, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.convs(x)).mean((2, 3))


def test_a_default_spatial_entry_keeps_maps_too_small_to_split_whole() -> None:
    model, x, y = _case(Deep, (4, 2, 8, 8))  # rows 8 -> 4 -> 2 -> 1 -> 1
    with pytest.raises(ValueError, match="grid dim H=2 exceeds what this layer can split"):
        run_threads(train_step, 2, model, SPATIAL, x, y)  # without the shape: refused
    ref = reference_step(model, x, y)
    for got in run_threads(_sized_step, 2, model, SPATIAL, x, y):
        err = max_errors(ref, got)
        assert max(err.values()) < TOL, err
    text = str(explain(model, SPATIAL, (4, 2, 8, 8), world_size=2, verbose=True)).splitlines()
    starts = [i for i, line in enumerate(text) if line and not line[0].isspace()] + [len(text)]
    under = {text[i].split()[0]: [t.strip() for t in text[i + 1:j]]
             for i, j in zip(starts, starts[1:])}
    for layer, whole in (("convs.1", False), ("convs.2", True), ("last", True)):
        said = "H whole: maps too small to split" in under[layer]
        assert said == whole, (layer, under[layer])


class _Unused(nn.Module):
    """A block that builds a norm and a projection its forward never calls (as MONAI's
    ``TransformerBlock`` builds its cross-attention), between two it calls."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.spare = nn.Sequential(nn.BatchNorm2d(4), nn.Linear(4, 4))
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x).mean((2, 3)))


def _unused_step(comm, model: nn.Module, config: dict, x: torch.Tensor,  # noqa: ANN001
                 y: torch.Tensor) -> dict:
    from distconv.data import sample_block

    pmodel = parallelize(copy.deepcopy(model), config, comm=comm)
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.1)
    rows = sample_block(x.shape[0], pmodel.data_grid)
    F.cross_entropy(pmodel(x[rows]), y[rows]).backward()
    opt.step()
    return {"names": [n for n, _ in pmodel.named_parameters()],
            "no_grad": [n for n, p in pmodel.named_parameters() if p.grad is None],
            "state": pmodel.gather_state_dict()}


@SPLITS
def test_modules_the_forward_never_calls_are_kept_as_one_process_keeps_them(
        config: dict) -> None:
    """Their tensors are listed where one process lists them (``parameters()`` in its order,
    ``state_dict()``), whole, with no gradient and unchanged by a step, as in one process."""
    model, x, y = _case(_Unused, (4, 2, 6, 6))
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    F.cross_entropy(ref(x), y).backward()
    opt.step()
    for got in run_threads(_unused_step, 2, model, config, x, y):
        assert got["names"] == [n for n, _ in ref.named_parameters()]
        assert got["no_grad"] == ["spare.0.weight", "spare.0.bias", "spare.1.weight",
                                  "spare.1.bias"]
        assert list(got["state"]) == list(ref.state_dict())
        for k, v in ref.state_dict().items():
            assert (got["state"][k].double() - v.double()).abs().max() < TOL, k


def decoder_on_world(comm) -> dict[str, float]:  # noqa: ANN001
    """The decoder idiom under a spatial split, after one SGD step, against one process."""
    model, x, y = _case(Decoder, (4, 2, 8, 6))
    return max_errors(reference_step(model, x, y), train_step(comm, model, SPATIAL, x, y))


@pytest.mark.gloo
def test_decoder_on_gloo(gloo2) -> None:  # noqa: ANN001
    for err in gloo2.run(decoder_on_world):
        assert max(err.values()) < TOL, err
