"""What the planner keeps to price faster changes no plan: the search with its memos (each
node's step per what its handler reads, each plan's price, the gradient buckets' groups) and
without them price every plan alike and return the same plan, on random branchy graphs."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn as nn

from distconv.machines import lassen
from distconv.planner import plan_network, trace_network
from distconv.planner import search as planner_search
from distconv.planner.search import _Search


class _FanOut(nn.Module):
    """One value read by three convolutions (an Inception block): whether a layer takes its
    input gathered depends on how the others that read it are placed."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(8, 8, 3, padding=1)
        self.a, self.b, self.c = (nn.Conv2d(8, 8, 1) for _ in range(3))
        self.head = nn.Linear(24, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x))
        y = torch.cat([self.a(x), self.b(x), self.c(x)], dim=1)
        return self.head(y.mean(dim=(2, 3)))


class _Branchy(nn.Module):
    """A random DAG of convolutions (some grouped, some strided), batch norms, residual adds and
    channel concatenations that several later layers read (a DenseNet's and an Inception's
    shapes), drawn from ``seed``."""

    def __init__(self, seed: int, nodes: int = 9) -> None:
        super().__init__()
        rng = random.Random(seed)
        self.ops: list[tuple[str, tuple[int, ...]]] = []
        self.layers = nn.ModuleList()
        channels = [8]  # per value: its channels (every value keeps the input's 8x8 maps)
        for _ in range(nodes):
            kind = rng.choice(["conv", "conv", "add", "cat"])
            if kind == "add":
                same = [i for i, c in enumerate(channels) if channels.count(c) > 1]
                if len(same) < 2:
                    kind = "conv"
                else:
                    a = rng.choice(same)
                    b = rng.choice([i for i in same if i != a and channels[i] == channels[a]])
                    self.ops.append(("add", (a, b)))
                    channels.append(channels[a])
                    continue
            if kind == "cat" and len(channels) > 2:
                picked = tuple(sorted(rng.sample(range(len(channels)), rng.choice([2, 3]))))
                self.ops.append(("cat", picked))
                channels.append(sum(channels[i] for i in picked))
                continue
            src = rng.randrange(len(channels))
            cin, cout = channels[src], rng.choice([4, 8, 16])
            groups = 4 if cin % 4 == 0 and cout % 4 == 0 and rng.random() < 0.3 else 1
            self.layers.append(nn.Sequential(
                nn.Conv2d(cin, cout, rng.choice([1, 3]), padding="same", groups=groups,
                          bias=False),
                nn.BatchNorm2d(cout), nn.ReLU()))
            self.ops.append(("conv", (src, len(self.layers) - 1)))
            channels.append(cout)
        self.head = nn.Linear(channels[-1], 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values = [x]
        for kind, args in self.ops:
            if kind == "conv":
                values.append(self.layers[args[1]](values[args[0]]))
            elif kind == "add":
                values.append(values[args[0]] + values[args[1]])
            else:
                values.append(torch.cat([values[i] for i in args], dim=1))
        return self.head(values[-1].mean(dim=(2, 3)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_search_with_and_without_its_memos_returns_the_same_plan(seed: int,
                                                                      monkeypatch) -> None:  # noqa: ANN001
    net = trace_network(_Branchy(seed), (4, 8, 8, 8))
    plans = {}
    for memo in (True, False):
        monkeypatch.setattr(planner_search, "MEMO", memo)
        plan = plan_network(net, world_size=4, machine=lassen())
        plans[memo] = (plan.config(), plan.step_time, plan.memory,
                       [(str(lp.choice), lp.alternatives) for lp in plan.layers])
    assert plans[True] == plans[False]


@pytest.mark.parametrize("model", [_FanOut, lambda: _Branchy(3, nodes=12)],
                         ids=["fan-out", "branchy"])
def test_random_plans_are_priced_alike_with_and_without_the_memos(model) -> None:  # noqa: ANN001
    """Each plan of a random sequence (some repeated, some refused) priced by one search that
    keeps what it priced and by one that keeps nothing: the same step, forward and memory, the
    same layers, and the same refusals."""
    net = trace_network(model(), (4, 8, 8, 8))
    from distconv.planner import layer_candidates

    options = {c.name: layer_candidates(c, 4) for c in net.convs}
    base = {"default": {"grid": {"N": 4}, "algorithm": "sample"}}
    kept = _Search(net, 4, lassen(), options, base, 4, 1, memo=True)
    plain = _Search(net, 4, lassen(), options, base, 4, 1, memo=False)
    rng = random.Random(7)
    plans = [{n: rng.choice(opts) for n, opts in options.items()} for _ in range(30)]
    for chosen in plans + plans[::3]:  # every third priced again
        got = []
        for s in (kept, plain):
            try:
                p = s.price(chosen)
            except ValueError as exc:
                got.append(("refused", str(exc)))
                continue
            got.append((p.step, p.forward, p.memory,
                        [(lay.name, lay.forward_seconds, lay.backward_seconds,
                          [(st.what, st.bytes) for st in lay.steps]) for lay in p.layers]))
        assert got[0] == got[1]
