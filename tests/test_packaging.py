"""The wheel ships its data (presets, GPU targets, model shapes): build it, install it away from the
source tree, load every preset from there.

An editable install reads the source tree, so only an installed wheel shows whether package data is
declared right (it was not: `--config` failed on every non-editable install).
"""

import shutil
import subprocess
import sys
from pathlib import Path

import jaxserve

ROOT = Path(__file__).resolve().parents[1]
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]

CHECK = """
import sys
import jaxserve
from jaxserve.config import EngineConfig, preset_names

assert jaxserve.__file__.startswith(sys.argv[1]), jaxserve.__file__  # the installed copy, not the source
for name in preset_names():
    EngineConfig.from_preset(name)
# The GPU targets and bundled model shapes that `jaxserve compile` reads (no jax needed for either).
from jaxserve.device import TARGETS, target_facts
from jaxserve.model_configs import BUNDLED_SHAPES, bundled_config_values
assert all(target_facts(t).num_sms for t in TARGETS)
assert all(bundled_config_values(name)["vocab_size"] for name in BUNDLED_SHAPES)
print(" ".join(preset_names()))
"""


def test_an_installed_wheel_loads_every_preset(tmp_path):
    # Build from a copy: an in-tree build would leave build/ and egg-info beside the sources.
    source = tmp_path / "source"
    shutil.copytree(ROOT / "jaxserve", source / "jaxserve",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    wheels, target, elsewhere = tmp_path / "wheels", tmp_path / "installed", tmp_path / "elsewhere"
    elsewhere.mkdir()

    build = subprocess.run([*PIP, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(wheels),
                            str(source)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    (wheel,) = wheels.glob("jaxserve-*.whl")
    assert wheel.name.startswith(f"jaxserve-{jaxserve.__version__}-")
    install = subprocess.run([*PIP, "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr

    check = subprocess.run([sys.executable, "-c", CHECK, str(target)], capture_output=True, text=True,
                           timeout=120, cwd=elsewhere, env={"PYTHONPATH": str(target), "PATH": ""})
    assert check.returncode == 0, check.stderr
    bundled = sorted(p.stem for p in (ROOT / "jaxserve" / "configs").glob("*.yaml"))
    assert check.stdout.split() == bundled
