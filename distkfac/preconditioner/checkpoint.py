"""The checkpoint of :class:`~distkfac.preconditioner.KFAC`: its runtime state as a dict of
tensors and plain values (``state_dict``), where each tensor lies on the grid (``shard_specs``,
so ``distconv.save`` / ``distconv.load`` can reshard it), and the state restored onto the same or
another layout (``check_layers`` before anything changes, then ``load_layers``).  The layouts, and
what survives a change of layout, are described at :meth:`KFAC.shard_specs
<distkfac.preconditioner.KFAC.shard_specs>` and :meth:`KFAC.load_state_dict
<distkfac.preconditioner.KFAC.load_state_dict>`."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from distkfac.methods import Method
from distkfac.preconditioner.layer import Layer
from distkfac.sharded import BiasShardAdapter, BlockLayout, ExactLayer, ShardAdapter

if TYPE_CHECKING:
    from distkfac.preconditioner.kfac import KFAC

__all__ = ["LAYOUT_FIELDS", "check_layers", "load_layers", "shard_specs", "state_dict"]


def shard_specs(kfac: KFAC) -> dict[str, Any]:
    """Where each tensor of :func:`state_dict` lies (see :meth:`KFAC.shard_specs
    <distkfac.preconditioner.KFAC.shard_specs>`)."""
    from distconv.distribution import Dist
    from distconv.nn.sharding import ShardSpec

    specs: dict[str, Any] = {}
    for ly in kfac.layers:
        ad = ly.adapter
        if (not isinstance(ad, (ShardAdapter, BiasShardAdapter)) or ad.geo.C * ad.geo.F == 1
                or ad.module.groups == 1):
            continue
        # whole groups per rank: blocks of the global (groups, d, d) factors over the
        # grid dim that splits the filters, and of the decompositions' rows per group
        groups, grid, dim = ad.module.groups, ad.module.grid, ad.geo.fdim
        for key, d in (("A", ad.a_dim), ("G", ad.g_dim)):
            specs[f"factors/{ly.name}/{key}/value"] = ShardSpec(
                grid, Dist((dim, None, None)), (groups, d, d))
            specs[f"decompositions/{ly.name}/{key}"] = ShardSpec(
                grid, Dist((dim, None)), (groups, kfac.method.group_numel(d)))
    for name, parts in _block_modules(kfac.layers).items():
        geo = parts["weight"].adapter.geo
        layout, grid = BlockLayout.of(geo), parts["weight"].adapter.module.grid
        shards = (layout.F, layout.C)
        over = lambda *rest: Dist((geo.fdim, geo.cdim, *rest))  # noqa: E731
        for part in parts:
            base = f"block/{name}/{layout.key}/{part}"
            for key in "AG":
                d = layout.side(part, key)
                for field in (key, f"{key}_ref"):
                    specs[f"{base}/{field}"] = ShardSpec(grid, over(None, None),
                                                         (*shards, d, d))
                specs[f"{base}/{key}_decomposition"] = ShardSpec(
                    grid, over(None), (*shards, kfac.method.group_numel(d)))
            specs[f"{base}/counters"] = ShardSpec(grid, over(None), (*shards, 5))
    for ly in kfac.exact_layers:
        geo, grid = ly.geo, ly.grid
        specs[f"factors/{ly.name}/A/value"] = ShardSpec(
            grid, Dist((None, geo.cdim, None)), (1, geo.K, geo.K))
        specs[f"factors/{ly.name}/G/value"] = ShardSpec(
            grid, Dist((None, geo.fdim, None)), (1, geo.fo, geo.fo))
        specs[f"exact_inverses/{ly.name}/A"] = ShardSpec(
            grid, Dist((geo.cdim, None, None)), (geo.ci, geo.k2, geo.K))
        specs[f"exact_inverses/{ly.name}/G"] = ShardSpec(
            grid, Dist((geo.fdim, None)), (geo.fo, geo.fo))
    # the stale-statistics references lie like the factors
    for key in [k for k in specs if k.startswith("factors/")]:
        specs["stale/" + key[len("factors/"): -len("/value")] + "/ref"] = specs[key]
    return specs


def state_dict(kfac: KFAC) -> dict[str, Any]:
    """The state of :meth:`KFAC.state_dict <distkfac.preconditioner.KFAC.state_dict>`."""
    settings = {k: v for k, v in kfac.settings().items() if not callable(v)}
    whole, blocks = _whole_and_blocks(kfac.layers)
    factors = {ly.name: {"A": ly.a.state_dict(), "G": ly.g.state_dict()}
               for ly in whole}
    inverses: dict[str, Any] = {}
    for ly in kfac.exact_layers:
        factors[ly.name] = {k: {"value": None if ly.factors[k] is None
                                else ly.factors[k].unsqueeze(0), "updates": ly.updates}
                            for k in "AG"}
        a_inv, g_inv = ly.inverse_rows["A"], ly.inverse_rows["G"]
        if a_inv is not None:
            cn = ly.geo.c_blocks[ly.geo.c][1]
            inverses[ly.name] = {
                "A": a_inv[: cn * ly.geo.k2].reshape(cn, ly.geo.k2, -1).clone(), "G": g_inv}
            if ly.geo.bias:
                inverses[ly.name]["A_bias"] = a_inv[-1].clone()
    stale = {ly.name: dict(zip("AG", ly.stale)) for ly in whole}
    stale.update({name: dict(zip("AG", pair)) for name, pair in kfac._exact_stale.items()})
    exact = {ly.name for ly in kfac.exact_layers}
    return {
        "steps": kfac.steps,
        "settings": settings,
        "factors": factors,
        "stale": {name: {k: {"ref": None if st.ref is None else
                             st.ref.unsqueeze(0) if name in exact else st.ref,
                             "interval": st.interval, "wait": st.wait}
                         for k, st in pair.items()} for name, pair in stale.items()},
        "decompositions": {ly.name: {k: _by_group(kfac.method, ly, k) for k in "AG"}
                           for ly in whole},
        "uses": {ly.name: ly.uses for ly in whole},
        "exact_inverses": inverses,
        "block": {name: _block_state(kfac.method, parts) for name, parts in blocks.items()},
        "placement": kfac.placement.state_dict(),
        "payload_format": kfac.method.name,  # rows per group: packing does not matter
    }


def _block_modules(layers: list[Layer]) -> dict[str, dict[str, Layer]]:
    """The ``'block'`` layers of DistConv2d modules split over C or F by module name:
    ``{"weight": layer}``, plus ``"bias"`` where the bias is a block of its own."""
    out: dict[str, dict[str, Layer]] = {}
    for ly in layers:
        ad = ly.adapter
        if (isinstance(ad, (ShardAdapter, BiasShardAdapter)) and ad.geo.C * ad.geo.F > 1
                and ad.module.groups == 1):
            bias = isinstance(ad, BiasShardAdapter)
            name = ly.name[: -len(".bias")] if bias else ly.name
            out.setdefault(name, {})["bias" if bias else "weight"] = ly
    return out


def _whole_and_blocks(layers: list[Layer]) -> tuple[list[Layer], dict[str, dict[str, Layer]]]:
    """The layers saved whole, and the ``'block'`` ones by module (see :func:`_block_modules`)."""
    blocks = _block_modules(layers)
    in_blocks = {id(ly) for parts in blocks.values() for ly in parts.values()}
    return [ly for ly in layers if id(ly) not in in_blocks], blocks


def _block_state(method: Method, parts: dict[str, Layer]) -> dict[str, Any]:
    """``{layout key: {part: fields}}`` of one module's shard: its factors, stale-statistics
    references and decompositions zero-padded to the layout's largest block, as this
    shard's ``(1, 1, ...)`` entry of the stack over the shards; the stale intervals and
    waits and the uses of the decompositions as ``counters``."""
    geo = parts["weight"].adapter.geo
    layout = BlockLayout.of(geo)
    out: dict[str, Any] = {}
    for part, ly in parts.items():
        fields: dict[str, Any] = {"updates": {"A": ly.a.updates, "G": ly.g.updates}}
        counters = []
        for key, factor, st in (("A", ly.a, ly.stale[0]), ("G", ly.g, ly.stale[1])):
            d = layout.side(part, key)
            fields[key] = _padded(factor.value, (d, d))
            fields[f"{key}_ref"] = _padded(st.ref, (d, d))
            rows = _by_group(method, ly, key)
            fields[f"{key}_decomposition"] = _padded(
                rows, (method.group_numel(d),))
            counters += [st.interval, st.wait]
        fields["counters"] = torch.tensor([[counters + [ly.uses]]], dtype=torch.int64)
        out[part] = fields
    return {layout.key: {"layout": {k: getattr(layout, k) for k in LAYOUT_FIELDS}, **out}}


def _by_group(method: Method, layer: Layer, key: str) -> Tensor | None:
    payload = layer.a_payload if key == "A" else layer.g_payload
    ad = layer.adapter
    return None if payload is None else method.by_group(
        payload, ad.groups, ad.a_dim if key == "A" else ad.g_dim)


def check_layers(kfac: KFAC, state: dict[str, Any]) -> None:
    """Refuse, before anything is restored, a state of another set of layers, or ``'block'``
    state for a layer this preconditioner keeps whole."""
    whole, blocks = _whole_and_blocks(kfac.layers)
    saved_blocks = state.get("block", {})
    names = ({ly.name for ly in whole} | {ly.name for ly in kfac.exact_layers}
             | set(blocks))
    saved_names = set(state["factors"]) | set(saved_blocks)
    if saved_names != names:
        raise ValueError(f"state holds layers {sorted(saved_names)}, this "
                         f"preconditioner has {sorted(names)}")
    for ly in [*whole, *kfac.exact_layers]:
        if ly.name in saved_blocks:
            saved, = (BlockLayout(**{k: v["layout"][k] for k in LAYOUT_FIELDS})
                      for v in saved_blocks[ly.name].values())
            geo = ly.geo if isinstance(ly, ExactLayer) else ly.adapter.geo
            raise ValueError(
                f"K-FAC layer {ly.name!r}: the state holds its factors under {saved}; this "
                f"preconditioner keeps {BlockLayout.of(geo, whole=True)}, which diagonal "
                "blocks cannot give: load it with the saved layout (or one that splits "
                "those blocks further), or let the factors re-accumulate")


def load_layers(kfac: KFAC, state: dict[str, Any]) -> None:
    """Every layer's factors, decompositions (where saved in ``kfac.method``'s format) and
    stale-statistics state, and the placement's state (under the same policy)."""
    whole, blocks = _whole_and_blocks(kfac.layers)
    saved_blocks = state.get("block", {})
    same_format = state.get("payload_format") == kfac.method.name
    for layer in whole:
        layer.a.load_state_dict(state["factors"][layer.name]["A"])
        layer.g.load_state_dict(state["factors"][layer.name]["G"])
        saved = state.get("decompositions", {}).get(layer.name, {}) if same_format else {}
        ad = layer.adapter
        layer.a_payload, layer.g_payload = (
            None if saved.get(k) is None else
            kfac.method.from_groups(saved[k], ad.groups, d).to(kfac.factor_dtype)
            for k, d in (("A", ad.a_dim), ("G", ad.g_dim)))
        layer.inverses = None
        layer.uses = int(state.get("uses", {}).get(layer.name, 0)) if same_format else 0
        if layer.a_payload is None or layer.g_payload is None:
            layer.a_payload = layer.g_payload = None
            layer.uses = 0
    for layer in kfac.exact_layers:
        saved = state["factors"][layer.name]
        for key in "AG":
            value = saved[key]["value"]
            want = (1, len(layer.rows[key]), layer.side[key])
            if value is not None and tuple(value.shape) != want:
                raise ValueError(f"factor {key} of {layer.name!r} of shape "
                                 f"{tuple(value.shape)} does not fit this rank's block "
                                 f"{want}")
            layer.factors[key] = None if value is None else value[0].to(
                kfac.factor_dtype).clone()
        layer.updates = int(saved["A"]["updates"])
        inv = state.get("exact_inverses", {}).get(layer.name)
        layer.inverse_rows = {"A": None, "G": None}
        if inv is not None:
            a_rows = [inv["A"].reshape(-1, layer.side["A"])]
            if layer.geo.bias:
                a_rows.append(inv["A_bias"].reshape(1, -1))
            layer.inverse_rows = {"A": torch.cat(a_rows).to(kfac.factor_dtype),
                                  "G": inv["G"].to(kfac.factor_dtype).clone()}
    saved_stale = state.get("stale", {})
    pairs = [(ly.name, ly.stale, False) for ly in whole] + [
        (name, pair, True) for name, pair in kfac._exact_stale.items()]
    for name, pair, exact in pairs:
        for key, st in zip("AG", pair):
            got = saved_stale.get(name, {}).get(key)
            if got is None:
                st.ref, st.interval, st.wait = None, 1, 1
                continue
            ref = got["ref"]
            st.ref = None if ref is None else (ref[0] if exact else ref).to(
                kfac.factor_dtype).clone()
            st.interval, st.wait = int(got["interval"]), int(got["wait"])
    if state["settings"].get("placement") == kfac.placement.name:
        kfac.placement.load_state_dict(state.get("placement", {}))
    for name, parts in blocks.items():
        if name in saved_blocks:
            _load_blocks(kfac, name, parts, saved_blocks[name], same_format)
        else:
            _load_blocks_from_whole(name, parts, state["factors"][name])


def _load_blocks(kfac: KFAC, name: str, parts: dict[str, Layer], saved: dict[str, Any],
                 same_format: bool) -> None:
    """One module's ``'block'`` state: on the saved layout each shard takes its own entry
    (decompositions, stale statistics and uses too: the run continues identically); on
    another, its blocks are cut from the saved blocks that hold them."""
    geo = parts["weight"].adapter.geo
    mine = BlockLayout.of(geo)
    entry, = saved.values()
    layout = BlockLayout(**{k: entry["layout"][k] for k in LAYOUT_FIELDS})
    if layout != mine:
        def source(part: str, f: int, c: int, field: str) -> Tensor | None:
            t = entry[part][field]
            return None if t is None else t[f, c]

        _cut_blocks(name, parts, layout, source,
                         lambda part, k: entry[part]["updates"][k])
        return
    for part, ly in parts.items():
        fields = entry[part]
        ranges = mine.ranges(part, geo.f, geo.c)

        def own(field: str) -> Tensor | None:
            t = fields[field]
            return None if t is None else t[0, 0] if t.shape[:2] == (1, 1) else \
                t[geo.f, geo.c]

        counters = own("counters").tolist()
        for i, (key, factor, st) in enumerate((("A", ly.a, ly.stale[0]),
                                               ("G", ly.g, ly.stale[1]))):
            d = ranges[key][1] - ranges[key][0]
            value, ref = own(key), own(f"{key}_ref")
            factor.load_state_dict({"value": None if value is None else value[None, :d, :d],
                                    "updates": fields["updates"][key]})
            st.ref = None if ref is None else ref[None, :d, :d].to(kfac.factor_dtype).clone()
            st.interval, st.wait = int(counters[2 * i]), int(counters[2 * i + 1])
            rows = own(f"{key}_decomposition") if same_format else None
            payload = None if rows is None else kfac.method.from_groups(
                rows[None, : kfac.method.group_numel(d)], 1, d).to(kfac.factor_dtype)
            if key == "A":
                ly.a_payload = payload
            else:
                ly.g_payload = payload
        ly.inverses, ly.uses = None, int(counters[4])
        if ly.a_payload is None or ly.g_payload is None:
            ly.a_payload = ly.g_payload = None
            ly.uses = 0


def _load_blocks_from_whole(name: str, parts: dict[str, Layer],
                            saved: dict[str, Any]) -> None:
    """One module's ``'block'`` state from whole factors (saved under ``'exact'`` or on a
    layout without a channel or filter split): its diagonal blocks."""
    geo = parts["weight"].adapter.geo

    def source(part: str, f: int, c: int, field: str) -> Tensor | None:
        value = saved[field]["value"]
        return None if value is None else value[0]

    _cut_blocks(name, parts, BlockLayout.of(geo, whole=True), source,
                     lambda part, k: saved[k]["updates"])


def _cut_blocks(name: str, parts: dict[str, Layer], layout: BlockLayout,
                source: Callable[[str, int, int, str], Tensor | None],
                updates: Callable[[str, str], int]) -> None:
    """Each shard's factors cut from the blocks of ``layout`` that hold them
    (``source(part, f, c, "A" | "G")``: that block, padded); decompositions are recomputed
    at the next step and the stale-statistics schedule starts again.  A block that lies in
    no saved block is refused, naming both layouts."""
    geo = parts["weight"].adapter.geo
    mine = BlockLayout.of(geo)
    for part, ly in parts.items():
        for key, factor, st in (("A", ly.a, ly.stale[0]), ("G", ly.g, ly.stale[1])):
            lo, hi = mine.ranges(part, geo.f, geo.c)[key]
            found = layout.holder(key, lo, hi, prefer=part)
            if found is None:
                raise ValueError(
                    f"K-FAC layer {name!r}: the state holds its factors under {layout}; "
                    f"this preconditioner keeps {mine}, and the {key} block [{lo}:{hi}) of "
                    f"shard (f={geo.f}, c={geo.c}) lies in no saved block: load it with the "
                    "saved layout (or one that splits those blocks further), or let the "
                    "factors re-accumulate")
            part0, f0, c0, start = found
            value = source(part0, f0, c0, key)
            factor.load_state_dict({
                "value": None if value is None else
                value[None, lo - start: hi - start, lo - start: hi - start],
                "updates": updates(part0, key)})
            st.ref, st.interval, st.wait = None, 1, 1
        ly.a_payload = ly.g_payload = ly.inverses = None
        ly.uses = 0


#: the fields of a BlockLayout a checkpoint holds, beside its key
LAYOUT_FIELDS = ("ci", "fo", "k2", "bias", "C", "F")

def _padded(t: Tensor | None, shape: tuple[int, ...]) -> Tensor | None:
    """``t[0]`` (a one-group factor or payload row) zero-padded to ``shape``, as a
    ``(1, 1, *shape)`` entry of a stack over shards."""
    if t is None:
        return None
    out = t.new_zeros(shape)
    out[tuple(slice(0, n) for n in t.shape[1:])] = t[0]
    return out[None, None]
