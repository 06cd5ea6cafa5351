"""``ParallelModel``: a traced model whose layers run on their grids, and the training contract.

The contract (what makes a user's ordinary data-parallel loop exact)::

    pmodel = distconv.parallelize(model, config, comm=comm)
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.1)
    for x, y in loader:                           # this rank's block of the global batch
        loss = F.cross_entropy(pmodel(x), y)      # a mean over its own samples, on every rank
        loss.backward(); opt.step(); opt.zero_grad()

* ``x`` is this rank's block ``x[o_N,*,...]`` of the global batch on the data grid: ranks with
  the same N coordinate hold the same samples (balanced blocks: rank block i of N samples over
  P_N blocks has ``N//P_N + (i < N%P_N)`` of them; :class:`distconv.data.GridSampler` deals them).
  ``pmodel(x)`` returns the outputs of exactly those samples, in order, complete on every rank.
* Inside, every adjoint keeps the library's sum convention (a replicated value's gradient is the
  sum of every rank's contribution). At the exit, the output's cotangent is scaled by
  ``n_local / N`` (``loss_reduction='mean'``; by 1 for ``'sum'``, a loss summed over the local
  samples) and kept on one replica of each sample block, so the sum over all ranks is the
  gradient of the global-batch loss; every parameter's gradient is then completed by a
  segmented allreduce over the grid dims its distribution leaves unused. When
  ``loss.backward()`` returns, each shard's ``.grad`` equals the single-process gradient on the
  global batch -- also for uneven sample blocks.

The model's module tree (layers in place, shared parameters, aliases) is kept by
:mod:`distconv.parallel.module_tree`, its fused gradient completion by
:mod:`distconv.parallel.gradient_sync`.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.fx as fx
import torch.utils.checkpoint
from torch import nn

from distconv.comm import get_debug
from distconv.comm.base import compiling, eager
from distconv.distribution import as_shape, balanced_block
from distconv.grid import ProcessorGrid
from distconv.nn import clip as _clip
from distconv.nn.batchnorm import DistBatchNorm, broadcast_running
from distconv.nn.clip import register_parameter_specs
from distconv.nn.sharding import shard_specs
from distconv.nn.recompute import recompute_context
from distconv.comm.base import Communicator
from distconv.parallel.config import ConfigSource, ParallelConfig
from distconv.pricing.machine import AnyMachine
from distconv.parallel.graph import (
    Analysis, Step, analyse, check_shapes, operand_need, trace,
)
from distconv.parallel.gradient_sync import Trainable, fuse_gradient_syncs
from distconv.parallel.module_tree import (
    LayersInPlace, call_name, check_split, realias, retie, same_layer, set_submodule,
    tied_parameters,
)
from distconv.parallel.program import _eager, _get_attr, generate
from distconv.parallel.shapes import propagate_shapes
from distconv.parallel.state_sync import sync_module_states
from distconv.parallel.placement import Layout, Placement, convert, layout_str
from distconv.redistribute import gather

__all__ = ["LOSS_REDUCTIONS", "ParallelModel"]

LOSS_REDUCTIONS = ("mean", "sum")
_TAG = "distconv_shards"  # state-dict metadata: whose shards, on which layout


class _Exit(torch.autograd.Function):
    """Forward: the output as it is. Backward: the loss-reduction scale, then the cotangent kept
    on the root replica of each sample block (its copies on other replicas are not contributions;
    keep-root turns the complete copies into the pending sum the sum convention expects)."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, scale: float, root: bool) -> torch.Tensor:
        ctx.scale, ctx.root = scale, root
        return y.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if not ctx.root:
            return torch.zeros_like(g), None, None
        return g * ctx.scale if ctx.scale != 1.0 else g, None, None


class ParallelModel(nn.Module):
    """A model whose Conv2d layers run on the grids and algorithms of a declarative config.

    Made by :func:`distconv.parallelize`; see the module docstring for the training contract.
    It works on its own copy of the model (the caller's model is left as it was), which starts
    from rank 0's parameters and buffers on every rank, as DDP's construction does
    (:func:`~distconv.parallel.state_sync.sync_module_states`). Parameters and buffers are the
    local shards (``distconv.nn.shard_specs(pmodel)`` says where each lies); the state-dict keys
    are the original model's.

    Attributes:
        config: the validated :class:`~distconv.parallel.config.ParallelConfig`.
        data_grid: the grid of the input and output samples (``x[o_N,*,...]``).
        global_batch_size: the global batch of the last forward.
    """

    def __init__(self, model: nn.Module, config: ConfigSource | ParallelConfig, *,
                 comm: Communicator | None = None, loss_reduction: str = "mean",
                 input_shape: Sequence[int] | None = None, bucket_bytes: int = 25 << 20,
                 machine: AnyMachine | Callable[[], AnyMachine] | str | None = None) -> None:
        super().__init__()
        if comm is None:
            from distconv.comm import world

            comm = world()
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(
                f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {loss_reduction!r}")
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        if input_shape is not None:
            input_shape = as_shape(input_shape, "input_shape")
        cfg = config if isinstance(config, ParallelConfig) else ParallelConfig(
            config, world_size=comm.size)
        if cfg.world_size != comm.size:
            raise ValueError(f"config is for {cfg.world_size} ranks but comm has {comm.size}")
        if machine is not None:
            from distconv.machines import resolve_machine

            machine = resolve_machine(machine)
        # Our own copy: the parallel model never shares a module or tensor with the caller's
        # (thread ranks may pass one model object; shards replace its layers anyway). It starts
        # from rank 0's parameters and buffers, whole, before any rank cuts its blocks (DDP's
        # guarantee: ranks seeded differently still train as one process would).
        own = copy.deepcopy(model)
        sync_module_states(own, comm)
        # fx patches nn.Module.__call__ process-wide while it traces: no rank of a thread world
        # may run a module meanwhile, so every rank traces inside the same pair of barriers.
        comm.barrier(meta="parallelize: before tracing")
        try:
            gm = trace(own, input_shape)
        finally:
            comm.barrier(meta="parallelize: after tracing")
        ndim = None if input_shape is None else len(tuple(input_shape))
        self.auto_decisions: dict[str, Any] = {}
        if cfg.has_auto():
            cfg, self.auto_decisions = self._resolve_auto(comm, gm, cfg, input_shape, machine)
        analysis = analyse(gm, cfg, input_ndim=ndim)
        object.__setattr__(self, "_meta", copy.deepcopy(gm).to("meta"))
        object.__setattr__(self, "_template", copy.deepcopy(model).to("meta"))
        object.__setattr__(self, "_analysis", analysis)
        self.comm, self.config, self.loss_reduction = comm, cfg, loss_reduction
        self.global_batch_size: int | None = None
        self._grids: dict[Layout, ProcessorGrid] = {}
        self._function_modules: dict[str, nn.Module] = {}
        self._layers: dict[str, nn.Module] = {}  # built distributed layers, by module target
        self.data_grid = self.grid(cfg.data)
        #: whether this rank is the root replica of its sample block (the data grid's other
        #: dims all at 0): its output's cotangent is the one kept
        self._root = all(self.data_grid.coords[d] == 0 for d, e in self.data_grid.layout
                         if d != "N" and e > 1)
        ties = tied_parameters(gm)
        calls: dict[str, list[Step]] = {}  # module -> the steps that call it, in graph order
        for step in analysis.steps:
            if step.node.op == "call_module":
                calls.setdefault(str(step.node.target), []).append(step)
        split = {t: ss for t, ss in calls.items() if len(ss) > 1 and any(
            not same_layer(ss[0].layer, s.layer) for s in ss[1:])}
        for target, steps in split.items():
            check_split(target, steps, self._template.get_submodule(target))
        for step in analysis.steps:  # every layout a value lives on, in graph order
            for placement in [step.out, *step.needs.values()]:
                if placement is not None:
                    self.grid(placement.layout)
            if step.node.op == "call_module" and str(step.node.target) in split:
                self._build_call(step)
            elif step.layer is not None:
                self._build(gm, step)
        retie(gm, ties)
        realias(gm, self._template)
        for name, child in gm.named_children():
            self.add_module(name, child)
        for name, value in list(gm.named_parameters(recurse=False)):
            self.register_parameter(name, value)
        for name, value in list(gm.named_buffers(recurse=False)):  # the trace's constants too
            self.register_buffer(name, value,
                                 persistent=name not in gm._non_persistent_buffers_set)
        # The traced graph (its modules are this model's children): distkfac reads it to tell a
        # head, whose output is the model's, from a replicated layer inside the model.
        object.__setattr__(self, "_gm", gm)
        self._plans: dict[tuple[Any, ...], Callable[[torch.Tensor], Any]] = {}
        self.bucket_bytes = bucket_bytes
        self._local_norms = [m for m in self.modules() if isinstance(m, DistBatchNorm)
                             and m._block_comm is not None]
        self._trainable = Trainable(self)
        self._placed = LayersInPlace(self, self._layers)
        self.grad_sync = fuse_gradient_syncs(self, bucket_bytes)
        register_parameter_specs(self, comm)

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _resolve_auto(comm: Any, gm: fx.GraphModule, cfg: ParallelConfig,
                      input_shape: Sequence[int] | None, machine: Any) -> tuple[Any, Any]:
        from distconv.parallel.auto import resolve_auto_once
        from distconv.parallel.graph import check_planned
        from distconv.pricing.calibrate import calibrate

        if input_shape is None:
            raise ValueError("algorithm 'auto' chooses from the layers' global problems: pass "
                             "input_shape= (the global input shape) to parallelize")
        check_planned(gm, cfg)
        if machine is None:  # the calibrated §4 model of this machine (collective)
            machine = calibrate(comm)
        return resolve_auto_once(comm, gm, cfg, input_shape, machine)

    def _rebuild_gradient_syncs(self) -> None:
        """Parameters were frozen, unfrozen or replaced (``load_state_dict(assign=True)``) since
        the buckets were made: rebuild them, so a frozen parameter gets no gradient and no
        allreduce and an unfrozen or new one is reduced (every rank runs the same code, so every
        rank rebuilds the same buckets)."""
        if self.grad_sync is not None:
            self.grad_sync.detach()
        self._trainable = Trainable(self)
        self.grad_sync = fuse_gradient_syncs(self, self.bucket_bytes)
        register_parameter_specs(self, self.comm)

    def grid(self, layout: Layout) -> ProcessorGrid:
        """The one grid of ``layout`` (created collectively on first use, shared by layers)."""
        g = self._grids.get(layout)
        if g is None:
            g = self._grids[layout] = ProcessorGrid(dict(layout), comm=self.comm)
        return g

    def _build(self, gm: fx.GraphModule, step: Step) -> None:
        """The layer of ``step``: a module's, in place of the module under every name it has
        (calls of one module in one layout share it), or a function node's own."""
        spec = step.layer
        assert spec is not None
        node = step.node
        if node.op == "call_module" and str(node.target) in self._layers:
            return  # called again in the same layout: one layer, both uses exact
        module = gm.get_submodule(str(node.target)) if node.op == "call_module" else None
        new = self._make(step, module)
        if new is None:
            return  # runs as traced, on local blocks
        if node.op == "call_module":  # every name the module is registered under
            for path in [n for n, m in gm.named_modules(remove_duplicate=False) if m is module]:
                set_submodule(gm, path, new)
            self._layers[str(node.target)] = new
        else:
            self._function_modules[node.name] = new

    def _build_call(self, step: Step) -> None:
        """One call of a module without state that is called in several layouts: its own layer,
        or its own plain copy where it runs as traced, a child of the parallel model either way
        (so that train() and eval() reach it)."""
        node = step.node
        plain = copy.deepcopy(self._template.get_submodule(str(node.target))).to("cpu")
        new = self._make(step, plain) if step.layer is not None else None
        if new is not None:
            self._function_modules[node.name] = new
        self.add_module(call_name(node), new if new is not None else plain)

    def _make(self, step: Step, module: nn.Module | None) -> nn.Module | None:
        spec = step.layer
        assert spec is not None
        try:
            return step.handler.build(module, step.node, step, self.grid(spec.layout))
        except (ValueError, TypeError, NotImplementedError) as exc:
            where = f" ({spec.source})" if spec.source else ""
            raise type(exc)(f"parallelize: layer {spec.name!r}{where}: {exc}") from exc

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> Any:
        """``x``: this rank's samples ``x[o_N,*,...]`` on :attr:`data_grid`. Returns their outputs,
        complete on every rank (``[o_N,*,...]``)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"input must be a torch.Tensor, got {type(x).__name__}")
        self._check_dtype(x)
        if self._trainable.changed(self):
            _eager(self._rebuild_gradient_syncs)
        compiled = compiling()
        if compiled:  # the traced program checks its layers one by one
            shape = eager(self._agree_batch)(x)
        else:
            self._placed.check()
            shape = self._agree_batch(x)
        if not self._local_norms:
            return self._plan(shape, x.dtype, compiled)(x)
        collected: list[Any] = []  # local-statistics layers: one running-statistics broadcast
        for m in self._local_norms:
            m._collector = collected
        try:
            out = self._plan(shape, x.dtype, compiled)(x)
        finally:
            for m in self._local_norms:
                m._collector = None
        if collected:  # only after a whole forward: every rank sends the same layers
            _eager(broadcast_running, collected)
        return out

    def _run_segment(self, segment: int, env: dict[fx.Node, Any],
                     converted: dict[tuple[fx.Node, Placement], torch.Tensor],
                     shapes: dict[str, tuple[int, ...]],
                     needs: dict[tuple[fx.Node, fx.Node], Placement | None]) -> None:
        """Run one checkpointed segment under ``torch.utils.checkpoint``: its inputs are converted
        outside it (the forward's bytes, once), its own steps -- their collectives included -- run
        again in backward, and only its inputs are kept for backward."""
        analysis: Analysis = self._analysis
        steps = [s for s in analysis.steps if s.segment == segment]
        inside = {s.node for s in steps}
        outer: list[tuple[fx.Node, Placement | None]] = []
        for s in steps:
            for a in s.node.all_input_nodes:
                key = (a, needs[(s.node, a)])
                if a in inside or key in outer:
                    continue
                if key[1] is not None and key not in converted:
                    converted[key] = convert(env[a], analysis.step(a).out, key[1],
                                             shapes[a.name], self._grids)
                outer.append(key)
        leaving = [s.node for s in steps if any(u not in inside for u in s.node.users)]

        def forward(*values: Any) -> tuple[Any, ...]:
            given = dict(zip(outer, values))
            local: dict[fx.Node, Any] = {}
            moved: dict[tuple[fx.Node, Placement], torch.Tensor] = {}
            for s in steps:
                def arg(a: fx.Node, s: Step = s) -> Any:
                    need = needs[(s.node, a)]
                    if a not in inside:
                        return given[(a, need)]
                    if need is None:
                        return local[a]
                    if (a, need) not in moved:
                        moved[(a, need)] = convert(local[a], analysis.step(a).out, need,
                                                   shapes[a.name], self._grids)
                    return moved[(a, need)]

                args = fx.node.map_arg(s.node.args, arg)
                kwargs = fx.node.map_arg(s.node.kwargs, arg)
                local[s.node] = self._run(s, args, kwargs, shapes)
            return tuple(local[n] for n in leaving)

        values = [converted[k] if k[1] is not None else env[k[0]] for k in outer]
        out = torch.utils.checkpoint.checkpoint(forward, *values, use_reentrant=False,
                                                context_fn=recompute_context)
        env.update(zip(leaving, out))

    def _run(self, step: Step, args: Any, kwargs: Any, shapes: dict[str, tuple[int, ...]]) -> Any:
        node = step.node
        if step.handler is not None and not step.handler.runs_as_traced(step):
            return step.handler.run(node, args, kwargs, shapes[node.args[0].name])
        if node.name in self._function_modules:  # this call's own layer (a function, or a
            # module without state called in another layout than its first call)
            rest = step.handler.operands(args, kwargs) if step.handler is not None and (
                step.handler.layer_operands) else ()
            return _eager(self._function_modules[node.name], args[0], shapes[node.args[0].name],
                          *rest)
        distributed = node.target in self._layers if node.op == "call_module" else False
        if node.op == "call_module" and call_name(node) in self._modules:
            return self._modules[call_name(node)](*args, **kwargs)
        if node.op == "call_module":
            module = self.get_submodule(str(node.target))
            if distributed:
                if module is not self._layers[node.target]:
                    raise TypeError(
                        f"module {node.target!r} was replaced after parallelize (now "
                        f"{type(module).__name__}): the parallel model runs the layer it built. "
                        "Convert or replace layers in the plain model before parallelize")
                return _eager(module, args[0], shapes[node.args[0].name])
            return module(*args, **kwargs)
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        if node.op == "get_attr":
            return _get_attr(self, str(node.target))
        raise AssertionError(f"unexpected node {node.op}")

    def _exit(self, y: Any) -> Any:
        if not isinstance(y, torch.Tensor):
            return y
        n_local = y.shape[0] if y.dim() else 1
        scale = 1.0 if self.loss_reduction == "sum" else n_local / self.global_batch_size
        if self._root and scale == 1.0:  # one sample block and no replicas: the output as is
            return y
        return _Exit.apply(y, scale, self._root)

    def _check_dtype(self, x: torch.Tensor) -> None:
        """The input's dtype against the parameters', before any rank communicates: a mismatch
        would otherwise surface in some layer, or stall the ranks that did not meet it."""
        params = {p.dtype for p in self.parameters() if p.is_floating_point()}
        if not x.is_floating_point():
            raise TypeError(
                f"input must be a floating point tensor (the model's parameters are "
                f"{', '.join(sorted(map(str, params))) or 'floating point'}), got dtype "
                f"{x.dtype}: convert it, e.g. x.float()")
        if len(params) == 1 and x.dtype not in params and not torch.is_autocast_enabled(
                x.device.type):
            (want,) = params
            raise TypeError(
                f"input has dtype {x.dtype} but the model's parameters are {want}: convert the "
                f"input (x.to({want})) or the model (pmodel.to({x.dtype}))")

    def _agree_batch(self, x: torch.Tensor) -> tuple[int, ...]:
        """The global input shape, from one small allgather of every rank's local shape."""
        if x.dim() == 0:
            raise ValueError("input must have a sample dim, got a 0-d tensor")
        if self.comm.size == 1:  # nothing to agree on: no tensor, no device round trip
            object.__setattr__(self, "global_batch_size", x.shape[0])  # a plain attribute
            return tuple(x.shape)
        # on the host (on NCCL, its gloo sibling): the shapes are needed there at once, and a
        # device tensor would cost a device round trip per step
        local = torch.tensor(list(x.shape), dtype=torch.int64)
        shapes = self.comm.host.allgather(local, meta="ParallelModel entry: local input shapes")
        grid = self.data_grid
        p_n = grid.extent("N")
        blocks: dict[int, tuple[int, int]] = {}
        for r, s in enumerate(shapes):
            s = tuple(int(v) for v in s)
            if s[1:] != tuple(x.shape[1:]) or len(s) != x.dim():
                raise ValueError(
                    "give every rank inputs with the same non-sample dims: ranks disagree on "
                    f"them: rank {r} has {s}, rank {self.comm.rank} has {tuple(x.shape)}")
            n = grid.coords_of(r).get("N", 0)
            if n in blocks and blocks[n][1] != s[0]:
                raise ValueError(
                    "give every rank of one N block the same samples (distconv.data."
                    f"GridSampler deals them): ranks {blocks[n][0]} and {r} share sample block "
                    f"N={n} of the data grid {layout_str(grid.layout)} but hold {blocks[n][1]} "
                    f"and {s[0]} samples")
            blocks[n] = (r, s[0])
        total = sum(b[1] for b in blocks.values())
        for n, (r, got) in sorted(blocks.items()):
            want = balanced_block(total, p_n, n)[1]
            if got != want:
                sizes = [blocks[i][1] for i in range(p_n)]
                raise ValueError(
                    "deal the global batch in balanced blocks (distconv.data.GridSampler, or "
                    f"distconv.data.sample_block): sample blocks {sizes} of a global batch of "
                    f"{total} are not balanced: block N={n} must hold {want} (blocks of N//P_N, "
                    "one more for the first N%P_N)")
        if get_debug() and self.comm.size > 1:
            self._check_replicas(x)
        self.global_batch_size = total
        return (total,) + tuple(x.shape[1:])

    def _check_replicas(self, x: torch.Tensor) -> None:
        """Debug mode: ranks of one sample block must hold the same samples, bit for bit."""
        data = x.detach().contiguous().cpu().numpy().tobytes()
        digest = torch.tensor(list(hashlib.sha256(data).digest()[:8]), dtype=torch.int64,
                              device=self.comm.device)
        digests = self.comm.allgather(digest, meta="ParallelModel entry: sample digests")
        first: dict[int, int] = {}
        for r, d in enumerate(digests):
            n = self.data_grid.coords_of(r).get("N", 0)
            if n in first and not torch.equal(digests[first[n]], d):
                raise ValueError(
                    "give every rank of one N block the same samples (distconv.data."
                    f"GridSampler deals them): ranks {first[n]} and {r} share sample block "
                    f"N={n} of the data grid {layout_str(self.data_grid.layout)} but hold "
                    "different samples")
            first.setdefault(n, r)
        if x.numel() == 0:
            return
        for n, r in first.items():
            for m, q in first.items():
                if m > n and torch.equal(digests[r], digests[q]):
                    raise ValueError(
                        "give each N block its own block of the global batch (distconv.data."
                        "GridSampler, or distconv.data.sample_block), not the whole batch: "
                        f"sample blocks N={n} (rank {r}) and N={m} (rank {q}) of the data grid "
                        f"{layout_str(self.data_grid.layout)} hold identical samples")

    def _plan(self, shape: tuple[int, ...], dtype: torch.dtype,
              compiled: bool = False) -> Callable[[torch.Tensor], Any]:
        """The step's code for a global input shape (cached): every node's global shape (a
        meta-device trace) and the placement each node's inputs are converted to on those shapes
        (:func:`~distconv.parallel.graph.operand_need`), written out as one function of this
        rank's input block (:func:`~distconv.parallel.program.generate`); ``compiled``: the
        program ``torch.compile`` traces."""
        key = (shape, dtype, compiled)
        program = self._plans.get(key)
        if program is None:
            meta: fx.GraphModule = self._meta
            meta.to(dtype)
            propagate_shapes(meta, shape, dtype=dtype, argument="the input's global shape",
                             module=self._template)
            shapes = {n.name: tuple(n.meta["tensor_meta"].shape) for n in meta.graph.nodes
                      if isinstance(n.meta.get("tensor_meta"), fx.passes.shape_prop.TensorMetadata)}
            check_shapes(self._analysis, dict(meta.named_modules()), shapes)
            needs = {(s.node, a): operand_need(s, a, shapes) for s in self._analysis.steps
                     for a in s.node.all_input_nodes}
            program = self._plans[key] = generate(self, shapes, needs, compiled=compiled)
        return program

    # ------------------------------------------------------------------ state dicts
    def _shard_tag(self) -> dict[str, Any]:
        tag = getattr(self, "_tag", None)
        if tag is None:
            where = sorted((k, None if s.grid is None else s.grid.layout, s.dist.format(),
                            s.global_shape) for k, s in shard_specs(self).items())
            digest = hashlib.sha256(repr(where).encode()).hexdigest()[:16]
            tag = {"rank": self.comm.rank, "world_size": self.comm.size, "layout": digest}
            object.__setattr__(self, "_tag", tag)
        return dict(tag)

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "",
                   keep_vars: bool = False) -> Any:
        """This rank's shards under the single-process keys (what optimizers and
        :func:`distconv.save` work with), tagged with the rank and layout that hold them: it loads
        back only on the same rank and layout (:meth:`load_state_dict`). For the global tensors
        use :meth:`gather_state_dict` (collective); to save and reshard use
        :func:`distconv.save` / :func:`distconv.load`."""
        sd = super().state_dict(*args, destination=destination, prefix=prefix,
                                keep_vars=keep_vars)
        meta = getattr(sd, "_metadata", None)
        if meta is not None:
            meta.setdefault(prefix[:-1], {})[_TAG] = self._shard_tag()
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        """Load either this rank's own shards (a :meth:`state_dict` of this rank and layout,
        also after ``torch.save``/``torch.load``) or a plain single-process state dict (global
        tensors: every rank copies its blocks, as :func:`distconv.load_global_state_dict`).

        Raises:
            ValueError: shards of another rank or layout (use :func:`distconv.save` /
                :func:`distconv.load`, which reshard), or a tensor whose shape is neither its
                global shape nor, with the tag, its local one; missing or unknown keys when
                ``strict``.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        meta = getattr(state_dict, "_metadata", None) or {}
        tag = meta.get("", {}).get(_TAG)
        if tag is not None:
            mine = self._shard_tag()
            if tag != mine:
                raise ValueError(
                    f"state_dict holds the shards of rank {tag['rank']} of {tag['world_size']} "
                    f"(layout {tag['layout']}); this is rank {mine['rank']} of "
                    f"{mine['world_size']} (layout {mine['layout']}). Shards load only where "
                    "they were taken: save and resume with distconv.save / distconv.load "
                    "(they reshard onto any layout), or load a plain single-process state dict")
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        if assign:
            raise ValueError("assign=True takes this rank's own shards (pmodel.state_dict()); a "
                             "plain single-process state dict is sharded by copying its blocks")
        from distconv.checkpoint import load_global_state_dict

        load_global_state_dict(self, state_dict, strict=strict)
        keys = set(shard_specs(self))
        return nn.modules.module._IncompatibleKeys(
            sorted(keys - set(state_dict)), sorted(set(state_dict) - keys))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's ``no_sync``: backward passes inside the block complete no parameter gradients
        (each rank accumulates its own part in ``.grad``); the first backward pass after it
        reduces everything accumulated, so gradient accumulation costs one set of allreduces::

            with pmodel.no_sync():
                F.cross_entropy(pmodel(x0), y0).backward()
            F.cross_entropy(pmodel(x1), y1).backward()   # gradients of both, complete

        The layers' own collectives (halos, redistributions, statistics) still run: they carry
        activations, not gradients. Step the optimizer only after a synchronised pass."""
        syncs = [] if self.grad_sync is None else self.grad_sync.syncs
        for sync in syncs:
            sync.enabled = False
        try:
            yield
        finally:
            for sync in syncs:
                sync.enabled = True

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """:func:`distconv.clip_grad_norm_` of this model's parameters (collective): the norm of
        the global gradient, every shard counted once; returns it."""
        return _clip.clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite,
                                     comm=self.comm)

    # ------------------------------------------------------------------ gathering
    def gather_state_dict(self) -> dict[str, torch.Tensor]:
        """The single-process state dict, on every rank (collective). A tensor the model holds
        under several keys (a module registered under several paths) is gathered once and is one
        tensor under all of them, as in the single-process model's state dict."""
        state = self.state_dict(keep_vars=True)
        out: dict[str, torch.Tensor] = {}
        done: dict[int, torch.Tensor] = {}
        for key, spec in shard_specs(self).items():
            local = state[key]
            whole = done.get(id(local))
            if whole is None:
                if spec.grid is None or spec.is_replicated:
                    whole = local.detach().clone()
                else:
                    whole = gather(local.detach(), spec.dist, spec.grid, spec.global_shape)
                done[id(local)] = whole
            out[key] = whole
        return out

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise TypeError(
            "a ParallelModel cannot be deep-copied: its layers hold the communicators and grids "
            "of this job. For a second copy of the weights (an EMA, a snapshot), parallelize "
            "another copy of the plain model with the same config and load this one's "
            "state_dict() into it (each rank its own shards), or take gather_module() (the "
            "plain model, collective)")

    def gather_module(self) -> nn.Module:
        """The plain single-process model with the global parameters and buffers (collective)."""
        state = self.gather_state_dict()
        device = next((t.device for t in state.values()), torch.device("cpu"))
        model = copy.deepcopy(self._template).to_empty(device=device)
        missing = set(model.state_dict()) - set(state)
        if missing:
            raise NotImplementedError(
                f"gather_module: {sorted(missing)} belong to modules the traced forward never "
                "calls, so the parallel model does not hold them")
        model.load_state_dict(state)
        return model

    def extra_repr(self) -> str:
        return (f"world_size={self.comm.size}, data={layout_str(self.config.data)}, "
                f"loss_reduction={self.loss_reduction!r}, layers={len(self.config.layers)} "
                f"config entries")
