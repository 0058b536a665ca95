"""Print the fastest Gated DeltaNet scan configuration that passed every check.

Reads the JSON of ``bench/gdn_cuda.py --sections scan`` and prints
``L,R,warps,TB,kqf32,U`` of the configuration with the lowest time at B = 1,
T = 4096 (the key ``scan B=1 T=4096 cfg=[...]``: chained latency since the
third 2026-12-01 session, one call per evaluation in JSONs before it) among
those whose every check passed and that are still valid ScanConfigs (the
default configuration when none is)::

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
        if len(cfg) != len(default) or not isinstance(t, (int, float)):
            continue  # a configuration of another kernel version, or no time
        if cfg in checked and cfg not in bad and (best_t is None or t < best_t):
            best, best_t = cfg, t
    return best


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: python3 {sys.argv[0]} GDN_SCAN_JSON")
    try:
        with open(sys.argv[1]) as f:
            result = json.load(f)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{sys.argv[0]}: cannot read {sys.argv[1]}: {exc}")
    if not isinstance(result, dict):
        raise SystemExit(f"{sys.argv[0]}: {sys.argv[1]} is not a gdn_cuda.py scan result (a JSON object)")
    print(",".join(map(str, pick(result))))
