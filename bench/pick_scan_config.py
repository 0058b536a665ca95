"""Print the fastest Gated DeltaNet scan configuration that passed every check.

Reads the JSON of ``bench/gdn_cuda.py --sections scan`` and prints
``L,R,warps,TB,kqf32,U`` of the configuration with the lowest single-call
time at B = 1, T = 4096 among those whose every check passed (the default
configuration when none did)::

    python3 bench/pick_scan_config.py OUT/gdn_scan.json
"""

import json
import re
import sys


def pick(result: dict, default=(8, 2, 4, 32, 0, 1)) -> tuple:
    bad = {tuple(c["cfg"]) for c in result.get("checks", [])
           if isinstance(c.get("cfg"), list) and not c.get("ok")}
    checked = {tuple(c["cfg"]) for c in result.get("checks", []) if isinstance(c.get("cfg"), list)}
    best, best_t = tuple(default), None
    for key, t in result.get("timings", {}).items():
        m = re.fullmatch(r"scan B=1 T=4096 cfg=\[([\d, ]+)\]", key)
        if not m:
            continue
        cfg = tuple(int(x) for x in m.group(1).split(","))
        if cfg in checked and cfg not in bad and (best_t is None or t < best_t):
            best, best_t = cfg, t
    return best


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(",".join(map(str, pick(json.load(f)))))
