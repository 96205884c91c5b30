// metal-attn tests: the launch driver of the Metal threadgroup simulation, included last by the
// source tests/test_metal_cpu_sim.py generates (after `sim_kernel_entry`, which calls the kernel
// instantiation with the buffers in `sim_bufs`, in the kernel's signature order).
//
// Usage: sim <dir>. <dir>/launch.txt: "gx gy gz tx ty tz seed workers n_in n_out" (the grid in
// threads, as mx.fast kernels take it; the threadgroup size; the ring-order seed, 0 for thread
// order; worker processes), then one byte count per input and per output. Inputs are <dir>/in<i>.bin;
// outputs start as 0xff bytes (NaN in every float type: an element the kernel never writes shows)
// and are written to <dir>/out<i>.bin.
//
// Workers are processes (fork) sharing the outputs and the next threadgroup's index, so that each
// has one thread whose thread-local storage is the kernel's threadgroup arrays alone (sim_metal.h):
// before each threadgroup the driver fills that block with 0xff bytes (NaN; -1 as an integer) or
// 0x7f bytes (about 3.4e38 in float and bfloat16, NaN in half; a large positive integer), the two
// in turn, so a read of threadgroup memory that this threadgroup did not write shows (glibc's
// RTLD_DI_TLS_DATA; without it nothing is filled).
#pragma once

#include <dlfcn.h>
#include <link.h>
#include <sys/wait.h>

static unsigned char* sim_tls = nullptr;  // this thread's block of the executable's thread-local storage
static size_t sim_tls_bytes = 0;

static int sim_tls_segment(struct dl_phdr_info* info, size_t, void* out) {
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    if (info->dlpi_phdr[i].p_type == PT_TLS) *static_cast<size_t*>(out) = info->dlpi_phdr[i].p_memsz;
  }
  return 1;  // the first object is the executable
}

static void sim_find_tls() {
#ifdef __GLIBC__  // RTLD_DI_TLS_DATA (an enumerator, not a macro)
  size_t bytes = 0;
  dl_iterate_phdr(sim_tls_segment, &bytes);
  void* self = dlopen(nullptr, RTLD_NOW);
  void* block = nullptr;
  if (bytes != 0 && self != nullptr && dlinfo(self, RTLD_DI_TLS_DATA, &block) == 0 && block != nullptr) {
    sim_tls = static_cast<unsigned char*>(block);
    sim_tls_bytes = bytes;
  }
#endif
}

static void sim_run_threadgroup(SimGroup& g, uint3 tg, int threads, uint64_t seed, uint64_t index) {
  if (sim_tls != nullptr) std::memset(sim_tls, (index & 1) ? 0x7f : 0xff, sim_tls_bytes);
  g.n = threads;
  g.live = threads;
  g.pos = 0;
  for (int s = 0; s < SIM_MAX_SG; ++s) {
    g.sg_live[s] = 0;
    g.sg_at_tg[s] = 0;
    g.sg_bar[s] = SimBarrier{};
  }
  g.tg_bar = SimBarrier{};
  for (int i = 0; i < threads; ++i) {
    SimFiber& f = g.fibers[i];
    if (size_t(i) >= g.stacks_made) {
      sim_ctx_alloc(f.ctx, size_t(SIM_STACK_KIB) * 1024);
      g.stacks_made = size_t(i) + 1;
    }
    f.tg_pos = tg;
    f.grid_pos = uint3{tg.x * uint(threads) + uint(i), tg.y, tg.z};
    f.tid = uint(i);
    f.lane = i % SIM_SIMD;
    f.sg = i / SIM_SIMD;
    f.done = false;
    f.wait_gen = nullptr;
    ++g.sg_live[f.sg];
    sim_ctx_make(f.ctx, sim_fiber_main);
    g.order[i] = i;
  }
  if (seed != 0) {  // another interleaving: the ring in a pseudo-random order (xorshift64*)
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + index + 1;
    for (int i = threads - 1; i > 0; --i) {
      s ^= s >> 12;
      s ^= s << 25;
      s ^= s >> 27;
      const int j = int((s * 0x2545F4914F6CDD1Dull) >> 33) % (i + 1);
      const int t = g.order[i];
      g.order[i] = g.order[j];
      g.order[j] = t;
    }
  }
  g.cur = &g.fibers[g.order[0]];
  sim_ctx_switch_to(g.main_ctx, g.cur->ctx);
  if (g.live != 0 || g.tg_bar.arrived != 0) sim_fail("the threadgroup ended with threads still waiting");
}

// Memory every worker process shares.
static void* sim_shared(size_t bytes) {
  void* p = mmap(nullptr, bytes ? bytes : 1, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) sim_fail("mmap of shared memory failed");
  return p;
}

static unsigned char* sim_read(const char* path, size_t bytes) {
  unsigned char* p = static_cast<unsigned char*>(std::malloc(bytes ? bytes : 1));
  FILE* f = std::fopen(path, "rb");
  if (f == nullptr || std::fread(p, 1, bytes, f) != bytes) sim_fail("an input file is missing or short");
  std::fclose(f);
  return p;
}

// The grid, and the next threadgroup to take (in shared memory).
struct SimLaunch {
  uint64_t nx, ny, total;
  unsigned threads;
  unsigned long long seed;
  uint64_t next;
};

static void sim_worker(SimLaunch& l) {
  sim_find_tls();
  SimGroup* g = new SimGroup();
  sim_g = g;
  g->entry = sim_kernel_entry;
  for (uint64_t i = __atomic_fetch_add(&l.next, 1, __ATOMIC_RELAXED); i < l.total;
       i = __atomic_fetch_add(&l.next, 1, __ATOMIC_RELAXED)) {
    const uint3 tg{uint(i % l.nx), uint((i / l.nx) % l.ny), uint(i / (l.nx * l.ny))};
    sim_run_threadgroup(*g, tg, int(l.threads), l.seed, i);
  }
}

int main(int argc, char** argv) {
  if (argc != 2) sim_fail("usage: sim <dir>");
  char path[4096];
  std::snprintf(path, sizeof(path), "%s/launch.txt", argv[1]);
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) sim_fail("launch.txt is missing");
  unsigned gx, gy, gz, tx, ty, tz, workers;
  unsigned long long seed;
  int n_in, n_out;
  if (std::fscanf(f, "%u %u %u %u %u %u %llu %u %d %d", &gx, &gy, &gz, &tx, &ty, &tz, &seed, &workers, &n_in,
                  &n_out) != 10) {
    sim_fail("launch.txt: bad header");
  }
  constexpr int max_bufs = int(sizeof(sim_bufs) / sizeof(sim_bufs[0]));
  if (n_in < 0 || n_out < 0 || n_in + n_out > max_bufs) sim_fail("too many buffers");
  size_t out_bytes[max_bufs];
  for (int i = 0; i < n_in + n_out; ++i) {
    unsigned long long b;
    if (std::fscanf(f, "%llu", &b) != 1) sim_fail("launch.txt: bad byte count");
    if (i < n_in) {
      std::snprintf(path, sizeof(path), "%s/in%d.bin", argv[1], i);
      sim_bufs[i] = sim_read(path, size_t(b));
    } else {
      sim_bufs[i] = static_cast<unsigned char*>(sim_shared(size_t(b)));
      std::memset(sim_bufs[i], 0xff, size_t(b));
      out_bytes[i - n_in] = size_t(b);
    }
  }
  std::fclose(f);
  if (ty != 1 || tz != 1 || tx == 0 || tx > unsigned(SIM_MAX_THREADS) || tx % SIM_SIMD != 0) {
    sim_fail("threadgroups of (a multiple of 32 up to 1024, 1, 1) threads only");
  }
  if (gx % tx != 0) sim_fail("the grid's x extent is not whole threadgroups (Metal would make a partial one)");
  SimLaunch* launch = static_cast<SimLaunch*>(sim_shared(sizeof(SimLaunch)));
  *launch = SimLaunch{gx / tx, gy, uint64_t(gx / tx) * gy * gz, tx, seed, 0};
  const unsigned n_workers = workers < 1 ? 1 : workers > 64 ? 64 : workers;
  pid_t children[64];
  std::fflush(nullptr);
  for (unsigned w = 1; w < n_workers; ++w) {
    children[w] = fork();
    if (children[w] < 0) sim_fail("fork failed");
    if (children[w] == 0) {
      sim_worker(*launch);
      std::fflush(nullptr);
      _exit(0);
    }
  }
  sim_worker(*launch);
  for (unsigned w = 1; w < n_workers; ++w) {
    int status = 0;
    if (waitpid(children[w], &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      sim_fail("a worker process failed (its message is above)");
    }
  }
  for (int i = 0; i < n_out; ++i) {
    std::snprintf(path, sizeof(path), "%s/out%d.bin", argv[1], i);
    FILE* o = std::fopen(path, "wb");
    if (o == nullptr || std::fwrite(sim_bufs[n_in + i], 1, out_bytes[i], o) != out_bytes[i]) {
      sim_fail("an output file could not be written");
    }
    std::fclose(o);
  }
  return 0;
}
