"""The content check's fingerprint hash (`audit.rules.columns.hash64`, which
`audit.rules.neighbours.fingerprint_hashes` runs over a window's, or a chunk's, fingerprints)
against pyarrow's dictionary encoding of the same strings -- the two ways to find which of a
window's fingerprints are shared: hash them and compare only the rows whose hash repeats, or code
every distinct string.

Two sides over the same strings, alternating in one process, on one thread:

- hash: `hash64` of every string (8-byte words summed with powers of an odd base);
- dictionary: `pyarrow.compute.dictionary_encode` of every string (a hash table of the strings).

Three shapes of fingerprint: SHA-256 hex digests (64 bytes, what capture computes), short business
keys of one length (10 bytes, `fp00000001`, as `reconcile_scale.py` generates), and keys of mixed
lengths (8 to 54 bytes). Every string is distinct, as fingerprints nearly all are.

    .venv/bin/python benchmarks/fingerprint_hash.py
    .venv/bin/python benchmarks/fingerprint_hash.py --n 2000000 --reps 5

This is a measurement script, not a test: it asserts nothing about time, it prints ratios.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000, help="distinct strings of each shape (default 1,000,000)")
    ap.add_argument("--reps", type=int, default=3, help="timed rounds of the sides, alternating (medians)")
    args = ap.parse_args(argv)
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from audit.rules.columns import hash64

    n = args.n
    shapes = {
        "SHA-256 hex (64 bytes)": [hashlib.sha256(str(i).encode()).hexdigest() for i in range(n)],
        "keys of one length (10 bytes)": [f"fp{i:08d}" for i in range(n)],
        "keys of mixed lengths (8-54 bytes)": [f"{i:08d}" + "k" * (i % 47) for i in range(n)],
    }
    ratios = []
    for name, strings in shapes.items():
        arr = pa.array(strings, pa.string())
        if len(np.unique(hash64(arr))) != n or len(pc.unique(arr)) != n:
            print(f"{name}: the strings or their hashes are not all distinct", file=sys.stderr)
            return 1
        sides: dict[str, Callable[[], Any]] = {"hash": functools.partial(hash64, arr),
                                               "dictionary": functools.partial(pc.dictionary_encode, arr)}
        for fn in sides.values():  # one untimed run of each
            fn()
        times: dict[str, list[float]] = {s: [] for s in sides}
        for i in range(args.reps):
            for side in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
                times[side].append(_timed(sides[side]))
        h, d = statistics.median(times["hash"]), statistics.median(times["dictionary"])
        ratios.append(h / d)
        print(f"{name}: hash {h:.3f}s ({n / h / 1e6:.1f}M strings/s), dictionary {d:.3f}s, "
              f"hash / dictionary {h / d:.2f}")
    print(f"hash / dictionary, medians of {args.reps} over {n:,} strings: "
          + ", ".join(f"{r:.2f}" for r in ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
