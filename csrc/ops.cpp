// Host side of the CPU primitives: validation, work planning, threading,
// the split-KV reducer launch and reshape_and_cache.
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <sstream>
#include <stdexcept>

#include "kernel_api.h"
#include "mlx/allocator.h"
#include "mlx/ops.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/utils.h"
#include "thread_pool.h"

namespace metal_attn_native {

namespace {

// Decode work is cut into at least this many units per thread (dynamic balance).
constexpr int kUnitsPerThread = 4;

// ---- instruction sets ------------------------------------------------------------------

bool cpu_supports(Isa isa) {
  if (isa == Isa::kPortable) return true;
#if defined(MA_HAVE_X86_ISAS)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (isa == Isa::kAvx2) return avx2;
  if (isa == Isa::kAvx512)
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
#endif
  return false;
}

struct IsaFns {
  void (*attend)(const Job&, int, float*);
  void (*reduce)(const Job&, int);
  uint64_t (*read)(const char*, int64_t);
};

IsaFns isa_fns(Isa isa) {
#if defined(MA_HAVE_X86_ISAS)
  if (isa == Isa::kAvx512) return {isa_avx512::attend_unit, isa_avx512::reduce_item, isa_avx512::read_span};
  if (isa == Isa::kAvx2) return {isa_avx2::attend_unit, isa_avx2::reduce_item, isa_avx2::read_span};
#endif
  return {isa_portable::attend_unit, isa_portable::reduce_item, isa_portable::read_span};
}

// ---- array helpers -----------------------------------------------------------------------

int dtype_code(mx::Dtype d) {
  if (d == mx::float32) return kFloat32;
  if (d == mx::float16) return kFloat16;
  if (d == mx::bfloat16) return kBFloat16;
  return -1;
}

std::string dtype_str(mx::Dtype d) {
  if (d == mx::float32) return "float32";
  if (d == mx::float16) return "float16";
  if (d == mx::bfloat16) return "bfloat16";
  if (d == mx::int32) return "int32";
  if (d == mx::int64) return "int64";
  std::ostringstream o;  // any other dtype by MLX's own name (uint32, bool, float64, ...)
  o << d;
  return o.str();
}

std::string shape_str(const mx::Shape& s) {
  std::ostringstream o;
  o << "(";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << (s.size() == 1 ? ",)" : ")");
  return o.str();
}

// The three inner axes of a pool are dense (axes of extent 1 may have any stride).
bool pool_inner_dense(const mx::array& p) {
  const auto& sh = p.shape();
  const auto& st = p.strides();
  return (sh[3] == 1 || st[3] == 1) && (sh[2] == 1 || st[2] == sh[3]) &&
         (sh[1] == 1 || st[1] == static_cast<int64_t>(sh[2]) * sh[3]);
}

// Copy any strided array into a dense row-major buffer: the trailing axes that are dense in the
// source form one run, copied with one memcpy (a dense array is a single copy).
void copy_to_dense(const mx::array& a, char* dst) {
  const int64_t isz = a.itemsize();
  const auto& sh = a.shape();
  const auto& st = a.strides();
  const char* src = a.data<char>();
  int outer = static_cast<int>(sh.size());
  int64_t run = 1;
  while (outer > 0 && (sh[outer - 1] == 1 || st[outer - 1] == run)) run *= sh[--outer];
  const int64_t n = static_cast<int64_t>(a.size());
  if (n == 0) return;
  std::vector<int64_t> idx(outer, 0);
  for (int64_t r = 0; r < n / run; ++r) {
    int64_t off = 0;
    for (int d = 0; d < outer; ++d) off += idx[d] * st[d];
    std::memcpy(dst + r * run * isz, src + off * isz, run * isz);
    for (int d = outer - 1; d >= 0; --d) {
      if (++idx[d] < sh[d]) break;
      idx[d] = 0;
    }
  }
}

// A float as the caller gave it (std::to_string prints 1e-46 as 0.000000).
std::string num_str(double x) {
  std::ostringstream out;
  out.precision(9);
  out << x;
  return out.str();
}

// What the kernels take for scale and softcap, as the Python layer admits them: a normal positive float32
// (1/x of a subnormal overflows) that stays finite times log2(e).
constexpr double kF32Tiny = std::numeric_limits<float>::min();
constexpr double kF32Log2Max = std::numeric_limits<float>::max() / 1.4426950408889634;
bool kernel_f32(double x) { return x >= kF32Tiny && x <= kF32Log2Max; }

template <typename T>
int64_t int_at(const mx::array& a, int64_t i, int64_t j = 0) {
  const auto& st = a.strides();
  int64_t off = i * st[0] + (a.ndim() > 1 ? j * st[1] : 0);
  return static_cast<int64_t>(a.data<T>()[off]);
}

int64_t read_int(const mx::array& a, int64_t i, int64_t j = 0) {
  return a.dtype() == mx::int64 ? int_at<int64_t>(a, i, j) : int_at<int32_t>(a, i, j);
}

mx::Stream cpu_stream() { return mx::default_stream(mx::Device(mx::Device::cpu)); }

void fill_nan_rows(void* out, int dtype, int64_t first, int64_t count) {
  if (dtype == kFloat32) {
    std::fill_n(static_cast<float*>(out) + first, count, std::numeric_limits<float>::quiet_NaN());
  } else {
    std::fill_n(static_cast<uint16_t*>(out) + first, count,
                static_cast<uint16_t>(dtype == kFloat16 ? 0x7e00 : 0x7fc0));
  }
}

}  // namespace

// ---- ISA selection -----------------------------------------------------------------------

std::string isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "portable";
  }
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> out;
  for (Isa isa : {Isa::kAvx512, Isa::kAvx2, Isa::kPortable})
    if (cpu_supports(isa)) out.push_back(isa_name(isa));
  return out;
}

Isa resolve_isa(const std::string& name) {
  if (name == "auto") {
    for (Isa isa : {Isa::kAvx512, Isa::kAvx2})
      if (cpu_supports(isa)) return isa;
    return Isa::kPortable;
  }
  for (Isa isa : {Isa::kAvx512, Isa::kAvx2, Isa::kPortable}) {
    if (name == isa_name(isa)) {
      if (!cpu_supports(isa)) {
        std::ostringstream o;
        o << "isa='" << name << "' is not supported by this CPU (supported here: ";
        auto s = supported_isas();
        for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
        o << ", auto)";
        throw std::invalid_argument(o.str());
      }
      return isa;
    }
  }
  throw std::invalid_argument("isa='" + name + "' (allowed: auto, avx512, avx2, portable)");
}

// ---- paged attention -----------------------------------------------------------------------

bool PagedAttention::is_equivalent(const mx::Primitive& other) const {
  if (typeid(other) != typeid(*this)) return false;
  return params_ == static_cast<const PagedAttention&>(other).params_;
}

std::vector<mx::Shape> PagedAttention::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

void PagedAttention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "metal_attn's native paged attention is a CPU kernel and has no GPU implementation; "
      "evaluate it on the CPU stream (it is only selected when the backend is cpu)");
}

void PagedAttention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array& q = inputs[0];
  const mx::array& k = inputs[1];
  const mx::array& v = inputs[2];
  const mx::array& bt = inputs[3];
  const mx::array& sl = inputs[4];
  const mx::array& cu = inputs[5];
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));

  auto& enc = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);

  std::optional<mx::array> sinks;
  if (params_.has_sinks) sinks = inputs[6];
  enc.dispatch([q, k, v, bt, sl, cu, sinks, out, p = params_]() mutable {
    const int T = q.shape(0), H = q.shape(1), D = q.shape(2);
    const int NB = k.shape(0), BS = k.shape(1), KVH = k.shape(2);
    const int S = sl.shape(0), MB = bt.shape(1);
    const int G = H / KVH;
    const int dtype = dtype_code(q.dtype());
    const int64_t isz = q.itemsize();

    // Pools whose inner axes are not dense are copied once (documented fallback).
    std::vector<char> kcopy, vcopy;
    const void* kp = k.data<void>();
    const void* vp = v.data<void>();
    int64_t k_sb = k.strides()[0], v_sb = v.strides()[0];
    const int64_t block_elems = static_cast<int64_t>(BS) * KVH * D;
    if (!pool_inner_dense(k)) {
      kcopy.resize(k.size() * isz);
      copy_to_dense(k, kcopy.data());
      kp = kcopy.data();
      k_sb = block_elems;
    }
    if (!pool_inner_dense(v)) {
      vcopy.resize(v.size() * isz);
      copy_to_dense(v, vcopy.data());
      vp = vcopy.data();
      v_sb = block_elems;
    }

    // Host copies of the metadata, read as 64-bit and checked before narrowing,
    // so a bad table cannot read out of bounds (an entry past 2^31 must not wrap
    // onto a valid block). An invalid entry becomes -1, which fails the checks.
    auto narrow = [](int64_t x, int64_t lo, int64_t hi) { return x >= lo && x <= hi ? static_cast<int32_t>(x) : -1; };
    std::vector<int32_t> tables(static_cast<size_t>(S) * MB), lens(S), cuq(S + 1);
    for (int s = 0; s < S; ++s) {
      lens[s] = narrow(read_int(sl, s), 0, std::numeric_limits<int32_t>::max());
      for (int j = 0; j < MB; ++j) tables[static_cast<size_t>(s) * MB + j] = narrow(read_int(bt, s, j), 0, NB - 1);
    }
    for (int s = 0; s <= S; ++s) cuq[s] = narrow(read_int(cu, s), 0, T);
    // A sequence computes only if its rows lie in [0, T), after the previous
    // computed sequence's rows (no two units ever write one row), and its
    // table covers seq_len with valid blocks.
    std::vector<int32_t> tok_seq(T, -1);
    std::vector<char> seq_ok(S, 0);
    int64_t rows_done = 0;
    for (int s = 0; s < S; ++s) {
      const int64_t q0 = cuq[s], q1 = cuq[s + 1];
      bool ok = q0 >= rows_done && q1 > q0 && lens[s] >= q1 - q0;
      const int64_t need = ok ? (static_cast<int64_t>(lens[s]) + BS - 1) / BS : 0;
      ok = ok && need <= MB;
      for (int64_t j = 0; ok && j < need; ++j) ok = tables[static_cast<size_t>(s) * MB + j] >= 0;
      seq_ok[s] = ok;
      if (ok) {
        for (int64_t t = q0; t < q1; ++t) tok_seq[t] = s;
        rows_done = q1;
      }
    }
    // Rows no valid sequence owns (a bad sequence, or outside cu_seqlens_q) are
    // NaN, never uninitialised memory.
    for (int64_t t = 0; t < T;) {
      if (tok_seq[t] >= 0) {
        ++t;
        continue;
      }
      int64_t e = t;
      while (e < T && tok_seq[e] < 0) ++e;
      fill_nan_rows(out.data<void>(), dtype, t * H * D, (e - t) * H * D);
      t = e;
    }

    int part = p.partition_size;
    int max_parts = 0;
    if (part > 0) {
      int max_len = 0;
      for (int s = 0; s < S; ++s)
        if (seq_ok[s]) max_len = std::max(max_len, lens[s]);
      max_parts = (max_len + part - 1) / part;
      const double scratch = static_cast<double>(T) * H * max_parts * (D + 2) * 4.0;
      if (max_parts <= 1 || scratch > static_cast<double>(MA_SCRATCH_CAP_BYTES)) part = 0, max_parts = 0;
    }

    // Work units (sequence, KV heads, row tile, partition), most expensive first.
    // Decode rows (q_len == 1) take `hpu` KV heads per unit: the largest divisor
    // of KVH that still leaves kUnitsPerThread units per thread, so each page is
    // read as whole token rows (contiguous, TLB- and prefetcher-friendly).
    // Prefill tiles take one KV head and RT rows (K/V reused from L2).
    const int RT = row_tile_for_group(G);
    const int threads = std::max(1, p.num_threads);
    int n_decode_units = 0;
    for (int s = 0; s < S; ++s) {
      if (seq_ok[s] && cuq[s + 1] - cuq[s] == 1)
        n_decode_units += part > 0 ? (lens[s] + part - 1) / part : 1;
    }
    int hpu = 1;
    for (int d = KVH; d >= 1; --d) {
      if (KVH % d == 0 && static_cast<int64_t>(n_decode_units) * (KVH / d) >= kUnitsPerThread * threads) {
        hpu = d;
        break;
      }
    }
    std::vector<Unit> units;
    std::vector<int64_t> cost;
    for (int s = 0; s < S; ++s) {
      if (!seq_ok[s]) continue;
      const int q_len = cuq[s + 1] - cuq[s];
      const int ctx = lens[s] - q_len;
      const int heads = q_len == 1 ? hpu : 1;
      for (int r0 = 0; r0 < q_len; r0 += RT) {
        const int r1 = std::min(q_len, r0 + RT);
        const int64_t row_kv = std::min<int64_t>(ctx + r1, p.window > 0 ? p.window + (r1 - r0) : INT64_MAX);
        for (int h = 0; h < KVH; h += heads) {
          if (part > 0) {
            const int nparts = (lens[s] + part - 1) / part;
            for (int z = 0; z < nparts; ++z) {
              units.push_back(Unit{s, h, h + heads, r0, r1, z});
              cost.push_back(int64_t(heads) * (r1 - r0) * std::min<int64_t>(part, lens[s] - int64_t(z) * part));
            }
          } else {
            units.push_back(Unit{s, h, h + heads, r0, r1, -1});
            cost.push_back(int64_t(heads) * (r1 - r0) * row_kv);
          }
        }
      }
    }
    std::vector<int> order(units.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return cost[a] > cost[b]; });
    std::vector<Unit> sorted(units.size());
    for (size_t i = 0; i < order.size(); ++i) sorted[i] = units[order[i]];

    std::vector<float> sink_vals;
    if (sinks) {
      sink_vals.resize(H);
      const auto st = sinks->strides()[0];
      for (int h = 0; h < H; ++h) sink_vals[h] = sinks->data<float>()[h * st];
    }
    std::vector<float> pm, pl, po;
    if (part > 0) {
      const size_t n = static_cast<size_t>(T) * H * max_parts;
      pm.assign(n, -std::numeric_limits<float>::max());
      pl.assign(n, 0.0f);
      po.assign(n * D, 0.0f);
    }

    Job job{};
    job.dtype = dtype;
    job.q = q.data<void>();
    job.q_st = q.strides()[0];
    job.q_sh = q.strides()[1];
    job.q_sd = q.strides()[2];
    job.k = kp;
    job.v = vp;
    job.k_sb = k_sb;
    job.v_sb = v_sb;
    job.block_tables = tables.data();
    job.bt_row = MB;
    job.seq_lens = lens.data();
    job.cu_q = cuq.data();
    job.tok_seq = tok_seq.data();
    job.sinks = sinks ? sink_vals.data() : nullptr;
    job.out = out.data<void>();
    job.H = H;
    job.KVH = KVH;
    job.D = D;
    job.BS = BS;
    job.group = G;
    job.scale = p.scale;
    job.softcap = p.softcap;
    job.window = p.window;
    job.part_size = part;
    job.max_parts = max_parts;
    job.part_m = pm.data();
    job.part_l = pl.data();
    job.part_out = po.data();
    job.units = sorted.data();
    job.num_units = static_cast<int>(sorted.size());
    job.work_floats = static_cast<int64_t>(std::max(RT * G, hpu * G)) * (2 * D + 2);

    const IsaFns fns = isa_fns(p.isa);
    // No more threads (and per-thread work buffers) than units.
    const int attend_threads = std::max(1, std::min(threads, job.num_units));
    std::vector<float> work(static_cast<size_t>(job.work_floats) * attend_threads);
    ThreadPool::instance().run(attend_threads, job.num_units, [&](int i, int tid) {
      fns.attend(job, i, work.data() + static_cast<size_t>(tid) * job.work_floats);
    });
    if (part > 0) {
      // No more threads than the attention pass had: the pool keeps every thread it ever started.
      ThreadPool::instance().run(attend_threads, static_cast<int>(static_cast<int64_t>(T) * H), [&](int item, int) {
        if (tok_seq[item / H] >= 0) fns.reduce(job, item);
      });
    }
  });
}

mx::array paged_attention(const mx::array& q, const mx::array& k_cache, const mx::array& v_cache,
                          const mx::array& block_tables, const mx::array& seq_lens,
                          const mx::array& cu_seqlens_q, const std::optional<mx::array>& sinks, double scale,
                          double softcap, int sliding_window, int partition_size, int num_threads,
                          const std::string& isa) {
  auto bad = [](const std::string& msg) { throw std::invalid_argument(msg); };
  if (q.ndim() != 3) bad("q must have rank 3 [total_q_tokens, num_heads, head_size] (got shape " + shape_str(q.shape()) + ")");
  if (k_cache.ndim() != 4 || v_cache.ndim() != 4 || k_cache.shape() != v_cache.shape())
    bad("k_cache and v_cache must have equal rank-4 shapes [num_blocks, block_size, num_kv_heads, head_size] (got " +
        shape_str(k_cache.shape()) + " and " + shape_str(v_cache.shape()) + ")");
  if (dtype_code(q.dtype()) < 0 || q.dtype() != k_cache.dtype() || q.dtype() != v_cache.dtype())
    bad("q, k_cache and v_cache must share one dtype of float32, float16, bfloat16 (got " + dtype_str(q.dtype()) + ", " +
        dtype_str(k_cache.dtype()) + ", " + dtype_str(v_cache.dtype()) + ")");
  const int D = q.shape(2), H = q.shape(1), KVH = k_cache.shape(2);
  if (k_cache.shape(3) != D) bad("q head_size=" + std::to_string(D) + " differs from the cache's " + std::to_string(k_cache.shape(3)));
  if (D <= 0 || D % 16 != 0 || D > kMaxHeadSize)
    bad("head_size=" + std::to_string(D) + " (supported: multiples of 16 up to " + std::to_string(kMaxHeadSize) + ")");
  if (KVH <= 0 || H % KVH != 0)
    bad("num_heads=" + std::to_string(H) + " is not a multiple of num_kv_heads=" + std::to_string(KVH));
  for (auto [name, a, nd] : {std::tuple{"block_tables", &block_tables, 2}, std::tuple{"seq_lens", &seq_lens, 1},
                             std::tuple{"cu_seqlens_q", &cu_seqlens_q, 1}}) {
    if (a->ndim() != nd || (a->dtype() != mx::int32 && a->dtype() != mx::int64))
      bad(std::string(name) + " must be int32 or int64 of rank " + std::to_string(nd) + " (got " + dtype_str(a->dtype()) +
          " " + shape_str(a->shape()) + ")");
  }
  const int S = seq_lens.shape(0);
  if (block_tables.shape(0) != S || cu_seqlens_q.shape(0) != S + 1 || block_tables.shape(1) < 1)
    bad("block_tables needs one row per sequence and cu_seqlens_q num_seqs+1 entries (got block_tables " +
        shape_str(block_tables.shape()) + ", seq_lens " + shape_str(seq_lens.shape()) + ", cu_seqlens_q " +
        shape_str(cu_seqlens_q.shape()) + ")");
  if (k_cache.shape(1) < 1) bad("block_size=" + std::to_string(k_cache.shape(1)) + " (k_cache.shape[1]; allowed: >= 1)");
  const std::string f32_range = "a normal float32 that stays finite times log2(e), " + num_str(kF32Tiny) + " to " +
                                num_str(kF32Log2Max);
  if (!kernel_f32(scale)) bad("scale=" + num_str(scale) + " (allowed: " + f32_range + ")");
  if (softcap != 0.0 && !kernel_f32(softcap))
    bad("softcap=" + num_str(softcap) + " (allowed: 0 for none, or " + f32_range + ")");
  if (sliding_window < 0) bad("sliding_window=" + std::to_string(sliding_window) + " (allowed: 0 for none, or >= 1)");
  if (partition_size < 0 || (partition_size > 0 && partition_size % 8 != 0))
    bad("partition_size=" + std::to_string(partition_size) + " (allowed: 0 for unsplit, or a positive multiple of 8)");
  if (num_threads < 0)
    bad("num_threads=" + std::to_string(num_threads) + " (allowed: 0 for every hardware thread, or >= 1)");
  AttentionParams p;
  p.scale = static_cast<float>(scale);
  p.softcap = static_cast<float>(softcap);
  p.window = sliding_window;
  p.partition_size = partition_size;
  p.num_threads = num_threads > 0 ? num_threads : ThreadPool::hardware_threads();
  p.isa = resolve_isa(isa);
  std::vector<mx::array> inputs = {q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q};
  if (sinks) {
    if (sinks->ndim() != 1 || sinks->shape(0) != H || sinks->dtype() != mx::float32)
      bad("sinks must be float32 of shape (" + std::to_string(H) + ",) (got " + dtype_str(sinks->dtype()) + " " +
          shape_str(sinks->shape()) + ")");
    p.has_sinks = true;
    inputs.push_back(*sinks);
  }
  return mx::array(q.shape(), q.dtype(), std::make_shared<PagedAttention>(cpu_stream(), p), std::move(inputs));
}

// ---- the bandwidth probe -----------------------------------------------------------------------

uint64_t read_bytes(const mx::array& a, int num_threads, const std::string& isa) {
  if (num_threads < 0)
    throw std::invalid_argument("num_threads=" + std::to_string(num_threads) +
                                " (allowed: 0 for every hardware thread, or >= 1)");
  mx::array x = a;
  x.eval();
  // Only a row-contiguous buffer holding every element is read as is (a view with strides, a reversed or
  // broadcast one, would read past its buffer or the wrong bytes): anything else is read from a dense copy.
  if (!x.flags().row_contiguous || x.data_size() != x.size()) {
    x = mx::contiguous(a);
    x.eval();
  }
  const int threads = num_threads > 0 ? num_threads : ThreadPool::hardware_threads();
  const IsaFns fns = isa_fns(resolve_isa(isa));
  const char* base = x.data<char>();
  const int64_t n = static_cast<int64_t>(x.nbytes());
  // Contiguous shares, one per item; several items per thread so that an uneven thread keeps up.
  const int items = std::max(1, threads * 4);
  const int64_t share = ((n + items - 1) / items + 63) / 64 * 64;
  std::vector<uint64_t> sums(items, 0);
  ThreadPool::instance().run(threads, items, [&](int i, int) {
    const int64_t lo = std::min<int64_t>(n, i * share), hi = std::min<int64_t>(n, lo + share);
    sums[i] = fns.read(base + lo, hi - lo);
  });
  return std::accumulate(sums.begin(), sums.end(), uint64_t{0});
}

// ---- reshape_and_cache -----------------------------------------------------------------------

std::vector<mx::Shape> ReshapeAndCache::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[1].shape()};
}

void ReshapeAndCache::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "metal_attn's native reshape_and_cache is a CPU kernel and has no GPU implementation; "
      "evaluate it on the CPU stream (it is only selected when the backend is cpu)");
}

void ReshapeAndCache::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  // inputs: {src [num_tokens, KVH, D], pool [NB, BS, KVH, D], slots [num_tokens]}; one output pool.
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) enc.set_input_array(a);
  const mx::array& pool = inputs[1];
  mx::array& out = outputs[0];
  // In place when the pool is the sole owner of its buffer (as MLX's own
  // scatter does) and its blocks do not overlap; otherwise the write goes into a
  // fresh dense copy. (A pool made by broadcasting one block has block stride 0:
  // written in place, one token landed in every block.)
  const int64_t block_elems = static_cast<int64_t>(pool.shape(1)) * pool.shape(2) * pool.shape(3);
  const bool blocks_apart = pool.shape(0) == 1 || pool.strides()[0] >= block_elems;
  const bool donated = pool.is_donatable() && pool_inner_dense(pool) && blocks_apart;
  if (donated) {
    out.copy_shared_buffer(pool);
  } else {
    out.set_data(mx::allocator::malloc(out.nbytes()));
  }
  enc.set_output_array(out);
  enc.dispatch([src = inputs[0], pool = inputs[1], slots = inputs[2], out, donated]() mutable {
    const int NB = pool.shape(0), BS = pool.shape(1), KVH = pool.shape(2), D = pool.shape(3);
    const int64_t row = static_cast<int64_t>(KVH) * D;
    const int64_t isz = pool.itemsize();
    const int64_t ntok = src.shape(0);
    const int64_t nslots = static_cast<int64_t>(NB) * BS;
    if (!donated) copy_to_dense(pool, out.data<char>());
    const int64_t sb = donated ? pool.strides()[0] : static_cast<int64_t>(BS) * row;
    char* dst = out.data<char>();
    const auto& st = src.strides();
    const bool dense_row = (KVH == 1 || st[1] == D) && (D == 1 || st[2] == 1);
    for (int64_t t = 0; t < ntok; ++t) {
      const int64_t slot = read_int(slots, t);
      if (slot < 0 || slot >= nslots) continue;  // padding (the range is checked by the Python layer)
      char* d = dst + ((slot / BS) * sb + (slot % BS) * row) * isz;
      if (dense_row) {
        std::memcpy(d, src.data<char>() + t * st[0] * isz, row * isz);
      } else {
        for (int h = 0; h < KVH; ++h)
          for (int e = 0; e < D; ++e)
            std::memcpy(d + (static_cast<int64_t>(h) * D + e) * isz,
                        src.data<char>() + (t * st[0] + h * st[1] + e * st[2]) * isz, isz);
      }
    }
  });
}

std::vector<mx::array> reshape_and_cache(const mx::array& key, const mx::array& value, const mx::array& k_cache,
                                         const mx::array& v_cache, const mx::array& slot_mapping) {
  auto bad = [](const std::string& msg) { throw std::invalid_argument(msg); };
  if (key.ndim() != 3 || key.shape() != value.shape())
    bad("key and value must have equal rank-3 shapes [num_tokens, num_kv_heads, head_size] (got " +
        shape_str(key.shape()) + " and " + shape_str(value.shape()) + ")");
  if (k_cache.ndim() != 4 || k_cache.shape() != v_cache.shape())
    bad("k_cache and v_cache must have equal rank-4 shapes (got " + shape_str(k_cache.shape()) + " and " +
        shape_str(v_cache.shape()) + ")");
  if (key.shape(1) != k_cache.shape(2) || key.shape(2) != k_cache.shape(3))
    bad("key [num_kv_heads, head_size] = " + shape_str({key.shape(1), key.shape(2)}) + " differs from the pool's " +
        shape_str({k_cache.shape(2), k_cache.shape(3)}));
  if (dtype_code(k_cache.dtype()) < 0 || key.dtype() != k_cache.dtype() || value.dtype() != k_cache.dtype() ||
      v_cache.dtype() != k_cache.dtype())
    bad("key, value, k_cache and v_cache must share one dtype of float32, float16, bfloat16 (got " +
        dtype_str(key.dtype()) + ", " + dtype_str(value.dtype()) + ", " + dtype_str(k_cache.dtype()) + ", " +
        dtype_str(v_cache.dtype()) + ")");
  if (slot_mapping.ndim() != 1 || slot_mapping.shape(0) != key.shape(0) ||
      (slot_mapping.dtype() != mx::int64 && slot_mapping.dtype() != mx::int32))
    bad("slot_mapping must be int64 or int32 of shape (" + std::to_string(key.shape(0)) + ",) (got " +
        dtype_str(slot_mapping.dtype()) + " " + shape_str(slot_mapping.shape()) + ")");
  // One single-output primitive per pool: a multi-output primitive would hold
  // each input twice (once per sibling) and so could never write in place.
  auto write = [&](const mx::array& src, const mx::array& pool) {
    return mx::array(pool.shape(), pool.dtype(), std::make_shared<ReshapeAndCache>(cpu_stream()),
                     {src, pool, slot_mapping});
  };
  return {write(key, k_cache), write(value, v_cache)};
}

}  // namespace metal_attn_native
