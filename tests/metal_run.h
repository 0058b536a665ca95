// The driver of one metal_check program: included after the kernel source
// and the generated mqf_body() (which calls the kernel with mqf_buf[] and
// the calling fiber's attributes). Usage: PROGRAM DIR GX GY GZ TX TY TZ;
// DIR/manifest lists "name nbytes" per buffer in buffer order, DIR/<i>.bin
// holds each buffer's initial bytes; each buffer is written back to
// DIR/<i>.out. Every buffer ends at a page boundary followed by an
// inaccessible page, so a read or write past its end faults; the fault is
// reported with the buffer's name. SCHEDULE 0 runs every runnable fiber in
// turn until it blocks, then releases the SIMD groups and barriers that are
// complete; SCHEDULE 1 always runs the lowest-numbered runnable fiber and
// releases a SIMD group's collective as soon as its last lane arrives, so
// those lanes run ahead of the rest of the group. A kernel whose outputs
// differ between the two reads memory that another thread writes without a
// barrier between them.
#pragma once
// (its system headers are included by metal_shim.h, before the address-space macros)

namespace mqf {
// (the buffer registry, mqf::buffers, is metal_shim.h's: its simdgroup_matrix
// loads and stores check element addresses against it)
inline void on_fault(int, siginfo_t* info, void*) {
  char* p = static_cast<char*>(info->si_addr);
  char msg[256];
  std::snprintf(msg, sizeof msg, "access outside every buffer at %p", (void*)p);
  for (auto& b : buffers) {
    if (p >= b.base && p < b.base + b.mapped) {
      long off = long(p - b.data);
      std::snprintf(msg, sizeof msg, "out-of-bounds access of buffer '%s' at byte %ld (size %zu bytes)",
                    b.name.c_str(), off, b.nbytes);
    }
  }
  fail(msg);
}

inline void trampoline();
}  // namespace mqf

static void mqf_trampoline() {
  mqf_body();
  mqf::cur->state = mqf::DONE;
  swapcontext(&mqf::cur->ctx, &mqf::sched_ctx);
}

int main(int argc, char** argv) {
  if (argc != 9) {
    std::fprintf(stderr, "usage: %s DIR GX GY GZ TX TY TZ SCHEDULE\n", argv[0]);
    return 2;
  }
  const bool eager = std::atoi(argv[8]) == 1;
  std::string dir = argv[1];
  uint grid[3], tg[3];
  for (int i = 0; i < 3; i++) {
    grid[i] = uint(std::atol(argv[2 + i]));
    tg[i] = std::min<uint>(uint(std::atol(argv[5 + i])), grid[i]);  // MLX: min(threadgroup, grid)
  }
  std::ifstream man(dir + "/manifest");
  std::string name;
  size_t nbytes;
  long page = sysconf(_SC_PAGESIZE);
  while (man >> name >> nbytes) {
    size_t body = (nbytes + page - 1) / page * page;
    size_t mapped = body + 2 * page;
    char* base = (char*)mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    mprotect(base, page, PROT_NONE);
    mprotect(base + page + body, page, PROT_NONE);
    char* data = base + page + body - nbytes;
    int idx = int(mqf::buffers.size());
    std::ifstream in(dir + "/" + std::to_string(idx) + ".bin", std::ios::binary);
    in.read(data, std::streamsize(nbytes));
    mqf::buffers.push_back({name, nbytes, base, mapped, data});
    mqf_buf[idx] = data;
  }
  struct sigaction sa {};
  sa.sa_sigaction = mqf::on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  static char altstack[1 << 16];
  stack_t ss{};
  ss.ss_sp = altstack;
  ss.ss_size = sizeof altstack;
  sigaltstack(&ss, nullptr);
  sigaction(SIGSEGV, &sa, nullptr);
  sigaction(SIGBUS, &sa, nullptr);

  const size_t stack_bytes = 1 << 17;
  std::vector<mqf::Fiber> fibers;
  std::vector<char*> stacks;
  uint groups[3];
  for (int i = 0; i < 3; i++) groups[i] = (grid[i] + tg[i] - 1) / tg[i];
  for (uint gz = 0; gz < groups[2]; gz++)
    for (uint gy = 0; gy < groups[1]; gy++)
      for (uint gx = 0; gx < groups[0]; gx++) {
        uint g[3] = {gx, gy, gz}, ext[3];
        for (int i = 0; i < 3; i++) ext[i] = std::min(tg[i], grid[i] - g[i] * tg[i]);
        size_t n = size_t(ext[0]) * ext[1] * ext[2];
        fibers.assign(n, mqf::Fiber{});
        while (stacks.size() < n) stacks.push_back((char*)std::malloc(stack_bytes));
        mqf::fibers = &fibers;
        mqf::group_id++;
        for (size_t t = 0; t < n; t++) {
          auto& f = fibers[t];
          uint lx = uint(t % ext[0]), ly = uint((t / ext[0]) % ext[1]), lz = uint(t / (size_t(ext[0]) * ext[1]));
          auto& a = f.a;
          a.thread_position_in_threadgroup = vec<uint, 3>(lx, ly, lz);
          a.threadgroup_position_in_grid = vec<uint, 3>(gx, gy, gz);
          a.thread_position_in_grid = vec<uint, 3>(gx * tg[0] + lx, gy * tg[1] + ly, gz * tg[2] + lz);
          a.threads_per_threadgroup = vec<uint, 3>(ext[0], ext[1], ext[2]);
          a.threads_per_grid = vec<uint, 3>(grid[0], grid[1], grid[2]);
          a.threadgroups_per_grid = vec<uint, 3>(groups[0], groups[1], groups[2]);
          a.thread_index_in_threadgroup = uint(t);
          a.thread_index_in_simdgroup = uint(t % 32);
          a.simdgroup_index_in_threadgroup = uint(t / 32);
          a.threads_per_simdgroup = 32;
          a.simdgroups_per_threadgroup = uint((n + 31) / 32);
          getcontext(&f.ctx);
          f.ctx.uc_stack.ss_sp = stacks[t];
          f.ctx.uc_stack.ss_size = stack_bytes;
          f.ctx.uc_link = nullptr;
          makecontext(&f.ctx, mqf_trampoline, 0);
        }
        auto simd_complete = [&](size_t s) {  // live lanes of SIMD group s all at one collective
          size_t e = std::min(n, s + 32), live = 0, at = 0;
          for (size_t i = s; i < e; i++) {
            if (fibers[i].state == mqf::DONE) continue;
            live++;
            at += fibers[i].state == mqf::AT_SIMD;
          }
          return at > 0 && at == live;
        };
        for (;;) {
          if (eager) {
            for (size_t i = 0; i < n;) {  // lowest runnable first; a completed collective runs on at once
              if (fibers[i].state != mqf::RUN) { i++; continue; }
              mqf::cur = &fibers[i];
              swapcontext(&mqf::sched_ctx, &fibers[i].ctx);
              size_t s = i / 32 * 32;
              if (fibers[i].state == mqf::AT_SIMD && simd_complete(s)) {
                const mqf::Fiber* first = nullptr;
                for (size_t j = s; j < std::min(n, s + 32); j++) {
                  if (fibers[j].state != mqf::AT_SIMD) continue;
                  if (first && !mqf::same_point(*first, fibers[j])) mqf::fail_diverged(*first, fibers[j]);
                  if (!first) first = &fibers[j];
                }
                for (size_t j = s; j < std::min(n, s + 32); j++)
                  if (fibers[j].state == mqf::AT_SIMD) fibers[j].state = mqf::RUN;
                i = s;
              } else {
                i++;
              }
            }
          } else {
            for (auto& f : fibers) {
              if (f.state != mqf::RUN) continue;
              mqf::cur = &f;
              swapcontext(&mqf::sched_ctx, &f.ctx);
            }
          }
          mqf::cur = nullptr;
          std::snprintf(mqf::where, sizeof mqf::where, "threadgroup %u,%u,%u", gx, gy, gz);
          size_t done = 0, barrier = 0;
          for (auto& f : fibers) done += f.state == mqf::DONE, barrier += f.state == mqf::AT_BARRIER;
          if (done == n) break;
          bool released = false;
          for (size_t s = 0; s < n; s += 32) {  // SIMD groups whose live lanes all wait at one collective
            size_t e = std::min(n, s + 32), live = 0, at = 0;
            const mqf::Fiber *first = nullptr, *other = nullptr;  // other: one at a different point than first
            for (size_t i = s; i < e; i++) {
              if (fibers[i].state == mqf::DONE) continue;
              live++;
              if (fibers[i].state == mqf::AT_SIMD) {
                at++;
                if (!first) first = &fibers[i];
                else if (!other && !mqf::same_point(*first, fibers[i])) other = &fibers[i];
              }
            }
            if (at == 0) continue;
            if (at != live)
              mqf::fail("SIMD group diverged: some lanes wait at a simd_* collective, others at a threadgroup barrier");
            if (other) mqf::fail_diverged(*first, *other);
            for (size_t i = s; i < e; i++)
              if (fibers[i].state == mqf::AT_SIMD) fibers[i].state = mqf::RUN;
            released = true;
          }
          if (released) continue;
          if (done > 0 && barrier > 0)
            mqf::fail("threadgroup_barrier not reached by every thread of the threadgroup (some returned)");
          for (auto& f : fibers) f.state = mqf::RUN;  // every live thread is at the barrier
        }
      }
  for (size_t i = 0; i < mqf::buffers.size(); i++) {
    std::ofstream out(dir + "/" + std::to_string(i) + ".out", std::ios::binary);
    out.write(mqf::buffers[i].data, std::streamsize(mqf::buffers[i].nbytes));
  }
  return 0;
}
