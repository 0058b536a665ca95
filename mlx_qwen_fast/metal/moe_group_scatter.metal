// Grouping of the prefill MoE's assignments by expert, stage 2 of 2: counts,
// offsets, the stable grouping permutation and the block map; the body of an
// mx.fast.metal_kernel (kernels/moe_group_metal.py builds it; MLX adds the
// signature). Stage 1 (moe_group_count.metal) wrote part [C, E], chunk c's
// count of expert e, over the same C chunks (the same grid).
// Contract: ops/moe/naive.py (group_by_expert, block_map), exactly: the
// order is the stable one (assignments of one expert in increasing order).
//
// Every threadgroup c (TPG threads; thread e < E stands for expert e):
//   1. total[e] = sum over chunks of part[., e], before[e] = the same over the
//      chunks before c; tiles[e] = ceil(total[e] / BM);
//   2. exclusive scans of total and tiles over the experts (simd prefix sums
//      within each SIMD group, then the SIMD groups' totals added from
//      threadgroup memory): offsets[e] and the first block-map item of e;
//   3. threadgroup 0 writes counts [E] and offsets [E + 1];
//   4. block-map items i = c TPG + t, stepping by C TPG: item i < (tiles in
//      all) is (e, i - first item of e), e found by a binary search of the
//      inclusive tile scan; items past them are (-1, -1);
//   5. chunk c's ids are staged 1024 at a time (as stage 1); thread e walks
//      them in order and gives each assignment a of expert e the next grouped
//      row r from offsets[e] + before[e] on: order[r] = a, sorted_experts[r]
//      = e, inverse[a] = r. Rows of one expert come chunk by chunk, each
//      chunk's in increasing a: the stable order, with no atomics.
// Ids are clamped into [0, E) as in stage 1.
//
// Inputs: inds [N, K] int32 or uint32, part [C, E] int32. Outputs: counts
// [E], offsets [E + 1], order [NK], sorted_experts [NK], inverse [NK],
// block_map [MT, 2], all int32, NK = N K, MT = ceil(NK / BM) + E.
// Template: E (experts, 1..1024), BM (rows per block-map tile, >= 1).
// Launch: as stage 1 (grid C TPG threads, threadgroup TPG = 32 ceil(E / 32)).

    constexpr int TPG = 32 * ((E + 31) / 32);
    constexpr int NSG = TPG / 32;  // SIMD groups
    constexpr int STAGE = 1024;
    threadgroup int ids[STAGE];
    threadgroup int sg_count[NSG];  // each SIMD group's sum of total, and of tiles
    threadgroup int sg_tiles[NSG];
    threadgroup int tile_end[TPG];  // inclusive scan of tiles over the experts
    const int NK = int(inds_shape[0]) * int(inds_shape[1]);
    const int MT = (NK + BM - 1) / BM + E;
    const int C = int(threadgroups_per_grid.x);
    const int chunk = (NK + C - 1) / C;
    const int c = int(threadgroup_position_in_grid.x);
    const int t = int(thread_index_in_threadgroup);
    const uint lane = thread_index_in_simdgroup;
    const uint sgi = simdgroup_index_in_threadgroup;

    // 1. this thread's expert over all chunks, and over the chunks before c
    int total = 0;
    int before = 0;
    if (t < E) {
        for (int q = 0; q < C; q++) {
            int v = part[q * E + t];
            total += v;
            before += q < c ? v : 0;
        }
    }
    const int tiles = (total + BM - 1) / BM;

    // 2. exclusive scans over the experts
    int off = simd_prefix_exclusive_sum(total);
    int first = simd_prefix_exclusive_sum(tiles);
    if (lane == 31) {
        sg_count[sgi] = off + total;
        sg_tiles[sgi] = first + tiles;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    int all_tiles = 0;
    for (int g = 0; g < NSG; g++) {
        if (g < int(sgi)) {
            off += sg_count[g];
            first += sg_tiles[g];
        }
        all_tiles += sg_tiles[g];
    }
    tile_end[t] = first + tiles;

    // 3. counts and offsets
    if (c == 0 && t < E) {
        counts[t] = total;
        offsets[t] = off;
        if (t == E - 1) {
            offsets[E] = off + total;
        }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // 4. the block map
    for (int i = c * TPG + t; i < MT; i += C * TPG) {
        int e = -1;
        int tile = -1;
        if (i < all_tiles) {
            int lo = 0;
            int hi = E - 1;
            while (lo < hi) {  // the first expert whose tiles end past item i
                int mid = (lo + hi) / 2;
                if (tile_end[mid] > i) {
                    hi = mid;
                } else {
                    lo = mid + 1;
                }
            }
            e = lo;
            tile = i - (e == 0 ? 0 : tile_end[e - 1]);
        }
        block_map[2 * i] = e;
        block_map[2 * i + 1] = tile;
    }

    // 5. chunk c's assignments to their grouped rows
    const int start = metal::min(c * chunk, NK);
    const int end = metal::min(start + chunk, NK);
    int row = off + before;
    for (int base = start; base < end; base += STAGE) {
        const int len = metal::min(STAGE, end - base);
        for (int i = t; i < len; i += TPG) {
            ids[i] = int(metal::min(uint(inds[base + i]), uint(E - 1)));
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (int i = 0; i < len; i++) {
            if (ids[i] == t) {
                const int a = base + i;
                order[row] = a;
                sorted_experts[row] = t;
                inverse[a] = row;
                row++;
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
