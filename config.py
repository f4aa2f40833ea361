"""Configuration: a TOML file (or dict) validated once into frozen, typed objects.

Layout of a config file::

    [engine]
    io_threads = 2
    max_pending_stores = 64
    max_pending_bytes = "auto"    # store queue budget: "auto" = 1/8 of the top tier (256MiB..16GiB)
    store_wait_s = 10.0          # how long the part of a store over the budget may wait for it

    [[tiers]]              # top (fastest) tier first
    name = "dram"          # instance name; `kind` defaults to the name
    capacity = "16GiB"     # or "auto"
    eviction = "prefix-aware"
    admission = "all"
    write = "write-through"  # also copy every stored block to the next tier
    promote = true         # copy blocks found in a lower tier up into this one

    [[tiers]]
    name = "nvme"
    path = "~/.cache/kvstrata/nvme"   # tier-specific options sit beside the common ones
    capacity = "auto"

Environment overrides (one scheme): ``KVSTRATA__<SECTION>__<FIELD>=value`` for the
engine section and ``KVSTRATA__TIERS__<TIER NAME>__<FIELD>=value`` for a tier, e.g.
``KVSTRATA__TIERS__NVME__PATH=/mnt/nvme0/kv`` or ``KVSTRATA__ENGINE__IO_THREADS=4``.
Values are read as TOML values when they parse as one (numbers, booleans) and as
strings otherwise. ``KVSTRATA_CONFIG`` names a config file used when none is given.
"""

from __future__ import annotations

import math
import os
import shutil
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvstrata.errors import ConfigError
from kvstrata.units import Size, parse_size, shown

ENV_PREFIX = "KVSTRATA__"
DEFAULT_DRAM_CAP = 16 * 1024**3
DEFAULT_NVME_CAP = 64 * 1024**3


def _size_or_auto(value: object) -> int | str:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    return parse_size(value)


SizeOrAuto = Annotated[int | Literal["auto"], BeforeValidator(_size_or_auto)]


def _not_bool(value: object) -> object:
    if isinstance(value, bool):  # pydantic would read true as 1
        raise ValueError(f"expected an integer, not {value!r}")
    return value


Count = Annotated[int, BeforeValidator(_not_bool)]
"""An integer setting (``true`` is not 1)."""

COMMON_TIER_FIELDS = {
    "name",
    "kind",
    "capacity",
    "eviction",
    "admission",
    "write",
    "promote",
    "read_latency_s",
    "write_latency_s",
}


class EngineConfig(BaseModel):
    """Engine-wide settings."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    io_threads: Count = Field(2, ge=1, le=256)
    max_pending_stores: Count = Field(64, ge=1, le=1 << 20)
    max_pending_bytes: SizeOrAuto = "auto"  # resolved against the top tier (engine/queue.py)
    store_wait_s: float = Field(10.0, ge=0, le=3600)
    max_background_bytes: Size = 1024**3  # write-through/promotion copies in flight


class TierConfig(BaseModel):
    """One tier: common fields plus the tier's own options (validated by the tier class)."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True, allow_inf_nan=False)

    name: str = Field(min_length=1)
    kind: str
    capacity: SizeOrAuto = "auto"
    eviction: str = "prefix-aware"
    admission: str = "all"
    write: Literal["write-through", "write-back"] = "write-through"
    promote: bool = True
    #: Seconds added before each of the engine's read / write batches of this tier: emulates a
    #: slower or more distant medium (a remote pool, an object store across a WAN) in experiments
    #: and tests, e.g. a load that is still running when vLLM aborts its request. 0 (the default)
    #: adds nothing; zero-copy reads (``peek``) and the daemon's migrations are never delayed.
    read_latency_s: float = Field(default=0.0, ge=0.0, le=60.0)
    write_latency_s: float = Field(default=0.0, ge=0.0, le=60.0)
    options: Any = None  # a TierOptions subclass instance

    @model_validator(mode="before")
    @classmethod
    def _split_options(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        if "options" in data and not isinstance(data["options"], Mapping):
            return data
        name = data.get("name")
        data.setdefault("kind", name)
        extras = {k: data.pop(k) for k in list(data) if k not in COMMON_TIER_FIELDS and k != "options"}
        extras.update(data.pop("options", None) or {})
        data["options"] = _validate_tier_options(str(data.get("kind")), extras)
        if data.get("promote") is None:
            data["promote"] = data.get("kind") != "hbm"
        return data

    @field_validator("eviction")
    @classmethod
    def _known_eviction(cls, v: str) -> str:
        from kvstrata.policies import EVICTION

        EVICTION.get(v)
        return v

    @field_validator("admission")
    @classmethod
    def _known_admission(cls, v: str) -> str:
        from kvstrata.policies import ADMISSION

        ADMISSION.get(v)
        return v


def _validate_tier_options(kind: str, extras: dict[str, Any]) -> Any:
    from kvstrata.tiers import TIERS

    tier_cls = TIERS.get(kind)
    options = tier_cls.Options.model_validate(extras)
    for key, value in options:  # every tier's numbers are finite, whatever its own fields allow
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{key} must be a finite number, got {value!r}")
    return options


class LayerRule(BaseModel):
    """One ``[[policies.layers]]`` rule: the layers it matches and what it sets for them
    (see :mod:`kvstrata.policies.layers`). Later matching rules override earlier ones."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    match: str  # a layer kind (full, sliding_window, linear/mamba, mla) or a layer-name glob
    tiers: tuple[str, ...] | None = None  # tiers the matched layers may occupy (default: every tier)
    retention: Literal["auto", "all"] | None = None  # "all": keep every block (turns the kind's rule off)
    priority: Count | None = None  # eviction: a victim block sheds its lowest-priority layers first

    @field_validator("match")
    @classmethod
    def _known_match(cls, v: str) -> str:
        from kvstrata.policies.layers import parse_match

        parse_match(v)
        return v.strip()

    @field_validator("tiers")
    @classmethod
    def _some_tiers(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if v is not None and not v:
            raise ValueError("an empty tier list would store the matched layers nowhere; name at least one tier")
        return v


class PoliciesConfig(BaseModel):
    """The ``[policies]`` section: per-layer-group policies for hybrid models."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    layer_policy: Literal["per-layer", "uniform"] = "per-layer"
    checkpoint_every: Count = Field(0, ge=0)  # blocks between restore points (0: turn ends + branch points)
    checkpoint_budget: float = Field(0.5, gt=0, le=1)  # share of a tier's capacity for state snapshots
    layers: tuple[LayerRule, ...] = ()


class Watermarks(BaseModel):
    """High and low watermarks of one tier, as fractions of its capacity."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    high: float = Field(0.85, gt=0, le=1)  # above this the daemon moves or drops blocks ...
    low: float = Field(0.70, ge=0, lt=1)  # ... until usage is down to this

    @model_validator(mode="after")
    def _ordered(self) -> Watermarks:
        if self.low >= self.high:
            raise ValueError(f"the low watermark ({self.low}) must be below the high watermark ({self.high})")
        return self


def check_zmq_endpoint(endpoint: str) -> str:
    """``ValueError`` naming ``endpoint`` unless it is a ZMQ address vLLM accepts."""
    why = ""
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[len("tcp://") :].rpartition(":")
        if not sep or not host:
            why = "needs host:port"
        elif not port.isdigit() or not 0 <= int(port) <= 65535:
            why = f"port {port!r} is not 0-65535"
    elif endpoint.startswith(("ipc://", "inproc://")):
        if endpoint.endswith("//"):
            why = "needs a path or name"
    else:
        why = "must start with tcp://, ipc:// or inproc://"
    if why:
        raise ValueError(f"kv_events_endpoint {endpoint!r}: {why} (e.g. tcp://*:5557 binds, tcp://host:5557 connects)")
    return endpoint


class DaemonConfig(BaseModel):
    """The ``[daemon]`` section: the tier-migration daemon (``kvstrata daemon``, :mod:`kvstrata.daemon`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    high_watermark: float = Field(0.85, gt=0, le=1)  # every persistent tier, unless `watermarks` names it
    low_watermark: float = Field(0.70, ge=0, lt=1)
    watermarks: dict[str, Watermarks] = Field(default_factory=dict)  # per tier name: {high = .., low = ..}
    interval_s: float = Field(1.0, gt=0, le=3600)  # watermark check period
    move_batch: Size = 32 * 1024**2  # bytes moved per batch (SIGTERM and hints wait at most one batch)
    scrub_bytes_per_s: Size = 16 * 1024**2  # checksum scrubbing I/O budget (0: no scrubbing)
    scrub_pause_s: float = Field(60.0, ge=0, le=86400)  # rest between two full scrub passes of a tier
    compact_interval_s: float = Field(30.0, gt=0, le=86400)  # NVMe compaction pass period
    rescan_interval_s: float = Field(10.0, gt=0, le=86400)  # look for namespaces created since
    startup_check: Literal["auto", "full", "off"] = "auto"  # auto: verify + repair after an unclean stop
    metrics_host: str = Field("127.0.0.1", min_length=1)  # /metrics, /healthz, /status, POST /prefetch
    metrics_port: int = Field(9477, ge=0, le=65535)  # 0: any free port (written to the state file)
    state_dir: str | None = None  # default: <first nvme path>/.kvstrata-daemon (hints, state, lock)
    promote: bool = True  # copy hinted blocks from lower tiers back up to the top persistent tier
    hint_ttl_s: float = Field(600.0, gt=0)  # hinted blocks are not demoted for this long; older hints are ignored
    hint_poll_s: float = Field(0.2, gt=0, le=60)  # how often the hint file is read
    max_promote_bytes: Size = 1024**3  # bytes one hint may promote at most
    drain_timeout_s: float = Field(30.0, gt=0, le=3600)  # SIGTERM: longest wait for in-flight moves
    hold_pool_segment: bool = True  # keep a mooncake tier open: this node's pool segment outlives inference
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["json", "text"] = "json"
    # the HTTP API (README "Daemon API"): who may call it and what one caller can cost the daemon
    auth: Literal["none", "token"] = "none"  # token: /status and POST /prefetch need `Authorization: Bearer`
    token_file: str | None = None  # default <state_dir>/api-token (0600, made at the first start)
    auth_metrics: bool = False  # /metrics needs the token too (/healthz never does)
    max_request_bytes: Annotated[Size, Field(ge=1024, le=64 * 1024**2)] = 1024**2  # one POST body (413 above)
    request_timeout_s: float = Field(5.0, gt=0, le=300)  # a request not received in full by then is dropped
    max_connections: int = Field(16, ge=1, le=1024)  # handler threads; more connections get 503
    max_hint_keys: int = Field(16384, ge=1, le=1_000_000)  # keys in one hint (413 above)
    hint_queue_keys: int = Field(131072, ge=1, le=16_000_000)  # keys waiting for the main loop (503 when full)
    max_protected_keys: int = Field(262144, ge=1, le=64_000_000)  # hinted keys shielded from demotion at once
    hint_clock_skew_s: float = Field(3600.0, gt=0, le=7 * 86400)  # a hint's `t` within this of the daemon's clock
    # vLLM KV events for what the daemon moves (README "KV events for routers"); off when unset
    kv_events_endpoint: str | None = None  # e.g. "tcp://*:5557" (bind) or "tcp://host:5557" (connect)
    kv_events_topic: str = ""  # the first frame of every message, as vLLM's `topic`
    kv_events_queue: int = Field(10_000, ge=1, le=1_000_000)  # batches waiting to be sent (dropped when full)
    kv_events_hwm: int = Field(100_000, ge=1, le=10_000_000)  # the PUB socket's high-water mark
    kv_events_tracked_keys: int = Field(65536, ge=2, le=1 << 20)  # keys whose vLLM hashes the sidecar keeps

    @field_validator("kv_events_endpoint")
    @classmethod
    def _zmq_endpoint(cls, value: str | None) -> str | None:
        if value is None:
            return None
        return check_zmq_endpoint(value)

    @model_validator(mode="after")
    def _ordered(self) -> DaemonConfig:
        if self.low_watermark >= self.high_watermark:
            raise ValueError(
                f"low_watermark ({self.low_watermark}) must be below high_watermark ({self.high_watermark})"
            )
        return self

    def watermarks_of(self, tier: str) -> Watermarks:
        """The watermarks of tier ``tier`` (its own entry, else the global pair)."""
        found = self.watermarks.get(tier)
        return found if found is not None else Watermarks(high=self.high_watermark, low=self.low_watermark)


class KVStrataConfig(BaseModel):
    """The whole configuration."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    engine: EngineConfig = EngineConfig()
    tiers: tuple[TierConfig, ...] = Field(min_length=1)
    policies: PoliciesConfig = PoliciesConfig()
    daemon: DaemonConfig = DaemonConfig()

    @field_validator("daemon")
    @classmethod
    def _watermark_tiers_configured(cls, daemon: DaemonConfig, info: ValidationInfo) -> DaemonConfig:
        names = [t.name for t in info.data.get("tiers") or ()]
        for name in daemon.watermarks:
            if names and name not in names:
                raise ValueError(f"watermarks: tier {name!r} is not configured (tiers: {', '.join(names)})")
        return daemon

    @field_validator("policies")
    @classmethod
    def _rule_tiers_configured(cls, policies: PoliciesConfig, info: ValidationInfo) -> PoliciesConfig:
        names = [t.name for t in info.data.get("tiers") or ()]
        for i, rule in enumerate(policies.layers):
            for name in rule.tiers or ():
                if names and name not in names:
                    raise ValueError(f"layers.{i}.tiers: tier {name!r} is not configured (tiers: {', '.join(names)})")
        return policies

    @field_validator("tiers")
    @classmethod
    def _unique_names(cls, tiers: tuple[TierConfig, ...]) -> tuple[TierConfig, ...]:
        seen: set[str] = set()
        for t in tiers:
            if t.name in seen:
                raise ValueError(f"duplicate tier name {t.name!r}")
            seen.add(t.name)
        return tiers

    def tier(self, name: str) -> TierConfig:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)

    def with_tiers(self, tiers: tuple[TierConfig, ...]) -> KVStrataConfig:
        """The same config over other tiers (layer rules naming a tier left out no longer apply to it)."""
        return KVStrataConfig(engine=self.engine, tiers=tiers).model_copy(
            update={"policies": self.policies, "daemon": self.daemon}
        )


# --------------------------------------------------------------------------- defaults


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvstrata"


def default_config_dict() -> dict[str, Any]:
    """The embedded default: DRAM sized from available memory, write-through to NVMe in the cache dir."""
    return {
        "engine": {},
        "tiers": [
            {"name": "dram", "capacity": "auto", "eviction": "prefix-aware", "write": "write-through"},
            {
                "name": "nvme",
                "capacity": "auto",
                "eviction": "prefix-aware",
                "admission": "all",
                "path": str(default_cache_dir() / "nvme"),
            },
        ],
    }


def resolve_auto_capacity(tier: TierConfig) -> int:
    """Turn ``capacity = "auto"`` into bytes: a capped share of free memory or disk."""
    if tier.capacity != "auto":
        return int(tier.capacity)
    path = getattr(tier.options, "path", None)
    if not path and getattr(tier.options, "url", None):  # an object store: no local disk to measure
        raise ConfigError(
            f"tier {tier.name!r} on {tier.options.url!r} needs an explicit capacity, not 'auto'",
            field=f"tiers.{tier.name}.capacity",
            value="auto",
        )
    if path:
        probe = Path(os.path.expandvars(os.path.expanduser(path)))
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        free = shutil.disk_usage(probe).free
        return int(min(DEFAULT_NVME_CAP, max(free // 2, 64 * 1024**2)))
    return int(min(DEFAULT_DRAM_CAP, max(_mem_available() // 4, 64 * 1024**2)))


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 1024**3


# --------------------------------------------------------------------------- loading


def _env_value(raw: str) -> Any:
    """Numbers and booleans as such; everything else (paths, sizes, names) stays a string."""
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw
    if isinstance(value, bool | int) or (isinstance(value, float) and math.isfinite(value)):
        return value
    return raw


def apply_env_overrides(data: dict[str, Any], environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Apply ``KVSTRATA__...`` variables to a raw config dict (returns a new dict)."""
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {
        k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v) for k, v in data.items()
    }
    for var, raw in sorted(environ.items()):
        if not var.startswith(ENV_PREFIX):
            continue
        parts = [p.lower() for p in var[len(ENV_PREFIX) :].split("__")]
        if parts[0] == "tiers" and len(parts) == 3:
            tiers = [dict(t) for t in out.get("tiers", [])]
            match = [t for t in tiers if str(t.get("name", "")).lower() == parts[1]]
            if not match:
                names = ", ".join(str(t.get("name")) for t in tiers)
                raise ConfigError(f"{var}: no tier named {parts[1]!r} (tiers: {names})", field=var, value=raw)
            match[0][parts[2]] = _env_value(raw)
            out["tiers"] = tiers
        elif len(parts) == 2:
            section = dict(out.get(parts[0], {}))
            section[parts[1]] = _env_value(raw)
            out[parts[0]] = section
        else:
            raise ConfigError(
                f"{var}: expected KVSTRATA__<SECTION>__<FIELD> or KVSTRATA__TIERS__<NAME>__<FIELD>",
                field=var,
                value=raw,
            )
    return out


def _format_validation_error(exc: ValidationError, source: str) -> ConfigError:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-"))
    msg = " ".join(err["msg"].removeprefix("Value error, ").split())  # one line
    value = err.get("input")
    got = "" if isinstance(value, dict) else f" (got {shown(value)})"
    return ConfigError(f"{source}: {loc or 'config'}: {msg}{got}", field=loc, value=value)


def load_config(
    source: str | os.PathLike[str] | Mapping[str, Any] | KVStrataConfig | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> KVStrataConfig:
    """Load and validate a config from a TOML path, a dict, or the embedded default."""
    if isinstance(source, KVStrataConfig):
        return source
    environ = os.environ if environ is None else environ
    if source is None and environ.get("KVSTRATA_CONFIG"):
        source = environ["KVSTRATA_CONFIG"]
    if source is None:
        data, where = default_config_dict(), "default config"
    elif isinstance(source, Mapping):
        data, where = dict(source), "config"
    else:
        data, where = _read_toml(Path(source)), str(source)
    data = apply_env_overrides(data, environ)
    try:
        return KVStrataConfig.model_validate(data)
    except ValidationError as exc:
        raise _format_validation_error(exc, where) from None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}", field="config", value=str(path)) from None
    except (OSError, ValueError) as exc:  # a directory, no permission, not UTF-8, a NUL in the path
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ConfigError(f"cannot read config file {path}: {why}", field="config", value=str(path)) from None
    try:
        return tomllib.loads(text)
    except (ValueError, RecursionError) as exc:  # TOMLDecodeError, an integer of over 4,300 digits, deep nesting
        why = "nested too deeply" if isinstance(exc, RecursionError) else exc
        raise ConfigError(f"{path}: malformed TOML: {why}", field="config", value=str(path)) from None


# --------------------------------------------------------------------------- --tiers shorthand

_SHORTHAND_UNBOUNDED = {"inf", "infinite", "unbounded"}


def _shorthand_size(value: str, item: str) -> int | None:
    text = value.strip()
    if text.lower() in _SHORTHAND_UNBOUNDED:
        return None
    try:
        return parse_size(text)
    except ValueError as exc:
        raise ConfigError(f"--tiers: {item!r}: {exc}", field="tiers", value=value) from None


def _shorthand_option(tier: dict[str, Any], opt: str, item: str) -> None:
    from kvstrata.policies import ADMISSION, EVICTION

    word = opt.strip()
    key, sep, value = word.partition("=")
    if sep:
        if key.strip() in ("name", "capacity") or not key.strip():
            raise ConfigError(f"--tiers: {item!r}: option {word!r} is not allowed here", field="tiers", value=word)
        tier[key.strip()] = value.strip()
    elif word in EVICTION.names():
        tier["eviction"] = word
    elif word in ADMISSION.names():
        tier["admission"] = word
    elif word in ("write-through", "write-back"):
        tier["write"] = word
    elif word in ("promote", "no-promote"):
        tier["promote"] = word == "promote"
    elif word in ("shared", "private"):
        tier["shared"] = word == "shared"
    else:
        known = [*EVICTION.names(), *ADMISSION.names(), "write-through", "write-back", "promote", "no-promote"]
        raise ConfigError(
            f"--tiers: {item!r}: unknown option {word!r}; known: {', '.join(known)}, shared, private, KEY=VALUE",
            field="tiers",
            value=word,
        )


def parse_tiers_shorthand(text: str) -> list[dict[str, Any]]:
    """Parse the ``--tiers`` shorthand into raw tier dicts, top tier first.

    ``"hbm=40GiB,dram=256GiB,nvme=4TiB,fs=inf"``: one ``NAME=SIZE`` per tier (the name is
    also the kind, unless ``kind=...`` says otherwise), then optional ``:``-separated words:
    an eviction policy (``lru``, ``prefix-aware``), an admission policy (``all``,
    ``second-touch``), ``write-through``/``write-back``, ``promote``/``no-promote``,
    ``shared``/``private`` (for planning several instances) and ``KEY=VALUE`` tier options
    (``path=/mnt/nvme0/kv``). ``inf`` is an unbounded capacity (``None``; planning only).
    ``hbm`` tiers default to ``lru`` without promotion, like ``replay --hbm-capacity``.
    """
    if not isinstance(text, str) or not text.strip():
        raise ConfigError("--tiers: expected e.g. 'dram=256GiB,nvme=4TiB'", field="tiers", value=text)
    tiers: list[dict[str, Any]] = []
    for raw in text.split(","):
        item = raw.strip()
        name, sep, spec = item.partition("=")
        name = name.strip()
        if not sep or not name or not spec.strip():
            raise ConfigError(f"--tiers: {item!r}: expected NAME=SIZE (e.g. dram=256GiB)", field="tiers", value=item)
        size, *opts = spec.split(":")
        tier: dict[str, Any] = {"name": name}
        for opt in opts:
            _shorthand_option(tier, opt, item)
        tier["capacity"] = _shorthand_size(size, item)
        if tier.get("kind", name) == "hbm":
            tier.setdefault("eviction", "lru")
            tier.setdefault("promote", False)
        tiers.append(tier)
    return tiers


def tiers_from_shorthand(text: str, *, environ: Mapping[str, str] | None = None) -> KVStrataConfig:
    """A validated config from the ``--tiers`` shorthand (see :func:`parse_tiers_shorthand`),
    with the default engine section; ``nvme`` tiers default to the cache directory. Unbounded
    (``inf``) capacities are rejected: a real engine needs a size."""
    tiers = parse_tiers_shorthand(text)
    for tier in tiers:
        if tier["capacity"] is None:
            raise ConfigError(
                f"--tiers: tier {tier['name']!r}: an unbounded capacity ('inf') is for planning only; give a size",
                field="tiers",
                value=text,
            )
        tier.pop("shared", None)
        if tier.get("kind", tier["name"]) == "nvme":
            tier.setdefault("path", str(default_cache_dir() / "nvme"))
    return load_config({"engine": {}, "tiers": tiers}, environ=environ)
