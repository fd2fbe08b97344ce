"""The package's layout rules, read from the source (AST only; no torch import needed):

1. no import cycle between longstraw's modules (function-level and `if TYPE_CHECKING:`
   imports count: a lazy or type-only import hides a cycle, it does not remove it);
2. layers: ops/, state/ and parallel/deal.py never import models/ or engine/; parallel/
   never imports engine/; plan/ imports neither torch nor any longstraw module outside
   plan/ but the torch-free parallel/deal.py and defaults.py;
3. no module imports another module's `_private` name;
4. a function-level import is only for an optional dependency (never a longstraw module;
   the CLI alone imports its torch commands when they run, so `longstraw plan` needs no torch);
5. no function over 80 lines, no module over 500.

Each rule is also run on a small made-up package that breaks it, so the test is seen to
fail when a rule is broken.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 500
OPTIONAL = {"trl", "peft", "accelerate", "datasets", "matplotlib", "numpy", "tqdm", "psutil", "fla"}
"""Optional dependencies: a function-level import of one of these is fine."""
TORCH_FREE_FOR_PLAN = {"parallel.deal", "defaults", "errors"}


@dataclass
class Module:
    name: str  # dotted, relative to the package: "engine.engine", "" for the package itself
    path: str
    lines: int
    imports: list = field(default_factory=list)  # (target module, imported names, lazy?)
    functions: list = field(default_factory=list)  # (qualified name, lines)


def read_package(root: str, package: str = "longstraw") -> dict[str, Module]:
    """Every module under `root` (the package directory), with its imports resolved to
    dotted names relative to the package, and its functions' lengths."""
    modules = {}
    for folder, _, files in os.walk(root):
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.join(folder, f)
            rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
            name = rel[: -len("__init__")].rstrip(".") if rel.endswith("__init__") else rel
            src = open(path).read()
            tree = ast.parse(src)
            mod = Module(name, path, len(src.splitlines()))
            here = name.split(".") if name else []
            pkg = here if f == "__init__.py" else here[:-1]
            lazy_lines = set()
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    mod.functions.append((node.name, node.end_lineno - node.lineno + 1))
                    for sub in ast.walk(node):
                        if isinstance(sub, (ast.Import, ast.ImportFrom)):
                            lazy_lines.add(sub.lineno)
            for node in ast.walk(tree):  # every import, `if TYPE_CHECKING:` ones too
                lazy = getattr(node, "lineno", None) in lazy_lines
                if isinstance(node, ast.ImportFrom):
                    if node.level:
                        base = pkg[: len(pkg) - node.level + 1]
                        target = ".".join(base + ([node.module] if node.module else []))
                        mod.imports.append((target, [a.name for a in node.names], lazy))
                    else:
                        mod.imports.append(("!" + (node.module or ""), [a.name for a in node.names], lazy))
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        mod.imports.append(("!" + a.name, [], lazy))
            modules[name] = mod
    # absolute imports of the package itself become relative names
    for mod in modules.values():
        fixed = []
        for target, names, lazy in mod.imports:
            if target.startswith("!" + package + ".") or target == "!" + package:
                target = target[len(package) + 2:]
            fixed.append((target, names, lazy))
        mod.imports = fixed
    return modules


def _internal(target: str, names: list, modules: dict) -> list[str]:
    """The package modules an import statement pulls in (`from . import x` may name modules)."""
    if target.startswith("!"):
        return []
    submodules = [f"{target}.{n}".lstrip(".") for n in names if f"{target}.{n}".lstrip(".") in modules]
    whole = target in modules and len(submodules) < len(names)  # names taken from the module itself
    return ([target] if whole else []) + submodules


def import_cycles(modules: dict) -> list[list[str]]:
    graph = {m: set() for m in modules}
    for name, mod in modules.items():
        for target, names, _ in mod.imports:
            for dep in _internal(target, names, modules):
                if dep != name and not name.startswith(dep + ".") and dep != "":
                    graph[name].add(dep)
    cycles, state = [], {}

    def visit(u, stack):
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                cycles.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v, stack)
        stack.pop()
        state[u] = 2

    for u in sorted(graph):
        if u not in state:
            visit(u, [])
    return cycles


def _in(name: str, room: str) -> bool:
    return name == room or name.startswith(room + ".")


def layer_violations(modules: dict) -> list[str]:
    out = []
    for name, mod in modules.items():
        for target, names, _ in mod.imports:
            deps = _internal(target, names, modules)
            if any(_in(name, low) for low in ("ops", "state", "parallel.deal")):
                out += [f"{name} imports {d}" for d in deps if _in(d, "models") or _in(d, "engine")]
            if _in(name, "parallel"):
                out += [f"{name} imports {d}" for d in deps if _in(d, "engine")]
            if _in(name, "plan"):
                if target in ("!torch",) or target.startswith("!torch."):
                    out.append(f"{name} imports torch")
                out += [f"{name} imports {d}" for d in deps
                        if not _in(d, "plan") and d not in TORCH_FREE_FOR_PLAN]
    return out


def private_imports(modules: dict) -> list[str]:
    out = []
    for name, mod in modules.items():
        for target, names, _ in mod.imports:
            if target.startswith("!") and not target.startswith("!longstraw"):
                continue
            out += [f"{name} imports {target}.{n}" for n in names
                    if n.startswith("_") and not n.startswith("__") and target != name]
    return out


LAZY_ALLOWED = {"cli"}
"""Modules whose function-level imports stand: the CLI imports torch and the engine only in
the commands that load a model, so `longstraw plan` runs without torch."""


def lazy_internal_imports(modules: dict) -> list[str]:
    out = []
    for name, mod in modules.items():
        for target, names, lazy in mod.imports:
            if not lazy or name in LAZY_ALLOWED:
                continue
            top = target.lstrip("!").split(".")[0]
            if not target.startswith("!"):
                out.append(f"{name}: lazy import of {target or 'the package'}")
            elif top not in OPTIONAL and top not in _STDLIB:
                out.append(f"{name}: lazy import of {target[1:]}")
    return out


_STDLIB = {"os", "sys", "json", "math", "time", "re", "io", "csv", "subprocess", "tempfile", "pathlib",
           "contextlib", "datetime", "argparse", "random", "signal", "shutil", "platform", "hashlib",
           "itertools", "functools", "collections", "dataclasses", "typing", "warnings", "logging",
           "inspect", "struct", "weakref", "threading", "traceback", "ctypes", "resource", "socket"}


def too_long(modules: dict) -> list[str]:
    out = [f"{m.name}: {m.lines} lines" for m in modules.values() if m.lines > MAX_MODULE_LINES]
    out += [f"{m.name}.{f}: {n} lines" for m in modules.values() for f, n in m.functions if n > MAX_FUNCTION_LINES]
    return out


RULES = {"cycles": import_cycles, "layers": layer_violations, "private": private_imports,
         "lazy": lazy_internal_imports, "length": too_long}


@pytest.fixture(scope="module")
def package():
    return read_package(os.path.join(REPO, "longstraw"))


@pytest.mark.parametrize("rule", sorted(RULES))
def test_the_package_keeps_the_rule(package, rule):
    assert RULES[rule](package) == []


# ----------------------------------------------------------------------------
# each rule, broken once in a made-up package


BROKEN = {
    "cycles": {"a.py": "from .b import x\n", "b.py": "def f():\n    from .a import y\n"},
    "layers": {"ops/__init__.py": "", "ops/k.py": "from ..models import base\n",
               "models/__init__.py": "", "models/base.py": ""},
    "private": {"a.py": "from .b import _helper\n", "b.py": "def _helper():\n    pass\n"},
    "lazy": {"a.py": "def f():\n    from .b import g\n", "b.py": "def g():\n    pass\n"},
    "length": {"a.py": "def f():\n" + "    x = 1\n" * (MAX_FUNCTION_LINES + 1)},
}


@pytest.mark.parametrize("rule", sorted(BROKEN))
def test_a_broken_rule_is_caught(tmp_path, rule):
    root = tmp_path / "pkg"
    for rel, text in {"__init__.py": "", **BROKEN[rule]}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    assert RULES[rule](read_package(str(root), "pkg")) != []


def test_plan_may_not_import_torch(tmp_path):
    root = tmp_path / "pkg"
    (root / "plan").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "plan" / "__init__.py").write_text("import torch\n")
    assert layer_violations(read_package(str(root), "pkg")) == ["plan imports torch"]


def test_a_type_only_import_cycle_is_caught(tmp_path):
    """`train` <-> `train_budget` was such a circle: an import under `if TYPE_CHECKING:`
    runs for the type checker, and the two modules still cannot be read one without the other."""
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "a.py").write_text("from .b import x\n")
    (root / "b.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .a import A\n")
    assert import_cycles(read_package(str(root), "pkg")) == [["a", "b", "a"]]
