"""The package's arrows point down: api -> engine -> runner -> models -> ops. Every import in a module,
at the top or inside a function, is checked: a layer imports nothing above it, and the runner takes from
the engine only the records that cross between them (`engine/step_io.py`)."""

import ast
from pathlib import Path

import pytest

import jaxserve

PACKAGE = Path(jaxserve.__file__).parent
LAYERS = ("api", "engine", "runner", "models", "ops")  # top to bottom
ALLOWED_UP = {("runner", "jaxserve.engine.step_io")}  # (layer, module it may import from a layer above)


def imported_modules(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return [name for name in names if name.startswith("jaxserve.")]


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


@pytest.mark.parametrize("layer", LAYERS)
def test_no_layer_imports_a_layer_above(layer: str):
    above = LAYERS[: LAYERS.index(layer)]
    wrong = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for module in imported_modules(path):
            target = layer_of(module)
            if target in above and not any(module.startswith(ok) for lay, ok in ALLOWED_UP if lay == layer):
                wrong.append(f"{path.relative_to(PACKAGE.parent)} imports {module}")
    assert not wrong, "\n".join(sorted(set(wrong)))


def test_step_io_imports_no_layer():
    """The records module stands alone: the scheduler's side imports it, the runner imports nothing else
    of the engine (that it imports no jax is checked with the scheduler's purity)."""
    modules = imported_modules(PACKAGE / "engine" / "step_io.py")
    assert all(layer_of(m) is None for m in modules), modules


def test_the_check_sees_an_upward_import(tmp_path: Path):
    """The checker itself: a function-level import of the scheduler is caught."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from jaxserve.engine.scheduler import Scheduler\n")
    assert "jaxserve.engine.scheduler" in imported_modules(module)
    assert layer_of("jaxserve.engine.scheduler") == "engine"
