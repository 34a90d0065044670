"""Whether a valid run config can train on a given federation: refused before round 1 when not.

:mod:`simulations.settings` checks each value; this module checks what needs the federation or
the data as well, and answers in seconds, so ``python -m simulations.run --check`` and the
server before round 1 refuse a run that would otherwise log failures for every round and end
at its initial accuracy:

* the federation samples fewer clients per round than the strategy needs (a secure round's
  share threshold, at least 2 share holders);
* a signed secure round in the simulation engine (:func:`engine_problems`): its virtual nodes
  hold no identity keys, so every client would refuse every round;
* the dataset cannot be loaded: a missing package, a local ``hf:`` folder that does not exist,
  a Hub dataset that is neither reachable nor in the local cache (one probe with a short
  timeout instead of the ``datasets`` library's 30 s of retries).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from fedquant.secagg.groups import MIN_GROUP_SIZE
from simulations import synthetic
from simulations.data import HF_PREFIX, HUB_DATASETS
from simulations.settings import SimSettings

HUB_PROBE_SECONDS = 5.0
MIN_TRAIN_NODES = 1  # the app's FedAvg trains on at least one sampled client per round


def sampled_per_round(settings: SimSettings, num_nodes: int) -> int:
    """Clients the app's strategy samples per round on ``num_nodes`` (as ``SeededFedAvg`` does)."""
    return min(num_nodes, max(int(num_nodes * settings.fraction_train), MIN_TRAIN_NODES))


def federation_problems(settings: SimSettings, num_nodes: int) -> list[str]:
    """Why ``settings`` cannot train on ``num_nodes`` supernodes (empty when they can)."""
    if num_nodes < 1:
        return [f"the federation has {num_nodes} supernodes; a run needs at least 1"]
    why = _secure_round_problem(settings, num_nodes)
    if why is None:
        return []
    smallest = next((n for n in range(num_nodes + 1, 10_000) if _secure_round_problem(settings, n) is None), None)
    fix = (f"run at least {smallest} supernodes (python -m simulations.run --num-supernodes {smallest}, or "
           f'flwr run . --federation-config "num-supernodes={smallest}")' if smallest
           else "lower secagg-threshold")  # fmt: skip
    return [
        f"secagg=true on {num_nodes} supernodes: fraction-train={settings.fraction_train} samples "
        f"{sampled_per_round(settings, num_nodes)} client(s) per round, and a secure round needs at least 2 share "
        f"holders and a threshold of more than half of them ({why}), so every round would fail and no update "
        f"would ever be applied. Fix: {fix}, or raise fraction-train."
    ]


def _secure_round_problem(settings: SimSettings, num_nodes: int) -> str | None:
    """Why a secure round of ``settings`` cannot complete on ``num_nodes`` (None: it can, or no secagg)."""
    if not settings.secagg:
        return None
    config = settings.secagg_config()
    sampled = sampled_per_round(settings, num_nodes)
    smallest = sampled // max(1, min(config.groups, sampled // MIN_GROUP_SIZE))  # as split_groups splits them
    k = config.neighbours
    holders = smallest if k is None or k >= smallest - 1 else k + 1  # each client's share holders, itself included
    try:
        config.threshold_for(holders)
    except ValueError as err:
        return str(err)
    return None


def engine_problems(settings: SimSettings) -> list[str]:
    """Why ``settings`` cannot train in Flower's simulation engine (Ray) whatever its size.

    Signed rounds need each node's Ed25519 identity and a directory of its peers' public keys,
    loaded from node-config files (``fedquant.clients.secure``); the engine's virtual nodes have
    no node config of their own, so every client would refuse every round.
    """
    if settings.secagg and settings.secagg_signed:
        return ["secagg-signed=True: signed rounds need every SuperNode started with the node-config keys "
                "secagg-identity-file and secagg-directory-file (flower-supernode --node-config ...); the "
                "simulation engine's virtual nodes have none, so every client would refuse every round. "
                "Use it in a deployment, or set secagg-signed=false"]  # fmt: skip
    return []


def dataset_problem(dataset: str, probe_hub: bool = True) -> str | None:
    """Why ``dataset`` cannot be loaded here, or None (the offline datasets only need their package).

    A Hub dataset is probed once (``HUB_PROBE_SECONDS``) unless it is in the local cache;
    ``probe_hub=False`` skips the network and accepts any Hub name.
    """
    if synthetic.is_synthetic(dataset):
        return None
    if dataset == "digits":
        if importlib.util.find_spec("sklearn") is None:
            return "dataset 'digits' ships with scikit-learn, which is not installed: pip install scikit-learn"
        return None
    missing = [name for name in ("datasets", "flwr_datasets") if importlib.util.find_spec(name) is None]
    if missing:
        return f"dataset {dataset!r} needs flwr-datasets (missing: {', '.join(missing)}): pip install -e '.[hub]'"
    path = HUB_DATASETS[dataset].path if dataset in HUB_DATASETS else dataset[len(HF_PREFIX) :]
    if _looks_local(path):
        folder = Path(path).expanduser()
        return None if folder.is_dir() else f"dataset {dataset!r}: there is no folder {str(folder)!r}"
    if _in_local_cache(path) or not probe_hub:
        return None
    return _probe_hub(dataset, path)


def _looks_local(path: str) -> bool:
    return path.startswith(("/", "./", "../", "~")) or os.path.exists(path)


def _in_local_cache(repo: str) -> bool:
    """Whether the Hub cache or the ``datasets`` cache holds ``repo`` (then it loads offline)."""
    hub = Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", "~/.cache/huggingface")) / "hub")
    data = Path(os.environ.get("HF_DATASETS_CACHE") or Path(os.environ.get("HF_HOME", "~/.cache/huggingface"))
                / "datasets")  # fmt: skip
    return (hub.expanduser() / f"datasets--{repo.replace('/', '--')}").is_dir() or (
        data.expanduser() / repo.replace("/", "___")
    ).is_dir()


def _probe_hub(dataset: str, repo: str) -> str | None:
    offline = any(os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on")
                  for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))  # fmt: skip
    if offline:
        return f"dataset {dataset!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set"
    try:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import RepositoryNotFoundError
    except ImportError:  # pragma: no cover - datasets depends on huggingface_hub
        return None
    try:
        HfApi().dataset_info(repo, timeout=HUB_PROBE_SECONDS)
    except RepositoryNotFoundError:
        return f"dataset {dataset!r}: the Hugging Face Hub has no dataset {repo!r} (or it is private)"
    except Exception as err:  # noqa: BLE001 - no network, DNS, proxy, timeout: all mean "cannot load it"
        return (f"dataset {dataset!r} is not in the local Hugging Face cache and the Hub cannot be reached "
                f"({type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}); "
                "download it once with internet, or use an offline dataset (digits, synthetic)")  # fmt: skip
    return None


def feasibility_problems(settings: SimSettings, num_nodes: int, probe_hub: bool = True) -> list[str]:
    """Every reason ``settings`` cannot train on ``num_nodes`` supernodes, one line each."""
    problems = federation_problems(settings, num_nodes)
    data = dataset_problem(settings.dataset, probe_hub=probe_hub)
    return problems + ([data] if data else [])


__all__ = ["dataset_problem", "engine_problems", "federation_problems", "feasibility_problems", "sampled_per_round"]
