"""README.md and docs/ agree with the code: defaults, folders, columns, codecs, numbers, links."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import torch

from fedquant.codecs import available_codecs, get_codec
from simulations.history import run_dir_name
from simulations.settings import SimSettings

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
APP_DOC = (ROOT / "docs" / "app.md").read_text()
MEASURED = ROOT / "docs" / "measured"


def _table(text: str, header_start: str) -> list[list[str]]:
    """The rows (cells stripped) of the markdown table whose header line starts with ``header_start``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def _between(text: str, marker: str) -> str:
    return text.split(f"<!-- {marker} -->")[1].split(f"<!-- /{marker} -->")[0]


def test_the_first_screen_is_what_install_run_test_in_that_order():
    headings = re.findall(r"^## (.+)$", README, flags=re.M)
    assert headings[:3] == ["Install", "Run", "Test"]


def test_the_run_config_table_is_pyproject_toml():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    rows = _table(APP_DOC, "| key | default | meaning |")
    documented = {row[0].strip("`"): tomllib.loads(f"v = {row[1].strip('`')}")["v"] for row in rows}
    assert documented == config  # same keys, same defaults
    assert list(documented) == list(config)


def test_the_named_default_codec_is_the_apps():
    assert re.search(r"default codec \*\*`([^`]+)`\*\*", README).group(1) == SimSettings().codec


def test_the_results_folders_named_are_the_folders_written():
    default = f"results/{run_dir_name(SimSettings(), 2)}/"
    assert default in README and default in APP_DOC
    assert f"results/{run_dir_name(SimSettings(rounds=5), 20)}/" in APP_DOC


def test_the_documented_csv_columns_are_the_header_a_run_writes(tmp_path):
    from simulations.client_app import app as client_app
    from simulations.server_app import run_server
    from tests.flower_fakes import InProcessGrid

    history = run_server(InProcessGrid(client_app, 2), {}, rounds=1, local_epochs=1, min_local_steps=1,
                         out_dir=str(tmp_path))  # fmt: skip
    header = (history.folder / "history.csv").read_text().splitlines()[0].split(",")
    documented = re.findall(r"`([a-z0-9-]+)`", _between(APP_DOC, "history-csv-columns"))
    missing, extra = sorted(set(header) - set(documented)), sorted(set(documented) - set(header))
    assert documented == header, f"docs/app.md: add {missing}, remove {extra}, in the CSV's order"


def _codec_rows() -> list[list[str]]:
    return _table(README, "| codec | paper | unbiased | bits/param, large tensor | bits/param, digits CNN |")


def test_the_codec_table_lists_every_codec():
    names = [re.match(r"`([a-z0-9-]+)", row[0]).group(1) for row in _codec_rows()]
    assert names == available_codecs()


def _numbers(cell: str) -> list[float]:
    return [float(x) for x in re.findall(r"\d+(?:\.\d+)?", cell)]


def test_the_codec_tables_bits_are_measured():
    from benchmarks.codec_table import measure, model_update

    update = model_update("cnn")
    big = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))

    def large_tensor_bits(spec: str) -> float:
        return 8 * len(get_codec(spec).encode(big, seed=1)) / big.numel()

    for row in _codec_rows():
        name = re.match(r"`([a-z0-9-]+)", row[0]).group(1)
        large, cnn = row[3], row[4]
        if ":bits=B" in row[0]:  # eden, ecdq: "B + 0.03", "1.42 (B=1), 2.43 (B=2)"
            rates = re.findall(r"(\d+\.\d+) \(B=(\d+)\)", cnn)
            assert len(rates) >= 2, name
            for bits_cnn, b in rates:
                spec = f"{name}:bits={b}"
                assert large_tensor_bits(spec) == pytest.approx(int(b) + _numbers(large)[0], abs=0.01)
                assert measure(spec, update, SimSettings().min_numel)[0] == pytest.approx(float(bits_cnn), abs=0.006)
            continue
        assert large_tensor_bits(name) == pytest.approx(_numbers(large)[0], abs=0.01), name
        assert measure(name, update, SimSettings().min_numel)[0] == pytest.approx(_numbers(cnn)[0], abs=0.006), name


DEFAULT_RUN_DOCS = ("README.md", "docs/default-run.md")


@pytest.mark.slow  # one default run (Ray, 2 supernodes, 20 rounds): about 40 s on an idle machine
def test_the_default_runs_numbers_are_what_a_run_of_this_code_prints(tmp_path):
    from simulations.data import load_test_set
    from simulations.run import run_app

    history = run_app({"seed": 0, "out-dir": str(tmp_path)})  # README's command: the defaults, seed 0
    assert history.status == "finished" and history.rounds[-1]["round"] == SimSettings().rounds
    final = history.rounds[-1]["accuracy"]
    round_1 = next(r["accuracy"] for r in history.rounds if r["round"] == 1)
    total = len(load_test_set("digits"))
    for doc in DEFAULT_RUN_DOCS:
        text = (ROOT / doc).read_text()
        assert _numbers(_between(text, "default-accuracy")) == pytest.approx([final], abs=5e-5), doc
        assert _numbers(_between(text, "round-1-accuracy")) == pytest.approx([round_1], abs=5e-5), doc
        correct, of = _numbers(_between(text, "default-correct"))
        assert of == total and correct / total == pytest.approx(final, abs=1e-9), doc


def test_the_default_run_numbers_are_marked_for_that_check():
    for doc in DEFAULT_RUN_DOCS:
        text = (ROOT / doc).read_text()
        for marker in ("default-accuracy", "round-1-accuracy", "default-correct"):
            assert len(_numbers(_between(text, marker))) in (1, 2), (doc, marker)


def test_the_secure_aggregation_numbers_are_the_sweeps_and_the_benchmarks():
    section = README.split("## Secure aggregation")[1].split("\n## ")[0]
    sweep = {row[0]: row for row in _table((MEASURED / "secagg" / "sweep.md").read_text(), "| codec | bits/param |")}
    secure, dropped, plain = sweep["secagg"], sweep["secagg:dropouts=2"], sweep["fp32"]
    assert secure[-1] == dropped[-1] == plain[-1] == "0,1,2"  # three seeds each
    for cell in (secure[4], plain[4], secure[5], secure[1].split(" ")[0], plain[1].split(" ")[0],
                 dropped[1].split(" ")[0]):  # fmt: skip
        assert cell.replace("-", "") in section.replace("-", ""), cell
    benchmark = (ROOT / "docs" / "secure-aggregation.md").read_text()
    legacy = re.search(r"Flower legacy (\d+\.\d+)", benchmark).group(1)
    assert f"legacy SecAgg+: {legacy}" in section
    cnn, mlp = re.search(r"compressed: CNN (\d+\.\d+) .* 1M MLP (\d+\.\d+)", benchmark).groups()
    assert f"{cnn} bits/param on the CNN and {mlp} on a 1M-parameter MLP" in section


def test_the_compressed_secure_numbers_are_the_ray_benchmarks():
    section = README.split("## Secure aggregation")[1].split("\n## ")[0]
    measured = (MEASURED / "secagg" / "compressed-sweep.md").read_text()
    rows = {row[0]: row for row in _table(measured, "| arm | last-5 accuracy |")}
    secure = next(row for arm, row in rows.items() if arm.startswith("secagg:"))
    plain = rows["fp32"]
    assert "\nPASS\n" in measured and secure[3] == "within fp32's spread" and secure[-1] == plain[-1] == "0,1,2"
    guide = (ROOT / "docs" / "secure-aggregation.md").read_text()
    for cell in (secure[1], plain[1], secure[2], secure[5].split(" ")[0]):
        assert cell in section and cell in guide, cell


def test_the_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q\n" in ci and "python -m pytest -q                   # full suite" in README


LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))])
def test_relative_links_resolve(doc):
    path = ROOT / doc
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        assert resolved.exists(), f"{doc}: link to {target} (no such file)"
        if anchor and resolved.suffix == ".md":
            anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", resolved.read_text(), flags=re.M)}
            assert anchor in anchors, f"{doc}: link to {target} (no such heading)"
