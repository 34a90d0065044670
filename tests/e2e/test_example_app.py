"""fedquant as a user's dependency: the built wheel, installed into a fresh virtual environment that
already holds a newer torch, runs ``examples/quickstart-pytorch`` (Flower's quickstart shape).

Needs a package index (pip's configured one) for the wheel's dependencies. ``FEDQUANT_TEST_TORCH``
names the torch the environment starts with (default ``torch==2.15.0``, the newest release; pip's
constraint file of this machine is lifted for that one command with ``PIP_CONSTRAINT=/dev/null``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "quickstart-pytorch"
TORCH = os.environ.get("FEDQUANT_TEST_TORCH", "torch==2.15.0")
APP_ONLY = ("ray", "torchvision", "scikit-learn", "matplotlib")

RUN_EXAMPLE = """
import json, sys
import fedquant, torch
from flwr.simulation import run_simulation
from pytorchexample.client_app import app as client_app
from pytorchexample.server_app import app as server_app

run_simulation(server_app=server_app, client_app=client_app, num_supernodes=2,
               backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0}})
print(json.dumps({"fedquant": fedquant.__file__, "version": fedquant.__version__, "torch": torch.__version__}))
"""


def _run(args: list, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{args[:4]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", dist, ROOT], timeout=600)
    (built,) = dist.glob("fedquant-*.whl")
    return built


@pytest.mark.slow
def test_the_wheel_holds_only_the_library_with_ranges_not_pins(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")} == {"fedquant"}
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert f"\nVersion: {version}\n" in metadata
    requires = re.findall(r"^Requires-Dist: (.+)$", metadata, flags=re.M)
    plain = [r for r in requires if "extra ==" not in r]
    for name in ("torch", "flwr"):
        (spec,) = [r for r in plain if re.match(rf"{name}\b", r)]
        assert "==" not in spec and ">=" in spec, spec
    assert not [r for r in plain if re.match(rf"({'|'.join(APP_ONLY)})\b", r) or "[simulation]" in r], plain
    assert any(r.startswith("flwr[simulation]") and "extra == 'app'" in r for r in requires)


@pytest.mark.slow
def test_the_example_app_runs_on_the_wheel_beside_the_users_newer_torch(wheel, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv])  # no system site-packages: only what pip installs
    pip, python = venv / "bin" / "pip", venv / "bin" / "python"
    env = {**os.environ, "PIP_CONSTRAINT": "/dev/null", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYTHONPATH", None)
    _run([pip, "install", "-q", TORCH], env=env, timeout=1200)
    before = _run([python, "-c", "import torch; print(torch.__version__)"], env=env).stdout.strip()
    _run([pip, "install", "-q", wheel, "flwr[simulation]"], env=env, timeout=1200)  # the example's other need

    app = tmp_path / "app"
    shutil.copytree(EXAMPLE, app, ignore=shutil.ignore_patterns("__pycache__"))
    run_env = {**env, "PYTHONPATH": str(app), "FEDQUANT_KERNELS": "twin", "FEDQUANT_CACHE_DIR": str(tmp_path / "cache")}
    done = _run([python, "-c", RUN_EXAMPLE], cwd=app, env=run_env, timeout=900)
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["torch"] == before and before.startswith(TORCH.split("==")[-1])  # the user's torch stayed
    assert summary["fedquant"].startswith(str(venv))  # the installed wheel, not the source tree
    rounds = re.findall(r"round (\d+): (\d+) uplink bytes, (\d+\.\d)x", done.stdout)
    assert [int(r[0]) for r in rounds] == [1, 2, 3]
    assert all(float(ratio) > 4 for _, _, ratio in rounds)  # eden:bits=2 against float32 (small tensors go dense)
    assert (app / "final_model.pt").exists()
