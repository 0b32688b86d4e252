"""The package's import structure: no import circles, and no arrow back up the layers.

Every ``import`` of a ``portarl`` module counts, at module level and inside functions alike:
a function-level import that closes a circle still ties the two modules together (a change
to one means reading the other), it only moves the failure from import time to call time.
An edge goes to the module an import names (``from portarl.a import b`` names ``portarl.a.b``
when that is a module, else ``portarl.a``); a package's ``__init__`` is a module of its own
when it is imported by name.

The layers, top to bottom (a module may import its own layer and any layer below):

1. ``cli``: the command line (``portarl/cli/``, ``__main__``);
2. ``bench``: benchmarks and the stability harness, which drive the trainer;
3. ``trainer``: the GRPO trainer (``portarl/trainer/``, with ``trainer/checkpoint/export.py``,
   which turns its checkpoints into a model directory) and the async rollout worker's entry
   point ``portarl/rollout/async_worker.py`` (the rollout process's main: it builds its
   engine and rewards from the run's :class:`~portarl.trainer.config.TrainConfig`, as the
   trainer does);
4. ``engines``: what the trainer drives: rollout engines (``rollout/``), multi-turn
   episodes (``multiturn/``), the parity harness (``parity/``) and the device-free
   algorithms (``core/``);
5. ``assets``: what a run is built from (``portarl/assets/``): models and tokenizers, LoRA,
   data, rewards and their runner; vision-language models and the images of their prompts
   (``portarl/vision/``); mixture-of-experts models and their routing (``portarl/moe/``);
6. ``runtime``: process-level plumbing (``portarl/runtime/``): the supervising parent and
   what it reads, signals, lifelines, process trees, the user-code guard, the distributed
   set-up and heartbeat, file modes, the errors raised across layers;
7. ``ops``: the public ops;
8. ``backends``, with devices and the numerics switches (``backends/device.py``,
   ``precision_switches.py``, ``emulation.py``, ``envinfo.py``);
9. ``kernels`` (Triton device code);
10. ``base``: ``portarl/__init__.py`` (the version, lazy re-exports and the old names of moved
    modules; imports nothing at module level).

The package's top level holds these folders and nothing loose: a new module goes into the
folder of its role (:func:`test_the_top_level_holds_only_the_packages_by_role`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "portarl"

LAYERS = ["cli", "bench", "trainer", "engines", "assets", "runtime", "ops", "backends", "kernels", "base"]

#: First matching prefix wins (so a module listed on its own comes before its package).
LAYER_OF_PREFIX = [
    ("portarl.rollout.async_worker", "trainer"),
    ("portarl.cli", "cli"),
    ("portarl.__main__", "cli"),
    ("portarl.bench", "bench"),
    ("portarl.trainer", "trainer"),
    ("portarl.rollout", "engines"),
    ("portarl.multiturn", "engines"),
    ("portarl.parity", "engines"),
    ("portarl.core", "engines"),
    ("portarl.assets", "assets"),
    ("portarl.vision", "assets"),
    ("portarl.moe", "assets"),
    ("portarl.runtime", "runtime"),
    ("portarl.ops", "ops"),
    ("portarl.backends", "backends"),
    ("portarl.kernels", "kernels"),
]


def layer_of(module: str) -> str:
    if module == "portarl":
        return "base"
    for prefix, layer in LAYER_OF_PREFIX:
        if module == prefix or module.startswith(prefix + "."):
            return layer
    raise AssertionError(f"{module}: no layer; put it in the package of its role, or add a package to LAYER_OF_PREFIX")


def modules(package: Path = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """``name -> (file, is_package)`` for every module of the package."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_package)
    return out


def _targets(module: str, is_package: bool, node: ast.AST, known: dict) -> list[str]:
    root = module.split(".")[0]
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        names = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]
    out = []
    for name in names:
        if name.split(".")[0] != root:
            continue
        while name not in known and "." in name:  # portarl.a.b.attr -> portarl.a.b
            name = name.rsplit(".", 1)[0]
        if name in known and name != module:
            out.append(name)
    return out


def import_graph(package: Path = PACKAGE) -> dict[str, dict[str, int]]:
    """``module -> {imported module: line of the first import}``: every import of the
    package's own modules, module level and function level."""
    known = modules(package)
    graph = {}
    for module, (path, is_package) in known.items():
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(module, is_package, node, known):
                    edges[target] = min(edges.get(target, node.lineno), node.lineno)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module (Tarjan), as a
    path ``a -> b -> ... -> a`` through it."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(_circle_in(graph, component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _circle_in(graph, component: set[str]) -> list[str]:
    """A shortest circle through the component's first module (breadth-first)."""
    start = min(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v]):
            if w == start:
                return paths[v] + [start]
            if w in component and w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    raise AssertionError("a strongly connected component without a circle")


def upward_arrows(graph: dict[str, dict[str, int]]) -> list[str]:
    rank = {name: i for i, name in enumerate(LAYERS)}
    return [f"{m} ({layer_of(m)}) imports {t} ({layer_of(t)}) at line {line}"
            for m, edges in sorted(graph.items()) for t, line in sorted(edges.items())
            if rank[layer_of(t)] < rank[layer_of(m)]]


def _describe(graph, circle: list[str]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(circle, circle[1:])) + f" -> {circle[-1]}"


def test_the_package_has_no_import_circle():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import circles (move the shared piece down a layer):\n" + "\n".join(
        _describe(graph, c) for c in found)


def test_no_import_runs_back_up_the_layers():
    arrows = upward_arrows(import_graph())
    assert not arrows, "imports against the layers (see this module's docstring):\n" + "\n".join(arrows)


def test_every_module_has_a_layer():
    for module in modules():
        assert layer_of(module) in LAYERS


#: ``portarl/`` by role: one package per layer (the engines' four, the assets' three), and the two files Python needs.
TOP_LEVEL = {"__init__.py", "__main__.py", "cli", "bench", "trainer", "rollout", "multiturn", "parity", "core",
             "assets", "vision", "moe", "runtime", "ops", "backends", "kernels"}


def test_the_top_level_holds_only_the_packages_by_role():
    """A newcomer reads the roles off the listing: no loose module grows back beside them."""
    entries = {p.name for p in PACKAGE.iterdir() if p.name != "__pycache__"}
    assert entries == TOP_LEVEL, (f"unexpected in portarl/: {sorted(entries - TOP_LEVEL)} (put each in the package "
                                  f"of its role: this module's docstring); missing: {sorted(TOP_LEVEL - entries)}")


def test_the_old_names_of_moved_modules_are_the_modules_themselves():
    """``portarl.models`` and the other names docs and users' code import still work, as the
    very module of the new home (portarl/__init__.py, MOVED), and nothing is left at an old path."""
    import importlib

    import portarl

    for old, new in portarl.MOVED.items():
        assert not (PACKAGE / (old.split(".", 1)[1] + ".py")).exists(), f"{old} is both moved and left"
        assert importlib.import_module(old) is importlib.import_module(new), old


def _write_package(root: Path, files: dict[str, str]) -> Path:
    package = root / "portarl"
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return package


def test_a_circle_through_a_function_level_import_is_found(tmp_path):
    """The check itself: a circle closed inside a function (the way circles hide) is
    reported with its path; the same package without it is clean."""
    files = {"__init__.py": "", "trainer/__init__.py": "", "trainer/a.py": "from portarl.trainer import b\n",
             "trainer/b.py": "def f():\n    from portarl.trainer.c import g\n",
             "trainer/c.py": "def g():\n    from . import a\n"}
    graph = import_graph(_write_package(tmp_path / "with", files))
    assert cycles(graph) == [["portarl.trainer.a", "portarl.trainer.b", "portarl.trainer.c", "portarl.trainer.a"]]
    files["trainer/c.py"] = "def g():\n    pass\n"
    assert cycles(import_graph(_write_package(tmp_path / "without", files))) == []


def test_an_arrow_up_the_layers_is_found(tmp_path):
    files = {"__init__.py": "", "ops/__init__.py": "def f():\n    from portarl.trainer.grpo import GRPOTrainer\n",
             "trainer/__init__.py": "", "trainer/grpo.py": "from portarl import ops\n"}
    arrows = upward_arrows(import_graph(_write_package(tmp_path, files)))
    assert arrows == ["portarl.ops (ops) imports portarl.trainer.grpo (trainer) at line 2"]


@pytest.mark.parametrize("importer, imported", [("runtime", "assets"), ("assets", "multiturn"), ("backends", "runtime"),
                                               ("runtime", "cli"), ("assets", "trainer")])
def test_an_arrow_up_between_the_packages_by_role_is_found(tmp_path, importer, imported):
    """The check between the new layers: a module low in the package importing one above."""
    files = {"__init__.py": "", f"{importer}/__init__.py": "", f"{imported}/__init__.py": "",
             f"{importer}/low.py": f"def f():\n    from portarl.{imported} import high\n", f"{imported}/high.py": ""}
    arrows = upward_arrows(import_graph(_write_package(tmp_path, files)))
    assert arrows == [f"portarl.{importer}.low ({layer_of('portarl.' + importer)}) imports portarl.{imported}.high "
                      f"({layer_of('portarl.' + imported)}) at line 2"]


@pytest.mark.parametrize("module, layer", [("portarl.cli.train", "cli"), ("portarl.bench.step", "bench"),
                                           ("portarl.rollout.async_worker", "trainer"),
                                           ("portarl.trainer.checkpoint.export", "trainer"),
                                           ("portarl.rollout.hf", "engines"), ("portarl.assets.models", "assets"),
                                           ("portarl.vision.images", "assets"),
                                           ("portarl.runtime.distributed", "runtime"),
                                           ("portarl.backends.device", "backends"), ("portarl.runtime.errors", "runtime"),
                                           ("portarl", "base")])
def test_layer_names(module, layer):
    assert layer_of(module) == layer


# ---------------------------------------------------------------- the trainer's private attributes
#: The only module that may touch a private attribute of the trainer object.
TRAINER_MODULE = PACKAGE / "trainer" / "grpo.py"
#: Where the trainer is used: the package, the repository's benchmarks and examples, the tests.
TRAINER_USERS = [PACKAGE, PACKAGE.parent / "bench", PACKAGE.parent / "examples", PACKAGE.parent / "tests"]
#: The names the trainer object goes by outside grpo.py: ``trainer`` (every phase function's
#: parameter), ``x.trainer`` (an object holding it), and the class itself (an unbound method).
_TRAINER_NAMES = {"trainer", "GRPOTrainer"}


def _is_trainer(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id in _TRAINER_NAMES) or (
        isinstance(node, ast.Attribute) and node.attr == "trainer")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_trainer_accesses(path: Path) -> list[str]:
    """``trainer._x``, ``self.trainer._x``, ``GRPOTrainer._x`` and ``getattr(trainer, "_x")``
    (also ``setattr``, ``hasattr``, ``delattr``) in ``path``, as ``file:line: text``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        name = None
        if isinstance(node, ast.Attribute) and _is_trainer(node.value) and _private(node.attr):
            name = node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
              and _is_trainer(node.args[0]) and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and _private(node.args[1].value)):
            name = node.args[1].value
        if name is not None:
            found.append((node.lineno, f"{path}:{node.lineno}: {name}"))
    return [text for _, text in sorted(found)]


def test_no_module_reaches_into_the_trainers_private_attributes():
    """The phases take the trainer's public state (documented on :class:`GRPOTrainer`) and
    return explicit values; only grpo.py touches what is private to it."""
    files = [p for root in TRAINER_USERS if root.exists() for p in sorted(root.rglob("*.py"))
             if p != TRAINER_MODULE and p != Path(__file__).resolve()]
    found = [hit for p in files for hit in private_trainer_accesses(p)]
    assert not found, "private attributes of the trainer used outside trainer/grpo.py:\n" + "\n".join(found)


def test_a_private_trainer_access_is_found(tmp_path):
    phase = tmp_path / "phase.py"
    phase.write_text("def run(trainer, step):\n    trainer.step = step\n    n = trainer._offset\n"
                     "    self.trainer._rollout.close()\n    getattr(trainer, '_warned', False)\n"
                     "    GRPOTrainer._stop(trainer)\n    trainer.__class__\n    other._x\n")
    assert private_trainer_accesses(phase) == [f"{phase}:{line}: {name}" for line, name in [
        (3, "_offset"), (4, "_rollout"), (5, "_warned"), (6, "_stop")]]
