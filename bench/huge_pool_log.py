"""Replay a pool log of gigabytes: peak memory must follow the pool's state, not the file.

Builds a MindSpore pool log (``VLOG_v=12906``) of ``--gb`` gigabytes in /tmp by repeating the
real lines of a recorded run (``tests/data/pool_log/gpt_varying_seq_4steps.log.gz``: CPU,
MindSpore 2.10, 8106 lines of which 7,000 pool lines) with fresh addresses each time (every
address moved by a multiple of 4 GiB), and, after each repetition, a real ``Free memory details``
line for each allocation still live, so the pool's state stays that of one repetition while the
file grows. The file is written as a stream and deleted at the end.

``ms-memopt replay FILE --json`` then runs in a child process, on a file a tenth of the size and on
the whole one; the table shows each run's peak RSS (``ru_maxrss`` of the child), time and
throughput. Bounded memory means the two peaks are close although the files differ tenfold.

    python bench/huge_pool_log.py            # 2 GB (about 6.4M lines); a few minutes here
    python bench/huge_pool_log.py --gb 0.5

The last line is one JSON object with the figures.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "tests" / "data" / "pool_log" / "gpt_varying_seq_4steps.log.gz"
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")
_STRIDE = 4 << 30               # addresses of repetition k: the recorded ones + k * 4 GiB
_WRAP = 4096                    # repetitions before the offsets repeat (addresses stay below 2**48)


def _pieces(lines: list[str]) -> list[tuple[list[str], list[int]]]:
    """Each line split around its addresses: (text pieces, addresses)."""
    out = []
    for line in lines:
        addrs = [int(m.group(), 16) for m in _ADDRESS.finditer(line)]
        out.append((_ADDRESS.split(line), addrs))
    return out


def write_log(path: Path, target_bytes: int) -> tuple[int, int]:
    """Write about ``target_bytes`` of pool log to ``path``; returns (bytes, lines)."""
    sys.path.insert(0, str(ROOT))
    from ms_memopt.io.traces.ms_pool_log import PoolLogParser

    lines = gzip.open(SOURCE, "rt", encoding="utf-8").read().splitlines()
    parser = PoolLogParser()
    for line in lines:
        parser.feed(line)
    free_template = next(line for line in lines if "Free memory details" in line)
    # the allocations live at the end of the recording: freed after each repetition
    tail = [_ADDRESS.sub(f"{addr:#x}", free_template, count=1) for addr in sorted(parser.live)]
    pieces = _pieces(lines + tail)
    written = count = rep = 0
    with open(path, "w", encoding="utf-8", buffering=1 << 20) as out:
        while written < target_bytes:
            offset = (rep % _WRAP) * _STRIDE
            chunk = []
            for texts, addrs in pieces:
                if addrs:
                    parts = [texts[0]]
                    for addr, text in zip(addrs, texts[1:]):
                        parts.append(f"{addr + offset:#x}")
                        parts.append(text)
                    chunk.append("".join(parts))
                else:
                    chunk.append(texts[0])
            block = "\n".join(chunk) + "\n"
            out.write(block)
            written += len(block)
            count += len(chunk)
            rep += 1
    return written, count


def replay(path: Path) -> dict:
    """``ms-memopt replay PATH --json`` in a child; its figures, peak RSS and wall time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "ms_memopt", "replay", str(path), "--json"], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if done.returncode != 0:
        raise SystemExit(f"replay failed ({done.returncode}): {done.stderr[-2000:]}")
    out = json.loads(done.stdout)
    # ru_maxrss of RUSAGE_CHILDREN is the largest child so far: runs go smallest first
    return {"peak_rss_mib": max(peak_kb, before) / 1024, "seconds": seconds, "events": out["events"],
            "allocs": out["allocs"], "pool_lines": out.get("pool_log", {}).get("pool_lines"),
            "final_layout_match": out.get("final_layout_match")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.0, help="size of the big log in GB (default 2)")
    args = parser.parse_args()
    sizes = [int(args.gb * 1e9 / 10), int(args.gb * 1e9)]
    rows = []
    for size in sizes:
        path = Path(f"/tmp/ms_memopt_huge_pool_log_{os.getpid()}_{size}.log")
        try:
            start = time.perf_counter()
            nbytes, nlines = write_log(path, size)
            generated = time.perf_counter() - start
            result = replay(path)
        finally:
            path.unlink(missing_ok=True)
        result.update(bytes=nbytes, lines=nlines, generate_seconds=generated,
                      mb_per_s=nbytes / 1e6 / result["seconds"], lines_per_s=nlines / result["seconds"],
                      events_per_s=result["events"] / result["seconds"])
        rows.append(result)

    print(f"{'file':>9} {'lines':>11} {'events':>11} {'peak RSS':>10} {'seconds':>8} {'MB/s':>7} {'lines/s':>10}")
    for row in rows:
        print(f"{row['bytes'] / 1e9:>7.2f}GB {row['lines']:>11,} {row['events']:>11,} {row['peak_rss_mib']:>7.0f}MiB "
              f"{row['seconds']:>8.1f} {row['mb_per_s']:>7.1f} {row['lines_per_s']:>10,.0f}")
    small, big = rows
    ratio = big["peak_rss_mib"] / small["peak_rss_mib"]
    print(f"file {big['bytes'] / small['bytes']:.1f}x larger, peak RSS {ratio:.2f}x: memory follows the pool's "
          "state (one repetition's live allocations), not the file")
    print(json.dumps({"bytes": big["bytes"], "lines": big["lines"], "events": big["events"],
                      "peak_rss_mib": round(big["peak_rss_mib"], 1),
                      "peak_rss_mib_tenth": round(small["peak_rss_mib"], 1), "rss_ratio": round(ratio, 3),
                      "seconds": round(big["seconds"], 1), "mb_per_s": round(big["mb_per_s"], 1),
                      "lines_per_s": round(big["lines_per_s"]), "events_per_s": round(big["events_per_s"])}))


if __name__ == "__main__":
    main()
