"""The package's structure, from its source (AST; nothing is imported):

* ``mlx_qwen_fast/config.py`` is the only module that reads or writes the
  environment (``os.environ``, ``os.getenv``, ``os.putenv``, ``os.unsetenv``,
  also imported by name);
* ``mlx_qwen_fast/kernels/`` imports nothing from ``mlx_qwen_fast.ops``
  (kernels are leaves below the op families that dispatch to them);
* no module of the package is longer than :data:`MAX_LINES` lines (a
  longer one holds more than one concept: split it by concept).
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mlx_qwen_fast"
MODULES = sorted(PACKAGE.rglob("*.py"))
ENV_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}
MAX_LINES = 600


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _tree(path: Path) -> ast.AST:
    return ast.parse(path.read_text(), filename=str(path))


def environment_uses(tree: ast.AST):
    """(line, what) of every use of the environment in ``tree``: ``os.X`` for
    X in ENV_NAMES (any alias of ``os``), and ``from os import X``."""
    os_aliases = {"os"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "os":
                    os_aliases.add(a.asname or "os")
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            for a in node.names:
                if a.name in ENV_NAMES or a.name == "*":
                    found.append((node.lineno, f"from os import {a.name}"))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in ENV_NAMES
                and isinstance(node.value, ast.Name) and node.value.id in os_aliases):
            found.append((node.lineno, f"{node.value.id}.{node.attr}"))
    return found


def imported_modules(tree: ast.AST, module: str, is_package: bool):
    """Absolute names of every module ``tree`` imports (relative imports
    resolved against ``module``), with the line."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            out.append((node.lineno, target))
            out += [(node.lineno, f"{target}.{a.name}") for a in node.names]  # `from pkg import module`
    return out


def test_the_checks_can_fail():
    """Guards of the checks themselves."""
    uses = environment_uses(ast.parse(
        "import os as o\nfrom os import getenv\nx = o.environ.get('A')\no.putenv('B', '1')\n"))
    assert sorted(w for _, w in uses) == ["from os import getenv", "o.environ", "o.putenv"]
    assert environment_uses(ast.parse("import os\npath = os.path.join('a', 'b')\n")) == []
    mods = [m for _, m in imported_modules(ast.parse("from ..ops import moe\nfrom . import _cuda_build\n"),
                                           "mlx_qwen_fast.kernels.moe_routing", False)]
    assert "mlx_qwen_fast.ops.moe" in mods and "mlx_qwen_fast.kernels._cuda_build" in mods


def test_modules_found():
    names = {_module_name(p) for p in MODULES}
    assert {"mlx_qwen_fast.config", "mlx_qwen_fast.kernels.moe_routing", "mlx_qwen_fast.ops.moe"} <= names


@pytest.mark.parametrize("path", MODULES, ids=_module_name)
def test_only_config_touches_the_environment(path):
    if _module_name(path) == "mlx_qwen_fast.config":
        return
    uses = environment_uses(_tree(path))
    assert not uses, (f"{path.relative_to(PACKAGE.parent)} uses the environment directly "
                      f"({', '.join(f'line {n}: {w}' for n, w in uses)}); read it through mlx_qwen_fast.config")


@pytest.mark.parametrize("path", sorted((PACKAGE / "kernels").rglob("*.py")), ids=_module_name)
def test_kernels_import_nothing_from_ops(path):
    name = _module_name(path)
    bad = [(n, m) for n, m in imported_modules(_tree(path), name, path.name == "__init__.py")
           if m == "mlx_qwen_fast.ops" or m.startswith("mlx_qwen_fast.ops.")]
    assert not bad, f"{name} imports from mlx_qwen_fast.ops: " + ", ".join(f"line {n}: {m}" for n, m in bad)


@pytest.mark.parametrize("path", MODULES, ids=_module_name)
def test_modules_stay_short(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, (f"{path.relative_to(PACKAGE.parent)} has {n} lines (at most {MAX_LINES}): "
                            "split it by concept, as ops/decoder.py, ops/layer_plans.py and ops/model_plan.py are")
