"""The connector's settings, parsed once at the edge (no vLLM import; unit-testable on its own).

Everything the connector takes from vLLM's config is read here, once, into a frozen
:class:`ConnectorSettings`: the keys of ``kv_transfer_config.kv_connector_extra_config``
(validated, each bad key or value named in the error) and the few facts of vLLM's own config
the connector depends on (model id, weights identity, KV dtype, tensor-parallel size, instance
id, hash algorithm). The scheduler and worker halves read settings, never ``extra_config``.

============================  =========  ====================================================
key                           default    meaning
============================  =========  ====================================================
``config``                    absent     kvstrata config: a TOML path, an inline JSON object
                                         (a dict, or a string starting with ``{``); absent: the
                                         embedded default (or ``$KVSTRATA_CONFIG``)
``model_id``                  absent     the whole model identity in kvstrata's namespace: used
                                         as its name and no weights digest is computed (the
                                         operator vouches: change ``model_id`` whenever the
                                         weights change). Default: vLLM's ``served_model_name``
                                         (else ``model``) plus the weights identity
``weights_id``                absent     replaces only the weights digest (for fleets that
                                         version weights explicitly: change it whenever the
                                         weights change); the name stays as above
``worker_lookup_timeout_s``   ``1.0``    how long the scheduler waits for a worker's lookup
                                         answer before it reads the persistent tiers itself
``load_mode``                 ``auto``   ``auto``, ``async`` or ``sync`` (see the scheduler)
============================  =========  ====================================================

**The weights identity** (:mod:`kvstrata.integrations.vllm.weights`): without ``model_id`` or
``weights_id`` the namespace also holds a digest of the checkpoint vLLM loads (configs, index,
each weights file's header, size and a bounded sample of its bytes, plus vLLM's ``revision``,
``quantization`` and ``load_format``), computed once per process, so a re-trained checkpoint
served under the same name never restores the old one's KV, while the same files at another
path do. Without local weights files (a hub id not in the cache, weights streamed from object
storage) it falls back to the model's name and revision, with a warning.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstrata.config import KVStrataConfig, load_config
from kvstrata.errors import ConfigError
from kvstrata.integrations.vllm.lookup import lookup_address
from kvstrata.integrations.vllm.plan import DETERMINISTIC_HASHES
from kvstrata.integrations.vllm.weights import NO_WEIGHTS, WeightsIdentity, weights_identity

PREFIX = "kv_connector_extra_config"
LOAD_MODES = ("auto", "async", "sync")
KNOWN_KEYS = ("config", "kv_events", "load_mode", "model_id", "weights_id", "worker_lookup_timeout_s")


@dataclass(frozen=True)
class ExtraConfig:
    """``kv_connector_extra_config``, validated."""

    config: KVStrataConfig
    model_id: str | None = None
    weights_id: str | None = None
    worker_lookup_timeout_s: float = 1.0
    load_mode: str = "auto"
    kv_events: bool | None = None  # None: follow vLLM's kv_events_config.enable_kv_cache_events

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> ExtraConfig:
        """Validate every key; a :class:`ConfigError` names the first bad key or value."""
        extra = dict(extra or {})
        unknown = sorted(k for k in extra if k not in KNOWN_KEYS)
        if unknown:
            raise ConfigError(
                f"{PREFIX}: unknown key {unknown[0]!r} (known keys: {', '.join(KNOWN_KEYS)})",
                field=f"{PREFIX}.{unknown[0]}",
                value=extra[unknown[0]],
            )
        return cls(
            config=_parse_config(extra.get("config")),
            model_id=_parse_id("model_id", extra.get("model_id")),
            weights_id=_parse_id("weights_id", extra.get("weights_id")),
            worker_lookup_timeout_s=_parse_timeout(extra.get("worker_lookup_timeout_s", 1.0)),
            load_mode=_parse_load_mode(extra.get("load_mode", "auto")),
            kv_events=_parse_kv_events(extra.get("kv_events")),
        )


def _bad(key: str, value: object, why: str) -> ConfigError:
    return ConfigError(f"{PREFIX}.{key} {why}, got {value!r}", field=f"{PREFIX}.{key}", value=value)


def _parse_config(raw: object) -> KVStrataConfig:
    if isinstance(raw, str) and raw.strip().startswith("{"):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise _bad("config", raw, f"is not valid inline JSON ({exc})") from None
    if raw is not None and not isinstance(raw, str | Mapping | KVStrataConfig):
        raise _bad("config", raw, "must be a TOML path or a config object (a JSON object or dict)")
    return load_config(raw)  # type: ignore[arg-type]  # narrowed above


def _parse_id(key: str, raw: object) -> str | None:
    if raw is None:
        return None  # absent
    if not isinstance(raw, str) or not raw.strip():
        raise _bad(key, raw, "must be a non-empty string (or absent)")
    return raw


def _parse_timeout(raw: object) -> float:
    try:
        value = float(raw)  # type: ignore[arg-type]  # anything float() takes, as before
    except (TypeError, ValueError):
        raise _bad("worker_lookup_timeout_s", raw, "must be a number of seconds") from None
    if isinstance(raw, bool) or not math.isfinite(value) or value <= 0:
        raise _bad("worker_lookup_timeout_s", raw, "must be a positive, finite number of seconds")
    return value


def _parse_kv_events(raw: object) -> bool | None:
    if raw is None or isinstance(raw, bool):
        return raw
    raise _bad("kv_events", raw, "must be true or false (default: vLLM's kv_events_config)")


def _parse_load_mode(raw: object) -> str:
    if raw not in LOAD_MODES:
        raise _bad("load_mode", raw, "must be 'auto', 'async' or 'sync'")
    return str(raw)


@dataclass(frozen=True)
class ConnectorSettings:
    """What the connector takes from vLLM's config, parsed once (see the module docstring)."""

    extra: ExtraConfig
    model: str  # the model id in kvstrata's namespace
    kv_dtype: str
    tp_size: int
    instance_id: str  # names the workers' lookup sockets (shared by one vLLM instance; not a secret)
    dp_rank: int
    use_vllm_hashes: bool  # vLLM's block hashes are the same in every process
    weights: WeightsIdentity = NO_WEIGHTS  # the model's weights (``weights.weights`` enters the namespace)
    kv_events: bool = False  # publish KV events for kvstrata's tiers (see events.py)

    @property
    def config(self) -> KVStrataConfig:
        return self.extra.config

    @property
    def load_mode(self) -> str:
        return self.extra.load_mode

    @property
    def worker_lookup_timeout_s(self) -> float:
        return self.extra.worker_lookup_timeout_s

    def lookup_address(self, tp_rank: int) -> str:
        """Socket path of a worker's lookup server, in the per-user ``0700`` directory. Its
        handshake secret is not derived from anything here: the worker's server makes a random
        one and the scheduler reads it from the key file beside the socket (see
        :mod:`kvstrata.integrations.vllm.lookup`)."""
        return lookup_address(self.instance_id, self.dp_rank, tp_rank)

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> ConnectorSettings:
        ktc = vllm_config.kv_transfer_config
        extra = ExtraConfig.parse(getattr(ktc, "kv_connector_extra_config", None))
        mc = vllm_config.model_config
        served = getattr(mc, "served_model_name", None)
        if isinstance(served, list | tuple):
            served = served[0] if served else None
        kv_dtype = str(vllm_config.cache_config.cache_dtype)
        if kv_dtype == "auto":
            kv_dtype = str(mc.dtype).removeprefix("torch.")
        algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"))
        return cls(
            extra=extra,
            model=str(extra.model_id or served or mc.model),
            kv_dtype=kv_dtype,
            tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
            instance_id=str(getattr(vllm_config, "instance_id", "") or os.getppid()),
            dp_rank=int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0),
            use_vllm_hashes=algo in DETERMINISTIC_HASHES or bool(os.environ.get("PYTHONHASHSEED")),
            weights=_weights_of(vllm_config, extra),
            kv_events=_kv_events_on(vllm_config, extra),
        )


def _kv_events_on(vllm_config: Any, extra: ExtraConfig) -> bool:
    """``kv_events`` in extra_config if set, else whether vLLM publishes KV events at all."""
    if extra.kv_events is not None:
        return extra.kv_events
    kec = getattr(vllm_config, "kv_events_config", None)
    return bool(kec is not None and getattr(kec, "enable_kv_cache_events", False))


def _weights_of(vllm_config: Any, extra: ExtraConfig) -> WeightsIdentity:
    """The weights identity (cached per process: the scheduler and each worker compute it once)."""
    if extra.model_id is not None and extra.weights_id is None:
        return WeightsIdentity("", "model_id")
    mc = vllm_config.model_config
    load = getattr(vllm_config, "load_config", None)

    def opt(obj: Any, name: str) -> str | None:
        value = getattr(obj, name, None)
        return None if value is None else str(getattr(value, "value", value))

    return weights_identity(
        str(getattr(mc, "model_weights", "") or mc.model),  # streamed weights: their original URI
        revision=opt(mc, "revision"),
        quantization=opt(mc, "quantization"),
        load_format=opt(load, "load_format"),
        download_dir=opt(load, "download_dir"),
        weights_id=extra.weights_id,
    )
