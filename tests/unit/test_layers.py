"""Dependencies point one way: every import of the package goes down the layers of DESIGN.md.

Read from the source with ``ast`` (lazy imports inside functions count too;
nothing is imported). Each top-level module or package of ``elastic_ft`` is
one unit; the units are listed from the top down, and a unit may import
itself and the units below it, never one above. Within a layer the order is
fixed too, so that no two units of a layer can import each other:

1. ``cli``, ``aws_batch``, ``components``, ``submission`` (what the component checks and builds);
2. ``worker``, ``train`` (the workers);
3. ``doctor``, ``viz``, ``runevents``, ``spot`` (the workers' notices), ``rendezvous`` (the agent);
4. ``config``, ``inputs``, ``checkpoint``, ``preflight`` (the node's fast checks);
5. ``warm`` (the node's warm process and the launcher that asks it for a worker), ``handoff``: what a
   torchrun agent and its workers exchange, below both.

The package's own ``__init__`` (its version) may be imported from anywhere.
"""

from __future__ import annotations

from tests.unit.test_code_structure import _imports, _modules

LAYERS: list[tuple[str, ...]] = [
    ("cli", "aws_batch", "components", "submission"),
    ("worker", "train"),
    ("doctor", "viz", "runevents", "spot", "rendezvous"),
    ("config", "inputs", "checkpoint", "preflight"),
    ("warm", "handoff"),
]
ORDER = [unit for layer in LAYERS for unit in layer]
LAYER_OF = {unit: n for n, layer in enumerate(LAYERS, start=1) for unit in layer}


def _unit(module: str) -> str | None:
    """``elastic_ft.rendezvous.etcd.wire`` -> ``rendezvous``; the package root -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def violations(graph: dict[str, set[str]]) -> list[str]:
    """One line per import that points up (or sideways past the order), or from/to a unit not placed."""
    out = []
    for importer, imported in sorted(graph.items()):
        src = _unit(importer)
        for target in sorted(imported):
            dst = _unit(target)
            if dst is None or dst == src:
                continue
            if src not in LAYER_OF or dst not in LAYER_OF:
                unplaced = src if src not in LAYER_OF else dst
                out.append(f"{importer} -> {target}: {unplaced!r} is in no layer (add it to LAYERS)")
            elif ORDER.index(dst) < ORDER.index(src):
                out.append(f"{importer} (layer {LAYER_OF[src]}, {src}) imports {target} "
                           f"(layer {LAYER_OF[dst]}, {dst}), which is above it")
    return out


def test_every_import_points_down_the_layers():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    found = violations(graph)
    assert not found, "imports against the layers (DESIGN.md):\n" + "\n".join(found)


def test_every_unit_of_the_package_has_a_layer():
    units = {_unit(m) for m in _modules()} - {None}
    assert units <= set(LAYER_OF), f"units in no layer: {sorted(units - set(LAYER_OF))}"


def test_the_check_names_an_upward_import():
    graph = {
        "elastic_ft.rendezvous.handler": {"elastic_ft.train.world", "elastic_ft.handoff.lost_nodes", "elastic_ft"},
        "elastic_ft.runevents.live": {"elastic_ft.doctor.rendezvous"},
        "elastic_ft.train.loop": {"elastic_ft.spot.imds", "elastic_ft.train.world"},
        "elastic_ft.newpkg.mod": {"elastic_ft.config"},
    }
    assert violations(graph) == [
        "elastic_ft.newpkg.mod -> elastic_ft.config: 'newpkg' is in no layer (add it to LAYERS)",
        "elastic_ft.rendezvous.handler (layer 3, rendezvous) imports elastic_ft.train.world (layer 2, train), "
        "which is above it",
        "elastic_ft.runevents.live (layer 3, runevents) imports elastic_ft.doctor.rendezvous (layer 3, doctor), "
        "which is above it",
    ]
