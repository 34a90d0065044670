"""Multi-node simulation: a Ray cluster of two nodes on this machine, ``flwr run`` spreading clients over both.

    python benchmarks/multinode.py                      # 8 clients, 2 rounds, all sampled each round
    python benchmarks/multinode.py --clients 20 --rounds 3 --keep-logs

Recipe (what it does, every server bound to 127.0.0.1, every process stopped by PID at the end):

1. ``ray start --head --node-ip-address=127.0.0.1 --port=P --num-cpus=1 --resources='{"fq-head": 1}'
   --temp-dir=<own dir> --block`` and ``ray start --address=127.0.0.1:P --node-ip-address=127.0.0.1
   --num-cpus=1 --resources='{"fq-worker": 1}' --block``: two Ray nodes with separate resources
   (on real machines the second command runs on the second machine, with its own IP). The own
   ``--temp-dir`` keeps other users' ``ray.init()`` from attaching to this cluster.
2. ``flower-superlink --simulation --insecure --host 127.0.0.1 --port L`` started with
   ``RAY_ADDRESS=127.0.0.1:P`` in its environment. Its simulation process calls ``ray.init()``,
   which attaches to the cluster named by ``RAY_ADDRESS`` instead of starting a local Ray: flwr
   1.42's backend config ``init-args`` only takes ``num-cpus``, ``num-gpus``, ``logging-level``
   and ``log-to-driver`` in the federation config (``run_simulation``'s Python
   ``backend_config={"init_args": {"address": ...}}`` takes any ``ray.init`` argument). Flower
   sizes its actor pool from every alive node (``ray.nodes()``), one actor per
   ``client-resources-num-cpus`` of each node, and Ray places one actor on each node.
3. ``flwr run . mn --federation-config "num-supernodes=N client-resources-num-cpus=1"`` with
   ``FLWR_HOME`` set to an own folder whose ``config.toml`` names that SuperLink, so no other
   local SuperLink (Flower's managed one listens on 127.0.0.1:39091 whatever ``FLWR_HOME`` is) is used.
4. Every client reports ``ray-node-id`` (and host, pid) in its ``client-info``; the script reads
   them from the run's ``history.json`` and exits 1 unless clients ran on both nodes and the
   run finished.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.local_processes import free_port, port_open, stop, tails, wait_for  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
START_TIMEOUT_S = 120


def cluster_nodes(address: str) -> dict[str, str]:
    """Alive Ray nodes of the cluster at ``address``: node id -> ``head`` / ``worker`` (by custom resource)."""
    import ray

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        nodes = {}
        for node in ray.nodes():
            if node["Alive"]:
                roles = [role for role in ("head", "worker") if f"fq-{role}" in node["Resources"]]
                nodes[node["NodeID"]] = roles[0] if roles else "?"
        return nodes
    finally:
        ray.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--flwr-home", default="/tmp/flwr-b2", help="own Flower home (config.toml, logs)")
    parser.add_argument("--run-timeout", type=float, default=600)
    parser.add_argument("--keep-logs", action="store_true", help="print where the logs are instead of deleting them")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="fq-multinode-"))
    ray_tmp = Path(tempfile.mkdtemp(prefix="ray-mn-", dir="/tmp"))  # short: Ray's socket paths must stay < 108 chars
    flwr_home = Path(args.flwr_home)
    flwr_home.mkdir(parents=True, exist_ok=True)
    gcs_port, link_port = free_port(), free_port()
    ray_address = f"127.0.0.1:{gcs_port}"
    (flwr_home / "config.toml").write_text(
        f'[superlink]\ndefault = "mn"\n\n[superlink.mn]\naddress = "127.0.0.1:{link_port}"\ninsecure = true\n'
    )
    env = dict(os.environ)
    env.update(
        FLWR_HOME=str(flwr_home),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
        RAY_ADDRESS=ray_address,
        RAY_USAGE_STATS_ENABLED="0",
        PATH=os.pathsep.join([str(BIN), env.get("PATH", "")]),
    )
    logs: dict[str, Path] = {}
    pids: list[int] = []

    def start(name: str, command: list[str]) -> None:
        logs[name] = work / f"{name}.log"
        with logs[name].open("w") as log:
            proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=work)
        pids.append(proc.pid)
        print(f"started {name} (pid {proc.pid}): {' '.join(command)}", flush=True)

    ok = False
    t0 = time.perf_counter()
    try:
        ray_start = [str(BIN / "ray"), "start", "--block", "--node-ip-address=127.0.0.1", "--num-cpus=1"]
        start("ray-head", [*ray_start, "--head", f"--port={gcs_port}", "--resources", '{"fq-head": 1}',
                           "--include-dashboard=false", f"--temp-dir={ray_tmp}", "--disable-usage-stats"])  # fmt: skip
        wait_for(lambda: port_open(gcs_port), START_TIMEOUT_S, "the Ray head", logs)
        start("ray-worker", [*ray_start, f"--address={ray_address}", "--resources", '{"fq-worker": 1}'])
        nodes: dict[str, str] = {}

        def two_nodes() -> bool:
            nodes.clear()
            nodes.update(cluster_nodes(ray_address))
            return sorted(nodes.values()) == ["head", "worker"]

        wait_for(two_nodes, START_TIMEOUT_S, "both Ray nodes", logs)
        print(f"Ray cluster at {ray_address}: {nodes} ({time.perf_counter() - t0:.0f} s)", flush=True)

        start("superlink", [str(BIN / "flower-superlink"), "--simulation", "--insecure", "--host", "127.0.0.1",
                            "--port", str(link_port)])  # fmt: skip
        wait_for(lambda: port_open(link_port), START_TIMEOUT_S, "the SuperLink", logs)
        out_dir = work / "results"
        run_config = (
            f'dataset="synthetic" model="logreg" rounds={args.rounds} fraction-train=1.0 local-epochs=1 '
            f'out-dir="{out_dir}" run-name="multinode"'
        )
        federation = f"num-supernodes={args.clients} client-resources-num-cpus=1"
        command = [str(BIN / "flwr"), "run", str(REPO), "mn", "--stream", "--run-config", run_config,
                   "--federation-config", federation]  # fmt: skip
        print("running:", " ".join(command), flush=True)
        logs["flwr-run"] = work / "flwr-run.log"
        with logs["flwr-run"].open("w") as log:
            subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, timeout=args.run_timeout)
        history_path = out_dir / "multinode" / "history.json"
        wait_for(history_path.exists, 60, "the run's history.json", logs)
        history = json.loads(history_path.read_text())
        placements = Counter(nodes.get(str(c.get("ray-node-id")), "unknown") for c in history["clients"])
        processes = Counter((nodes.get(str(c.get("ray-node-id")), "unknown"), c.get("pid")) for c in history["clients"])
        final = history["rounds"][-1]
        print("| round | clients | on head | on worker | accuracy | uplink kB |")
        print("|---:|---:|---:|---:|---:|---:|")
        for row in history["rounds"][1:]:
            here = [c for c in history["clients"] if c["round"] == row["round"]]
            on = Counter(nodes.get(str(c.get("ray-node-id")), "unknown") for c in here)
            print(f"| {row['round']} | {len(here)} | {on['head']} | {on['worker']} | {row['accuracy']:.4f} | "
                  f"{row.get('uplink-bytes', 0) / 1e3:.1f} |")  # fmt: skip
        print(f"client executions per node: {dict(placements)}; per (node, pid): {dict(processes)}")
        print(f"final accuracy {final['accuracy']:.4f}; wall time {time.perf_counter() - t0:.0f} s")
        ok = placements["head"] > 0 and placements["worker"] > 0 and set(placements) <= {"head", "worker"}
        ok = ok and len(history["rounds"]) == args.rounds + 1
        if not ok:
            print(f"FAILED: clients did not run on both Ray nodes (or the run is incomplete)\n{tails(logs)}")
    except (TimeoutError, subprocess.TimeoutExpired) as err:
        print(f"FAILED: {err}\n{tails(logs)}")
    finally:
        stop(reversed(pids))  # SuperLink (and its simulation process), then the Ray worker and head
        shutil.rmtree(ray_tmp, ignore_errors=True)
        if args.keep_logs:
            print(f"logs in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
