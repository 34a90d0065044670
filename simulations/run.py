"""Run the simulation app in this process and exit non-zero when it fails: ``python -m simulations.run``.

``flwr run . --stream`` (flwr 1.42) exits 0 once it has submitted the run and its log stream has
ended, whatever became of the run; only ``flwr ls`` tells a failed run from a finished one. This
command runs the same ServerApp and ClientApp with ``flwr.simulation.run_simulation`` instead,
after checking the whole run config (nothing starts when it is invalid), and its exit status
says what happened:

* 0: the run finished (its folder is printed; a diverged run also finishes, with a warning);
* 1: the run failed (the reason on one line; the rounds it finished are in its folder);
* 1 also when the run applied no update in any round (``status`` "failed", with the reason);
* 2: invalid run config or arguments, or a run that cannot train on this federation or with this
  data (a secure round's threshold above the clients sampled, a dataset that cannot be loaded),
  one line per problem, in seconds and before Ray starts;
* 130: interrupted with Ctrl-C (the rounds it finished are in its folder, ``status`` "interrupted").

``--flwr`` submits the run with ``flwr run .`` instead (to the SuperLink connection of your Flower
configuration), streams its log with ``flwr log`` and then reads its status with ``flwr ls``: 0
for ``finished:completed``, 1 for a failed or stopped run. Ctrl-C there stops only the log
stream, as in ``flwr run --stream``: the run goes on (``flwr stop <run-id>`` ends it).

Usage::

    python -m simulations.run
    python -m simulations.run --run-config 'codec="orq:levels=4" rounds=10' --num-supernodes 20
    python -m simulations.run --check --run-config 'codecs="fp32"'    # validate only
    python -m simulations.run --flwr --run-config 'rounds=5'           # through flwr run, same exit codes

Scripts call :func:`run_app` (returns the :class:`~simulations.history.RunHistory`, raises
:class:`~simulations.settings.RunConfigError` or :class:`RunFailed`).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from simulations.history import RunHistory, end_active_runs, run_dir_name
from simulations.settings import RunConfigError, check_run_config

# Flower's default federation (what `flwr run .` gets without federation settings).
DEFAULT_SUPERNODES = 2
DEFAULT_CPUS = 2.0


class RunFailed(RuntimeError):
    """The run raised; ``history`` holds what it finished (``history.folder``), or None if it never started."""

    def __init__(self, message: str, history: RunHistory | None) -> None:
        super().__init__(message)
        self.history = history


def run_app(
    run_config: dict[str, Any] | None = None,
    *,
    num_supernodes: int = DEFAULT_SUPERNODES,
    num_cpus: float = DEFAULT_CPUS,
    num_gpus: float = 0.0,
    on_start: Callable[[RunHistory], None] | None = None,
    **overrides: Any,
) -> RunHistory:
    """Run one simulation of the app; returns its history once it has finished.

    Parameters
    ----------
    run_config : dict, optional
        Run-config keys (kebab-case, as ``--run-config`` takes them); ``overrides`` (snake_case)
        win. Missing keys take the defaults of ``pyproject.toml``.
    num_supernodes, num_cpus, num_gpus : int, float, float
        Federation size and resources per client (default: Flower's default federation).
    on_start : callable, optional
        Called with the run's history once the ServerApp has created it (its folder exists).

    Raises
    ------
    RunConfigError
        Before anything starts, listing every problem of the config.
    RunFailed
        When the run raised (its ``history`` says how far it got, ``__cause__`` why).
    """
    from flwr.simulation import run_simulation

    from simulations.client_app import app as client_app
    from simulations.feasibility import engine_problems
    from simulations.loopback import ray_loopback_only
    from simulations.server_app import make_server_app

    settings = check_run_config(run_config, **overrides)
    if engine_problems(settings):
        raise RunConfigError(engine_problems(settings))
    if num_supernodes < 1 or num_cpus <= 0 or num_gpus < 0:
        raise RunConfigError([f"num-supernodes={num_supernodes}, num-cpus={num_cpus}, num-gpus={num_gpus}: "
                              "need >= 1 supernode, > 0 CPUs and >= 0 GPUs per client"])  # fmt: skip
    started: list[RunHistory] = []

    def record_start(history: RunHistory) -> None:
        started.append(history)
        if on_start is not None:
            on_start(history)

    config = {k.replace("-", "_"): v for k, v in settings.as_config().items()}
    ray_loopback_only()  # Ray's servers on 127.0.0.1, not on every interface
    try:
        run_simulation(
            server_app=make_server_app(on_start=record_start, **config),
            client_app=client_app,
            num_supernodes=num_supernodes,
            backend_config={"client_resources": {"num_cpus": num_cpus, "num_gpus": num_gpus}},
        )
    except KeyboardInterrupt:
        if started:
            started[-1].finish("interrupted", "KeyboardInterrupt")
        raise
    except Exception as err:
        cause = err.__cause__ if isinstance(err, RuntimeError) and err.__cause__ else err
        raise RunFailed(f"{type(cause).__name__}: {cause}", started[-1] if started else None) from err
    if not started or started[-1].status != "finished":
        raise RunFailed("the ServerApp ended without finishing its rounds", started[-1] if started else None)
    return started[-1]


def run_with_flwr(run_config_args: Sequence[str], superlink: str | None = None, poll_seconds: float = 2.0) -> int:
    """Submit with ``flwr run . --format json``, stream ``flwr log``, exit status from ``flwr ls``.

    Returns 0 when ``flwr ls`` reports ``finished:completed``, 1 otherwise (the status is printed).
    """
    import json
    import subprocess
    import time

    where = [superlink] if superlink else []
    overrides = [arg for text in run_config_args for arg in ("--run-config", text)]
    submitted = subprocess.run(["flwr", "run", ".", *where, *overrides, "--format", "json"],
                               capture_output=True, text=True)  # fmt: skip
    try:
        run_id = json.loads(submitted.stdout[submitted.stdout.index("{") :])["run-id"]
    except (ValueError, KeyError, TypeError):
        print(f"simulations.run: flwr run did not start a run: {submitted.stdout.strip()} {submitted.stderr.strip()}",
              file=sys.stderr)  # fmt: skip
        return 1
    print(f"simulations.run: run {run_id} submitted; streaming its log (Ctrl-C stops only the stream)", flush=True)
    try:
        subprocess.run(["flwr", "log", str(run_id), *where, "--stream"])
        while True:
            listed = subprocess.run(["flwr", "ls", *where, "--run-id", str(run_id), "--format", "json"],
                                    capture_output=True, text=True)  # fmt: skip
            run = json.loads(listed.stdout[listed.stdout.index("{") :])["runs"][0]
            if run["status"].startswith("finished"):
                break
            time.sleep(poll_seconds)
    except KeyboardInterrupt:
        print(
            f"\nsimulations.run: stopped streaming; run {run_id} goes on (flwr stop {run_id} ends it)", file=sys.stderr
        )
        return 130
    details = f" ({run['status-details']})" if run.get("status-details") not in (None, "", "N/A") else ""
    print(
        f"simulations.run: run {run_id} {run['status']}{details}",
        file=sys.stderr if run["status"] != "finished:completed" else sys.stdout,
    )
    return 0 if run["status"] == "finished:completed" else 1


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m simulations.run", description=__doc__.split("\n")[0])
    parser.add_argument("--run-config", "-c", action="append", default=[], metavar="'KEY=VALUE ...'",
                        help="run-config overrides as flwr run takes them, e.g. 'codec=\"fp32\" rounds=5'")  # fmt: skip
    parser.add_argument("--num-supernodes", type=int, default=DEFAULT_SUPERNODES, help="virtual clients (default 2)")
    parser.add_argument("--num-cpus", type=float, default=DEFAULT_CPUS, help="CPUs per client (default 2)")
    parser.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per client, e.g. 0.25 (default 0)")
    parser.add_argument("--overwrite", action="store_true", help="reuse the run folder if it exists")
    parser.add_argument("--check", action="store_true", help="validate the run config and exit (0: valid, 2: not)")
    parser.add_argument("--flwr", nargs="?", const="", default=None, metavar="SUPERLINK",
                        help="run through flwr run (optionally to the named SuperLink connection); "
                        "the federation is then Flower's, not --num-supernodes")  # fmt: skip
    return parser.parse_args(argv)


def _problem(text: str) -> int:
    print(f"simulations.run: {text}", file=sys.stderr)
    return 2


def stop_at_ctrl_c(what: str = "run") -> None:
    """Ctrl-C records every run of this process going on as ``interrupted`` and exits 130 at once.

    A KeyboardInterrupt raised into Flower's simulation loop shuts Ray down while the ServerApp
    thread still calls it, and Ray's core worker then ends the process with status 1 (seen under
    load), so the handler never lets the interrupt reach that loop: the rounds finished are already
    on disk, only the status is left to write.
    """

    def stop(signum: int, frame: Any) -> None:
        ended = end_active_runs("interrupted", "KeyboardInterrupt")
        where = "".join(f"; {h.folder} says interrupted after round {h.last_round}" for h in ended if h.folder)
        print(f"{what}: interrupted (Ctrl-C); the rounds it finished are saved{where}", file=sys.stderr, flush=True)
        os._exit(130)

    signal.signal(signal.SIGINT, stop)


def main(argv: Sequence[str] | None = None) -> int:
    from flwr.common.config import parse_config_args

    from simulations.feasibility import engine_problems, feasibility_problems
    from simulations.federation_check import data_warnings

    args = _parse_args(argv)
    try:
        run_config = parse_config_args(args.run_config)
    except Exception as err:  # flwr raises click.ClickException on malformed text
        return _problem(f"--run-config: {getattr(err, 'message', err)}")
    if args.overwrite:
        run_config["overwrite"] = True
    try:
        settings = check_run_config(run_config)
    except RunConfigError as err:
        for problem in err.problems:
            _problem(f"invalid run config: {problem}")
        return 2
    if args.flwr is not None and not args.check:
        return run_with_flwr(args.run_config + (["overwrite=true"] if args.overwrite else []), args.flwr or None)
    # Before Ray starts: refuse a run that cannot train on this federation (--num-supernodes; with
    # --flwr the federation is Flower's, and the ServerApp refuses it before round 1).
    problems = engine_problems(settings) + feasibility_problems(settings, args.num_supernodes)
    for problem in problems:
        _problem(f"this run cannot train: {problem}")
    if problems:
        return 2
    if args.check:
        changed = " ".join(f"{k}={v!r}" for k, v in settings.changed().items()) or "(all defaults)"
        print(f"run config OK: {changed}")
        print(f"results folder: {os.path.join(settings.out_dir, run_dir_name(settings, args.num_supernodes))}")
        for warning in data_warnings(settings, args.num_supernodes):
            print(f"warning: {warning}")
        return 0
    stop_at_ctrl_c("simulations.run")
    try:
        history = run_app(run_config, num_supernodes=args.num_supernodes, num_cpus=args.num_cpus,
                          num_gpus=args.num_gpus)  # fmt: skip
    except RunConfigError as err:
        for problem in err.problems:
            _problem(problem)
        return 2
    except RunFailed as err:
        where = f"; the rounds it finished are in {err.history.folder}" if err.history else ""
        print(f"simulations.run: the run FAILED: {err}{where}", file=sys.stderr)
        return 1
    final = history.final
    print(f"simulations.run: finished, accuracy {final.get('accuracy', float('nan')):.4f} after "
          f"{len(history.rounds) - 1} rounds; results in {history.folder}")  # fmt: skip
    return 0


__all__ = ["RunFailed", "main", "run_app", "stop_at_ctrl_c"]

if __name__ == "__main__":
    sys.exit(main())
