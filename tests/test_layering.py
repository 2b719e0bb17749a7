"""The package's arrows point one way: the service and the CLI above the engine, the engine above the math, and
nothing in the runtime package reaches into the tools (bench/) or the tests. Read from the import statements."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "specdec"
# Each module's layer; a module may import only modules of its own layer or below.
LAYERS = {
    0: ("errors", "params", "stats", "sampling", "verification", "adaptive"),  # the math and the contracts
    1: ("kv_cache", "cpu", "threads"),  # models' caches, the CPU kernels, OS threads
    2: ("engine", "drafters", "loading", "weights", "default_pair", "text"),  # the engine and what feeds it
    3: ("cli", "serve", "__main__", "__init__"),  # the interfaces
}
APART = ("cli", "serve")  # the two interfaces know nothing of each other


def layer_of(module: str) -> int:
    top = module.split(".")[1] if module.startswith("specdec.") else "__init__"
    return next(layer for layer, names in LAYERS.items() if top in names)


def imports(path: Path) -> set[str]:
    """Every module `path` imports, absolute ("specdec.engine", "torch", ...)."""
    module = "specdec." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names
                         if (PACKAGE.parent / (target + "." + alias.name).replace(".", "/")).with_suffix(".py").exists())
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path):
    module = "specdec." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
    own = layer_of(module) if module != "specdec" else 3
    for target in imports(path):
        top = target.split(".")[0]
        assert top not in ("bench", "tests", "conftest"), f"{module} imports the tool or test module {target}"
        if top != "specdec" or target == "specdec":
            continue
        assert layer_of(target) <= own, f"{module} (layer {own}) imports {target} (layer {layer_of(target)})"
        mine, theirs = module.split(".")[1:2], target.split(".")[1:2]
        if mine and theirs and mine != theirs:
            assert not (mine[0] in APART and theirs[0] in APART), f"{module} imports {target}"


def test_every_module_has_a_layer():
    for path in MODULES:
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        layer_of("specdec." + ".".join(parts))  # raises StopIteration for a module no layer names


def test_the_check_sees_a_wrong_arrow(tmp_path, monkeypatch):
    """The check itself can fail: an engine-layer module importing the service is reported."""
    bad = PACKAGE / "engine.py"
    source = bad.read_text(encoding="utf-8") + "\nfrom .serve import create_app\n"
    fake = tmp_path / "specdec" / "engine.py"
    fake.parent.mkdir()
    fake.write_text(source, encoding="utf-8")
    monkeypatch.setattr(__import__(__name__, fromlist=["PACKAGE"]), "PACKAGE", tmp_path / "specdec")
    with pytest.raises(AssertionError, match="imports specdec.serve"):
        test_imports_point_down(fake)
