"""The layer contract of docs/architecture.md, checked on every import, lazy ones included
(imports inside functions count; only ``if TYPE_CHECKING:`` imports, which never run, do not).

A module may import modules of its own layer or of layers below it. ``KNOWN`` lists the edges that
still break the contract: it may only shrink (an entry that no longer exists fails the test, so
whoever removes a violation also removes its line)."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.test_architecture import _is_type_checking, _modules, from_import_targets

# lowest first: (layer, module prefixes); a module belongs to its longest matching prefix
LAYERS: list[tuple[str, list[str]]] = [
    ("core", ["adacomp.errors", "adacomp.registry", "adacomp.units", "adacomp.netschedule", "adacomp.engine.metrics",
              "adacomp.devices", "adacomp.tensors"]),
    ("backends", ["adacomp.backends"]),
    ("components", ["adacomp.compressors", "adacomp.memories", "adacomp.communicators", "adacomp.models",
                    "adacomp.datasets", "adacomp.netmodel"]),
    ("config", ["adacomp.config"]),
    ("engine", ["adacomp.engine", "adacomp.policies", "adacomp.outer"]),
    ("runtime", ["adacomp.runtime", "adacomp.checkpoint_reshard", "adacomp.preemption", "adacomp.ddp", "adacomp.fsdp"]),
    ("api", ["adacomp"]),
    ("tools", ["adacomp.tools", "adacomp.bench", "adacomp.netem", "adacomp.integrations"]),
]

# (importer, imported): edges allowed to break the contract; empty since issue 29, and must stay so
KNOWN: set[tuple[str, str]] = set()


def layer_of(module: str) -> int:
    best: tuple[int, int] | None = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[0]


def all_imports(me: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every package module ``me`` imports anywhere in its body, except under TYPE_CHECKING."""
    tree = ast.parse(path.read_text())
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node)
                   for n in ast.walk(node)}
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                name = a.name
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name:
                    out.add(name)
        elif isinstance(node, ast.ImportFrom):
            out.update(from_import_targets(node, package, modules))
    out.discard(me)
    return out


def violations() -> set[tuple[str, str]]:
    modules = _modules()
    return {(m, d) for m, p in modules.items() for d in all_imports(m, p, modules) if layer_of(d) > layer_of(m)}


def test_imports_respect_the_layers() -> None:
    found = violations()
    new = sorted(found - KNOWN)
    assert not new, "imports that reach up a layer (docs/architecture.md, 'Layers'): " + \
        "; ".join(f"{a} ({LAYERS[layer_of(a)][0]}) -> {b} ({LAYERS[layer_of(b)][0]})" for a, b in new)
    gone = sorted(KNOWN - found)
    assert not gone, f"these violations are fixed: remove them from KNOWN: {gone}"


def test_layer_checker_sees_lazy_imports(tmp_path: Path) -> None:
    """A planted upward import inside a function is found (the checker is not blind to lazy imports)."""
    src = "def f():\n    from adacomp.tools import cli\n    return cli\n"
    modules = {"adacomp.errors": tmp_path / "errors.py", "adacomp.tools.cli": tmp_path / "cli.py"}
    modules["adacomp.errors"].write_text(src)
    assert all_imports("adacomp.errors", modules["adacomp.errors"], modules) == {"adacomp.tools.cli"}
    assert layer_of("adacomp.tools.cli") > layer_of("adacomp.errors")


def test_ddp_hook_imports_as_users_type_it() -> None:
    from adacomp.ddp import hook, register  # noqa: F401
    import adacomp
    assert adacomp.ddp.hook is hook
