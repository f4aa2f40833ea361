"""Keys include everything vLLM's block hash includes: LoRA adapter (name and path), multimodal
items (and their offsets in a block), prompt embeddings, cache salt. On kvstrata's own hash path
(vLLM's hashes random per process) the extras come from vLLM's own
``generate_block_hash_extra_keys``, canonically encoded; on the vLLM-hash path vLLM's block
hashes already carry them. A request whose extras cannot be computed or encoded is declined:
no hit, no store, counted, logged once per reason. Requests are vLLM's own ``Request`` objects."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from test_vllm_plan import FullAttentionSpec, Group  # the shared stand-ins for vLLM's specs

from kvstrata.core.keys import BlockHasher, Key, Namespace, UnencodableExtraKey, encode_extra_keys

BLOCK = 16
MODEL = "extra-model"


# -- the encoding and the hasher (no vLLM needed) --------------------------------------------------


def test_the_encoding_is_canonical_and_type_tagged() -> None:
    values: list[object] = [
        None,
        True,
        False,
        0,
        1,
        -1,
        2**80,
        1.0,
        -0.0,
        "1",
        "",
        b"1",
        b"",
        (),
        [],
        (1,),
        [1],
        ("a", "b"),
        ("ab",),
        (("a",), "b"),
        ("lora", "name", "/path"),
        ("mm", "hash", 0),
        ("mm", "hash", 1),
    ]
    encoded = [encode_extra_keys(v) for v in values]
    assert len(set(encoded)) == len(values)  # no two values (or types) share bytes
    assert encoded == [encode_extra_keys(v) for v in values]  # deterministic
    assert encode_extra_keys(bytearray(b"x")) == encode_extra_keys(memoryview(b"x")) == encode_extra_keys(b"x")


@pytest.mark.parametrize("bad", [object(), {1, 2}, {"a": 1}, ("ok", object()), "\ud800"])
def test_values_without_canonical_bytes_are_refused_by_name(bad: object) -> None:
    with pytest.raises(UnencodableExtraKey) as exc:
        encode_extra_keys(bad)
    assert "extra key" in str(exc.value)


def test_extras_change_keys_from_their_block_on_and_chunking_does_not_matter() -> None:
    hasher = BlockHasher(Namespace("m", "bf16", "fp", BLOCK))
    tokens = list(range(6 * BLOCK))
    plain = hasher.keys_for_tokens(tokens)
    assert hasher.keys_for_tokens(tokens, extras={}) == plain  # no extras: the fast path, same keys
    assert hasher.keys_for_tokens(tokens, extras={99: b"x"}) == plain  # beyond the tokens: unused
    a = hasher.keys_for_tokens(tokens, extras={2: b"a"})
    b = hasher.keys_for_tokens(tokens, extras={2: b"b"})
    assert a[:2] == plain[:2] == b[:2]
    assert all(x != y != z for x, y, z in zip(a[2:], b[2:], plain[2:], strict=True))
    grown = hasher.keys_for_tokens(tokens[: 3 * BLOCK], extras={2: b"a"})
    rest = hasher.keys_for_tokens(tokens, parent=grown[-1], start_block=3, extras={2: b"a", 4: b"c"})
    assert grown + rest == hasher.keys_for_tokens(tokens, extras={2: b"a", 4: b"c"})
    with pytest.raises(TypeError, match="block 1"):
        hasher.keys_for_tokens(tokens, extras={1: "str"})  # type: ignore[dict-item]


# -- vLLM's requests -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def v() -> SimpleNamespace:
    """vLLM's classes (the rest of this file needs vLLM)."""
    pytest.importorskip("vllm")
    return vllm_classes()


def vllm_classes() -> SimpleNamespace:
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    return SimpleNamespace(
        LoRARequest=LoRARequest,
        MultiModalFeatureSpec=MultiModalFeatureSpec,
        PlaceholderRange=PlaceholderRange,
        SamplingParams=SamplingParams,
        Request=Request,
        kv_cache_utils=kv_cache_utils,
    )


TOKENS = [(i * 7 + 3) % 1000 for i in range(6 * BLOCK + 5)]  # 6 full blocks and a partial one


def make_request(v: SimpleNamespace, spec: dict[str, Any], request_id: str = "r", block_hasher: Any = None) -> Any:
    """A vLLM ``Request`` from a JSON-able spec: ``lora`` [name, id, path], ``mm`` [[identifier,
    offset, length], ...], ``embeds`` [seed, changed row or None], ``salt``."""
    lora = v.LoRARequest(spec["lora"][0], spec["lora"][1], spec["lora"][2]) if spec.get("lora") else None
    mm = [
        v.MultiModalFeatureSpec(
            data=None, modality="image", identifier=ident, mm_position=v.PlaceholderRange(offset=off, length=n)
        )
        for ident, off, n in spec.get("mm", [])
    ]
    embeds = None
    tokens: list[int] | None = list(spec.get("tokens", TOKENS))
    if spec.get("embeds") is not None:
        import torch

        seed, row = spec["embeds"]
        gen = torch.Generator().manual_seed(seed)
        embeds = torch.randn(len(TOKENS), 8, generator=gen)
        if row is not None:
            embeds[row] += 1.0
        tokens = None  # an embeddings-only prompt: vLLM's token ids are placeholders (zeros)
    return v.Request(
        request_id,
        tokens,
        v.SamplingParams(max_tokens=4),
        None,
        prompt_embeds=embeds,
        mm_features=mm or None,
        lora_request=lora,
        cache_salt=spec.get("salt"),
        block_hasher=block_hasher,
    )


def own_keys(spec: dict[str, Any], v: SimpleNamespace, hash_block: int = BLOCK) -> list[Key]:
    """The request's keys on the own-hash path, as the scheduler computes them."""
    from kvstrata.integrations.vllm.plan import ExtraKeys, RequestKeys, build_plan, make_namespace
    from kvstrata.integrations.vllm.scheduler import vllm_extra_keys_fn

    plan = build_plan(MODEL, [Group(["l0"], FullAttentionSpec(hash_block, 256))], hash_block, hash_block)
    ns = make_namespace(plan, MODEL, "float16", 0, 1, spec.get("salt") or "")
    keys = RequestKeys(ns.seed, BlockHasher(ns), extra_keys=ExtraKeys(vllm_extra_keys_fn()))
    return list(keys.update(make_request(v, spec)))


LORA_A = ["adapter-a", 1, "/adapters/a"]
LORA_B = ["adapter-b", 2, "/adapters/b"]


def plain_keys(salt: str = "") -> list[Key]:
    from kvstrata.integrations.vllm.plan import build_plan, make_namespace

    plan = build_plan(MODEL, [Group(["l0"], FullAttentionSpec(BLOCK, 256))], BLOCK, BLOCK)
    return BlockHasher(make_namespace(plan, MODEL, "float16", 0, 1, salt)).keys_for_tokens(TOKENS)


def first_difference(a: list[Key], b: list[Key]) -> int | None:
    """The first block whose keys are equal nowhere after; None when all are equal."""
    assert len(a) == len(b)
    diff = [i for i in range(len(a)) if a[i] != b[i]]
    if not diff:
        return None
    assert diff == list(range(diff[0], len(a))), f"keys equal again after block {diff[0]}: {diff}"
    return diff[0]


def test_plain_and_salted_requests_keep_their_keys(v: SimpleNamespace) -> None:
    assert own_keys({}, v) == plain_keys()
    assert own_keys({"salt": "tenant"}, v) == plain_keys("tenant")  # the salt is in the namespace
    assert not set(plain_keys()) & set(plain_keys("tenant"))


def test_another_adapter_never_shares_a_key(v: SimpleNamespace) -> None:
    plain, a, b = own_keys({}, v), own_keys({"lora": LORA_A}, v), own_keys({"lora": LORA_B}, v)
    moved = own_keys({"lora": ["adapter-a", 1, "/adapters/a-v2"]}, v)  # the name re-pointed
    same = own_keys({"lora": ["adapter-a", 7, "/adapters/a"]}, v)  # vLLM keys name and path, not the id
    assert len(a) == len(TOKENS) // BLOCK
    assert first_difference(plain, a) == first_difference(a, b) == first_difference(a, moved) == 0
    assert same == a


def test_another_image_changes_keys_from_its_first_block_on(v: SimpleNamespace) -> None:
    plain = own_keys({}, v)
    x = own_keys({"mm": [["image-x", 40, 20]]}, v)  # tokens 40..59: hash blocks 2 and 3
    y = own_keys({"mm": [["image-y", 40, 20]]}, v)
    moved = own_keys({"mm": [["image-x", 44, 20]]}, v)  # the same image 4 tokens later
    two = own_keys({"mm": [["image-x", 40, 20], ["image-y", 70, 10]]}, v)
    assert first_difference(plain, x) == first_difference(x, y) == first_difference(x, moved) == 2
    assert first_difference(x, two) == 4  # the second image starts in block 4 (tokens 64..79)
    assert own_keys({"mm": [["image-x", 40, 20]]}, v) == x


def test_other_prompt_embeds_change_keys_from_their_block_on(v: SimpleNamespace) -> None:
    base = own_keys({"embeds": [3, None]}, v)
    assert own_keys({"embeds": [3, None]}, v) == base
    assert first_difference(base, own_keys({"embeds": [3, 50]}, v)) == 3  # row 50 is in block 3
    assert first_difference(base, own_keys({"embeds": [4, None]}, v)) == 0
    zeros = BlockHasher(Namespace("x", "y", "z", BLOCK)).keys_for_tokens([0] * len(TOKENS))
    assert not set(base) & set(zeros)


def test_extras_are_per_hash_block_when_vllm_hashes_finer_than_it_schedules(v: SimpleNamespace) -> None:
    fine = own_keys({"mm": [["image-x", 40, 20]]}, v, hash_block=8)  # image in 8-token blocks 5 .. 7
    plain = own_keys({}, v, hash_block=8)
    assert first_difference(plain, fine) == 5


def test_the_same_extras_give_the_same_keys_in_another_process(v: SimpleNamespace, tmp_path: Path) -> None:
    specs: list[dict[str, Any]] = [
        {"lora": LORA_A},
        {"mm": [["image-x", 40, 20]], "salt": "t"},
        {"embeds": [3, 50]},
        {"lora": LORA_B, "mm": [["image-y", 10, 30]]},
    ]
    here = [[k.hex() for k in own_keys(s, v)] for s in specs]
    script = (
        "import json, sys\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "import test_vllm_extra_keys as t\n"
        "v = t.vllm_classes()\n"
        "specs = json.loads(sys.argv[1])\n"
        "print(json.dumps([[k.hex() for k in t.own_keys(s, v)] for s in specs]))\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")  # another str hash: nothing may depend on it
    out = subprocess.run(
        [sys.executable, "-c", script, json.dumps(specs), str(Path(__file__).parent)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here


def test_vllm_hashes_carry_the_extras_too(v: SimpleNamespace) -> None:
    """The vLLM-hash path: ``request.block_hashes`` from vLLM's own hasher (sha256)."""
    from vllm.utils.hashing import sha256

    from kvstrata.integrations.vllm.plan import RequestKeys, build_plan, make_namespace

    v.kv_cache_utils.init_none_hash(sha256)
    hasher = v.kv_cache_utils.get_request_block_hasher(BLOCK, sha256)
    plan = build_plan(MODEL, [Group(["l0"], FullAttentionSpec(BLOCK, 256))], BLOCK, BLOCK)
    seed = make_namespace(plan, MODEL, "float16", 0, 1, "").seed

    def keys(spec: dict[str, Any]) -> list[Key]:
        req = make_request(v, spec, block_hasher=hasher)
        assert len(req.block_hashes) == len(TOKENS) // BLOCK
        return list(RequestKeys(seed, None).update(req))

    plain = keys({})
    assert keys({}) == plain
    assert first_difference(plain, keys({"lora": LORA_A})) == 0
    assert first_difference(keys({"lora": LORA_A}), keys({"lora": LORA_B})) == 0
    assert first_difference(keys({"mm": [["image-x", 40, 20]]}), keys({"mm": [["image-y", 40, 20]]})) == 2
    assert first_difference(keys({"mm": [["image-x", 40, 20]]}), keys({"mm": [["image-x", 44, 20]]})) == 2
    assert first_difference(keys({"embeds": [3, None]}), keys({"embeds": [3, 50]})) == 3


# -- the scheduler half: declined requests ---------------------------------------------------------


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, level: int) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == level]


@pytest.fixture
def records() -> Iterator[Records]:
    handler = Records()
    logger = logging.getLogger("vllm.kvstrata")  # vLLM's logger tree does not propagate to root
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old)


class Scheduler:
    """The connector's scheduler half on the own-hash path, with a worker that holds every key
    it is asked for (so any request kvstrata keys gets a hit)."""

    def __init__(self, tmp_path: Path, use_vllm_hashes: bool = False) -> None:
        from kvstrata.config import load_config
        from kvstrata.integrations.vllm.lookup import LookupServer
        from kvstrata.integrations.vllm.plan import build_plan
        from kvstrata.integrations.vllm.scheduler import SchedulerSide
        from kvstrata.integrations.vllm.settings import ConnectorSettings, ExtraConfig

        extra = ExtraConfig(config=load_config({"tiers": [{"name": "dram", "capacity": "16MiB"}]}))
        instance = f"extra-{os.getpid()}-{tmp_path.name}"
        s = ConnectorSettings(extra, MODEL, "float16", 1, instance, 0, use_vllm_hashes=use_vllm_hashes)
        self.asked: list[list[Key]] = []

        def answer(keys: list[Key], layers: list[int]) -> tuple[int, int]:
            self.asked.append(keys)
            return len(keys), len(keys)

        self.server = LookupServer(s.lookup_address(0), answer)
        self.plan = build_plan(MODEL, [Group(["l0"], FullAttentionSpec(BLOCK, 256))], BLOCK, BLOCK)
        self.side = SchedulerSide(s, self.plan)

    def close(self) -> None:
        self.side.close()
        self.server.close()

    def step(self, req: Any) -> Any:
        """One scheduler step that runs the whole prompt of ``req``: the stores it plans."""
        n_blocks = req.num_tokens // BLOCK + 1
        new = SimpleNamespace(req_id=req.request_id, block_ids=(list(range(1, n_blocks + 1)),), num_computed_tokens=0)
        cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
        so = SimpleNamespace(
            scheduled_new_reqs=[new],
            num_scheduled_tokens={req.request_id: req.num_tokens},
            scheduled_cached_reqs=cached,
            finished_req_ids=set(),
        )
        return self.side.build_connector_meta(so)


def test_a_keyable_request_hits_and_stores(v: SimpleNamespace, tmp_path: Path, records: Records) -> None:
    sched = Scheduler(tmp_path)
    try:
        (line,) = [m for m in records.messages(logging.INFO) if m.startswith("kvstrata keys:")]
        assert "own" in line and "LoRA, multimodal, prompt embeds" in line and "declined" in line
        req = make_request(v, {"lora": LORA_A, "mm": [["image-x", 40, 20]]}, "keyed")
        want = len(TOKENS) // BLOCK * BLOCK
        assert sched.side.get_num_new_matched_tokens(req, 0) == (want, False)
        assert sched.asked and sched.asked[0] == own_keys({"lora": LORA_A, "mm": [["image-x", 40, 20]]}, v)
        meta = sched.step(req)
        assert sum(len(s.keys) for s in meta.stores) == len(TOKENS) // BLOCK
        assert sched.side.take_stats() == {"live": {"scheduler": {"tracked_requests": 1}}}  # the gauge, once
        assert sched.side.take_stats() is None
    finally:
        sched.close()


@pytest.mark.parametrize(
    "breakage",
    ["absent", "raises", "unencodable"],
)
def test_a_request_that_cannot_be_keyed_is_declined(
    v: SimpleNamespace, tmp_path: Path, records: Records, monkeypatch: pytest.MonkeyPatch, breakage: str
) -> None:
    """No hit (the worker is never asked), no store, counted per request, logged once."""
    from kvstrata.integrations.vllm.connector import KVStrataConnector
    from kvstrata.integrations.vllm.plan import EXTRA_KEYS_ERROR, EXTRA_KEYS_UNAVAILABLE, UNENCODABLE_EXTRA_KEY

    spec: dict[str, Any] = {"lora": LORA_A}
    if breakage == "absent":  # an older or newer vLLM without the function
        monkeypatch.delattr(v.kv_cache_utils, "generate_block_hash_extra_keys")
        reason = EXTRA_KEYS_UNAVAILABLE
    elif breakage == "raises":
        real = v.kv_cache_utils.generate_block_hash_extra_keys

        def broken(request: Any, start: int, end: int, mm_idx: int) -> Any:
            if request.lora_request is not None and start >= 2 * BLOCK:
                raise RuntimeError("feature spec out of order")
            return real(request, start, end, mm_idx)

        monkeypatch.setattr(v.kv_cache_utils, "generate_block_hash_extra_keys", broken)
        reason = EXTRA_KEYS_ERROR
    else:  # an identifier vLLM accepts but no canonical bytes exist for (vLLM's own function)
        spec = {"mm": [[frozenset({"not", "bytes"}), 40, 20]]}
        reason = UNENCODABLE_EXTRA_KEY
    sched = Scheduler(tmp_path)
    try:
        (line,) = [m for m in records.messages(logging.INFO) if m.startswith("kvstrata keys:")]
        if breakage == "absent":
            assert "declined (computed by vLLM, never restored or stored): LoRA, multimodal, prompt embeds" in line
        for i in range(3):
            req = make_request(v, spec, f"declined-{i}")
            assert sched.side.get_num_new_matched_tokens(req, 0) == (0, False)
            assert sched.side.get_num_new_matched_tokens(req, 0) == (0, False)  # asked again: still declined
            meta = sched.step(req)
            assert meta.stores == [] and meta.loads == []
        assert sched.asked == []  # never looked up
        assert sched.side.take_stats() == {
            f"declined_{reason}": 3,
            "declined_requests": 3,
            "live": {"scheduler": {"tracked_requests": 3}},
        }
        assert sched.side.take_stats() is None  # reported once
        warnings = [m for m in records.messages(logging.WARNING) if "declined" in m]
        assert len(warnings) == 1 and reason in warnings[0] and "declined-0" in warnings[0]
        # a plain request still hits, with the keys it always had
        plain = make_request(v, {}, "plain")
        assert sched.side.get_num_new_matched_tokens(plain, 0) == (len(TOKENS) // BLOCK * BLOCK, False)
        assert sched.asked == [plain_keys()]
        # the connector hands the scheduler's count to vLLM (which aggregates it with the workers')
        sched.side.get_num_new_matched_tokens(make_request(v, spec, "declined-3"), 0)
        conn = KVStrataConnector.__new__(KVStrataConnector)
        conn._impl = sched.side
        stats = conn.get_kv_connector_stats()
        assert stats is not None and stats.data == {
            f"declined_{reason}": 1,
            "declined_requests": 1,
            "live": {"scheduler": {"tracked_requests": 5}},
        }
        assert stats.reduce()["declined_requests"] == 1
        assert conn.get_kv_connector_stats() is None
        # asked through the connector, the lookup's time is the scheduler's hook time
        assert conn.get_num_new_matched_tokens(plain, 0)[0] == len(TOKENS) // BLOCK * BLOCK
        timed = conn.get_kv_connector_stats()
        assert timed is not None and timed.data["scheduler_hook_time_ms"] > 0
        assert "worker_hook_time_ms" not in timed.data
        assert conn.get_kv_connector_stats() is None
    finally:
        sched.close()


def test_the_vllm_hash_path_declines_nothing(v: SimpleNamespace, tmp_path: Path, records: Records) -> None:
    sched = Scheduler(tmp_path, use_vllm_hashes=True)
    try:
        (line,) = [m for m in records.messages(logging.INFO) if m.startswith("kvstrata keys:")]
        assert "vLLM's block hashes" in line and "declined: none" in line
        assert sched.side.extra_keys is None
    finally:
        sched.close()


def test_declined_requests_are_a_prometheus_counter_by_reason(v: SimpleNamespace) -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvstrata.integrations.vllm.stats import KVStrataPromMetrics

    registry = CollectorRegistry()

    def bind(cls: Any) -> Any:
        return lambda **kw: cls(registry=registry, **kw)

    types = {Gauge: bind(Gauge), Counter: bind(Counter), Histogram: bind(Histogram)}
    config = SimpleNamespace(kv_transfer_config=None)
    prom = KVStrataPromMetrics(config, types, ["engine"], {0: ["0"]})
    prom.observe({"declined_requests": 3, "declined_unencodable_extra_key": 2, "declined_extra_keys_error": 1})
    prom.observe({"declined_requests": 1, "declined_unencodable_extra_key": 1})

    def value(reason: str) -> float | None:
        labels = {"engine": "0", "reason": reason}
        return registry.get_sample_value("vllm:kvstrata_declined_requests_total", labels)

    assert value("unencodable_extra_key") == 3 and value("extra_keys_error") == 1
    total = sum(
        s.value for m in registry.collect() for s in m.samples if s.name == "vllm:kvstrata_declined_requests_total"
    )
    assert total == 4  # the all-reasons total is not counted a second time
