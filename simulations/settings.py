"""The run configuration of the simulation app: defaults, parsing, validation.

Keys are those of ``[tool.flwr.app.config]`` in ``pyproject.toml`` (``flwr run . --run-config
'codec="orq:levels=4" rounds=10'``); the server sends what the clients need in each round's
config, so clients never read the run config themselves.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

from simulations.data import check_dataset_name, check_partitioning
from simulations.models import MODEL_NAMES

CLIENT_INFO_KEY = "client-info"  # ConfigRecord each client adds to its train reply
# Train-config key naming one federation (one run_server call): a node that sees a new one drops the
# transform state (error-feedback residuals) it kept from another, even when first sampled after round 1.
FEDERATION_KEY = "federation-id"


@dataclass(frozen=True)
class SimSettings:
    """One simulation's settings (run-config key = field name with ``-`` for ``_``)."""

    codec: str = "eden:bits=2"
    dataset: str = "digits"
    partitioning: str = "iid"
    dirichlet_alpha: float = 0.5
    model: str = "cnn"
    rounds: int = 20
    fraction_train: float = 0.5
    local_epochs: int = 3
    batch_size: int = 16
    learning_rate: float = 0.05
    clip_norm: float = 1.0
    min_local_steps: int = 30
    seed: int = 0
    min_numel: int = 1
    uplink: str = "none"
    downlink: str = "none"
    downlink_codec: str = "none"
    upload_deadline_seconds: float = 0.0
    uplink_bytes_budget: int = 0
    out_dir: str = "results"
    run_name: str = ""

    def __post_init__(self) -> None:
        check_dataset_name(self.dataset)
        check_partitioning(self.partitioning, self.dirichlet_alpha)
        if self.model not in MODEL_NAMES:
            raise ValueError(f"unknown model {self.model!r}; use one of {', '.join(MODEL_NAMES)}")
        for name in ("rounds", "local_epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.fraction_train <= 1:
            raise ValueError(f"fraction-train must be in (0, 1], got {self.fraction_train}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning-rate must be > 0, got {self.learning_rate}")
        if not self.clip_norm >= 0:
            raise ValueError(f"clip-norm must be >= 0 (0: no clipping), got {self.clip_norm}")
        if self.min_local_steps < 0:
            raise ValueError(f"min-local-steps must be >= 0, got {self.min_local_steps}")
        if self.min_numel < 1:
            raise ValueError(f"min-numel must be >= 1, got {self.min_numel}")
        if not self.upload_deadline_seconds >= 0 or self.uplink_bytes_budget < 0:
            raise ValueError("upload-deadline-seconds and uplink-bytes-budget must be >= 0 (0: off)")
        if self.upload_deadline_seconds > 0 and self.uplink.strip().lower() in ("", "none"):
            raise ValueError(
                'upload-deadline-seconds needs an uplink profile (e.g. uplink="lognormal:median=2,sigma=1")'
            )

    @classmethod
    def from_run_config(cls, run_config: dict[str, Any], **overrides: Any) -> SimSettings:
        """Build from a Flower run config (kebab-case keys); unknown keys raise ``ValueError``."""
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in {**run_config, **{k.replace("_", "-"): v for k, v in overrides.items()}}.items():
            name = key.replace("-", "_")
            if name not in known:
                raise ValueError(f"unknown run-config key {key!r}; known: {', '.join(cls.keys())}")
            kind = type(known[name].default)
            try:
                values[name] = kind(value) if kind is not float else float(value)
            except (TypeError, ValueError) as err:
                raise ValueError(f"run-config {key}={value!r} is not a {kind.__name__}") from err
        return cls(**values)

    @classmethod
    def keys(cls) -> list[str]:
        """Run-config keys."""
        return [f.name.replace("_", "-") for f in fields(cls)]

    def as_config(self) -> dict[str, Any]:
        """Kebab-case dict (for the history file and the clients' round config)."""
        return {k.replace("_", "-"): v for k, v in dataclasses.asdict(self).items()}

    def replace(self, **changes: Any) -> SimSettings:
        return dataclasses.replace(self, **changes)
