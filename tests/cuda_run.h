// The driver of one CUDA-check program (tests/cuda_check.py): included after
// the kernel's source, whose entry point is KNAME.
//
// Usage: PROGRAM DIR GX GY GZ BX BY BZ SMEM SCHEDULE COOP
//   DIR/manifest: one "name nbytes" line per array parameter, in parameter
//   order (inputs, then outputs); DIR/<i>.bin: each array's bytes; each is
//   written back to DIR/<i>.out. DIR/scalars: one "i VALUE" (int32) or
//   "f HEXBITS" (fp32) line per scalar parameter. G*: blocks per grid
//   dimension, B*: threads per block, SMEM: dynamic shared-memory bytes,
//   SCHEDULE: 0 or 1 (cuda_shim.h), COOP: 1 runs every block at once
//   (kernels with grid-wide barriers), 0 one block after another.
// Every array ends where an inaccessible page starts (and one sits before
// its first page); a fault is reported with the array, byte offset, block
// and thread. Exit code 0 on success, 3 on a check's failure (message on
// stderr), 2 on a usage error.
#pragma once

static constexpr long mqf_launch_bound = MQF_LAUNCH_BOUND;

namespace mqf {

struct Buffer {
  std::string name;
  size_t nbytes;
  char* base;
  size_t mapped;
  char* data;
};
inline std::vector<Buffer> buffers;
struct Scalar {
  char kind;
  int i;
  float f;
};
inline std::vector<Scalar> scalars;
inline std::vector<Block*> all_blocks;
inline std::vector<char*> stacks;
inline constexpr size_t STACK_BYTES = size_t(256) << 10;

[[noreturn]] void fail(const std::string& what) {
  char who[128];
  describe_thread(who, sizeof who, cur);
  std::fprintf(stderr, "%s: %s [%s]\n", kernel_name, what.c_str(), who);
  std::fflush(stderr);
  _exit(3);
}

inline void on_fault(int, siginfo_t* info, void*) {
  const char* p = static_cast<const char*>(info->si_addr);
  std::string msg = "access outside every array (address " + std::to_string(uintptr_t(p)) + ")";
  for (auto& b : buffers)
    if (p >= b.base && p < b.base + b.mapped)
      msg = "out-of-bounds access of array '" + b.name + "' at byte " + std::to_string(long(p - b.data)) +
            " (size " + std::to_string(b.nbytes) + " bytes)";
  for (Block* blk : live_blocks) {
    if (!(p >= blk->arena && p < blk->arena + ARENA_RESERVE)) continue;
    msg = "out-of-bounds access of shared memory at shared address " + std::to_string(long(p - blk->arena));
    const Alloc* best = nullptr;  // the allocation whose guard page this is: the nearest below
    for (auto& [s, a] : blk->statics)
      if (a.data <= p && (!best || a.data > best->data)) best = &a;
    Alloc dyn{"dynamic shared memory", blk->dyn, blk->dyn_bytes, nullptr};
    if (blk->dyn && blk->dyn <= p && (!best || blk->dyn > best->data)) best = &dyn;
    if (best)
      msg = "out-of-bounds access of shared array '" + best->name + "' at byte " + std::to_string(long(p - best->data)) +
            " (size " + std::to_string(best->bytes) + " bytes)";
  }
  for (char* s : stacks)
    if (p >= s && p < s + page_size) msg = "stack overflow of a thread (" + std::to_string(STACK_BYTES) + " bytes)";
  fail(msg);
}

// ---- context switch -----------------------------------------------------------------------------
#if defined(__x86_64__)
extern "C" void mqf_switch(void** save_sp, void* to_sp);
asm(R"(
  .text
  .globl mqf_switch
  .type mqf_switch,@function
mqf_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size mqf_switch, .-mqf_switch
)");
inline void* sched_sp = nullptr;
#else
inline ucontext_t sched_ctx;
#endif

inline std::function<void()> body;

[[noreturn]] void thread_exit();

extern "C" void mqf_fiber_entry() {
  body();
  thread_exit();
}

inline void switch_to(Fiber* f) {
  cur = f;
#if defined(__x86_64__)
  mqf_switch(&sched_sp, f->sp);
#else
  swapcontext(&sched_ctx, &f->uctx);
#endif
  cur = nullptr;
}

void yield(State s) {
  Fiber* f = cur;
  f->state = s;
#if defined(__x86_64__)
  mqf_switch(&f->sp, sched_sp);
#else
  swapcontext(&f->uctx, &sched_ctx);
#endif
  cur = f;  // resumed
}

inline void start_fiber(Fiber* f, char* stack) {
  f->stack = stack;
#if defined(__x86_64__)
  uint64_t* top = reinterpret_cast<uint64_t*>(stack + STACK_BYTES);
  *--top = 0;                                            // alignment: entry sees rsp % 16 == 8
  *--top = reinterpret_cast<uint64_t>(&mqf_fiber_entry);  // "return address"
  for (int i = 0; i < 6; i++) *--top = 0;                // rbp rbx r12-r15
  *--top = 0x037F00001F80ull;                            // mxcsr (low), x87 control word (high)
  f->sp = top;
#else
  getcontext(&f->uctx);
  f->uctx.uc_stack.ss_sp = stack + page_size;
  f->uctx.uc_stack.ss_size = STACK_BYTES - page_size;
  f->uctx.uc_link = nullptr;
  makecontext(&f->uctx, (void (*)())mqf_fiber_entry, 0);
#endif
}

// Stacks past the first GUARDED_STACKS (launches of many blocks x threads, e.g. a grid-barrier
// kernel's whole resident grid) come in chunks of one mapping each, their lowest page filled with
// CANARY bytes instead of made inaccessible: a guard page per stack would take two of the machine's
// vm.max_map_count memory mappings per thread. The canary's top bytes, where an overflow lands
// first, are checked whenever the thread yields (check_stack_canary).
inline constexpr size_t GUARDED_STACKS = 8192;
inline constexpr size_t STACK_CHUNK = 256;
inline constexpr size_t CANARY_CHECKED = 256;
inline constexpr unsigned char STACK_CANARY = 0xA7;

inline char* stack_for(size_t i) {
  while (stacks.size() <= i) {
    if (stacks.size() < GUARDED_STACKS) {
      char* s = (char*)mmap(nullptr, STACK_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (s == MAP_FAILED) fail("cannot map a thread's stack");
      protect_or_fail(s, page_size, PROT_NONE, "a thread's stack guard");  // overflow guard
      stacks.push_back(s);
      continue;
    }
    char* c = (char*)mmap(nullptr, STACK_BYTES * STACK_CHUNK, PROT_READ | PROT_WRITE,
                          MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (c == MAP_FAILED) fail("cannot map threads' stacks");
    for (size_t k = 0; k < STACK_CHUNK; k++) {
      char* s = c + k * STACK_BYTES;
      std::memset(s + page_size - CANARY_CHECKED, STACK_CANARY, CANARY_CHECKED);
      stacks.push_back(s);
    }
  }
  return stacks[i];
}

// A thread whose stack has no guard page: fail where it wrote into its stack's lowest page.
inline void check_stack_canary(const Fiber* f) {
  if (!f->stack_canary) return;
  const unsigned char* c = reinterpret_cast<const unsigned char*>(f->stack + page_size - CANARY_CHECKED);
  for (size_t k = 0; k < CANARY_CHECKED; k++)
    if (c[k] != STACK_CANARY) {
      cur = const_cast<Fiber*>(f);  // named in the failure
      fail("stack overflow of a thread (" + std::to_string(STACK_BYTES) + " bytes)");
    }
}

// ---- deadlock report ------------------------------------------------------------------------------
inline std::string where_waits(const Fiber* g) {
  switch (g->state) {
    case DONE: return "returned";
    case AT_BARRIER: return "waits at __syncthreads at " + site_str(g->site);
    case AT_WARP: return std::string("waits at ") + g->coll->what + " at " + site_str(g->site);
    case SPINNING: return "spins (a grid barrier or flag wait)";
    default: return "runnable";
  }
}

[[noreturn]] inline void fail_deadlock(const std::vector<Fiber*>& fs) {
  for (Fiber* f : fs)
    if (f->state == SPINNING) {
      cur = f;
      fail("spin-waits at " + site_str(f->spin_site) + " and no thread can make progress (a grid barrier or flag "
           "that is never reached: do all blocks arrive, is the target right?)");
    }
  for (Fiber* f : fs) {
    if (f->state != AT_WARP) continue;
    Coll* c = f->coll;
    unsigned missing = c->mask & ~c->arrived;
    for (Fiber* g : fs)
      if (g->blk == f->blk && g->warp == f->warp && (missing >> g->lane & 1)) {
        cur = f;
        fail(std::string(c->what) + " at " + site_str(c->site) + " (mask " + hex(c->mask) + ") never completes: lane " +
             std::to_string(g->lane) + " of the mask " + where_waits(g));
      }
  }
  for (Fiber* f : fs)
    if (f->state == AT_BARRIER)
      for (Fiber* g : fs)
        if (g->blk == f->blk && g->state != AT_BARRIER) {
          cur = f;
          char who[128];
          describe_thread(who, sizeof who, g);
          fail("__syncthreads at " + site_str(f->site) + " never completes: " + who + " " + where_waits(g));
        }
  fail("no thread can run");
}

// A thread returned: nothing may be waiting for it.
[[noreturn]] void thread_exit() {
  Fiber* f = cur;
  Block* b = f->blk;
  if (b->at_barrier > 0)
    fail("returned while " + std::to_string(b->at_barrier) + " threads of the block wait at __syncthreads at " +
         site_str(b->barrier_site) + " (a __syncthreads that not every thread reaches is undefined)");
  for (Coll* c : b->warp_colls)
    if (c->warp == f->warp && (c->mask >> f->lane & 1) && !(c->arrived >> f->lane & 1))
      fail(std::string("lane ") + std::to_string(f->lane) + " returned while lanes " + hex(c->arrived) + " wait for it at " +
           c->what + " at " + site_str(c->site) + " (mask " + hex(c->mask) + ")");
  if (!f->async_open.empty() || !f->async_groups.empty())
    fail("returned with wgmma results never waited for (wgmma_commit / wgmma_wait<0> missing)");
  b->done++;
  yield(DONE);
  __builtin_unreachable();
}

// ---- the scheduler ------------------------------------------------------------------------------
inline long epoch = 0;  // counts progress: see run_fibers

inline void run_fibers(const std::vector<Fiber*>& fs) {
  const size_t n = fs.size();
  size_t rr = 0;
  for (;;) {
    Fiber* pick = nullptr;
    if (schedule == 0) {
      for (size_t k = 0; k < n && !pick; k++) {
        size_t i = (rr + k) % n;
        if (fs[i]->state == READY) pick = fs[i], rr = i + 1;
      }
    } else {
      for (size_t i = n; i-- > 0 && !pick;)
        if (fs[i]->state == READY) pick = fs[i];
    }
    if (!pick) {
      size_t done = 0;
      for (Fiber* f : fs) done += f->state == DONE;
      if (done == n) return;
      // only spinners left: run one that has not looked since the last progress
      for (size_t k = 0; k < n && !pick; k++) {
        Fiber* f = fs[schedule == 0 ? k : n - 1 - k];
        if (f->state == SPINNING && f->seen_epoch != epoch) pick = f;
      }
      if (!pick) fail_deadlock(fs);
    }
    const bool was_spinning = pick->state == SPINNING;
    const std::source_location before = pick->spin_site;
    pick->state = READY;
    switch_to(pick);
    check_stack_canary(pick);
    // Progress is anything but a spinner polling again at the same place.
    if (!(was_spinning && pick->state == SPINNING && same_site(before, pick->spin_site))) epoch++;
    if (pick->state == SPINNING) pick->seen_epoch = epoch;
  }
}

inline Block* make_block(uint3 idx, size_t first_stack) {
  Block* b = new Block;
  b->idx = idx;
  arena_map(b);
  size_t n = size_t(block_dim.x) * block_dim.y * block_dim.z;
  for (size_t t = 0; t < n; t++) {
    Fiber* f = new Fiber;
    f->tid = uint3{unsigned(t % block_dim.x), unsigned(t / block_dim.x % block_dim.y),
                   unsigned(t / (size_t(block_dim.x) * block_dim.y))};
    f->linear = unsigned(t), f->lane = unsigned(t % 32), f->warp = unsigned(t / 32);
    f->blk = b;
    start_fiber(f, stack_for(first_stack + t));
    f->stack_canary = first_stack + t >= GUARDED_STACKS;
    b->fibers.push_back(f);
  }
  return b;
}

inline void end_block(Block* b) {
  cur = nullptr;
  check_canaries(b);
  munmap(b->arena, ARENA_RESERVE);
  for (Fiber* f : b->fibers) delete f;
  delete b;
}

// ---- the launch -----------------------------------------------------------------------------
template <typename T>
inline constexpr bool is_array_param = std::is_pointer_v<T>;

template <typename T>
T make_arg(size_t& ib, size_t& is) {
  if constexpr (std::is_pointer_v<T>) {
    return reinterpret_cast<T>(buffers[ib++].data);
  } else {
    const Scalar& s = scalars[is++];
    if constexpr (std::is_floating_point_v<T>) {
      if (s.kind != 'f') fail("scalar parameter " + std::to_string(is - 1) + " is a float; the launch passes an int");
      return T(s.f);
    } else {
      static_assert(std::is_integral_v<T> && sizeof(T) == 4, "scalar parameters are int32 or fp32");
      if (s.kind != 'i') fail("scalar parameter " + std::to_string(is - 1) + " is an int; the launch passes a float");
      return T(s.i);
    }
  }
}

template <typename... A>
void bind(void (*k)(A...)) {
  constexpr size_t nptr = (size_t(is_array_param<A>) + ... + size_t(0));
  constexpr size_t nscal = sizeof...(A) - nptr;
  constexpr bool ordered = [] {  // arrays first, then scalars (MLX's calling convention)
    bool seen_scalar = false, ok = true;
    ((seen_scalar && is_array_param<A> ? ok = false : (seen_scalar |= !is_array_param<A>)), ...);
    return ok;
  }();
  if (!ordered) fail("the kernel's array parameters do not all come before its scalars");
  if (nptr != buffers.size() || nscal != scalars.size())
    fail("the kernel takes " + std::to_string(nptr) + " arrays and " + std::to_string(nscal) +
         " scalars; the launch passes " + std::to_string(buffers.size()) + " arrays (inputs + outputs) and " +
         std::to_string(scalars.size()) + " scalars");
  size_t ib = 0, is = 0;
  std::tuple<A...> args{make_arg<A>(ib, is)...};
  body = [k, args] { std::apply(k, args); };
}

}  // namespace mqf

int main(int argc, char** argv) {
  using namespace mqf;
  if (argc != 12) {
    std::fprintf(stderr, "usage: %s DIR GX GY GZ BX BY BZ SMEM SCHEDULE COOP\n", argv[0]);
    return 2;
  }
  page_size = sysconf(_SC_PAGESIZE);
  std::string dir = argv[1];
  grid_dim = uint3{unsigned(std::atol(argv[2])), unsigned(std::atol(argv[3])), unsigned(std::atol(argv[4]))};
  block_dim = uint3{unsigned(std::atol(argv[5])), unsigned(std::atol(argv[6])), unsigned(std::atol(argv[7]))};
  dyn_smem_request = size_t(std::atol(argv[8]));
  schedule = std::atoi(argv[9]);
  const bool coop = std::atoi(argv[10]) == 1;
  kernel_name = argv[11];

  const size_t threads = size_t(block_dim.x) * block_dim.y * block_dim.z;
  if (threads == 0 || threads > 1024 || block_dim.z > 64)
    fail("a block of " + std::to_string(block_dim.x) + "x" + std::to_string(block_dim.y) + "x" +
         std::to_string(block_dim.z) + " threads: CUDA allows 1 to 1024 threads, z at most 64");
  if (grid_dim.x == 0 || grid_dim.y == 0 || grid_dim.z == 0 || grid_dim.y > 65535 || grid_dim.z > 65535)
    fail("a grid of " + std::to_string(grid_dim.x) + "x" + std::to_string(grid_dim.y) + "x" + std::to_string(grid_dim.z) +
         " blocks: each dimension must be at least 1, y and z at most 65535");
  if (mqf_launch_bound > 0 && long(threads) > mqf_launch_bound)
    fail("a block of " + std::to_string(threads) + " threads exceeds the kernel's __launch_bounds__(" +
         std::to_string(mqf_launch_bound) + ")");
  if (dyn_smem_request > SMEM_LIMIT) fail("dynamic shared memory of " + std::to_string(dyn_smem_request) + " bytes");

  std::ifstream man(dir + "/manifest");
  std::string name;
  size_t nbytes;
  while (man >> name >> nbytes) {
    size_t body_bytes = std::max<size_t>((nbytes + page_size - 1) / page_size * page_size, page_size);
    size_t mapped = body_bytes + 2 * page_size;
    char* base = (char*)mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) fail("cannot map array '" + name + "'");
    protect_or_fail(base, page_size, PROT_NONE, "an array's guard page");
    protect_or_fail(base + page_size + body_bytes, page_size, PROT_NONE, "an array's guard page");
    char* data = base + page_size + body_bytes - nbytes;
    size_t idx = buffers.size();
    std::ifstream in(dir + "/" + std::to_string(idx) + ".bin", std::ios::binary);
    in.read(data, std::streamsize(nbytes));
    buffers.push_back({name, nbytes, base, mapped, data});
  }
  std::ifstream sc(dir + "/scalars");
  std::string kind, value;
  while (sc >> kind >> value) {
    Scalar s{kind[0], 0, 0.0f};
    if (s.kind == 'i') s.i = int(std::stol(value));
    else s.f = std::bit_cast<float>(unsigned(std::stoul(value, nullptr, 16)));
    scalars.push_back(s);
  }

  struct sigaction sa {};
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  static char altstack[1 << 16];
  stack_t ss{};
  ss.ss_sp = altstack;
  ss.ss_size = sizeof altstack;
  sigaltstack(&ss, nullptr);
  sigaction(SIGSEGV, &sa, nullptr);
  sigaction(SIGBUS, &sa, nullptr);

  bind(KNAME);

  std::vector<uint3> order;
  for (unsigned z = 0; z < grid_dim.z; z++)
    for (unsigned y = 0; y < grid_dim.y; y++)
      for (unsigned x = 0; x < grid_dim.x; x++) order.push_back(uint3{x, y, z});
  if (coop) {  // one pool, ascending: schedule 1 runs the highest-numbered thread of the last block first
    std::vector<Fiber*> fs;
    for (size_t i = 0; i < order.size(); i++) {
      Block* b = make_block(order[i], i * threads);
      live_blocks.push_back(b);
      fs.insert(fs.end(), b->fibers.begin(), b->fibers.end());
    }
    run_fibers(fs);
    for (Block* b : live_blocks) end_block(b);
    live_blocks.clear();
  } else {
    if (schedule == 1) std::reverse(order.begin(), order.end());
    for (const uint3& idx : order) {
      Block* b = make_block(idx, 0);
      live_blocks.assign(1, b);
      std::vector<Fiber*> fs(b->fibers.begin(), b->fibers.end());
      run_fibers(fs);
      end_block(b);
      live_blocks.clear();
    }
  }
  for (size_t i = 0; i < buffers.size(); i++) {
    std::ofstream out(dir + "/" + std::to_string(i) + ".out", std::ios::binary);
    out.write(buffers[i].data, std::streamsize(buffers[i].nbytes));
  }
  return 0;
}
