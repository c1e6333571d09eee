"""What placing the generator's copies in one pass saves (session 77).

``generate events`` adds a producer's retries (copies 1-49 records after their originals)
and bad records to the records in delivery order. Until session 77 each was inserted with
``list.insert``, one at a time: time quadratic in the records. Per size, the same copies
placed both ways on a list of ints (the records' objects do not change the list's moves):
the old loop, kept here as the reference, and the product's ``interleaved``. Both must hold
the same records (where several copies meet, or a copy lands past an earlier one, the two
order them differently: either is a realistic delivery). Writes
``bench/results/generate-delivery-<stamp>.json``.

    .venv/bin/python bench/generate_delivery_bench.py    # ~2-3 min (the old loop at 4M)
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from results_file import write_result

from clickstream.jobs.generate import interleaved


def one_at_a_time(records: list[int], copied: list[int], later: list[int]) -> list[int]:
    """The generator's copies before session 77."""
    out = list(records)
    for original, place in sorted(zip(copied, later, strict=True), reverse=True):
        out.insert(place, out[original])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000000,4000000",
                        help="records per round, comma-separated")
    parser.add_argument("--copy-fraction", type=float, default=0.02)
    args = parser.parse_args(argv)
    rounds = []
    for n in (int(size) for size in args.sizes.split(",")):
        rng = np.random.default_rng(1)
        records = list(range(n))
        copied = rng.choice(n, int(n * args.copy_fraction), replace=False)
        later = np.minimum(n, copied + rng.integers(1, 50, size=len(copied)))
        started = time.perf_counter()
        placed = interleaved(records, [records[int(d)] for d in copied], later)
        one_pass_s = time.perf_counter() - started
        started = time.perf_counter()
        reference = one_at_a_time(records, copied.tolist(), later.tolist())
        old_s = time.perf_counter() - started
        if sorted(placed) != sorted(reference):
            print(f"{n:,} records: the two placements hold different records", file=sys.stderr)
            return 1
        rounds.append({"records": n, "copies": len(copied), "one_at_a_time_s": round(old_s, 3),
                       "one_pass_s": round(one_pass_s, 3)})
        print(f"{n:,} records, {len(copied):,} copies: one at a time {old_s:.2f} s, "
              f"one pass {one_pass_s:.2f} s")
    print(f"wrote {write_result('generate-delivery', {'rounds': rounds})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
