"""Whether a change to the CUDA sources changed the GPU code: every kernel
configuration in a record of the CUDA check compiled by nvcc from two trees,
cubins compared byte for byte.

For source changes meant to leave the machine code alone (helpers moved,
comments, the CPU branches of ``ptx.cuh``): identical cubins show the GPU
runs what it ran before, without a GPU. Needs ``nvcc``; ``KNAME`` is fixed
(the package's kernel names hash the source text), and the hash nvcc puts
into the names of a source's internal-linkage symbols (``_INTERNAL_<8 hex>_``,
``_GLOBAL__N__<8 hex>_``:
a ``__device__`` variable in an anonymous namespace, such as a grid
barrier's counter) is masked before hashing (it follows the file's text, so
any edit of that file changes it; the names keep their length, the rest of
the cubin its bytes).

Usage::

    MQF_CUDA_CHECK_RECORD=/tmp/configs.jsonl python -m pytest -q -m cpu_check tests
    git worktree add /tmp/old <commit>
    python -m bench.cubin_identity /tmp/old . /tmp/configs.jsonl [--arch sm_90a]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def cubin_hash(root: Path, source: str, defines: dict, arch: str, out: Path) -> str:
    """sha256 of ``source`` (in root/mlx_qwen_fast/cuda) built by nvcc, or "error: ..."."""
    cuda = root / "mlx_qwen_fast" / "cuda"
    defs = [f"-D{k}={v}" for k, v in sorted(defines.items())]
    r = subprocess.run(["nvcc", "-cubin", "-std=c++17", "-O3", f"-gencode=arch=compute_{arch[3:]},code={arch}",
                        f"-I{cuda}", "-DKNAME=k", *defs, "-o", str(out), str(cuda / source)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return "error: " + r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "error"
    return hashlib.sha256(_INTERNAL.sub(rb"\g<1>00000000_", out.read_bytes())).hexdigest()


#: nvcc's per-source hash in the names of internal-linkage symbols.
_INTERNAL = re.compile(rb"(_INTERNAL_|_GLOBAL__N__)[0-9a-f]{8}_")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path, help="the tree before the change")
    ap.add_argument("new", type=Path, help="the tree after it")
    ap.add_argument("record", type=Path, help="MQF_CUDA_CHECK_RECORD output (JSON lines)")
    ap.add_argument("--arch", default="sm_90a")
    args = ap.parse_args(argv)
    packaged = {p.name for p in (args.new / "mlx_qwen_fast" / "cuda").glob("*.cu")}
    configs = {}
    for line in args.record.read_text().splitlines():
        source, defines = json.loads(line)
        if source in packaged:
            configs[(source, json.dumps(defines, sort_keys=True))] = (source, defines)
    tmp = Path(tempfile.mkdtemp(prefix="cubin-identity-"))

    def one(item):
        i, (source, defines) = item
        a = cubin_hash(args.old, source, defines, args.arch, tmp / f"old{i}.cubin")
        b = cubin_hash(args.new, source, defines, args.arch, tmp / f"new{i}.cubin")
        return source, defines, a, b

    with ThreadPoolExecutor(2) as ex:
        results = list(ex.map(one, enumerate(configs.values())))
    same = [r for r in results if r[2] == r[3] and not r[2].startswith("error")]
    for source, defines, a, b in results:
        if a != b or a.startswith("error"):
            print(f"DIFFERENT {source} {defines}: {a[:16]} vs {b[:16]}")
    per_file = {}
    for r in same:
        per_file[r[0]] = per_file.get(r[0], 0) + 1
    print(f"{len(same)}/{len(results)} configurations byte-identical ({args.arch}); per source: "
          + ", ".join(f"{k} {v}" for k, v in sorted(per_file.items())))
    return 0 if len(same) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
