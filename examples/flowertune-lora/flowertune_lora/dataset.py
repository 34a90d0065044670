"""Text that ships with Python, split by topic: pre-training, clients' fine-tuning, validation.

CPython's ``pydoc_data.topics`` holds the language reference's help topics (79 topics, 465 kB of
English; 78 distinct texts). Every fourth topic, in sorted order, is held out of pre-training: those topics are the
federated fine-tuning task, dealt to the clients by topic (a client's data is a few whole topics,
as a data owner's would be), with the last tenth of each held-out topic kept for validation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pydoc_data.topics import topics

import torch

HELD_OUT_EVERY = 4  # topic i (sorted) is fine-tuning data when i % HELD_OUT_EVERY == 1
VALIDATION_SHARE = 0.1


class ByteTokenizer:
    """UTF-8 bytes as tokens (ids 0-255) plus a begin-of-text id: needs no download, no vocabulary file."""

    vocab_size = 257
    bos_token_id = 256

    def encode(self, text: str) -> list[int]:
        return [self.bos_token_id, *text.encode("utf-8")]


def _topic_names() -> list[str]:
    """Sorted topic names, one per distinct text ("else" and "if" share theirs: validation text must not leak)."""
    seen: set[str] = set()
    names = []
    for name in sorted(topics):
        if topics[name] not in seen:
            seen.add(topics[name])
            names.append(name)
    return names


def pretraining_text() -> list[str]:
    """The topics the base model is pre-trained on."""
    return [topics[name] for i, name in enumerate(_topic_names()) if i % HELD_OUT_EVERY != 1]


def finetuning_topics() -> list[str]:
    """The held-out topics, by name."""
    return [name for i, name in enumerate(_topic_names()) if i % HELD_OUT_EVERY == 1]


def _split(text: str) -> tuple[str, str]:
    cut = int(len(text) * (1.0 - VALIDATION_SHARE))
    return text[:cut], text[cut:]


def client_topics(partition_id: int, num_partitions: int) -> list[str]:
    """The held-out topics of one client: dealt largest first, each to the client with the least text so far."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} is not in [0, {num_partitions})")
    names = sorted(finetuning_topics(), key=lambda name: (-len(topics[name]), name))
    if num_partitions > len(names):
        raise ValueError(f"{num_partitions} clients but only {len(names)} fine-tuning topics")
    load = [0] * num_partitions
    owned: list[list[str]] = [[] for _ in range(num_partitions)]
    for name in names:
        owner = min(range(num_partitions), key=lambda p: (load[p], p))
        owned[owner].append(name)
        load[owner] += len(topics[name])
    return owned[partition_id]


def client_text(partition_id: int, num_partitions: int) -> list[str]:
    """A client's training text: the first 90 % of each of its topics."""
    return [_split(topics[name])[0] for name in client_topics(partition_id, num_partitions)]


def validation_text() -> list[str]:
    """The last 10 % of every held-out topic: text no client trains on."""
    return [_split(topics[name])[1] for name in finetuning_topics()]


def windows(texts: Sequence[str], encode: Callable[[str], list[int]], seq_len: int) -> torch.Tensor:
    """Non-overlapping token windows of ``seq_len + 1`` tokens (``seq_len`` next-token predictions each)."""
    if seq_len < 2:
        raise ValueError(f"seq-len must be at least 2, got {seq_len}")
    ids = [token for text in texts for token in encode(text)]
    count = len(ids) // (seq_len + 1)
    if count == 0:
        raise ValueError(f"{len(ids)} tokens make no window of {seq_len + 1}")
    return torch.tensor(ids[: count * (seq_len + 1)], dtype=torch.long).view(count, seq_len + 1)
