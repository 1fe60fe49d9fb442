"""The import graph (issues 21 and 34): contract/ at the bottom, router/ and workers/ side by side, audit/ on contract/
alone, lab/ (the instruments) imported by scripts/ and the tests alone, no cycle between packages, and no cycle between
modules; the tests import neither scripts/ nor each other (what they share is in tests/helpers/).

Every import statement of every module is read with `ast` (top-level and inside functions alike, plus
`importlib.import_module("...")` with a literal name), so a lazy import counts as an edge too.
Run it as a script to print the edges: `.venv/bin/python tests/test_import_graph.py`.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("contract", "harness", "router", "workers", "audit", "lab", "scripts")


def imported_names(tree: ast.AST, package: str) -> list[tuple[str, int]]:
    """(dotted module name, line) of every import in a module; relative imports resolve into its own package."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((package if node.level else node.module or "", node.lineno))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__")))):
            found.append((node.args[0].value, node.lineno))
    return found


def package_edges() -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> the 'path:line' sites of that edge, for packages that differ."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for name, line in imported_names(tree, package):
                target = name.split(".")[0]
                if target in PACKAGES and target != package:
                    edges[(package, target)].append(f"{path.relative_to(REPO)}:{line}")
    return dict(edges)


EDGES = package_edges()


def sites(source: str, target: str) -> list[str]:
    return EDGES.get((source, target), [])


def test_the_graph_is_read():
    assert ("harness", "contract") in EDGES  # the walk finds imports at all


def test_contract_imports_none_of_the_other_packages():
    assert {t: s for (p, t), s in EDGES.items() if p == "contract"} == {}


def test_router_and_workers_do_not_import_each_other():
    assert sites("router", "workers") == []
    assert sites("workers", "router") == []


def test_audit_imports_only_contract():
    assert {t: s for (p, t), s in EDGES.items() if p == "audit" and t != "contract"} == {}


def test_no_cycle_between_packages():
    graph = defaultdict(set)
    for source, target in EDGES:
        graph[source].add(target)
    done: set[str] = set()

    def cycle_from(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        for nxt in sorted(graph[node]):
            found = cycle_from(nxt, path + [node])
            if found:
                return found
        done.add(node)
        return None

    for package in PACKAGES:
        cycle = cycle_from(package, [])
        assert cycle is None, " -> ".join(cycle) + f": {sites(cycle[0], cycle[1])}"


if __name__ == "__main__":
    for (source, target), where in sorted(EDGES.items()):
        print(f"{source} -> {target}  ({len(where)} imports, e.g. {where[0]})")
    sys.exit(0)


def module_edges() -> dict[str, set[str]]:
    """First-party module -> the first-party modules it imports (a package's own __init__ aside)."""
    modules = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            if "_generated" in path.parts:
                continue
            name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            modules[name] = path
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and target not in PACKAGES:
                    edges[name].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_detection_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_two_modules_import_each_other_even_lazily():
    assert cycles(module_edges()) == []


# workers/ in layers, top to bottom (issues 21 and 34): every module of workers/ has a layer and imports only modules of
# layers below its own, with no exemption. From the top: the engine served and simulated
# (serve, sim); the engine (engine.py) over the interfaces it declares (engine_api.py); what runs a step (executor) and
# the checkpoint writers; what makes a request's sequence (inputs) and reads the checkpoint's tensors (weights); the
# model; its parallel layout; the scheduling core, the checkpoint's configs, request options, sampling; the foundation.
WORKER_LAYERS = {
    "serve": 8, "sim": 8,
    "engine": 7,
    "engine_api": 6, "random_checkpoint": 6,
    "executor": 5, "quantized_checkpoint": 5,
    "inputs": 4, "weights": 4,
    "model": 3,
    "parallel": 2,
    "core": 1, "model_config": 1, "request_options": 1, "sampler": 1,
    "config": 0, "grammar": 0, "host_copy": 0, "kv_cache": 0, "checkpoint_quant": 0, "tiny_checkpoint": 0,
}


def worker_layer(module: str) -> str | None:
    """The layer (WORKER_LAYERS' key) of a module of workers/: its subpackage or its top-level file."""
    parts = module.split(".")
    return parts[1] if parts[0] == "workers" and len(parts) > 1 and parts[1] in WORKER_LAYERS else None


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    """The imports between modules of workers/ that do not go to a lower layer."""
    upward = []
    for source, targets in sorted(edges.items()):
        a = worker_layer(source)
        for target in sorted(targets):
            b = worker_layer(target)
            if a and b and a != b and WORKER_LAYERS[a] <= WORKER_LAYERS[b]:
                upward.append(f"{source} -> {target}")
    return upward


def test_the_layer_check_finds_an_import_that_goes_up_or_sideways():
    # the back-arrow issue 34 removed (the model read its config from the checkpoint reader), and two engine runners
    assert upward_imports({"workers.model.text": {"workers.weights", "workers.model.layers"},
                           "workers.sim.engine": {"workers.serve.async_engine", "workers.engine"}}) == [
        "workers.model.text -> workers.weights", "workers.sim.engine -> workers.serve.async_engine"]


def test_every_module_of_workers_has_a_layer():
    assert sorted(m for m in module_edges() if m.startswith("workers.") and worker_layer(m) is None) == []


def test_workers_layers_import_only_downward():
    assert upward_imports(module_edges()) == []


# lab/ holds the instruments (benches, tuners, the planner, the peak finder, the soak, issue 34): scripts/ and tests
# import it, no product package does.
def lab_importers(edges: dict[tuple[str, str], list[str]]) -> list[str]:
    """The 'path:line' sites where a package other than lab/ and scripts/ imports lab/."""
    return sorted(site for (source, target), where in edges.items()
                  if target == "lab" and source not in ("lab", "scripts") for site in where)


def test_the_lab_check_finds_a_product_package_that_imports_lab():
    assert lab_importers({("harness", "lab"): ["harness/cli.py:3"], ("scripts", "lab"): ["scripts/a.py:1"],
                          ("lab", "harness"): ["lab/peak/cli.py:5"]}) == ["harness/cli.py:3"]


def test_no_package_but_lab_and_scripts_imports_lab():
    assert lab_importers(EDGES) == []


# Tests import the packages and tests/helpers/: never scripts/ (a test runs a script as a process of its own) and never
# another test file (what two files share lives in tests/helpers/).
TEST_MODULES = {path.stem for path in (REPO / "tests").glob("test_*.py")}


def forbidden_test_imports(sources: dict[str, str], test_modules: set[str]) -> list[str]:
    """'path:line name' of every import in `sources` (path -> text) of scripts/ or of a module in `test_modules`."""
    found = []
    for path, text in sorted(sources.items()):
        tree = ast.parse(text, filename=path)
        names = imported_names(tree, "tests")
        names += [(f"{node.module}.{alias.name}", node.lineno) for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and node.module and not node.level for alias in node.names]
        for name, line in names:
            parts = name.split(".")
            if parts[0] == "scripts" or test_modules & set(parts):
                found.append(f"{path}:{line} {name}")
    return sorted(set(found))


def test_the_test_import_check_finds_scripts_and_other_test_files():
    source = ("from scripts import tune_fp8\nimport scripts.bench_fp8\nfrom test_b import helper\n"
              "from tests import test_b\nfrom tests.helpers.image_fixtures import png\nimport lab.bench.engine\n")
    assert forbidden_test_imports({"tests/test_a.py": source}, {"test_a", "test_b"}) == [
        "tests/test_a.py:1 scripts", "tests/test_a.py:1 scripts.tune_fp8", "tests/test_a.py:2 scripts.bench_fp8",
        "tests/test_a.py:3 test_b", "tests/test_a.py:3 test_b.helper", "tests/test_a.py:4 tests.test_b"]


def test_no_test_imports_scripts_or_another_test_file():
    sources = {str(path.relative_to(REPO)): path.read_text(encoding="utf-8")
               for path in (REPO / "tests").rglob("*.py")}
    assert forbidden_test_imports(sources, TEST_MODULES) == []
