"""The FlowerTune-style LoRA example (``examples/flowertune-lora``), run from its folder with ``flwr run``.

A SuperLink and two SuperNodes on 127.0.0.1 (the harness of ``tests/e2e/test_deployment.py``) run
the example for two rounds on a tiny Llama (2 layers, hidden 32, 5 pre-training steps, cached in
a temporary folder), with ``eden:bits=1`` on the uplink. The test reads the history the example's
ServerApp wrote: every round's replies were admitted, FlowerTune's byte count of the replies
(``ArrayRecord.count_bytes()`` where they cross the Grid) equals fedquant's ``uplink-bytes``, the
adapters went down as float32 and came back over 8x smaller, and the validation loss is finite.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.e2e.test_deployment import NUM_NODES, RUN_TIMEOUT_S, Deployment
from tests.timeouts import wait_while_progressing

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flowertune-lora"
ROUNDS = 2
TINY = (
    f"num-server-rounds={ROUNDS} fraction-train=1.0 local-steps=2 batch-size=4 tiny-hidden=32 tiny-layers=2 "
    'tiny-heads=2 seq-len=32 pretrain-steps=5 lora-r=32 lora-targets="q_proj,v_proj" codec="eden:bits=1"'
)


@pytest.fixture(scope="module")
def history(tmp_path_factory) -> dict:
    running = Deployment(tmp_path_factory.mktemp("flowertune-lora"))
    running.env["FLOWERTUNE_LORA_CACHE"] = str(running.tmp_path / "cache")
    out_dir = running.tmp_path / "results"
    try:
        running.start()
        running.flwr("run", str(EXAMPLE), "fq-test", "--run-config", f'{TINY} out-dir="{out_dir}" run-name="tiny"')
        path = out_dir / "tiny" / "history.json"
        wait_while_progressing(path.exists, RUN_TIMEOUT_S, "the LoRA example's run to finish", running.logs)
        return json.loads(path.read_text())
    finally:
        running.shutdown()


def test_two_rounds_of_lora_fine_tuning_from_the_example_folder(history):
    rounds = history["rounds"]
    assert [row["round"] for row in rounds] == list(range(ROUNDS + 1))  # 0: the base model, fresh adapters
    assert all(math.isfinite(row["val-loss"]) for row in rounds)
    # 2 layers x (q_proj, v_proj) x (lora_A 32x32, lora_B 32x32): 8 tensors of 1,024 float32, each
    # as large as fedquant's default min-numel, so all are encoded
    numel = 2 * 2 * 2 * 32 * 32
    for row in rounds[1:]:
        assert row["rejected-replies"] == 0
        assert row["flowertune-uplink-bytes"] == row["uplink-bytes"]  # the same ArrayRecords, counted twice
        assert row["flowertune-downlink-bytes"] > NUM_NODES * numel * 4  # float32 adapters (+ .npy headers, keys)
        assert row["uplink-bytes-dense"] == row["flowertune-downlink-bytes"]  # same adapters, same keys
        assert row["flowertune-uplink-bytes"] * 8 < row["uplink-bytes-dense"]  # 1 bit a weight + envelopes
    assert rounds[-1]["flowertune-cumulative-uplink-bytes"] == sum(r["flowertune-uplink-bytes"] for r in rounds[1:])
    assert history["run-config"]["codec"] == "eden:bits=1" and history["run-config"]["tiny-hidden"] == 32
