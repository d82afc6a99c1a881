"""Summarise an Nsight Compute source page (`ncu --import R --page source --csv --print-source sass`): the SASS
instructions with the most warp-stall samples, and the samples per stall reason over the whole kernel.

Usage: python bench/ncu_source.py SASS.csv [top N (default 40)]   (bench/ncu.sh writes the csv with NCU_SOURCE=...)
"""
from __future__ import annotations

import csv
import sys


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def _rows(path: str):
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.strip()]
    head = next(i for i, ln in enumerate(lines) if "Source" in ln and "Address" in ln)   # banner lines before it
    return list(csv.DictReader(lines[head:]))


def summarise(path: str, top: int = 40) -> None:
    rows = _rows(path)
    if not rows:
        print("no rows")
        return
    cols = list(rows[0])
    addr = next(c for c in cols if "Address" in c)
    samp = next(c for c in cols if "Sampling" in c and "All" in c)
    execd = next((c for c in cols if c.startswith("Instructions Executed")), None)
    reasons = [c for c in cols if "stall" in c.lower() and "Sampling" not in c]     # per-reason columns, if any
    total = sum(_num(r[samp]) for r in rows) or 1.0
    print(f"{len(rows)} SASS instructions, {total:.0f} stall samples")
    sums = {c: sum(_num(r[c]) for r in rows) for c in reasons}
    for c, v in sorted(sums.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {c:50s} {v / total:6.1%}")
    print(f"top {top} instructions by samples (address, % of samples, executed, source):")
    for r in sorted(rows, key=lambda r: -_num(r[samp]))[:top]:
        why = sorted(((c, _num(r[c])) for c in reasons), key=lambda kv: -kv[1])[:2]
        why = ", ".join(f"{c} {v:.0f}" for c, v in why if v > 0)
        ex = r[execd] if execd else ""
        print(f"  {r[addr]:>8s} {_num(r[samp]) / total:6.2%} {ex:>12s}  {r['Source'][:70]:70s} {why}")


if __name__ == "__main__":
    summarise(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40)
