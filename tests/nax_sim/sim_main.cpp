// metal-attn tests: run the NAX kernel's body (body.inc, written by the test) on the CPU simulation.
// Usage: sim <dir>: reads q.bin k.bin v.bin block_tables.bin seq_lens.bin cu_seqlens_q.bin tiles.bin
// sinks.bin params.bin fparams.bin and sizes.txt (q elements, num_tiles, num_heads); writes out.bin.
#include "sim_prelude.h"
#include "defines.h"
#include "paged_common.h"
#include "nax_layout.h"
#include "sim_tensor_ops.h"

using T = SIM_T;
constexpr int HEAD_SIZE = SIM_HEAD;
constexpr int BLOCK_SIZE = SIM_BLOCK;

static void body(const T* q, const T* k_cache, const T* v_cache, const int32_t* block_tables, const int32_t* seq_lens,
                 const int32_t* cu_seqlens_q, const int32_t* tiles, const float* sinks, const int32_t* params,
                 const float* fparams, T* out) {
#include "body.inc"
}

template <typename U>
static std::vector<U> load(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  const size_t n = size_t(f.tellg()) / sizeof(U);
  std::vector<U> v(n);
  f.seekg(0);
  f.read(reinterpret_cast<char*>(v.data()), std::streamsize(n * sizeof(U)));
  return v;
}

int main(int argc, char** argv) {
  const std::string d = std::string(argv[1]) + "/";
  auto q = load<T>(d + "q.bin"), k = load<T>(d + "k.bin"), v = load<T>(d + "v.bin");
  auto bt = load<int32_t>(d + "block_tables.bin"), sl = load<int32_t>(d + "seq_lens.bin");
  auto cu = load<int32_t>(d + "cu_seqlens_q.bin"), tiles = load<int32_t>(d + "tiles.bin");
  auto sinks = load<float>(d + "sinks.bin");
  auto params = load<int32_t>(d + "params.bin");
  auto fparams = load<float>(d + "fparams.bin");
  std::vector<T> out(q.size(), T(0.0f));
  const int num_tiles = params[0], num_heads = params[1];
  SimGroup group;
  sim_group = &group;
  std::vector<sim_thread> lanes;
  for (int lane = 0; lane < 32; ++lane) {
    lanes.emplace_back([&, lane] {
      sim_lane = lane;
      for (int t = 0; t < num_tiles; ++t) {
        for (int h = 0; h < num_heads; ++h) {
          for (int sg = 0; sg < MA_NAX_BQ / 16; ++sg) {
            sim_tg = {uint(t), uint(h), 0u};
            sim_sg = sg;
            body(q.data(), k.data(), v.data(), bt.data(), sl.data(), cu.data(), tiles.data(), sinks.data(),
                 params.data(), fparams.data(), out.data());
            group.bar.arrive_and_wait();  // every lane left this simdgroup's body
          }
        }
      }
    });
  }
  for (auto& th : lanes) th.join();
  std::ofstream f(d + "out.bin", std::ios::binary);
  f.write(reinterpret_cast<const char*>(out.data()), std::streamsize(out.size() * sizeof(T)));
  return 0;
}
