"""The install story: the checkout is the product, so a wheel carries the dependencies and no module."""
import os
import subprocess
import sys
import zipfile

import pytest

from project import modules

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    ROOT], check=True, timeout=300, capture_output=True)
    (whl,) = [p for p in out.iterdir() if p.suffix == ".whl"]
    return zipfile.ZipFile(whl)


@pytest.mark.slow
def test_wheel_installs_no_module(wheel):
    """No top-level name (data, model, distributed, evaluate, ...) can reach site-packages."""
    outside = [n for n in wheel.namelist() if ".dist-info/" not in n]
    assert outside == [], f"the wheel installs {outside}"
    top_level = [n for n in wheel.namelist() if n.endswith(".dist-info/top_level.txt")]
    assert all(not wheel.read(n).strip() for n in top_level)


@pytest.mark.slow
def test_wheel_carries_the_dependencies(wheel):
    (meta,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    requires = [line.split(":", 1)[1].strip() for line in wheel.read(meta).decode().splitlines()
                if line.startswith("Requires-Dist:")]
    names = {r.split(";")[0].split(">")[0].split("=")[0].split("<")[0].strip() for r in requires}
    assert {"torch", "datasets", "tokenizers", "tqdm", "numpy"} <= names
    assert any(r.startswith("safetensors") and "extra == \"hf\"" in r for r in requires)


@pytest.mark.slow
def test_every_module_of_the_checkout_imports_from_it():
    """The modules that the wheel leaves out are whole in the checkout: each imports from the root."""
    mods = sorted(modules())
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    r = subprocess.run([sys.executable, "-c", code, *mods], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode == 0, r.stderr[-2000:]
    assert {"training.loop", "training.step", "data_pipeline.loader", "data_pipeline.mixture", "train_fsdp", "train_2d"} <= set(mods)
