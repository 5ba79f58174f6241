"""The layer order holds: each layer imports only the layers below it, and no two files of the package import
each other in a circle. Read from the source with `ast`, imports inside functions included, so a lazy import
cannot hide a back-edge.

    experiments/, benchmarks/   recipes and runners: nothing below imports them
    dspark/ (top level)         the application: cli, api, hf, metrics, quickstart, sweep
    dspark/training/            data, regeneration, the training loop
    drafters/, verifiers/       the methods (neither imports the other)
    dspark/engine/              the engine core and the drafter/verifier protocol

`dspark/config.py` (dataclasses <-> flags and YAML) stands apart: it imports nothing of the package, and the
training entry points and the application both use it.
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RANK = {"engine": 0, "drafters": 1, "verifiers": 1, "training": 2, "app": 3, "experiments": 4, "benchmarks": 4}
LEAVES = {"dspark.config"}  # importable from every layer; imports nothing of the package


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer(module: str) -> str | None:
    """The layer of a module of this repository, None for anything else (the standard library, torch, ...)."""
    top, _, rest = module.partition(".")
    if top == "dspark":
        sub = rest.partition(".")[0]
        return {"engine": "engine", "training": "training"}.get(sub, "app")
    return top if top in RANK else None


def imports(path: Path, source: str | None = None) -> set[str]:
    """Every module the file imports, at any depth of its code (relative imports resolved)."""
    tree = ast.parse(path.read_text(encoding="utf-8") if source is None else source, filename=str(path))
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            # `from dspark.engine import decode` imports the submodule dspark.engine.decode
            found.update(f"{base}.{alias.name}" for alias in node.names if _is_module(f"{base}.{alias.name}"))
    return found


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


FILES = sorted(p for top in ("dspark", "drafters", "verifiers", "experiments", "benchmarks")
               for p in (ROOT / top).rglob("*.py"))


def test_every_file_is_in_a_layer():
    assert FILES and all(layer(module_name(p)) for p in FILES)


def test_no_layer_imports_a_layer_above_it():
    wrong = [edge for path in FILES for edge in back_edges(path)]
    assert not wrong, "\n".join(wrong)


def test_leaves_import_nothing_of_the_package():
    for leaf in LEAVES:
        path = ROOT.joinpath(*leaf.split(".")).with_suffix(".py")
        assert not [t for t in imports(path) if layer(t)], f"{leaf} must stay a leaf"


def test_no_import_cycle_between_files():
    package = [p for p in FILES if layer(module_name(p)) not in ("experiments", "benchmarks")]
    names = {module_name(p) for p in package}
    graph = {module_name(p): {t for t in imports(p) if t in names and t != module_name(p)} for p in package}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def back_edges(path: Path, source: str | None = None) -> list[str]:
    me = module_name(path)
    mine = layer(me)
    wrong = []
    for target in sorted(imports(path, source)):
        theirs = layer(target)
        if theirs is None or target in LEAVES:
            continue
        if RANK[theirs] > RANK[mine] or (RANK[theirs] == RANK[mine] == 1 and theirs != mine):
            wrong.append(f"{me} ({mine}) imports {target} ({theirs})")
    return wrong


def test_the_check_sees_a_lazy_back_edge():
    """An import inside a function body, where a back-edge would hide, is found and refused."""
    path = ROOT / "dspark" / "engine" / "sampling.py"
    assert back_edges(path) == []
    late = path.read_text(encoding="utf-8") + "\n\ndef _late():\n    from dspark.training import data\n"
    assert back_edges(path, late) == ["dspark.engine.sampling (engine) imports dspark.training (training)",
                                      "dspark.engine.sampling (engine) imports dspark.training.data (training)"]
