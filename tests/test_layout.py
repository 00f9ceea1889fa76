"""One direction of imports: no circles in the library, its layers (packages) import downward
only, the model knows no technique, techniques know no loop, experiments import the library and
never each other (only their shared harness, ``experiments.common``). Read from the source
(module-level and function-level imports alike).
And no function in the library longer than a reader takes in at once (80 lines)."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The technique modules: each a transformation of a model, a gradient function or the data.
TECHNIQUES = ("techniques.lora", "techniques.fp8", "techniques.sparsity", "techniques.init",
              "techniques.remat", "techniques.stochastic_depth", "techniques.token_drop",
              "techniques.stacking", "techniques.pipeline", "step.precision", "data.sampling",
              "step.grads", "step.optim", "techniques.surgery")


def modules(package: str) -> dict[str, str]:
    """Every module of ``package`` by dotted name -> its file."""
    found = {}
    for folder, _, files in os.walk(os.path.join(ROOT, package)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def imports(path: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that the file at ``path`` imports, anywhere in it."""
    tree = ast.parse(open(path).read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            # ``from package import module`` imports the module (its package's __init__ runs
            # first whatever the spelling: not an edge of its own)
            subs = [f"{node.module}.{a.name}" for a in node.names]
            names = [s for s in subs if s in known] or [node.module]
        else:
            continue
        out |= {n for n in names if n in known}
    own = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
    return {n for n in out if not own.startswith(n + ".")}     # a module's own packages


GRAPH = {}
for package in ("jaxaccel", "experiments"):
    for name, path in modules(package).items():
        GRAPH[name] = path
EDGES = {name: imports(path, set(GRAPH)) - {name} for name, path in GRAPH.items()}


def cycle_from(start: str) -> list[str] | None:
    """A path from ``start`` back to itself, if there is one."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for nxt in EDGES.get(node, ()):
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, path + [nxt]))
    return None


def test_no_import_circles():
    circles = {" -> ".join(c) for name in sorted(GRAPH) if (c := cycle_from(name))}
    assert not circles, "\n".join(sorted(circles))


# The library's layers, lowest first: a package imports only from its own layer and those below
# (jaxaccel/__init__.py says what each holds). A reader knows from a file's folder what it may
# import.
LAYERS = ("core", "data", "model", "step", "techniques", "run", "outputs")


def layer(module: str) -> int:
    return LAYERS.index(module.split(".")[1])


def test_every_module_sits_in_a_layer():
    loose = [name for name in GRAPH if name.startswith("jaxaccel.")
             and name.split(".")[1] not in LAYERS]
    assert not loose, f"modules outside the layers' packages: {loose}"


def test_imports_run_downward_only():
    upward = sorted(f"{name} imports {other}" for name, edges in EDGES.items()
                    if name.startswith("jaxaccel.")
                    for other in edges if other.startswith("jaxaccel.")
                    and layer(other) > layer(name))
    assert not upward, "\n".join(upward)


def test_the_model_knows_no_technique():
    # sections declares every section (the techniques' too) and does no work: it stands on the
    # ground, importing only errors, settings and tokenizer
    ground = {"jaxaccel.core.errors", "jaxaccel.core.settings", "jaxaccel.core.tokenizer",
              "jaxaccel.core", "jaxaccel"}
    assert EDGES["jaxaccel.core.sections"] <= ground, EDGES["jaxaccel.core.sections"] - ground
    model = [n for n in GRAPH if n.startswith("jaxaccel.model")]
    assert not {e for n in model for e in EDGES[n] if layer(e) > layer(n)}
    assert EDGES["jaxaccel.model.nn"] <= {"jaxaccel.core.errors", "jaxaccel.core", "jaxaccel",
                                          "jaxaccel.model"}


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_techniques_know_no_loop_nor_config(technique):
    name = f"jaxaccel.{technique}"
    assert not {m for m in EDGES[name] if m.startswith(("jaxaccel.run", "experiments"))}


def techniques_named(path: str) -> set[str]:
    """The registered techniques (``jaxaccel.core.sections.TECHNIQUES``) the file at ``path``
    names: as an attribute (``cfg.token_drop``), a field path (``"token_drop.keep"``) or an
    import of the module that does its work."""
    from jaxaccel.core.sections import TECHNIQUES
    by_module = {t.module: t.name for t in TECHNIQUES} | {"jaxaccel.techniques.planner": "remat"}
    names, found = {t.name for t in TECHNIQUES}, set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Attribute) and node.attr in names:
            found.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                "." in node.value and node.value.partition(".")[0] in names:
            found.add(node.value.partition(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {by_module[m] for m in (node.module, *(f"{node.module}.{a.name}"
                                                            for a in node.names))
                      if m in by_module}
    return found


def test_the_config_and_the_loop_name_no_technique():
    # The config's technique sections come from the records, and the loop reaches each
    # technique through jaxaccel.techniques.registry: a run's growth (progressive stacking) and
    # a memory budget's choice (remat's policy) too.
    named = {name: techniques_named(path) for name, path in GRAPH.items()
             if name == "jaxaccel.run.config" or name.startswith("jaxaccel.run.loop")}
    assert not set().union(*named.values()), named


def test_experiments_import_the_library_never_each_other():
    for name, edges in EDGES.items():
        if name.startswith("experiments.") and name != "experiments.common":
            others = {m for m in edges if m.startswith("experiments.")} - {"experiments.common",
                                                                          "experiments"}
            assert not others, f"{name} imports {others}"
    assert not [m for m in EDGES if m.startswith("jaxaccel")
                and any(e.startswith("experiments") for e in EDGES[m])]


MAX_FUNCTION_LINES = 80


def long_functions(package: str, limit: int) -> list[str]:
    """``file: function, N lines`` for each function (a nested one counted in its parent too)
    of ``package`` longer than ``limit`` lines, decorators left out."""
    found = []
    for path in sorted(modules(package).values()):
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    found.append(f"{os.path.relpath(path, ROOT)}: {node.name}, {length} lines")
    return found


def test_no_function_is_longer_than_80_lines():
    # A function a reader takes in at once: a longer one is split by phase, each part named
    too_long = long_functions("jaxaccel", MAX_FUNCTION_LINES)
    assert not too_long, (f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(too_long))
