"""The launches and copy traffic of compiled IREE folders side by side, from iree-compile's stream IR
(:mod:`rewrite.backends.iree_census`; no GPU needed):

    python benchmarks/stream_census.py out_a/ out_b/ ... [--flag=--iree-some-option]

Each folder is one ``rewrite apply --backend iree`` wrote. A folder compiled with ``--stateful`` shows the KV cache
copies the stateful module makes (BENCHMARKS.md, "attention on CUDA").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rewrite.backends.errors import BackendError
from rewrite.backends.iree_census import census


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--flag", action="append", default=[], help="an iree-compile flag to add (repeatable)")
    args = ap.parse_args()
    print(f"{'folder':<40} {'dispatches':>10} {'copies':>7} {'fills':>6} {'launches':>9} {'bindings':>9} {'MB copied':>10} {'>=1 MiB':>8}")
    for folder in args.folders:
        try:
            c = census(folder, args.flag)
        except BackendError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        launches = c["dispatches"] + c["copies"] + c["fills"]
        print(f"{str(folder):<40} {c['dispatches']:>10} {c['copies']:>7} {c['fills']:>6} {launches:>9} {c['bindings']:>9} "
              f"{c['copy_bytes'] / 1e6:>10.1f} {c['big_copies']:>8}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
