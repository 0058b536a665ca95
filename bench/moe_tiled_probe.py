"""Probe: expert SwiGLU through gather_qmm on row tiles vs stock's one-row gather.

Stock mlx-lm sorts the T*k assignments by expert and calls gather_qmm with one
row per matrix (M=1). Here the sorted rows are packed into fixed-size tiles
of one expert each (padding rows zero, worst-case tile count
ceil(T*k/tile)+E, so no data-dependent shapes), and gather_qmm multiplies a
[tile, D] block per tile. Prints a table: variant, T, ms, TFLOP/s, max error.

    python -m bench.moe_tiled_probe --tokens 512,2048,4096 --tiles 8,16,32,64
"""

import argparse
import time

import mlx.core as mx
import mlx.nn as nn


def tiled_layout(inds, num_experts, tile):
    """Sorted order and padded tile layout of the assignments (all on device)."""
    flat = inds.flatten().astype(mx.int32)
    n = flat.size
    order = mx.argsort(flat)
    sorted_e = flat[order]
    counts = mx.zeros((num_experts,), mx.int32).at[flat].add(1)
    offsets = mx.cumsum(counts) - counts
    tiles_per_e = (counts + tile - 1) // tile
    tile_end = mx.cumsum(tiles_per_e)
    tile_start = tile_end - tiles_per_e
    max_tiles = (n + tile - 1) // tile + num_experts
    rank = mx.arange(n, dtype=mx.int32) - offsets[sorted_e]
    dest = (tile_start[sorted_e] + rank // tile) * tile + rank % tile
    src = mx.zeros((max_tiles * tile,), mx.int32).at[dest].add(order + 1) - 1
    tile_expert = (tile_end[None, :] <= mx.arange(max_tiles)[:, None]).sum(-1)
    tile_expert = mx.minimum(tile_expert, num_experts - 1).astype(mx.uint32)
    return order, dest, src, tile_expert, max_tiles


def qmm(x, layer, idx):
    return mx.gather_qmm(
        x, layer["weight"], layer["scales"], layer["biases"], rhs_indices=idx,
        transpose=True, group_size=64, bits=4, sorted_indices=True,
    )


def tiled_swiglu(x, inds, scores, layers, tile):
    gate, up, down = layers
    E = gate["weight"].shape[0]
    N, D = x.shape
    k = inds.shape[1]
    order, dest, src, tile_expert, max_tiles = tiled_layout(inds, E, tile)
    valid = (src >= 0)[:, None]
    rows = mx.where(valid, x[mx.maximum(src, 0) // k], 0).reshape(max_tiles, tile, D)
    h = nn.silu(qmm(rows, gate, tile_expert)) * qmm(rows, up, tile_expert)
    y = qmm(h, down, tile_expert).reshape(max_tiles * tile, D)
    y_sorted = y[dest]
    y_assign = mx.zeros_like(y_sorted).at[order].add(y_sorted)
    return (y_assign.reshape(N, k, D) * scores[..., None]).sum(1)


def stock_swiglu(x, inds, scores, layers):
    gate, up, down = layers
    N, D = x.shape
    k = inds.shape[1]
    flat = inds.flatten()
    order = mx.argsort(flat)
    inv = mx.argsort(order)
    xs = x[order // k][:, None, :]
    idx = flat[order]
    h = nn.silu(qmm(xs, gate, idx)) * qmm(xs, up, idx)
    y = qmm(h, down, idx)[inv].reshape(N, k, D)
    return (y * scores[..., None]).sum(1)


def random_layer(E, out_dim, in_dim):
    w = mx.random.normal((E, out_dim, in_dim)) * in_dim**-0.5
    wq, s, b = mx.quantize(w.astype(mx.bfloat16), group_size=64, bits=4)
    mx.eval(wq, s, b)
    return {"weight": wq, "scales": s, "biases": b}


def bench(fn, reps=10):
    mx.eval(fn())
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="512,2048,4096")
    p.add_argument("--tiles", default="8,16,32,64")
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=512)
    p.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of expert popularity")
    a = p.parse_args()
    E, k, D, I = a.experts, a.top_k, a.hidden, a.inter
    layers = (random_layer(E, I, D), random_layer(E, I, D), random_layer(E, D, I))
    rows = []
    for T in [int(t) for t in a.tokens.split(",")]:
        x = mx.random.normal((T, D)).astype(mx.bfloat16)
        bias = -a.skew * mx.log(mx.arange(1, E + 1).astype(mx.float32))
        logits = mx.random.normal((T, E)) + bias
        inds = mx.argpartition(-logits, kth=k - 1, axis=-1)[:, :k].astype(mx.uint32)
        scores = mx.softmax(mx.take_along_axis(logits, inds.astype(mx.int32), -1), -1)
        flops = 2 * T * k * 3 * D * I
        ref = stock_swiglu(x, inds, scores, layers)
        ms = bench(lambda: stock_swiglu(x, inds, scores, layers)) * 1e3
        rows.append(("stock-gather", T, ms, flops / ms / 1e9, 0.0))
        for tile in [int(t) for t in a.tiles.split(",")]:
            out = tiled_swiglu(x, inds, scores, layers, tile)
            err = (mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max()
                   / mx.abs(ref.astype(mx.float32)).max()).item()
            ms = bench(lambda: tiled_swiglu(x, inds, scores, layers, tile)) * 1e3
            rows.append((f"tiled-{tile}", T, ms, flops / ms / 1e9, err))
    print(f"{'variant':<14}{'T':>6}{'ms':>10}{'TFLOP/s':>10}{'max rel err':>14}")
    for r in rows:
        print(f"{r[0]:<14}{r[1]:>6}{r[2]:>10.3f}{r[3]:>10.2f}{r[4]:>14.2e}")


if __name__ == "__main__":
    main()
