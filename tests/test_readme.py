"""README.md and docs/ agree with the code: defaults, folders, columns, codecs, numbers, links."""

from __future__ import annotations

import json
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
    assert len(README.splitlines()) < 150  # a front page; the rest lives in docs/


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


def test_the_default_runs_accuracy_is_what_the_measured_runs_wrote():
    from simulations.data import load_test_set

    claimed = _numbers(_between(README, "default-accuracy"))
    claimed_round_1 = _numbers(_between(README, "round-1-accuracy"))
    *correct, total = _numbers(_between(README, "default-correct"))
    finals, round_1 = [], []
    for seed in range(len(claimed)):
        saved = json.loads((MEASURED / run_dir_name(SimSettings(seed=seed), 2) / "history.json").read_text())
        assert saved["status"] == "finished" and saved["num-nodes"] == 2
        expected = {**SimSettings.defaults(), "seed": seed, "out-dir": "docs/measured"}
        # The default run, nothing else changed; keys added after the run (secure aggregation,
        # the data-parallel mode, both off by default) are absent from its stored settings.
        added = expected.keys() - saved["settings"].keys()
        later = ("mode", "server-momentum", "clients-per-round")  # the data-parallel mode, off by default
        assert all(key.startswith("secagg") or key in later for key in added), added
        assert saved["settings"] == {key: value for key, value in expected.items() if key not in added}
        finals.append(saved["rounds"][-1]["accuracy"])
        round_1.append(next(r["accuracy"] for r in saved["rounds"] if r["round"] == 1))
    assert len(claimed) >= 3 and claimed == pytest.approx(finals, abs=5e-5)
    assert claimed_round_1 == pytest.approx(round_1, abs=5e-5)
    assert total == len(load_test_set("digits"))
    assert [c / total for c in correct] == pytest.approx(finals, abs=1e-9)  # the test digits right, per seed


def test_the_secure_aggregation_numbers_are_the_sweeps_and_the_benchmarks():
    section = README.split("## Secure aggregation")[1].split("\n## ")[0]
    sweep = {row[0]: row for row in _table((MEASURED / "secagg" / "sweep.md").read_text(), "| codec | bits/param |")}
    secure, dropped, plain = sweep["secagg"], sweep["secagg:dropouts=2"], sweep["fp32"]
    assert secure[-1] == dropped[-1] == plain[-1] == "0,1,2"  # three seeds each
    for cell in (secure[4], plain[4], secure[5], secure[1].split(" ")[0], plain[1].split(" ")[0],
                 dropped[1].split(" ")[0]):  # fmt: skip
        assert cell.replace("-", "") in section.replace("-", ""), cell
    benchmark = (ROOT / "docs" / "secure-aggregation.md").read_text()
    legacy = re.search(r"Flower legacy (\d+\.\d+) \(", benchmark).group(1)
    assert f"legacy SecAgg+: {legacy}" in section


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
