"""The codec sweep over seeds: statistics, the table, the figures, resuming, progress, and seeds honoured.

Most tests run the sweep's ServerApp loop (``run_plan``) on the in-process grid of
``tests.flower_fakes`` (the real ServerApp and ClientApp code, no Ray); one slow test runs it
through Flower's simulation engine.
"""

from __future__ import annotations

import csv
import json
import logging
import math

import pytest

from simulations.plots import pareto_frontier, sweep_figure
from simulations.settings import RunConfigError
from simulations.sweep import RunStore, SweepPlan, load_sweep, parse_seeds, run_plan, run_sweep, split_codecs
from simulations.sweep_stats import Interval, RunSummary, codec_rows, markdown_table, summarize_run, t_quantile
from tests.flower_fakes import InProcessGrid

TIMING = {"elapsed-seconds", "encode-seconds", "decode-seconds"}
# 4 digits clients, 2 sampled per round, 2 short rounds: seconds per run on the in-process grid.
SMALL = {"rounds": 2, "fraction_train": 0.5, "local_epochs": 1, "min_local_steps": 2}


def _grid(nodes: int = 4) -> InProcessGrid:
    from simulations.client_app import app as client_app

    return InProcessGrid(client_app, nodes)


def _untimed(rows):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def test_split_codecs_keeps_parameters_with_their_codec():
    text = "fp32, qsgd:levels=4,bucket_size=512,ef+signsgd,orq:levels=4"
    assert split_codecs(text) == ["fp32", "qsgd:levels=4,bucket_size=512", "ef+signsgd", "orq:levels=4"]


def test_parse_seeds():
    assert parse_seeds("0,1,2") == [0, 1, 2] and parse_seeds("3-5,1,3") == [3, 4, 5, 1]
    for bad in ("", "a", "-1", "1,x"):
        with pytest.raises(ValueError, match="seed"):
            parse_seeds(bad)


def _rows(accuracies, bytes_per_round=100, bits=4.0, **extra):
    rows = [{"round": 0, "accuracy": 0.1}]
    for i, a in enumerate(accuracies, 1):
        rows.append({"round": i, "accuracy": a, "uplink-bytes": bytes_per_round, "uplink-bytes-dense": 800,
                     "bits-per-param": bits, **extra})  # fmt: skip
    return rows


def test_summarize_run_totals_last_k_and_target():
    rows = _rows([0.5, 0.4, 0.7, 0.6, 0.8], **{"simulated-upload-seconds": 2.0})
    rows[2]["uplink-bytes"], rows[2]["bits-per-param"] = 300, 12.0
    s = summarize_run("x", 3, rows, last_k=2, target=0.65)
    assert s.final_accuracy == 0.8 and s.last_k_accuracy == pytest.approx(0.7) and s.rounds == 5
    assert s.uplink_bytes == 700 and s.dense_bytes == 4000
    assert s.bits_per_param == pytest.approx((4 * 400 + 12 * 300) / 700)  # byte-weighted
    assert (s.rounds_to_target, s.bytes_to_target, s.seconds_to_target) == (3, 500, 6.0)
    never = summarize_run("x", 3, rows, last_k=2, target=0.9)
    assert never.rounds_to_target is None and never.bytes_to_target is None
    assert summarize_run("x", 3, _rows([0.5]), last_k=1, target=0.1).seconds_to_target is None  # no link profile
    with pytest.raises(ValueError, match="no round"):
        summarize_run("x", 0, rows[:1], last_k=1, target=None)


def test_a_run_is_diverged_only_when_it_ends_diverged():
    # The server flags each round; a one-round collapse that recovers is told apart from a run that ends diverged.
    dip = _rows([0.5, 0.7, 0.1, 0.6, 0.75])
    for r, flag in zip(dip, [0, 0, 0, 1, 0, 0]):
        r["diverged"] = flag
    ends = _rows([0.5, 0.7, 0.1, 0.1])
    for r, flag in zip(ends, [0, 0, 0, 1, 1]):
        r["diverged"] = flag
    runs = [summarize_run("dip", 0, dip, last_k=2, target=None), summarize_run("ends", 0, ends, last_k=2, target=None)]
    assert (runs[0].diverged, runs[0].collapsed_rounds) == (False, 1)
    assert (runs[1].diverged, runs[1].collapsed_rounds) == (True, 2)
    text = markdown_table(codec_rows(runs), last_k=2, target=None)
    assert "| 0; 1 collapsed and recovered |" in text and "| 0; 1 diverged |" in text


def test_interval_is_students_t():
    assert t_quantile(2) == pytest.approx(4.3027, abs=1e-4) and t_quantile(29) == pytest.approx(2.0452, abs=1e-4)
    iv = Interval.of([0.70, 0.72, 0.74])
    assert iv.mean == pytest.approx(0.72) and iv.half == pytest.approx(4.3027 * 0.02 / math.sqrt(3), rel=1e-4)
    assert math.isnan(Interval.of([0.5]).half) and Interval.of([]).n == 0
    assert iv.contains(0.75) and not iv.contains(0.78)


def _summary(codec, seed, last_k, mb=1.0, nested=None):
    return RunSummary(codec, seed, 10, last_k, last_k, mb * 1e6, 8e6, 4.0, 5, mb * 5e5, None, nested, False, 0, 1.0)


def test_codec_rows_pair_by_seed_and_judge_against_fp32():
    runs = [_summary("fp32", s, a) for s, a in enumerate([0.80, 0.82, 0.81])]
    runs += [_summary("close", s, a - 0.003) for s, a in enumerate([0.80, 0.82, 0.81])]
    runs += [_summary("far", s, a - 0.10) for s, a in enumerate([0.80, 0.82, 0.81])]
    runs += [_summary("ndqsg", s, 0.8, nested=0.0) for s in range(3)]
    rows = {r.codec: r for r in codec_rows(runs, {"broken": ["seed 0: ValueError: boom"]})}
    assert rows["fp32"].verdict == "reference" and rows["close"].verdict == "within fp32's spread"
    assert rows["far"].verdict == "below fp32's spread"
    # Paired differences are the same every seed: the interval of the difference has zero width.
    assert rows["far"].delta.mean == pytest.approx(-0.10) and rows["far"].delta.half == pytest.approx(0, abs=1e-12)
    assert rows["broken"].last_k.n == 0 and rows["broken"].errors
    text = markdown_table(list(rows.values()), last_k=5, target=0.7)
    lines = text.strip().splitlines()
    assert len({line.count("|") for line in lines}) == 1  # every row has every column
    assert "0.0 (all DQSG)" in text and "failed: seed 0: ValueError: boom" in text
    assert "| far | 4.00 ± 0.00 | 1.000 ± 0.000 |" in text


def test_pareto_frontier_keeps_what_no_cheaper_point_beats():
    points = [(1.0, 0.5), (2.0, 0.4), (3.0, 0.7), (0.5, 0.2), (4.0, 0.7), (5.0, 0.9)]
    assert pareto_frontier(points) == [(0.5, 0.2), (1.0, 0.5), (3.0, 0.7), (5.0, 0.9)]


def test_codec_styles_stay_distinct_and_black_is_the_reference_alone():
    from simulations.plots import codec_style

    styles = [codec_style(i) for i in range(40)]
    assert len({(s["color"], s["marker"]) for s in styles}) == 40  # a figure of 40 codecs tells them all apart
    assert styles[0]["color"] == "#000000" and all(s["color"] != "#000000" for s in styles[1:])


def test_the_figure_holds_every_codec_with_band_and_frontier(tmp_path):
    def curve(base, n=6, mb=0.1, seconds=True):
        return [{"round": r, "accuracy": base + 0.05 * r, "cumulative-uplink-bytes": mb * r * 1e6,
                 **({"simulated-upload-seconds": 1.5} if seconds else {})} for r in range(1, n + 1)]  # fmt: skip

    curves = {"fp32": {0: curve(0.5, mb=1.0), 1: curve(0.52, mb=1.0)}, "signsgd": {0: curve(0.3), 1: curve(0.34)}}
    fig = sweep_figure(curves, "Synthetic(α=0.5, β=0.5), 2 seeds", target=0.7)
    left, right = fig.axes
    labels = [line.get_label() for line in left.get_lines()]
    assert labels[:2] == ["fp32 (2 seeds)", "signsgd (2 seeds)"] and "Pareto frontier" in labels
    assert left.get_xscale() == "log" and right.get_xlabel().startswith("simulated time")
    fp32 = left.get_lines()[0]
    assert list(fp32.get_ydata()) == pytest.approx([0.51 + 0.05 * r for r in range(1, 7)])  # mean of the seeds
    assert list(right.get_lines()[0].get_xdata()) == pytest.approx([1.5 * r for r in range(1, 7)])
    assert len(left.collections) == 2  # one shaded interval per codec
    colours = {line.get_color() for line in left.get_lines()[:2]}
    markers = {line.get_marker() for line in left.get_lines()[:2]}
    assert len(colours) == 2 and len(markers) == 2
    legend = fig.legends[0]
    assert legend.get_bbox_to_anchor().x0 >= fig.bbox.x1 - 1  # outside the axes, right of the figure
    untimed = sweep_figure({"fp32": {0: curve(0.5, seconds=False)}})
    assert untimed.axes[1].get_xlabel() == "round"
    from simulations.plots import plot_sweep

    paths = plot_sweep(curves, tmp_path / "sweep", "t")
    assert paths["png"].read_bytes()[:4] == b"\x89PNG" and paths["pdf"].read_bytes()[:4] == b"%PDF"


def test_a_sweep_with_a_codec_that_cannot_run_fails_before_any_run(tmp_path):
    plan = SweepPlan(("fp32", "qsgd:levels=4", "nope", "ef+ndqsg"), (0, 1), tmp_path, last_k=2, overrides=SMALL)
    grid = _grid()
    with pytest.raises(RunConfigError) as err:
        run_plan(grid, {}, plan)
    assert len(err.value.problems) == 2 and "unknown codec 'nope'" in str(err.value) and "ef+ndqsg" in str(err.value)
    assert not grid.sent and not list(tmp_path.rglob("*.json"))  # nothing ran, nothing stored
    with pytest.raises(RunConfigError):
        run_sweep(["fp32", "nope"], out=tmp_path, seeds=(0,), **SMALL)  # before Ray starts


def test_a_sweep_writes_table_records_and_figures(tmp_path, flwr_log, no_history_figure):
    plan = SweepPlan(("fp32", "qsgd:levels=4"), (0, 1), tmp_path, last_k=2, table=tmp_path / "table.md",
                     overrides=SMALL)  # fmt: skip
    result = run_plan(_grid(), {}, plan)
    assert [r.codec for r in result.rows] == ["fp32", "qsgd:levels=4"]
    fp32, qsgd = result.rows
    assert fp32.seeds == [0, 1] and fp32.last_k.n == 2 and 31 < fp32.bits_per_param.mean < 36
    assert qsgd.bits_per_param.mean < 6 and qsgd.uplink_mb.mean < fp32.uplink_mb.mean / 5
    for name in ("sweep.md", "sweep.csv", "sweep.png", "sweep.pdf", "sweep-uplink.png", "table.md", "table.png",
                 "table.pdf", "table-uplink.png"):  # fmt: skip
        assert (tmp_path / name).stat().st_size > 0, name
    assert "| qsgd:levels=4 |" in (tmp_path / "table.md").read_text()
    assert "](table.png)" in (tmp_path / "table.md").read_text()
    with (tmp_path / "sweep.csv").open() as fh:
        lines = list(csv.DictReader(fh))
    assert [(r["codec"], r["seed"]) for r in lines[:4]] == [("fp32", "0"), ("qsgd:levels=4", "0"), ("fp32", "1"),
                                                            ("qsgd:levels=4", "1")]  # fmt: skip
    # Same seed, same clients and initial model across codecs; another seed, another sample.
    store = RunStore(tmp_path)
    records = {(c, s): json.loads(store.path(c, s).read_text()) for c in ("fp32", "qsgd:levels=4") for s in (0, 1)}
    assert records["fp32", 0]["sampled"] == records["qsgd:levels=4", 0]["sampled"]
    assert records["fp32", 0]["rounds"][0]["accuracy"] == records["qsgd:levels=4", 0]["rounds"][0]["accuracy"]
    assert records["fp32", 0]["sampled"] != records["fp32", 1]["sampled"]
    progress = [r.getMessage() for r in flwr_log if "ETA" in r.getMessage()]
    assert any("qsgd:levels=4 seed 1: round 2/2" in m for m in progress)


def test_an_interrupted_sweep_resumes_without_rerunning_finished_runs(tmp_path, no_figures):
    plan = SweepPlan(("fp32", "signsgd"), (0, 1), tmp_path, last_k=1, overrides=SMALL)
    first = run_plan(_grid(), {}, plan)
    store = RunStore(tmp_path)
    store.path("signsgd", 1).unlink()  # as if the sweep had stopped during its last run
    grid = _grid()
    second = run_plan(grid, {}, plan)
    trained = {m.metadata.dst_node_id for m in grid.sent if m.metadata.message_type == "train"}
    assert len([m for m in grid.sent if m.metadata.message_type == "train"]) == 2 * 2  # one run: 2 rounds x 2
    assert trained  # and only that run trained
    a, b = ({(r.codec, r.seed): r for r in x.runs} for x in (first, second))
    assert a.keys() == b.keys() and all(a[k].final_accuracy == b[k].final_accuracy for k in a)
    # Changed settings do not reuse stored runs.
    other = SweepPlan(("fp32",), (0,), tmp_path, last_k=1, overrides={**SMALL, "learning_rate": 0.01})
    assert load_sweep(other).errors == {"fp32": ["seed 0: no finished run"]}
    assert store.clear() == 4 and not list(store.folder.glob("*"))


def test_seeds_are_honoured(tmp_path, no_figures):
    from simulations.server_app import run_server

    config = {"codec": "qsgd:levels=4", "rounds": 3, "fraction-train": 0.4, "local-epochs": 1, "min-local-steps": 2}
    histories = [run_server(_grid(5), config, seed=seed, out_dir=str(tmp_path), run_name=f"r{i}")
                 for i, seed in enumerate((7, 7, 8))]  # fmt: skip
    same, again, other = histories
    assert _untimed(same.rounds) == _untimed(again.rounds) and float(same.rounds[-1]["quantization-mse"]) > 0

    def sampled(history):
        return [(c["round"], c["partition-id"]) for c in history.clients]

    assert sampled(same) == sampled(again)
    assert sampled(same) != sampled(other) and len(sampled(other)) == 3 * 2
    assert same.rounds[0]["accuracy"] != other.rounds[0]["accuracy"]  # another initial model


def test_error_feedback_residuals_never_leak_into_the_next_federation(tmp_path, no_figures):
    # A sweep runs its federations on the same nodes. A node first sampled after round 1 of the
    # second run must not add the residual it kept from the first: the same run twice is identical.
    from simulations.server_app import run_server

    config = {"codec": "ef+signsgd", "rounds": 4, "fraction-train": 0.4, "local-epochs": 1, "min-local-steps": 2}
    grid = _grid(5)
    first, second = (run_server(grid, config, seed=3, out_dir=str(tmp_path), run_name=f"r{i}") for i in range(2))
    rounds = {}
    for c in first.clients:
        rounds.setdefault(c["partition-id"], []).append(c["round"])
    assert any(min(r) > 1 for r in rounds.values())  # some node joins late: the case that leaked
    assert _untimed(first.rounds) == _untimed(second.rounds)


def test_the_secure_arm_runs_beside_codecs_and_survives_a_dropout(tmp_path, no_figures):
    every = {**SMALL, "fraction_train": 1.0}  # 4 of 4 clients: 3 survive one dropout, above 0.6 x 4
    plan = SweepPlan(("secagg", "secagg:dropouts=1,bits=4", "qsgd:levels=4"), (0,), tmp_path, last_k=1,
                     overrides=every)  # fmt: skip
    result = run_plan(_grid(), {}, plan)
    assert not result.errors and [r.codec for r in result.rows] == list(plan.codecs)
    rounds = {c: json.loads(RunStore(tmp_path).path(c, 0).read_text())["rounds"][1:] for c in plan.codecs}  # trained
    secure, dropping = rounds["secagg"], rounds["secagg:dropouts=1,bits=4"]
    assert [r["secagg-survivors"] for r in secure] == [4, 4]
    assert [(r["secagg-survivors"], r["secagg-dropped-after-sharing"]) for r in dropping] == [(3, 1)] * 2
    # secagg-bits is the field width (quantizer bits + headroom for the sum): 2 more bits, 2 wider.
    assert [r["secagg-bits"] - s["secagg-bits"] for r, s in zip(dropping, secure)] == [2, 2]
    assert all("secagg-survivors" not in r for r in rounds["qsgd:levels=4"])
    assert all(math.isfinite(r["accuracy"]) and r["uplink-bytes"] > 0 for rs in rounds.values() for r in rs)
    with pytest.raises(RunConfigError, match="secagg-bitz"):
        run_plan(_grid(), {}, SweepPlan(("secagg:bitz=4",), (0,), tmp_path, overrides=every))


@pytest.mark.slow
def test_small_sweep_through_the_simulation_engine(tmp_path):
    # Ray, 4 virtual clients: two codecs and the secure arm (its advertise/share-keys rounds too).
    result = run_sweep(["fp32", "qsgd:levels=4", "secagg"], out=tmp_path, seeds=(0, 1), num_supernodes=4, last_k=1,
                       **{**SMALL, "fraction_train": 1.0})  # fmt: skip
    assert not result.errors and [len(r.seeds) for r in result.rows] == [2, 2, 2]
    assert (tmp_path / "sweep.png").stat().st_size > 0 and (tmp_path / "sweep.pdf").stat().st_size > 0
    assert "| qsgd:levels=4 |" in (tmp_path / "sweep.md").read_text()


def test_progress_lines_name_codec_seed_round_and_eta(flwr_log):
    from simulations.sweep import Progress

    progress = Progress(runs=4, rounds=10, pending=2)
    hook = progress.hook(3, "qsgd", 1)
    hook({"round": 0, "accuracy": 0.1})  # the initial model: not a trained round
    hook({"round": 1, "accuracy": 0.5})
    lines = [r.getMessage() for r in flwr_log if r.levelno == logging.INFO and "[sweep 3/4]" in r.getMessage()]
    assert len(lines) == 1 and "qsgd seed 1: round 1/10, accuracy 0.5000" in lines[0] and "ETA" in lines[0]
    assert progress.done == 1 and progress.left == 20


@pytest.mark.parametrize(("preset", "shape", "classes"), [("femnist", (28, 28), 62), ("cifar10", (32, 32, 3), 10)])
def test_hub_presets_run_on_local_data_of_their_shape(tmp_path, preset, shape, classes):
    # FEMNIST and CIFAR-10 need internet; the same settings on a local dataset of the same image shape.
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("flwr_datasets")
    import numpy as np
    from PIL import Image

    from simulations.server_app import run_server
    from simulations.sweep import PRESETS

    rng = np.random.default_rng(0)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=classes)})
    (tmp_path / "data" / "data").mkdir(parents=True)
    for split, n in (("train", 2 * classes), ("test", 20)):
        images = [Image.fromarray(rng.integers(0, 256, size=shape, dtype=np.uint8)) for _ in range(n)]
        table = datasets.Dataset.from_dict(
            {"image": images, "label": [i % classes for i in range(n)]}, features=features
        )
        table.to_parquet(str(tmp_path / "data" / "data" / f"{split}-00000-of-00001.parquet"))
    overrides = {**PRESETS[preset].overrides, "dataset": f"hf:{tmp_path / 'data'}", "rounds": 1, "fraction_train": 1.0,
                 "local_epochs": 1, "min_local_steps": 1}  # fmt: skip
    history = run_server(_grid(3), {}, out_dir=str(tmp_path / "runs"), run_name=preset, **overrides)
    final = history.rounds[-1]
    assert final["round"] == 1 and 0 <= final["accuracy"] <= 1 and final["uplink-bytes"] > 0
    assert history.settings.model == PRESETS[preset].overrides["model"]


@pytest.mark.parametrize(
    ("model", "label"),
    [("resnet18", "ResNet-18"), ("cnn:dtype=float16", "CNN (dtype=float16)"), ("mlp", "MLP")],
)
def test_a_sweep_describes_every_model_the_app_offers(model, label):
    from simulations.settings import SimSettings
    from simulations.sweep import describe

    text = describe(SimSettings(model=model), 4, [0, 1, 2])
    assert f", {label}, 4 clients" in text
