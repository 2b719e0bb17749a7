"""The package's arrows point one way: the service and the CLI above the engine, the engine above the math, and
nothing in the runtime package reaches into the tools (bench/) or the tests. Read from the import statements."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "specdec"
# Each module's layer; a module may import only modules of its own layer or below.
LAYERS = {
    0: ("errors", "params", "stats", "sampling", "verification", "adaptive"),  # the math and the contracts
    1: ("kv_cache", "compiled", "prompt_cache", "cpu", "cuda", "threads", "fused_forward"),  # models' caches (dynamic, static
    # and compiled, and those kept across requests), the CPU kernels, OS threads, the fused forward
    2: ("engine", "drafters", "grammar", "models", "text"),  # the engine and what feeds it
    3: ("cli", "serve", "default_pair", "__main__", "__init__"),  # the interfaces (default_pair: the prepare command)
}
# Model loading, one module per job: a module of specdec.models may import only those before it.
MODELS = ("startup", "cache", "checkpoint", "default_pair", "weights", "sources", "tokenizers", "memory",
          "quantization", "kernels", "load", "shipped", "draft_vocab", "pair")
# The modules that must stay free of torch (make serve checks the cache with them before torch is imported).
TORCH_FREE = ("specdec.models.cache", "specdec.models.checkpoint", "specdec.models.default_pair",
              "specdec.models.startup", "specdec.default_pair")
APART = ("cli", "serve")  # the two interfaces know nothing of each other


def layer_of(module: str) -> int:
    top = module.split(".")[1] if module.startswith("specdec.") else "__init__"
    return next(layer for layer, names in LAYERS.items() if top in names)


def imports(path: Path, at_import: bool = False) -> set[str]:
    """Every module `path` imports, absolute ("specdec.engine", "torch", ...); with `at_import`, only those imported
    when the module itself is (not inside a function)."""
    module = "specdec." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in _nodes(ast.parse(path.read_text(encoding="utf-8")), at_import):
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


def _nodes(tree: ast.AST, at_import: bool):
    """The tree's nodes; with `at_import`, none inside a function's body."""
    for child in ast.iter_child_nodes(tree):
        yield child
        if not (at_import and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))):
            yield from _nodes(child, at_import)


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


def module_name(path: Path, package: Path = PACKAGE) -> str:
    return "specdec." + ".".join(path.relative_to(package).with_suffix("").parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Each module of the package and the package's modules it imports, at the top or inside a function. An
    import of a package (its __init__) is left out: `from . import verification` names the module, and the
    package's own __init__ imports its modules lazily."""
    paths = sorted(package.rglob("*.py"))
    modules = {module_name(path, package) for path in paths if path.name != "__init__.py"}
    return {module_name(path, package): {target for target in imports(path) if target in modules}
            for path in paths if path.name != "__init__.py"}


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of the graph, as the modules along it, or None."""
    done, path = set(), []

    def visit(module):
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return None
        path.append(module)
        for target in sorted(graph.get(module, ())):
            circle = visit(target)
            if circle:
                return circle
        path.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        circle = visit(module)
        if circle:
            return circle
    return None


def test_no_import_circle():
    assert find_circle(import_graph()) is None, " -> ".join(find_circle(import_graph()))


def test_the_circle_check_sees_a_circle():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


@pytest.mark.parametrize("path", sorted((PACKAGE / "models").glob("*.py")), ids=lambda p: p.name)
def test_model_loading_imports_point_down(path):
    if path.name == "__init__.py":
        assert imports(path) == set(), "specdec/models/__init__.py imports nothing (its torch-free modules stay so)"
        return
    mine = MODELS.index(path.stem)
    for target in imports(path):
        if target.startswith("specdec.models."):
            theirs = target.split(".")[2]
            assert MODELS.index(theirs) < mine, f"models.{path.stem} imports models.{theirs}, which comes after it"


@pytest.mark.parametrize("module", TORCH_FREE)
def test_torch_free_modules_import_no_torch(module):
    """Nor through any specdec module they import when imported (a function may import torch when it runs:
    converting the pair does)."""
    seen, todo = set(), [module]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        path = PACKAGE.parent / (current.replace(".", "/") + ".py")
        found = imports(path, at_import=True)
        assert not {target.split(".")[0] for target in found} & {"torch", "transformers"}, \
            f"{module} imports torch through {current}"
        todo.extend(target for target in found
                    if target.startswith("specdec.") and (PACKAGE.parent / target.replace(".", "/")).with_suffix(".py").exists())


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
