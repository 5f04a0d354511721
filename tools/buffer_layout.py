"""Which host buffer layout makes O_DIRECT reads and writes fastest on this machine?

For each kind of buffer from :func:`tiers.buffers.allocate` (plain pages like ``malloc``;
plain + ``mlock``; transparent huge pages, prefaulted; THP + ``mlock``; hugetlb pages), this
reads and writes one file with the project's AIO engine (O_DIRECT), alternating the kinds
over several rounds, and prints the median GB/s (GB = 1e9 bytes) per kind and its ratio to
the plain kind.

The file lives in a private temporary directory under ``--dir`` and is removed at exit,
Ctrl-C and SIGTERM included. Run as root, the tool may raise ``/proc/sys/vm/nr_hugepages``
for the hugetlb kind when too few pages are free; it takes back what it added at exit.

Besides speed it reports, per kind, how many physically contiguous segments a
``--block-size`` request into the buffer needs (from /proc/self/pagemap, root only):
virtio-blk here accepts 254 per request and splits larger ones. ``--fragment`` scatters
free memory page by page first, as in a long-running process, where plain pages are
scattered too.

    python tools/buffer_layout.py --dir /tmp --size 1GiB --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tiers import AioConfig, AioEngine, hostmap
from tiers import buffers as B
from tiers.files import direct_refused
from tiers.units import format_size, parse_size

NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")


@dataclass
class Kind:
    name: str
    options: dict[str, Any]
    expect: str  # the backing this kind is meant to measure
    buffer: B.HostBuffer | None = None
    reads: list[float] = field(default_factory=list)  # GB/s
    writes: list[float] = field(default_factory=list)
    note: str = ""
    backing: str = ""
    locked: bool = False
    huge_mib: int = 0
    segments: tuple[float, float] | None = None


KINDS = {
    "plain": ({"huge": False, "lock": False}, "pages"),
    "lock": ({"huge": False, "lock": True}, "pages"),
    "thp": ({"huge": "thp", "lock": False}, "thp"),
    "thp+lock": ({"huge": "thp", "lock": True}, "thp"),
    "hugetlb": ({"huge": "hugetlb", "lock": False}, "hugetlb"),
}


def hugetlb_free_pages() -> int:
    info = hostmap._meminfo()
    return info.get("HugePages_Free", 0) - info.get("HugePages_Rsvd", 0)


@contextlib.contextmanager
def hugetlb_reserved(nbytes: int) -> Iterator[str]:
    """Make ``nbytes`` of hugetlb pages free if needed and allowed; restore at exit.

    Yields "" when the pages are there, else why not.
    """
    page = hostmap._meminfo().get("Hugepagesize", 0)
    if page <= 0:
        yield "no hugetlb support"
        return
    needed = -(-nbytes // page)
    shortfall = needed - hugetlb_free_pages()
    if shortfall <= 0:
        yield ""
        return
    try:
        old = int(NR_HUGEPAGES.read_text())
    except (OSError, ValueError) as exc:
        yield f"cannot read {NR_HUGEPAGES}: {exc}"
        return
    try:
        NR_HUGEPAGES.write_text(f"{old + shortfall}\n")
    except OSError as exc:
        yield f"{needed} hugetlb pages needed, cannot set {NR_HUGEPAGES} ({exc.strerror})"
        return
    print(f"# set {NR_HUGEPAGES} {old} -> {old + shortfall} (restored at exit)")
    try:
        free = hugetlb_free_pages()
        yield "" if free >= needed else f"only {free} of {needed} hugetlb pages could be made"
    finally:
        # Take back only what was added: another process may have changed it meanwhile.
        try:
            now = int(NR_HUGEPAGES.read_text())
        except (OSError, ValueError):
            now = old + shortfall
        back = max(now - shortfall, 0)
        NR_HUGEPAGES.write_text(f"{back}\n")
        print(f"# restored {NR_HUGEPAGES} to {back}")


def segments_per_request(buffer: B.HostBuffer, request_nbytes: int) -> tuple[float, float] | None:
    """(mean physical segments per request, fraction of requests over 254 segments).

    A segment is a run of physically consecutive pages, read from /proc/self/pagemap
    (page frame numbers are visible to root only; None otherwise). virtio-blk here takes
    at most 254 segments per request: a request needing more is split in two.
    """
    page = 4096
    pages = buffer.nbytes // page
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(buffer.address // page * 8)
            raw = f.read(pages * 8)
    except OSError:
        return None
    entries = np.frombuffer(raw, dtype=np.uint64)
    pfn = (entries & np.uint64((1 << 55) - 1)).astype(np.int64)
    if len(pfn) == 0 or not pfn.any():
        return None
    per = request_nbytes // page
    usable = len(pfn) // per * per
    runs = pfn[:usable].reshape(-1, per)
    breaks = (np.diff(runs, axis=1) != 1).sum(axis=1) + 1
    return float(breaks.mean()), float((breaks > 254).mean())


@contextlib.contextmanager
def fragmented_memory(nbytes: int) -> Iterator[None]:
    """Leave free memory scattered page by page, as in a long-running process.

    Faults in ``nbytes`` of ballast, then gives back every other page: the freed pages
    cannot merge with their still-used neighbours, so the next small-page allocations
    are served from these scattered pages.
    """
    import mmap

    ballast = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        ballast.madvise(mmap.MADV_NOHUGEPAGE)
        ballast.madvise(hostmap._MADV_POPULATE_WRITE)
        for offset in range(0, nbytes, 2 * 4096):
            ballast.madvise(mmap.MADV_DONTNEED, offset, 4096)
        yield
    finally:
        ballast.close()


def disk_bytes(path: Path) -> int | None:
    """Bytes read + written so far by the block device holding ``path`` (/proc/diskstats).

    Compared with what this tool moved, it tells whether others used the disk meanwhile.
    """
    dev = os.stat(path).st_dev
    wanted = (os.major(dev), os.minor(dev))
    try:
        with open("/proc/diskstats") as f:
            for line in f:
                fields = line.split()
                if (int(fields[0]), int(fields[1])) == wanted:
                    return (int(fields[5]) + int(fields[9])) * 512
    except (OSError, ValueError, IndexError):
        pass
    return None


def _terminate(signum: int, frame: object) -> None:
    # SIGTERM unwinds like Ctrl-C, so every cleanup below runs.
    raise KeyboardInterrupt(f"signal {signum}")


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def run(args: argparse.Namespace) -> int:
    size = args.size
    kinds = [Kind(name, *KINDS[name]) for name in args.kinds]
    config = AioConfig(block_size=args.block_size, queue_depth=args.queue_depth)
    tmp = Path(tempfile.mkdtemp(prefix="buffer-layout-", dir=args.dir))
    path = tmp / "data.bin"
    try:
        with contextlib.ExitStack() as stack:
            if args.fragment:
                # Twice what the plain-page kinds will take: half of it is given back.
                ballast = 2 * size * max(1, sum(k.expect == "pages" for k in kinds))
                print(f"# fragmenting free memory with {format_size(ballast)} of ballast")
                stack.enter_context(fragmented_memory(ballast))
            why_no_hugetlb = ""
            if any(k.expect == "hugetlb" for k in kinds):
                why_no_hugetlb = stack.enter_context(hugetlb_reserved(size))
            # Buffers are closed (and their references dropped) before nr_hugepages is
            # restored: this callback runs first.
            stack.callback(close_all, kinds)
            for kind in kinds:
                if kind.expect == "hugetlb" and why_no_hugetlb:
                    kind.note = f"skipped: {why_no_hugetlb}"
                    continue
                kind.buffer = B.allocate(size, pin=False, **kind.options)
                if kind.buffer.backing != kind.expect:
                    kind.note = f"got {kind.buffer.backing}, not {kind.expect}"
            measured = [k for k in kinds if k.buffer is not None]
            if not measured:
                print("nothing to measure", file=sys.stderr)
                return 1
            auto = B.allocate(size, pin=False)  # what allocate() picks by default here
            print(
                f"# allocate() defaults here: backing={auto.backing} locked={auto.locked} "
                f"(THP mode {B.thp_mode()!r}, {hugetlb_free_pages()} hugetlb pages free)"
            )
            auto.close()
            del auto
            print(f"# {format_size(size)} file in {tmp}, {config.describe()}, {args.rounds} rounds")
            # In a function of its own: no tensor outlives it, so close_all() unmaps.
            if not measure(measured, path, config, args):
                return 1
            if direct_refused(tmp):
                print("# WARNING: O_DIRECT was refused in this directory: buffered I/O measured")
            report(kinds)
            return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def measure(kinds: list[Kind], path: Path, config: AioConfig, args: argparse.Namespace) -> bool:
    """Time writes and reads for every kind, alternating; False if data came back wrong."""
    size = args.size
    buffers = {kind.name: kind.buffer.tensor for kind in kinds if kind.buffer is not None}
    reference = torch.frombuffer(bytearray(np.random.default_rng(1).bytes(size)), dtype=torch.uint8)
    with AioEngine(config) as engine:
        first = buffers[kinds[0].name]
        first.copy_(reference)
        engine.pwrite(first, path).result()
        for kind in kinds:
            # Each kind reads the data once untimed and is checked: a fast wrong read
            # would be worthless. Its pages are faulted in by now, so describe them.
            tensor = buffers[kind.name]
            tensor.zero_()
            engine.pread(tensor, path).result()
            if not torch.equal(tensor, reference):
                print(f"{kind.name}: data read back differs", file=sys.stderr)
                return False
            buf = kind.buffer
            if buf is not None:
                kind.backing, kind.locked = buf.backing, buf.locked
                kind.huge_mib = B.hugepage_bytes(buf) >> 20
                kind.segments = segments_per_request(buf, args.block_size)
        del reference
        gc.collect()
        for r in range(args.rounds):
            # Rotate the order every round so no kind always follows the same one.
            order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]
            disk_before = disk_bytes(path)
            for kind in order:
                tensor = buffers[kind.name]
                start = time.perf_counter()
                engine.pwrite(tensor, path).result()
                kind.writes.append(gbps(size, time.perf_counter() - start))
                start = time.perf_counter()
                engine.pread(tensor, path).result()
                kind.reads.append(gbps(size, time.perf_counter() - start))
            line = "  ".join(f"{k.name} r{k.reads[-1]:.2f}/w{k.writes[-1]:.2f}" for k in order)
            disk_after = disk_bytes(path)
            if disk_before is not None and disk_after is not None:
                other = disk_after - disk_before - 2 * size * len(order)
                line += f"  (other I/O on the disk: {max(other, 0) / 1e9:.1f} GB)"
            print(f"# round {r + 1}: {line}", flush=True)
    return True


def close_all(kinds: list[Kind]) -> None:
    for kind in kinds:
        if kind.buffer is not None:
            kind.buffer.close()
            kind.buffer = None
    gc.collect()


def report(kinds: list[Kind]) -> None:
    base = next((k for k in kinds if k.name == "plain" and k.reads), None)
    base_read = statistics.median(base.reads) if base else None
    base_write = statistics.median(base.writes) if base else None
    print()
    print(
        "| buffer | backing | huge pages | locked | segments / request (> 254) "
        "| read GB/s (min–max) | read × plain | write GB/s (min–max) | write × plain |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for kind in kinds:
        if not kind.reads:
            print(f"| {kind.name} | – | – | – | – | {kind.note} | | | |")
            continue
        buf_note = f" ({kind.note})" if kind.note else ""
        read, write = statistics.median(kind.reads), statistics.median(kind.writes)
        rx = f"{read / base_read:.2f}" if base_read else "–"
        segs = (
            "n/a" if kind.segments is None else f"{kind.segments[0]:.0f} ({kind.segments[1]:.0%})"
        )
        wx = f"{write / base_write:.2f}" if base_write else "–"
        print(
            f"| {kind.name}{buf_note} | {kind.backing} | {kind.huge_mib} MiB | {kind.locked} "
            f"| {segs} "
            f"| {read:.2f} ({min(kind.reads):.2f}–{max(kind.reads):.2f}) | {rx} "
            f"| {write:.2f} ({min(kind.writes):.2f}–{max(kind.writes):.2f}) | {wx} |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--dir", default=".", help="where the temporary directory goes (.)")
    parser.add_argument("--size", type=parse_size, default=1 << 30, help="file size (1GiB)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all kinds (3)")
    parser.add_argument("--block-size", type=parse_size, default=1 << 20, help="(1MiB)")
    parser.add_argument("--queue-depth", type=int, default=32, help="(32)")
    parser.add_argument(
        "--fragment",
        action="store_true",
        help="scatter free memory page by page first (as in a long-running process)",
    )
    parser.add_argument(
        "--kinds",
        type=lambda s: s.split(","),
        default=list(KINDS),
        help=f"comma-separated subset of {','.join(KINDS)}",
    )
    args = parser.parse_args(argv)
    unknown = [k for k in args.kinds if k not in KINDS]
    if unknown:
        parser.error(f"unknown kinds {unknown}; choose from {list(KINDS)}")
    if args.rounds < 1 or args.size <= 0 or args.size % 4096:
        parser.error("--rounds must be >= 1 and --size a positive multiple of 4096")
    if not os.path.isdir(args.dir):
        parser.error(f"--dir {args.dir} is not a directory")
    signal.signal(signal.SIGTERM, _terminate)
    # Also when started in the background, where the shell sets SIGINT to be ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("interrupted; temporary files removed", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
