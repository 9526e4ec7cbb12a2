"""`rewrite apply` time and peak memory per stage on tiny, mid and full models, side by side in one run.

Models: Qwen1.5-MoE (``qwen2_moe``) exported by transformers' exporter with seeded weights
(``examples/qwen_moe.py --weights seeded``: tiny 2 layers, mid 8 layers hidden 1024, full the real
Qwen1.5-MoE-A2.7B, 28.6 GB in fp16), reused from ``--work`` when already there. Each (size, backend) runs
``rewrite apply MODEL --plugins P --max-seq 256 --backend B --stages stages.json --quiet`` in its own process;
printed are the weights, the wall time and the peak resident memory of the whole command (the child's own
``ru_maxrss`` from ``wait4``, its compiler and importer children included), its stages (load, each plugin, save, import, compile), and the ratio of peak memory to
the weights' size.

Run: ``python benchmarks/apply_scaling.py --work /tmp/scaling --sizes tiny,mid,full --backends ort,iree``
(the full model needs ~30 GB of disk for the export and as much again for the outputs; an IREE run of it, about
15 GB of INT8-coded experts, is compiled by iree-compile).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

PLUGINS = "quant4,cast,legalize,expand,kv,topk,moe"


def export(size: str, dtype: str, work: Path) -> Path:
    """The seeded export of ``size`` under ``work`` (made once; exports are deterministic)."""
    out = work / f"qwen2_moe_{size}_{dtype}"
    path = out / "model.onnx"
    if not path.exists():
        subprocess.run([sys.executable, str(ROOT / "examples" / "qwen_moe.py"), "--arch", "qwen2_moe", "--size", size,
                        "--dtype", dtype, "--weights", "seeded", "--out", str(out)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return path


def weight_bytes(path: Path) -> int:
    data = path.with_name(path.name + ".data")
    return (data.stat().st_blocks * 512 if data.exists() else 0) + path.stat().st_size


def run_apply(model: Path, backend: str, target: str, out: Path, extra: list[str]) -> dict:
    """One ``rewrite apply`` in a child process: wall seconds, the child's peak RSS (MiB) and its stages."""
    shutil.rmtree(out, ignore_errors=True)
    stages = out.with_name(out.name + ".stages.json")
    cmd = [shutil.which("rewrite") or "rewrite", "apply", str(model), "--plugins", PLUGINS, "--max-seq", "256",
           "--backend", backend, "--target", target, "-o", str(out), "--stages", str(stages), "--quiet", *extra]
    log = out.with_name(out.name + ".log")
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak (and its children's), not the session's
    seconds = time.perf_counter() - start
    peak = usage.ru_maxrss
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{log.read_text()[-2000:]}")
    return dict(seconds=seconds, peak_mb=peak / 1024, stages=json.loads(stages.read_text()))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--sizes", default="tiny,mid,full")
    parser.add_argument("--backends", default="ort,iree", help="ort, iree (llvm-cpu), iree-cuda (compile only)")
    parser.add_argument("--dtype", default="fp16")
    parser.add_argument("--keep", action="store_true", help="keep the output folders")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    rows = []
    for size in args.sizes.split(","):
        model = export(size, args.dtype, args.work)
        gb = weight_bytes(model) / 1e9
        for be in args.backends.split(","):
            backend, target = {"ort": ("ort", "cpu"), "iree": ("iree", "llvm-cpu"), "iree-cuda": ("iree", "cuda")}[be]
            out = args.work / f"out_{size}_{be}"
            r = run_apply(model, backend, target, out, [])
            rows.append((size, be, gb, r))
            print(f"{size:5} {be:9} weights {gb:7.3f} GB  apply {r['seconds']:7.1f} s  peak RSS {r['peak_mb'] / 1024:6.2f} GiB"
                  f"  peak/weights {r['peak_mb'] * 2**20 / 1e9 / gb:6.3f}", flush=True)
            for s in r["stages"]:
                print(f"      {s['name']:22} {s['seconds']:8.2f} s  rss {s['rss_mb'] / 1024:6.2f} GiB  "
                      f"peak {s['peak_rss_mb'] / 1024:6.2f} GiB  child peak {s['children_peak_rss_mb'] / 1024:6.2f} GiB")
            if not args.keep:
                shutil.rmtree(out, ignore_errors=True)
    print("\nsize  backend   weights GB  apply s  peak GiB  peak/weights")
    for size, be, gb, r in rows:
        print(f"{size:5} {be:9} {gb:10.3f} {r['seconds']:8.1f} {r['peak_mb'] / 1024:9.2f} {r['peak_mb'] * 2**20 / 1e9 / gb:13.3f}")


if __name__ == "__main__":
    main()
