"""Hostile manifests, journals and data files: every one refused by NvmeStore.open with a
typed error naming the file (and the field), within a timeout, never a hang nor a raw
Python exception; plus the journal's own rules (replay, torn tail, stale generation)."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from tiers.aio import AioEngine
from tiers.config import AioConfig
from tiers.errors import SwapError, SwapIOError
from tiers.nvme import (
    MANIFEST_VERSION,
    MAX_METADATA_NBYTES,
    ManifestError,
    NvmeStore,
    OverlappingExtentsError,
)

KiB = 1024
STRIPE = 64 * KiB
OPEN_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def engine() -> Iterator[AioEngine]:
    with AioEngine(AioConfig(num_threads=1)) as e:
        yield e


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(40_000, generator=g),  # 160000 bytes: 3 chunks over 2 dirs
        "b": torch.randn(257, generator=g).half(),
        "e": torch.empty(0),
        "s": torch.tensor(7, dtype=torch.int64),
    }


@dataclass
class Store:
    """A closed store in ``dirs``; ``doc`` is its manifest as JSON."""

    dirs: list[Path]
    engine: AioEngine

    @property
    def manifest(self) -> Path:
        return self.dirs[0] / "swapper-store.json"

    @property
    def journal(self) -> Path:
        return self.dirs[0] / "swapper-store.journal"

    def data(self, i: int) -> Path:
        return self.dirs[i] / "swapper-store.bin"

    @property
    def doc(self) -> dict[str, Any]:
        return json.loads(self.manifest.read_text())

    def write_doc(self, doc: object) -> None:
        self.manifest.write_text(json.dumps(doc))

    def edit(self, change: Callable[[dict[str, Any]], None]) -> None:
        doc = self.doc
        change(doc)
        self.write_doc(doc)

    def open(self) -> NvmeStore:
        return NvmeStore.open(self.dirs, self.engine)


def _make_store(root: Path, engine: AioEngine, *, journal: bool) -> Store:
    dirs = [root / "d0", root / "d1"]
    with NvmeStore(dirs, engine, stripe_nbytes=STRIPE) as store:
        for f in [store.write(k, t) for k, t in _tensors().items()]:
            f.result(timeout=10)
        store.save_manifest()
        if journal:  # changes after the save live in the journal only
            store.write("j", torch.arange(100.0)).result(timeout=10)
            store.delete("b")
            store.sync()
    return Store(dirs, engine)


def _open_within(store: Store) -> BaseException | None:
    """Open the store in a thread; fail the test if it does not return in time."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            opened = store.open()
        except BaseException as exc:  # the test judges what came out
            outcome["error"] = exc
        else:
            opened.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(OPEN_TIMEOUT_S)
    assert not thread.is_alive(), f"NvmeStore.open hung for {OPEN_TIMEOUT_S}s"
    return outcome.get("error")


def _tensor(name: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda doc: doc["tensors"][name]


def _set(path: Callable[[dict[str, Any]], Any], field: Any, value: Any) -> Callable[[Store], None]:
    def mutate(s: Store) -> None:
        def change(doc: dict[str, Any]) -> None:
            path(doc)[field] = value

        s.edit(change)

    return mutate


def _top(field: str, value: Any) -> Callable[[Store], None]:
    return _set(lambda doc: doc, field, value)


def _extent(key: str, i: int, field: str, value: Any) -> Callable[[Store], None]:
    return _set(lambda doc: doc["tensors"][key]["extents"][i], field, value)


def _del(path: Callable[[dict[str, Any]], Any], field: str) -> Callable[[Store], None]:
    def mutate(s: Store) -> None:
        s.edit(lambda doc: path(doc).pop(field))

    return mutate


def _text(change: Callable[[str], str]) -> Callable[[Store], None]:
    def mutate(s: Store) -> None:
        s.manifest.write_text(change(s.manifest.read_text()))

    return mutate


def _bytes(data: bytes, which: str = "manifest") -> Callable[[Store], None]:
    def mutate(s: Store) -> None:
        getattr(s, which).write_bytes(data)

    return mutate


def _replace_with(kind: str, which: str) -> Callable[[Store], None]:
    def mutate(s: Store) -> None:
        path = s.data(0) if which == "data" else getattr(s, which)
        saved = path.with_name("saved-" + path.name)
        path.rename(saved)
        if kind == "fifo":
            os.mkfifo(path, 0o600)
        elif kind == "symlink":
            path.symlink_to(saved)  # to the very file it was: still refused
        elif kind == "dir":
            path.mkdir()
        elif kind == "devzero":
            path.symlink_to("/dev/zero")
        elif kind == "missing":
            pass
        elif kind == "huge":
            with open(path, "wb") as f:
                f.truncate(MAX_METADATA_NBYTES + 1)  # sparse: costs nothing to make
        elif kind == "empty":
            path.write_bytes(b"")
        else:  # pragma: no cover
            raise ValueError(kind)

    return mutate


def _duplicate_tensor_key(text: str) -> str:
    doc = json.loads(text)
    b = json.dumps(doc["tensors"]["b"])
    return text.replace('"tensors": {', '"tensors": {"b": ' + b + ", ", 1).replace(
        '"tensors":{', '"tensors":{"b":' + b + ",", 1
    )


def _overlap(s: Store) -> None:
    def change(doc: dict[str, Any]) -> None:
        w0 = doc["tensors"]["w"]["extents"][0]
        b0 = doc["tensors"]["b"]["extents"][0]
        b0["dir"], b0["offset"] = w0["dir"], w0["offset"]

    s.edit(change)


def _journal_header(generation: int) -> bytes:
    head = struct.pack("<8sQQ", b"SWPRJNL1", generation, 0)
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))


def _journal_record(generation: int, seq: int, payload: bytes) -> bytes:
    h = xxhash.xxh3_64(struct.pack("<QQ", generation, seq))
    h.update(payload)
    return struct.pack("<IQQ", len(payload), seq, h.intdigest()) + payload


def _journal_with(payload: bytes, generation_delta: int = 0) -> Callable[[Store], None]:
    """A journal of the manifest's generation (+ delta) holding one well-sealed record."""

    def mutate(s: Store) -> None:
        gen = s.doc["generation"] + generation_delta
        s.journal.write_bytes(_journal_header(gen) + _journal_record(gen, 1, payload))

    return mutate


def _garbage(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


_good_tensor = {
    "dtype": "float32",
    "shape": [3],
    "nbytes": 12,
    "extents": [{"dir": 0, "offset": 1 << 20, "nbytes": 12, "xxh3": 5}],
}

# (id, mutation, expected error type, regex the message must match)
CASES: list[tuple[str, Callable[[Store], None], type[BaseException], str]] = [
    # what is at the manifest's path
    ("manifest-fifo", _replace_with("fifo", "manifest"), ManifestError, "FIFO"),
    ("manifest-symlink", _replace_with("symlink", "manifest"), ManifestError, "symbolic link"),
    ("manifest-directory", _replace_with("dir", "manifest"), ManifestError, "directory"),
    ("manifest-devzero", _replace_with("devzero", "manifest"), ManifestError, "symbolic link"),
    ("manifest-huge", _replace_with("huge", "manifest"), ManifestError, "more than"),
    ("manifest-empty", _replace_with("empty", "manifest"), ManifestError, "not valid JSON"),
    ("manifest-missing", _replace_with("missing", "manifest"), ManifestError, "remove_store"),
    # bytes that are not JSON
    ("garbage", _bytes(_garbage(4096, 1)), ManifestError, "UTF-8|JSON"),
    ("not-utf8", _bytes(b'{"format": "\xff\xfe"}'), ManifestError, "UTF-8"),
    ("truncated", _text(lambda t: t[: len(t) // 2]), ManifestError, "not valid JSON"),
    ("nested-arrays", _bytes(b"[" * 100_000 + b"]" * 100_000), ManifestError, "nests"),
    ("nested-objects", _bytes(b'{"a":' * 100_000 + b"1" + b"}" * 100_000), ManifestError, "nests"),
    ("nested-unclosed", _bytes(b"[" * 100_000), ManifestError, "nests"),
    (
        "huge-integer",
        _text(lambda t: t.replace('"generation": 1', '"generation": ' + "9" * 5000)),
        ManifestError,
        "digits",
    ),
    (
        "nan",
        _text(lambda t: t.replace('"generation": 1', '"generation": NaN')),
        ManifestError,
        "NaN",
    ),
    (
        "infinity",
        _text(lambda t: t.replace('"generation": 1', '"generation": -Infinity')),
        ManifestError,
        "Infinity",
    ),
    (
        "duplicate-top-key",
        _text(lambda t: t.replace('"name":', '"name": "x", "name":', 1)),
        ManifestError,
        "twice",
    ),
    ("duplicate-tensor-key", _text(_duplicate_tensor_key), ManifestError, "'b' appears twice"),
    # the top level
    ("top-list", lambda s: s.write_doc([s.doc]), ManifestError, "not a swapper"),
    ("wrong-format", _top("format", "safetensors"), ManifestError, "not a swapper"),
    ("version-2", _top("version", 2), ManifestError, r"version 2.*remove_store\("),
    ("version-99", _top("version", 99), ManifestError, "version 99"),
    ("version-string", _top("version", str(MANIFEST_VERSION)), ManifestError, "version '3'"),
    ("version-float", _top("version", float(MANIFEST_VERSION)), ManifestError, "version 3.0"),
    ("missing-tensors", _del(lambda d: d, "tensors"), ManifestError, "'tensors' is missing"),
    ("missing-generation", _del(lambda d: d, "generation"), ManifestError, "'generation'"),
    ("unknown-top-field", _top("extra", 1), ManifestError, "unknown field 'extra'"),
    ("other-name", _top("name", "rank7"), ManifestError, r"\.name: written for store 'rank7'"),
    (
        "dirs-reversed",
        lambda s: s.edit(lambda d: d["dirs"].reverse()),
        ManifestError,
        "same directories in the same order",
    ),
    ("dirs-not-list", _top("dirs", "/tmp"), ManifestError, r"\.dirs: expected a list"),
    (
        "stripe-float",
        _top("stripe_nbytes", 65536.0),
        ManifestError,
        r"stripe_nbytes: expected an integer, got float",
    ),
    ("stripe-string", _top("stripe_nbytes", "65536"), ManifestError, "got str"),
    ("stripe-bool", _top("stripe_nbytes", True), ManifestError, "got bool"),
    ("stripe-unaligned", _top("stripe_nbytes", 65537), ManifestError, "not a multiple"),
    ("stripe-zero", _top("stripe_nbytes", 0), ManifestError, r"stripe_nbytes: 0 is outside"),
    ("checksum-string", _top("checksum", "yes"), ManifestError, r"\.checksum: expected true"),
    ("checksum-off-but-digests", _top("checksum", False), ManifestError, "records no checksums"),
    ("alignment-512", _top("alignment", 512), ManifestError, r"\.alignment"),
    ("generation-negative", _top("generation", -1), ManifestError, r"generation: -1 is outside"),
    ("generation-huge", _top("generation", 2**70), ManifestError, "generation"),
    ("tensors-list", _top("tensors", []), ManifestError, r"\.tensors: expected an object"),
    # one tensor
    (
        "shape-float",
        _set(_tensor("w"), "shape", [300000.5]),
        ManifestError,
        r"tensors\['w'\]\.shape\[0\]: expected an integer, got float 300000\.5",
    ),
    (
        "nbytes-string",
        _set(_tensor("w"), "nbytes", "600000"),
        ManifestError,
        r"tensors\['w'\]\.nbytes: expected an integer, got str",
    ),
    ("shape-negative", _set(_tensor("w"), "shape", [-40000]), ManifestError, r"shape\[0\]: -40000"),
    ("shape-bool", _set(_tensor("s"), "shape", [True]), ManifestError, "got bool"),
    ("shape-not-list", _set(_tensor("w"), "shape", 40000), ManifestError, "expected a list"),
    ("shape-too-many-dims", _set(_tensor("s"), "shape", [1] * 65), ManifestError, "dimensions"),
    ("nbytes-mismatch", _set(_tensor("w"), "nbytes", 160004), ManifestError, "do not match"),
    ("nbytes-negative", _set(_tensor("e"), "nbytes", -4), ManifestError, r"nbytes: -4 is outside"),
    ("dtype-unknown", _set(_tensor("w"), "dtype", "float99"), ManifestError, "unknown dtype"),
    ("dtype-not-string", _set(_tensor("w"), "dtype", 7), ManifestError, "unknown dtype 7"),
    ("dtype-object", _set(_tensor("w"), "dtype", "Tensor"), ManifestError, "unknown dtype"),
    ("missing-dtype", _del(_tensor("w"), "dtype"), ManifestError, "'dtype' is missing"),
    (
        "unknown-tensor-field",
        _set(_tensor("w"), "requires_grad", True),
        ManifestError,
        "unknown field 'requires_grad'",
    ),
    (
        "tensor-not-object",
        _set(lambda d: d["tensors"], "w", [1, 2]),
        ManifestError,
        r"tensors\['w'\]: expected an object",
    ),
    ("empty-key", _set(lambda d: d["tensors"], "", _good_tensor), ManifestError, "non-empty"),
    # extents
    ("extents-not-list", _set(_tensor("w"), "extents", {}), ManifestError, "expected a list"),
    (
        "extent-not-object",
        _set(_tensor("b"), "extents", [[0, 0, 514]]),
        ManifestError,
        r"extents\[0\]: expected an object",
    ),
    ("offset-negative", _extent("w", 0, "offset", -4096), ManifestError, "offset: -4096"),
    ("offset-unaligned", _extent("w", 1, "offset", 4097), ManifestError, "not a multiple"),
    ("offset-float", _extent("w", 0, "offset", 0.0), ManifestError, "got float"),
    ("offset-past-file", _extent("b", 0, "offset", 1 << 30), ManifestError, "which has only"),
    ("offset-huge", _extent("b", 0, "offset", 2**63), ManifestError, "outside"),
    ("extents-overlap", _overlap, ManifestError, "overlap"),
    ("extent-empty", _extent("b", 0, "nbytes", 0), ManifestError, "nbytes: 0 is outside"),
    ("extent-over-stripe", _extent("w", 0, "nbytes", STRIPE + 4096), ManifestError, "outside"),
    ("extents-short", _extent("w", 2, "nbytes", 100), ManifestError, "not nbytes=160000"),
    ("dir-out-of-range", _extent("w", 0, "dir", 2), ManifestError, r"dir: 2 is outside \[0, 1\]"),
    ("dir-negative", _extent("w", 0, "dir", -1), ManifestError, "dir: -1"),
    ("dir-bool", _extent("w", 1, "dir", True), ManifestError, "got bool"),
    ("digest-string", _extent("w", 0, "xxh3", "0xdead"), ManifestError, r"xxh3: .*got str"),
    ("digest-null", _extent("w", 0, "xxh3", None), ManifestError, r"xxh3: .*NoneType"),
    ("digest-too-big", _extent("w", 0, "xxh3", 2**64), ManifestError, "outside"),
    (
        "digest-missing",
        _del(lambda d: d["tensors"]["w"]["extents"][0], "xxh3"),
        ManifestError,
        "'xxh3' is missing",
    ),
    ("unknown-extent-field", _extent("w", 0, "crc", 1), ManifestError, "unknown field 'crc'"),
    # the journal
    (
        "journal-missing",
        _replace_with("missing", "journal"),
        ManifestError,
        r"journal .* is missing.*remove_store",
    ),
    ("journal-fifo", _replace_with("fifo", "journal"), ManifestError, "FIFO"),
    ("journal-symlink", _replace_with("symlink", "journal"), ManifestError, "symbolic link"),
    ("journal-directory", _replace_with("dir", "journal"), ManifestError, "directory"),
    ("journal-huge", _replace_with("huge", "journal"), ManifestError, "more than"),
    ("journal-empty", _replace_with("empty", "journal"), ManifestError, "shorter than"),
    ("journal-garbage", _bytes(_garbage(4096, 2), "journal"), ManifestError, "not a swapper"),
    (
        "journal-bad-header",
        lambda s: s.journal.write_bytes(b"SWPRJNL1" + bytes(16) + b"\x01" * 8),
        ManifestError,
        "header's checksum",
    ),
    (
        "journal-from-future",
        _journal_with(b'{"op":"delete","key":"w"}', 5),
        ManifestError,
        "newer than the manifest",
    ),
    ("journal-record-not-json", _journal_with(b"\x00garbage"), ManifestError, "record 1"),
    (
        "journal-record-unknown-op",
        _journal_with(b'{"op":"truncate","key":"w"}'),
        ManifestError,
        "not a put or delete",
    ),
    (
        "journal-record-shape-float",
        _journal_with(
            json.dumps(
                {"op": "put", "key": "x", "tensor": {**_good_tensor, "shape": [3.0]}}
            ).encode()
        ),
        ManifestError,
        r"record 1: tensors\['x'\]\.shape\[0\]",
    ),
    (
        "journal-record-overlap",
        _journal_with(
            json.dumps(
                {
                    "op": "put",
                    "key": "x",
                    "tensor": {
                        **_good_tensor,
                        "extents": [{"dir": 0, "offset": 0, "nbytes": 12, "xxh3": 5}],
                    },
                }
            ).encode()
        ),
        ManifestError,
        "overlap",
    ),
    ("journal-record-nested", _journal_with(b"[" * 50_000), ManifestError, "nests"),
    # the data files
    ("data-missing", _replace_with("missing", "data"), ManifestError, r"data file .* missing"),
    ("data-fifo", _replace_with("fifo", "data"), SwapIOError, "not a regular file"),
    ("data-symlink", _replace_with("symlink", "data"), SwapIOError, "symbolic link"),
    ("data-directory", _replace_with("dir", "data"), SwapIOError, "swapper-store.bin"),
    ("data-truncated", lambda s: os.truncate(s.data(0), 4096), ManifestError, "truncated"),
]


@pytest.mark.parametrize(
    ("mutate", "expected", "pattern"),
    [pytest.param(m, e, p, id=i) for i, m, e, p in CASES],
)
def test_hostile_files_are_refused(
    tmp_path: Path,
    engine: AioEngine,
    mutate: Callable[[Store], None],
    expected: type[BaseException],
    pattern: str,
) -> None:
    store = _make_store(tmp_path, engine, journal=False)
    # The generation is 1 after the save; the cases above rely on its exact spelling.
    assert '"generation": 1' in store.manifest.read_text()
    mutate(store)
    error = _open_within(store)
    assert error is not None, "a hostile file was accepted"
    assert isinstance(error, expected) and isinstance(error, SwapError), repr(error)
    assert any(str(p) in str(error) for p in [*store.dirs]), f"no file named: {error}"
    assert re.search(pattern, str(error), re.DOTALL), str(error)
    # A refused open leaves the store's files as they were, and nothing new.
    names = sorted(p.name for p in store.dirs[0].iterdir())
    assert not [n for n in names if n.endswith(".tmp")], names


def test_case_table_is_large_enough() -> None:
    assert len(CASES) >= 40


# -- hole 2 of issue 29: extents that overlap --------------------------------------------


def _copy_of_b(key: str, xxh3_delta: int = 0) -> Callable[[Store], None]:
    """A second key whose entry is b's (the same extents; its checksum changed by delta)."""

    def change(doc: dict[str, Any]) -> None:
        twin = json.loads(json.dumps(doc["tensors"]["b"]))
        twin["extents"][0]["xxh3"] = (twin["extents"][0]["xxh3"] + xxh3_delta) % 2**64
        doc["tensors"][key] = twin

    return lambda s: s.edit(change)


def _b_on_last_block_of_w(s: Store) -> None:
    """b's one block moved onto the last 4 KiB block of w's first extent."""

    def change(doc: dict[str, Any]) -> None:
        w0 = doc["tensors"]["w"]["extents"][0]
        b0 = doc["tensors"]["b"]["extents"][0]
        b0["dir"], b0["offset"] = w0["dir"], w0["offset"] + w0["nbytes"] - 4096

    s.edit(change)


def _w_names_its_first_bytes_twice(s: Store) -> None:
    def change(doc: dict[str, Any]) -> None:
        w = doc["tensors"]["w"]["extents"]
        w[2]["dir"], w[2]["offset"] = w[0]["dir"], w[0]["offset"]

    s.edit(change)


def _journal_puts_copy_of_b(s: Store) -> None:
    """A journal record (metadata applied over the manifest) giving key x b's extents."""
    _journal_with(json.dumps({"op": "put", "key": "x", "tensor": s.doc["tensors"]["b"]}).encode())(
        s
    )


@pytest.mark.parametrize(
    ("mutate", "keys", "shared_nbytes", "where"),
    [
        pytest.param(_copy_of_b("b2"), {"b", "b2"}, 4096, "manifest", id="shared-extent"),
        pytest.param(
            _copy_of_b("b2", 1), {"b", "b2"}, 4096, "manifest", id="shared-other-checksum"
        ),
        pytest.param(_b_on_last_block_of_w, {"w", "b"}, 4096, "manifest", id="one-block"),
        pytest.param(_w_names_its_first_bytes_twice, {"w"}, 32768, "manifest", id="same-key"),
        pytest.param(_journal_puts_copy_of_b, {"b", "x"}, 4096, "journal", id="journal-record"),
    ],
)
def test_overlapping_extents_are_refused_naming_both_keys(
    tmp_path: Path,
    engine: AioEngine,
    mutate: Callable[[Store], None],
    keys: set[str],
    shared_nbytes: int,
    where: str,
) -> None:
    """Two keys given the same bytes (or one key given them twice) by the manifest or by
    a journal record over it are refused at open with OverlappingExtentsError naming
    both keys and the data file. Before issue 29 an identical extent under two keys
    opened, and the second key read the first's bytes without error. (A data file holds
    extents only: the manifest, journal and snapshot records are files of their own, so
    the metadata that can overlap a tensor's bytes is a journal record's extents.)"""
    store = _make_store(tmp_path, engine, journal=False)
    mutate(store)
    error = _open_within(store)
    assert isinstance(error, OverlappingExtentsError), repr(error)
    assert isinstance(error, ManifestError)
    assert set(error.keys) == keys
    for key in keys:
        assert f"tensors[{key!r}]" in str(error)
    assert error.path.name == "swapper-store.bin" and str(error.path) in str(error)
    assert error.nbytes == shared_nbytes and error.offset % 4096 == 0
    assert "overlap" in str(error) and where in str(error)
    assert not [p for p in store.dirs[0].iterdir() if p.name.endswith(".tmp")]


def _keys(store: Store) -> list[str]:
    with store.open() as opened:
        return sorted(opened.keys())


def test_journal_replays_over_the_manifest(tmp_path: Path, engine: AioEngine) -> None:
    store = _make_store(tmp_path, engine, journal=True)
    assert _keys(store) == ["e", "j", "s", "w"]  # b deleted, j written, after the save
    # Opening compacted the journal into a new manifest: nothing left to replay.
    assert store.doc["generation"] == 2 and "j" in store.doc["tensors"]
    assert store.journal.read_bytes()[32:].count(0) == store.journal.stat().st_size - 32


def test_torn_tail_is_dropped_and_logged(
    tmp_path: Path, engine: AioEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """What a crash mid-append leaves (a cut record, garbage after the last record) is
    dropped, with a warning; every record before it counts. Zeros alone after the last
    record are the journal's preallocated space: no warning."""
    store = _make_store(tmp_path, engine, journal=True)
    manifest, padded = store.manifest.read_bytes(), store.journal.read_bytes()
    intact = padded.rstrip(b"\0")
    store.journal.write_bytes(padded)
    with caplog.at_level(logging.WARNING, logger="swapper.tiers.nvme"):
        assert _keys(store) == ["e", "j", "s", "w"]
    assert "torn tail" not in caplog.text
    for journal, expected in [
        (intact[:-1], ["b", "e", "j", "s", "w"]),  # the last record (delete b) cut short
        (intact[:-30], ["b", "e", "j", "s", "w"]),  # ...cut in its header
        (intact + b"x", ["e", "j", "s", "w"]),
        (intact + b"\x00" * 99 + b"x", ["e", "j", "s", "w"]),
        (intact + _journal_record(1, 99, b"{}"), ["e", "j", "s", "w"]),  # seq not next
    ]:
        store.manifest.write_bytes(manifest)  # each open compacts: start again each time
        store.journal.write_bytes(journal)
        with caplog.at_level(logging.WARNING, logger="swapper.tiers.nvme"):
            assert _keys(store) == expected
        assert "torn tail" in caplog.text
        caplog.clear()


def test_stale_journal_is_ignored(tmp_path: Path, engine: AioEngine) -> None:
    """A crash between the manifest's replace and the journal's reset leaves a journal of
    the previous generation, whose records are all in the manifest already."""
    store = _make_store(tmp_path, engine, journal=True)
    old_journal = store.journal.read_bytes()
    with store.open() as opened:  # compacts: manifest generation 2, journal reset
        opened.write("late", torch.ones(3)).result()
        opened.save_manifest()  # generation 3
    store.journal.write_bytes(old_journal)  # generation 1, records (delete b...) stale
    assert _keys(store) == ["e", "j", "late", "s", "w"]


def test_orphan_temporary_manifests_are_removed_at_open(tmp_path: Path, engine: AioEngine) -> None:
    store = _make_store(tmp_path, engine, journal=False)
    for name in (".swapper-store.json.a1b2c3d4.tmp", ".swapper-store.journal.zzzzzzzz.tmp"):
        (store.dirs[0] / name).write_text("{half")
    (store.dirs[0] / ".other.json.a1b2c3d4.tmp").write_text("{")  # another store's
    assert _keys(store) == ["b", "e", "s", "w"]
    assert sorted(p.name for p in store.dirs[0].iterdir()) == [
        ".other.json.a1b2c3d4.tmp",
        "swapper-store.bin",
        "swapper-store.journal",
        "swapper-store.json",
        "swapper-store.lock",
    ]


def test_refused_open_leaves_no_lock_file_it_made(tmp_path: Path, engine: AioEngine) -> None:
    d = tmp_path / "d"
    d.mkdir()
    (d / "swapper-store.json").write_text("[]")
    with pytest.raises(ManifestError):
        NvmeStore.open([d], engine)
    assert sorted(p.name for p in d.iterdir()) == ["swapper-store.json"]
