"""The run configuration of the simulation app: defaults, parsing, validation.

Keys are those of ``[tool.flwr.app.config]`` in ``pyproject.toml`` (``flwr run . --run-config
'codec="orq:levels=4" rounds=10'``); the server sends what the clients need in each round's
config, so clients never read the run config themselves.

:meth:`SimSettings.from_run_config` checks the whole config before anything runs: every key
known (a typo gets the closest key), every value of its type, codec specs and link profiles
built, and the rules between keys (a deadline needs an uplink profile, the synthetic dataset
needs a model for feature vectors). Each problem is one line naming the key, the value and what
is allowed; all of them come together in one :class:`RunConfigError`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, fields
from typing import Any

from simulations.data import check_dataset_name, check_partitioning
from simulations.models import IMAGE_MODELS, MODEL_NAMES, parse_model
from simulations.synthetic import is_synthetic

CLIENT_INFO_KEY = "client-info"  # ConfigRecord each client adds to its train reply
MODES = ("fedavg", "fedsgd")  # local epochs + FedAvg; one minibatch gradient + server SGD (simulations.fedsgd)
LINK_FORMS = "none, fixed:mbps=M, uniform:low=L,high=H, lognormal:median=M,sigma=S (Mbit/s)"


class RunConfigError(ValueError):
    """A run config that cannot run; ``problems`` holds one line per problem."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


# Train-config key naming one federation (one run_server call): a node that sees a new one drops the
# transform state (error-feedback residuals) it kept from another, even when first sampled after round 1.
FEDERATION_KEY = "federation-id"
# The run-config keys a client reads (simulations.client_app); the server sends only these, not the
# whole run config (each key travels in every train message).
CLIENT_KEYS = ("dataset", "partitioning", "dirichlet-alpha", "seed", "model", "local-epochs", "batch-size",
               "learning-rate", "clip-norm", "min-local-steps", "codec")  # fmt: skip
EVALUATE_KEYS = ("dataset", "partitioning", "dirichlet-alpha", "seed", "model")


@dataclass(frozen=True)
class SimSettings:
    """One simulation's settings (run-config key = field name with ``-`` for ``_``).

    Constructing one validates it (:class:`RunConfigError` lists every problem).
    """

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
    secagg: bool = False
    secagg_threshold: float = 0.6
    secagg_bits: int = 2
    secagg_clip: float = 1.0
    secagg_neighbours: int = 0
    secagg_noise_multiplier: float = 0.0
    secagg_keep: float = 1.0
    secagg_groups: int = 1
    secagg_signed: bool = False
    secagg_dropouts: int = 0
    mode: str = "fedavg"
    server_momentum: float = 0.9
    clients_per_round: int = 0
    out_dir: str = "results"
    run_name: str = ""
    overwrite: bool = False

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise RunConfigError(problems)

    def problems(self) -> list[str]:
        """Every value check and cross-key rule this config breaks, one line each."""
        found: list[str] = []

        def check(key: str, ok: bool, allowed: str) -> None:
            if not ok:
                found.append(f"{key}={getattr(self, key.replace('-', '_'))!r}: {allowed}")

        def builds(key: str, build, allowed: str) -> None:
            try:
                build()
            except ValueError as err:
                listed = "available:" in str(err) or "use one of" in str(err)  # the message names them already
                value = getattr(self, key.replace("-", "_"))
                found.append(f"{key}={value!r}: {err}" + ("" if listed else f"; allowed: {allowed}"))

        builds("codec", lambda: _build_codec(self.codec), _codec_forms())
        builds("dataset", lambda: check_dataset_name(self.dataset), "see the dataset key in README.md")
        builds("partitioning", lambda: check_partitioning(self.partitioning, 1.0), "iid or dirichlet")
        check("dirichlet-alpha", math.isfinite(self.dirichlet_alpha) and self.dirichlet_alpha > 0, "a number > 0")
        builds("model", lambda: parse_model(self.model), f"{', '.join(MODEL_NAMES)}, optionally :dtype=float16|float64")
        if is_synthetic(self.dataset) and self.model.partition(":")[0] in IMAGE_MODELS:
            found.append(f"model={self.model!r}: dataset {self.dataset!r} gives feature vectors; use logreg or mlp")
        for key in ("rounds", "local-epochs", "batch-size"):
            check(key, getattr(self, key.replace("-", "_")) >= 1, "an int >= 1")
        check("fraction-train", 0 < self.fraction_train <= 1, "a number in (0, 1]")
        check("learning-rate", math.isfinite(self.learning_rate) and self.learning_rate > 0, "a number > 0")
        check("clip-norm", math.isfinite(self.clip_norm) and self.clip_norm >= 0, "a number >= 0 (0: no clipping)")
        check("min-local-steps", self.min_local_steps >= 0, "an int >= 0")
        check("seed", self.seed >= 0, "an int >= 0")
        check("min-numel", self.min_numel >= 1, "an int >= 1 (1: encode every float tensor)")
        builds("uplink", lambda: _build_link(self.uplink), LINK_FORMS)
        builds("downlink", lambda: _build_link(self.downlink), LINK_FORMS)
        if not _is_none(self.downlink_codec):
            builds("downlink-codec", lambda: _build_strategy(downlink_codec=self.downlink_codec),
                   f"none, or a codec spec without ef+ or side information ({_codec_forms()})")  # fmt: skip
        deadline = self.upload_deadline_seconds
        check("upload-deadline-seconds", math.isfinite(deadline) and deadline >= 0, "a number of seconds >= 0 (0: off)")
        check("uplink-bytes-budget", self.uplink_bytes_budget >= 0, "an int >= 0 (0: off)")
        if self.upload_deadline_seconds > 0 and _is_none(self.uplink):
            found.append(
                f"upload-deadline-seconds={self.upload_deadline_seconds!r}: needs an uplink profile, "
                'e.g. uplink="lognormal:median=2,sigma=1" (the deadline is set against each client\'s speed)'
            )
        if self.secagg:
            found.extend(self._secagg_problems())
            if not _is_none(self.downlink_codec):
                found.append(f"downlink-codec={self.downlink_codec!r}: secagg=true sends the dense model; use none")
            if self.upload_deadline_seconds > 0 or self.uplink_bytes_budget > 0:
                found.append("secagg=true: upload-deadline-seconds and uplink-bytes-budget must be 0")
        check("secagg-dropouts", self.secagg_dropouts >= 0, "an int >= 0 (fault injection: clients that drop after "
              "sharing keys)")  # fmt: skip
        found += _fedsgd_problems(self)
        check("out-dir", bool(self.out_dir.strip()), "a folder path (relative to where the server runs)")
        return found

    @property
    def uplink_name(self) -> str:
        """What the replies carry: ``codec``, or ``secagg`` (the codec is unused under secure aggregation)."""
        return "secagg" if self.secagg else self.codec

    def _secagg_problems(self) -> list[str]:
        """SecAggConfig's own validation, each problem under its ``secagg-*`` run-config key."""
        try:
            self.secagg_config()
        except ValueError as err:
            found = getattr(err, "problems", [("threshold", str(err))])
            return [f"secagg-{key.replace('_', '-')}={getattr(self, 'secagg_' + key, None)!r}: {text}"
                    for key, text in found]
        return []

    def secagg_config(self):
        """The :class:`~fedquant.secagg.SecAggConfig` of ``secagg-*`` (None when ``secagg`` is false)."""
        if not self.secagg:
            return None
        from fedquant.secagg import SecAggConfig

        t = self.secagg_threshold
        threshold = int(t) if t >= 2 and float(t).is_integer() else float(t)
        return SecAggConfig(
            threshold=threshold,
            bits=self.secagg_bits,
            clip=self.secagg_clip,
            neighbours=self.secagg_neighbours or None,
            noise_multiplier=self.secagg_noise_multiplier,
            keep=self.secagg_keep,
            groups=self.secagg_groups,
            signed=self.secagg_signed,
        )

    @classmethod
    def from_run_config(cls, run_config: dict[str, Any], **overrides: Any) -> SimSettings:
        """Build from a Flower run config (kebab-case keys) and ``overrides`` (snake_case, win).

        Raises :class:`RunConfigError` with every problem: unknown keys (with the closest known
        one), values that are not of the key's type, and what :meth:`problems` finds.
        """
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        problems: list[str] = []
        for key, value in {**run_config, **{k.replace("_", "-"): v for k, v in overrides.items()}}.items():
            name = key.replace("-", "_")
            if name not in known:
                problems.append(_unknown_key(key))
                continue
            try:
                values[name] = _parse(value, type(known[name].default))
            except (TypeError, ValueError) as err:
                problems.append(f"{key}={value!r}: {err}")
        try:
            settings = cls(**values)
        except RunConfigError as err:
            problems += err.problems
        if problems:
            raise RunConfigError(problems)
        return settings

    @classmethod
    def keys(cls) -> list[str]:
        """Run-config keys."""
        return [f.name.replace("_", "-") for f in fields(cls)]

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every run-config key with its default value."""
        return {f.name.replace("_", "-"): f.default for f in fields(cls)}

    def changed(self) -> dict[str, Any]:
        """The run-config keys whose values differ from the defaults (kebab-case)."""
        return {k: v for k, v in self.as_config().items() if v != self.defaults()[k]}

    def as_config(self) -> dict[str, Any]:
        """Kebab-case dict (for the history file and the clients' round config)."""
        return {k.replace("_", "-"): v for k, v in dataclasses.asdict(self).items()}

    def client_config(self, keys: tuple[str, ...] = CLIENT_KEYS) -> dict[str, Any]:
        """The keys a client reads (``CLIENT_KEYS``), plus ``secagg-dropouts`` when fault injection is on."""
        config = self.as_config()
        sent = {k: config[k] for k in keys}
        if self.secagg_dropouts:
            sent["secagg-dropouts"] = self.secagg_dropouts
        return sent

    def replace(self, **changes: Any) -> SimSettings:
        return dataclasses.replace(self, **changes)


def check_run_config(run_config: dict[str, Any] | None = None, **overrides: Any) -> SimSettings:
    """Validate a run config (and snake_case ``overrides``) without running anything.

    Returns the settings; raises :class:`RunConfigError` (one line per problem). A sweep calls it
    for each of its runs before starting the simulation.
    """
    return SimSettings.from_run_config(dict(run_config or {}), **overrides)


def _parse(value: Any, kind: type) -> Any:
    """``value`` as ``kind``: strings of numbers and booleans are read (command lines give strings)."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        raise ValueError("not a boolean (true or false)")
    if isinstance(value, bool):
        raise ValueError(f"not {'an int' if kind is int else 'a number'} (a boolean)")
    if kind is str:
        if not isinstance(value, str):
            raise ValueError('not a string (quote it: key="value")')
        return value
    if isinstance(value, str):
        text = value.strip()
        try:
            value = int(text) if kind is int else float(text)
        except ValueError:
            raise ValueError(f"not {'an int' if kind is int else 'a number'}") from None
    if kind is int:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if not isinstance(value, int):
            raise ValueError("not an int")
        return value
    if not isinstance(value, int | float) or not math.isfinite(float(value)):
        raise ValueError("not a finite number")
    return float(value)


def _unknown_key(key: str) -> str:
    keys = SimSettings.keys()
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown run-config key {key!r}{hint}; known keys: {', '.join(keys)}"


def _fedsgd_problems(settings: SimSettings) -> list[str]:
    """Rules of the data-parallel mode's keys (``mode``, ``server-momentum``, ``clients-per-round``).

    See :mod:`simulations.fedsgd`.
    """
    found = []
    if settings.mode not in MODES:
        found.append(f"mode={settings.mode!r}: fedavg (local epochs, FedAvg) or fedsgd (one minibatch gradient per "
                     "client, SGD with momentum on the server)")  # fmt: skip
    momentum = settings.server_momentum
    if not (math.isfinite(momentum) and 0 <= momentum < 1):
        found.append(f"server-momentum={momentum!r}: a number in [0, 1)")
    if settings.clients_per_round < 0:
        found.append(f"clients-per-round={settings.clients_per_round!r}: an int >= 0 (0: fraction-train)")
    if settings.mode != "fedsgd":
        if settings.clients_per_round > 0:
            found.append(f"clients-per-round={settings.clients_per_round!r}: only with mode=\"fedsgd\" "
                         "(use fraction-train)")  # fmt: skip
        return found
    if not _is_none(settings.downlink_codec):
        found.append(f"downlink-codec={settings.downlink_codec!r}: mode=\"fedsgd\" sends the dense model (the server's "
                     "step needs the gradient at the model it holds); use none")  # fmt: skip
    if settings.secagg:
        found.append('secagg=true: not with mode="fedsgd" (use fedavg)')
    return found


def _is_none(spec: str) -> bool:
    return spec.strip().lower() in ("", "none")


def _build_codec(spec: str) -> None:
    from fedquant.codecs import get_codec

    get_codec(spec)


def _codec_forms() -> str:
    from fedquant.codecs import available_codecs, available_transforms

    prefixes = "".join(f"{t}+" for t in available_transforms())
    return f"a codec spec [{prefixes}]<name>[:key=value,...] with name one of {', '.join(available_codecs())}"


def _build_link(spec: str) -> None:
    from simulations.links import parse_uplink

    parse_uplink(spec)


def _build_strategy(**options: Any) -> None:
    """Construct the wrapper with ``options`` (the library's own checks of them)."""
    from flwr.serverapp.strategy import FedAvg

    from fedquant.strategies import QuantizedStrategy

    QuantizedStrategy(FedAvg(), codec="fp32", **options)


__all__ = ["CLIENT_INFO_KEY", "CLIENT_KEYS", "EVALUATE_KEYS", "RunConfigError", "SimSettings", "check_run_config"]
