"""Warnings for federations that give their clients too little data to learn the task.

Checked by the server before round 1, from the data's sizes alone (nothing is trained): the
problems are not errors (a small federation is a fine test of the plumbing) but runs that end
at chance without a hint cost an afternoon. Hub datasets are not checked (their partitions
are only known after a download).
"""

from __future__ import annotations

from simulations import synthetic
from simulations.data import load_partition
from simulations.settings import SimSettings

# Synthetic: at most this share of the server's test examples may come from clients that are not
# in the federation before the run is flagged.
MAX_UNSEEN_TEST_SHARE = 0.5
# Digits: clients hold at least one example per class on average, or the run is flagged.
DIGITS_CLASSES = 10


def data_warnings(settings: SimSettings, num_nodes: int) -> list[str]:
    """One line per problem of ``settings`` on a federation of ``num_nodes``, each with its fix."""
    if num_nodes < 1:
        return []
    if synthetic.is_synthetic(settings.dataset):
        return _synthetic(synthetic.parse_spec(settings.dataset), num_nodes, settings.dataset)
    if settings.dataset == "digits":
        return _digits(settings, num_nodes)
    return []


def _synthetic(spec: synthetic.SyntheticSpec, num_nodes: int, name: str) -> list[str]:
    sizes = [synthetic.num_samples(spec, k) for k in range(synthetic.TEST_CLIENTS)]
    held_out = [n - synthetic.split_point(n) for n in sizes]
    unseen = sum(held_out[num_nodes:]) / max(1, sum(held_out))
    if unseen <= MAX_UNSEEN_TEST_SHARE:
        return []
    return [
        f"dataset {name!r} on {num_nodes} supernodes: the server's test set pools the held-out examples of "
        f"clients 0-{synthetic.TEST_CLIENTS - 1}, and {unseen:.0%} of them belong to clients outside this "
        "federation (every synthetic client has its own teacher and features), so accuracy stays near chance. "
        f"Fix: run at least {synthetic.TEST_CLIENTS} supernodes (python -m simulations.run --num-supernodes "
        f'{synthetic.TEST_CLIENTS}, or flwr run . --federation-config "num-supernodes={synthetic.TEST_CLIENTS}"), '
        'or use dataset="digits".'
    ]


def _digits(settings: SimSettings, num_nodes: int) -> list[str]:
    total = len(load_partition("digits", 0, 1))  # every training digit, whatever the split
    mean = total / num_nodes
    if mean >= DIGITS_CLASSES:
        return []
    fix = f"at most {total // DIGITS_CLASSES} supernodes"
    if mean < 1:
        problem = f"{total:,} training digits cannot give each of them one"
        fix = f"at most {total:,} supernodes (better {total // DIGITS_CLASSES})"
    else:
        problem = (f"a client holds {mean:.1f} training digits on average, fewer than the {DIGITS_CLASSES} classes, "
                   "so each local model fits a digit or two and their average learns slowly")  # fmt: skip
    return [
        f"dataset 'digits' on {num_nodes} supernodes: {problem}. Fix: {fix}, or for large federations "
        'dataset="synthetic" with model="mlp" (any number of clients).'
    ]


__all__ = ["data_warnings"]
