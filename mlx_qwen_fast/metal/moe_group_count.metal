// Grouping of the prefill MoE's assignments by expert, stage 1 of 2: the
// per-chunk histogram; the body of an mx.fast.metal_kernel
// (kernels/moe_group_metal.py builds it; MLX adds the signature). Stage 2 is
// moe_group_scatter.metal. Contract: ops/moe/naive.py (group_by_expert).
//
// The N K assignments (a = n K + j, row-major inds) are cut into C chunks of
// ceil(N K / C), C = the grid's threadgroups; threadgroup c counts chunk c.
// Its TPG threads stage the chunk's ids in threadgroup memory, 1024 at a
// time; thread e < E then counts the staged ids equal to e (each thread reads
// every staged id: no atomics, so the counts, and stage 2's order, do not
// depend on the order threads run in).
// Ids are clamped into [0, E) (an id out of range is counted as E - 1: the
// wrapper checks the range; memory stays safe either way).
//
// Inputs: inds [N, K] int32 or uint32. Output: part [C, E] int32 (chunk c's
// count of expert e). Template: E (experts, 1..1024). Launch: grid C TPG
// threads, threadgroup TPG = 32 ceil(E / 32).

    constexpr int TPG = 32 * ((E + 31) / 32);
    constexpr int STAGE = 1024;  // ids staged per round
    threadgroup int ids[STAGE];
    const int NK = int(inds_shape[0]) * int(inds_shape[1]);
    const int C = int(threadgroups_per_grid.x);
    const int chunk = (NK + C - 1) / C;
    const int c = int(threadgroup_position_in_grid.x);
    const int t = int(thread_index_in_threadgroup);
    const int start = metal::min(c * chunk, NK);
    const int end = metal::min(start + chunk, NK);

    int count = 0;
    for (int base = start; base < end; base += STAGE) {
        const int len = metal::min(STAGE, end - base);
        for (int i = t; i < len; i += TPG) {
            ids[i] = int(metal::min(uint(inds[base + i]), uint(E - 1)));
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (int i = 0; i < len; i++) {
            count += ids[i] == t ? 1 : 0;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    if (t < E) {
        part[c * E + t] = count;
    }
