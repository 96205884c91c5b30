// metal-attn: the classic per-token paged-attention kernel and the split-KV reducer.
// Two kernel bodies, one per `// @kernel NAME` section; MLX writes the signatures.
// Generated defines (from metal_attn/constants.py via metal_attn/kernels.py):
//   MA_LOG2E, MA_NEG_FLT_MAX, MA_SOFTMAX_EPS, MA_RESCALE_SLACK, MA_SIMD_WIDTH, and per variant PA_SPLIT,
//   PA_STAGED, PA_MMA and PA_SWIZZLE (template arguments are not macros, so the code paths they pick
//   are defines).

// @kernel paged_attention
// One threadgroup per (HPS consecutive query heads, query row, partition). The HPS heads
// share one KV head (HPS divides the GQA group). The NUM_THREADS/32 simdgroups form an
// SG_H x SG_T grid: SG_H = HPS/HPW across heads (HPW heads a simdgroup, q and accumulators
// in registers) and SG_T across tokens (each takes STEP tokens in turn); at the end the
// token simdgroups merge their online-softmax states through threadgroup memory.
// Within a simdgroup, TPT lanes hold one token (a lane: E head elements, 4 at a time) and
// reduce its q.k with simd_shuffle_xor; the TPP = 32/TPT token slots keep separate states,
// merged by a butterfly.
// K/V rows reach the lanes one of two ways (PA_STAGED):
// - PA_STAGED == 0, direct: each lane loads its slice of its token's rows from the pools. Each
//   iteration issues all its K/V loads (packed) before any arithmetic and reads the next
//   iteration's page ids, so the block-table read is off the critical path; PREFETCH = 1
//   also asks L2 for the next iteration's rows (CUDA; a no-op on Metal).
// - PA_STAGED == 1, staged: the threadgroup copies chunks of STAGE tokens' K and V rows into
//   threadgroup memory, STAGES chunks in flight (CUDA: cp.async, the copy of the next chunks
//   overlapping the arithmetic on this one; Metal: plain copies), and the lanes read their
//   slices from there. Each row is read from the pools once for all HPS heads.
// PA_MMA == 1 (staged, 16-bit types, HPW = HPS <= 8): the arithmetic of each query row is
// still its own (one row per threadgroup, its own causal and window range, the same split
// contract), but the group's heads are the rows of 8x8 matrix products: per 8 staged tokens a
// simdgroup computes S = Q K^T (heads x tokens) and O += P V with the products of the tiled
// prefill kernel (tensor cores on CUDA, the simdgroup matrix unit on Metal), its online
// softmax per head row (reduced over the four lanes that hold a row); P enters the product
// as a high and a low 16-bit part, as in the tiled kernel (here the two 8-deep halves of one
// 16-deep product on CUDA). The token simdgroups take the chunk's 8-token blocks in turn
// (STEP = 8).
// PA_MMA == 2 (CUDA only, MA_KEY_ROWS_MMA; staged and swizzled, 16-bit, HPW = HPS <= 8): the keys are
// the rows of whole 16x8 tensor-core products and the group's heads their columns. Per 16 staged tokens
// a simdgroup computes S^T = K Q^T (keys x heads) and O^T += V^T P^T, half the products of PA_MMA == 1
// per token (whose 8x8 blocks fill half of each 16-row instruction); the online softmax runs per head
// column (reduced over the eight lanes that hold a column) and P^T reaches the right operands through
// an in-register transpose of each 8x8 block, as the same high and low 16-bit parts (STEP = 16).
// Inputs : q [T, H, D], k_cache/v_cache [NB, BS, KVH, D], block_tables [S, MB] int32,
//          seq_lens [S] int32, cu_seqlens_q [S+1] int32, sinks [H] float32,
//          params int32 [num_seqs, num_heads, num_kv_heads, max_blocks, window, max_parts, use_sinks],
//          fparams float32 [score_scale, softcap]
// Outputs: PA_SPLIT == 0: out [T, H, D] (T dtype)
//          PA_SPLIT == 1: max_logits [T, H, P], exp_sums [T, H, P], tmp_out [T, H, P, D] (float32)
//          PA_FUSED == 1 (split, CUDA only): also out [T, H, D] (T dtype) and counters
//          [T * ceil(H / HPS)] int32, zero before the launch and zero after it (see below)
// Template: T, HEAD_SIZE, BLOCK_SIZE, PARTITION_SIZE, NUM_THREADS, TPT (lanes per token),
//           UNROLL (tokens per lane per iteration), HPS (heads per threadgroup), HPW (heads
//           per simdgroup), PREFETCH, STAGE (tokens per staged chunk, 0 = direct), STAGES,
//           STAGE_PAD (bytes of padding after each staged row, a multiple of 16; 0 with PA_SWIZZLE).
constexpr int NUM_SG = NUM_THREADS / MA_SIMD_WIDTH;  // simdgroups
constexpr int SG_H = HPS / HPW;                       // simdgroups across heads
constexpr int SG_T = NUM_SG / SG_H;                   // simdgroups across tokens
#if !PA_MMA
constexpr int NV = HEAD_SIZE / (4 * TPT);             // 4-element vectors per lane
constexpr int E = 4 * NV;                             // head elements per lane
#endif
constexpr int TPP = MA_SIMD_WIDTH / TPT;              // tokens per simdgroup pass
constexpr int STEP = PA_MMA == 2 ? 16 : PA_MMA ? 8 : TPP * UNROLL;  // tokens per simdgroup iteration
static_assert(HPS % HPW == 0 && NUM_SG % SG_H == 0, "HPS/HPW simdgroups must divide the threadgroup");
static_assert(!PA_MMA || (PA_STAGED && HPW == HPS && HPS <= 8 && HEAD_SIZE % 32 == 0 && sizeof(T) == 2),
              "the matrix path stages 16-bit K/V, with every head of the threadgroup in one 8-row block");
static_assert(PA_MMA != 2 || (MA_KEY_ROWS_MMA && PA_SWIZZLE && HEAD_SIZE % 16 == 0),
              "the keys-as-rows matrix path is CUDA's, on swizzled rows of whole 16-element tiles");
static_assert(STAGE % (SG_T * STEP) == 0, "a staged chunk is whole iterations of every token simdgroup");
#if !PA_STAGED
// L2 prefetch (PREFETCH = 1): 128-byte lines per K (or V) row of one KV head.
constexpr int LINE_ELEMS = 128 / int(sizeof(T));
constexpr int ROW_LINES = HEAD_SIZE / LINE_ELEMS > 0 ? HEAD_SIZE / LINE_ELEMS : 1;
#endif

#if PA_FUSED
// The fused reducer (PA_FUSED: split, CUDA only; Metal keeps the standalone reducer, as the split
// contract's other writers do). Each threadgroup that writes a partial counts itself in on its
// (row, head group) counter; the last of the row's n_parts writers to arrive reduces the row's
// partials for its HPS heads into out (all at once, or one at a time: below) and sets the counter back to 0 for
// the next launch, which the launcher orders after this one (it writes the same counters).
// Every thread fences its partial's stores device-wide before the count; the last arrival
// fences again and reads the partials past L1.
static_assert(PA_SPLIT, "the fused reducer reduces split partials");
// The HPS heads reduced at once (ma_reduce_partials_heads) where they split the threadgroup into
// power-of-two blocks and the row has at most a block's worth of partitions; else one at a time.
constexpr bool FUSED_HEADS = NUM_THREADS % HPS == 0 && ((NUM_THREADS / HPS) & (NUM_THREADS / HPS - 1)) == 0;
#define MA_FUSED_REDUCE()                                                                          \
  {                                                                                               \
    threadgroup int last_arrival;                                                                 \
    threadgroup float red_sg[NUM_SG];                                                             \
    threadgroup float red_w[NUM_THREADS];                                                         \
    threadgroup float red_tot[HPS];                                                               \
    ma_device_fence();                                                                            \
    threadgroup_barrier(mem_flags::mem_device);                                                   \
    if (tid == 0) {                                                                               \
      const int64_t slot = int64_t(qtok) * ((num_heads + HPS - 1) / HPS) + head0 / HPS;           \
      const int n_parts = (ctx + PARTITION_SIZE - 1) / PARTITION_SIZE;                            \
      last_arrival = ma_atomic_add(&counters[slot], 1) == n_parts - 1;                            \
      if (last_arrival) {                                                                         \
        counters[slot] = 0;                                                                       \
      }                                                                                           \
    }                                                                                             \
    threadgroup_barrier(mem_flags::mem_threadgroup);                                              \
    if (last_arrival) {                                                                           \
      ma_device_fence();                                                                          \
      const int n_parts = (ctx + PARTITION_SIZE - 1) / PARTITION_SIZE;                            \
      if (FUSED_HEADS && n_parts <= NUM_THREADS / HPS) {                                          \
        ma_reduce_partials_heads<T, HEAD_SIZE, NUM_THREADS, FUSED_HEADS ? HPS : 1>(               \
            max_logits, exp_sums, tmp_out, out + row_head0 * HEAD_SIZE, row_head0 * max_parts,    \
            max_parts, n_parts, use_sinks != 0, sinks + head0, red_w, red_sg, red_tot, tid);      \
      } else {                                                                                    \
        for (int h = 0; h < HPS; ++h) {                                                           \
          const int64_t rh = row_head0 + h;                                                       \
          ma_reduce_partials<T, HEAD_SIZE, NUM_THREADS, true, 8, 1>(                              \
              max_logits, exp_sums, tmp_out, out + rh * HEAD_SIZE, rh * max_parts, n_parts,       \
              use_sinks != 0, use_sinks ? ma_sink_log2(sinks[head0 + h]) : MA_NEG_FLT_MAX, red_sg,   \
              red_w, red_w, tid);                                                                 \
          threadgroup_barrier(mem_flags::mem_threadgroup); /* the next head reuses red_sg, red_w */ \
        }                                                                                         \
      }                                                                                           \
    }                                                                                             \
  }
#endif

const int num_seqs = params[0];
const int num_heads = params[1];
const int num_kv_heads = params[2];
const int max_blocks = params[3];
const int window = params[4];
const int max_parts = params[5];
const int use_sinks = params[6];
const float score_scale = fparams[0];
const float softcap = fparams[1];

const int lane = int(thread_index_in_simdgroup);
const int sg = int(simdgroup_index_in_threadgroup);
const int sgt = sg / SG_H;  // which share of the tokens
const int tid = int(thread_position_in_threadgroup.x);
const int head0 = int(threadgroup_position_in_grid.x) * HPS;
const int qtok = int(threadgroup_position_in_grid.y);
const int part = int(threadgroup_position_in_grid.z);
// Every exit below depends on the threadgroup's (heads, row, partition) only: the whole
// threadgroup leaves together, so the barriers below are reached by all or none.
if (head0 >= num_heads) {
  return;
}

const int seq = ma_seq_of(cu_seqlens_q, num_seqs, qtok);
const int q_start = cu_seqlens_q[seq];
const int q_len = cu_seqlens_q[seq + 1] - q_start;
// Causal rule: row i attends to [0, seq_len - q_len + i + 1).
const int ctx = seq_lens[seq] - q_len + (qtok - q_start) + 1;
const int win_start = window > 0 ? metal::max(ctx - window, 0) : 0;
const int kv_head = head0 / (num_heads / num_kv_heads);
const int64_t row_head0 = int64_t(qtok) * num_heads + head0;

#if PA_SPLIT
const int p_start = part * PARTITION_SIZE;
if (p_start >= ctx) {
  return;  // past the row: nothing written, the reducer never reads it
}
const int p_end = metal::min(p_start + PARTITION_SIZE, ctx);
if (p_end <= win_start) {
  // Entirely left of the sliding window: a neutral partial for each head.
  for (int i = tid; i < HPS * HEAD_SIZE; i += NUM_THREADS) {
    const int64_t stat = (row_head0 + i / HEAD_SIZE) * max_parts + part;
    if (i % HEAD_SIZE == 0) {
      max_logits[stat] = MA_NEG_FLT_MAX;
      exp_sums[stat] = 0.0f;
    }
    tmp_out[stat * HEAD_SIZE + i % HEAD_SIZE] = 0.0f;
  }
#if PA_FUSED
  MA_FUSED_REDUCE()
#endif
  return;
}
const int t_begin = metal::max(p_start, win_start);
const int t_end = p_end;
#else
const int t_begin = win_start;
const int t_end = ctx;
#endif

#if PA_MMA == 2
// Keys as fragment rows, heads as columns: this lane holds keys kg and kg + 8 of a 16-token block and
// heads 2 * kq + j, j < 2 (columns >= HPS are zero: masked, never written).
constexpr int D16 = HEAD_SIZE / 16;
const int kg = lane >> 2;
const int kq = lane & 3;
// Q^T as right operands (dims x heads), in registers: dims 16 t + 2 kq + i, then those + 8, of head kg.
ma_opnd<T> q_b[D16][2];
ma_frag16 ofr[D16];
for (int t = 0; t < D16; ++t) {
  for (int j = 0; j < 2; ++j) {
    const int64_t qa = (row_head0 + kg) * HEAD_SIZE + t * 16 + j * 8 + 2 * kq;
    q_b[t][j] = ma_opnd_pack<T>(kg < HPS ? ma_to_float(q[qa]) : 0.0f, kg < HPS ? ma_to_float(q[qa + 1]) : 0.0f);
  }
  for (int i = 0; i < 4; ++i) {
    ofr[t].v[i] = 0.0f;
  }
}
float m_col[2] = {MA_NEG_FLT_MAX, MA_NEG_FLT_MAX};  // reference max of heads 2 kq + j (uniform over a column)
float l_lane[2] = {0.0f, 0.0f};                     // this lane's share of their sums (reduced at the end)
#elif PA_MMA
// Heads as fragment rows: this lane's row fr (head head0 + fr; rows >= HPS are zero and
// masked) and columns fc, fc + 1 of each 8-column block.
constexpr int D8 = HEAD_SIZE / 8;
const int fr = ma_frag_row(lane);
const int fc = ma_frag_col(lane);
const bool head_ok = fr < HPS;
// Q as left operands, packed once into threadgroup memory (the same for every simdgroup;
// registers are the scarcer resource: the output fragments take 2 * D8 a lane). Simdgroup 0
// writes them; the first chunk's barrier makes them visible before any product reads them.
threadgroup ma_opnd<T> q_ops[D8 * MA_SIMD_WIDTH];
ma_frag8 ofr[D8];
for (int d = 0; d < D8; ++d) {
  if (sg == 0) {
    const int64_t qa = (row_head0 + fr) * HEAD_SIZE + d * 8 + fc;
    q_ops[d * MA_SIMD_WIDTH + lane] =
        ma_opnd_pack<T>(head_ok ? ma_to_float(q[qa]) : 0.0f, head_ok ? ma_to_float(q[qa + 1]) : 0.0f);
  }
  ofr[d].v[0] = 0.0f;
  ofr[d].v[1] = 0.0f;
}
float m_row = MA_NEG_FLT_MAX;  // the reference max of row fr (uniform over its four lanes)
float l_lane = 0.0f;           // this lane's share of the row's sum (reduced at the end)
#else
// This lane's slice of each of its heads: vectors (sl + TPT * j), j < NV, of 4 elements.
const int sgh = sg % SG_H;  // which HPW heads
const int sub = lane / TPT;
const int sl = lane % TPT;
const int64_t my_head0 = row_head0 + sgh * HPW;
float q_reg[HPW][E];
for (int h = 0; h < HPW; ++h) {
  for (int j = 0; j < NV; ++j) {
    ma_load4(q + (my_head0 + h) * HEAD_SIZE + (sl + TPT * j) * 4, &q_reg[h][4 * j]);
  }
}

float m[HPW];
float l[HPW];
float acc[HPW][E];
for (int h = 0; h < HPW; ++h) {
  m[h] = MA_NEG_FLT_MAX;
  l[h] = 0.0f;
  for (int e = 0; e < E; ++e) {
    acc[h][e] = 0.0f;
  }
}

#endif

const int64_t tok_stride = int64_t(num_kv_heads) * HEAD_SIZE;
const int64_t head_off = int64_t(kv_head) * HEAD_SIZE;
const int bt_row = seq * max_blocks;

#if PA_STAGED
// Staged: chunk c (tokens t_begin + c * STAGE ...) goes to stage c % STAGES, its K rows then
// its V rows, each row PITCH elements apart (STAGE_PAD bytes of padding against bank conflicts:
// 64, so that the two tokens a half-simdgroup reads sit in different banks; 16 for the matrix
// path's 8-row fragment reads). PA_SWIZZLE == 1 (matrix path, CUDA only): rows unpadded, row r's
// 16-byte piece x stored at piece x ^ (r % 8), so that rows stay 32-byte aligned and an 8-row
// fragment read still touches 8 bank groups. Once the loop is done, the stages hold the simdgroup merge.
constexpr int VEC16 = 16 / int(sizeof(T));             // elements per 16-byte copy
constexpr int ROW_COPIES = HEAD_SIZE / VEC16;          // copies per row
static_assert(!PA_SWIZZLE || (PA_MMA && ROW_COPIES % 8 == 0),
              "the swizzle is the matrix path's, on rows of whole groups of 8 pieces (XOR by row % 8 stays in the row)");
constexpr int PITCH = HEAD_SIZE + STAGE_PAD / int(sizeof(T));
constexpr int STAGE_ELEMS = 2 * STAGE * PITCH;
// The merge's partial outputs, then its statistics (floats), once the stages are done.
constexpr int MERGE_FLOATS = SG_T * HPS * HEAD_SIZE;
constexpr int MERGE_ELEMS = ((MERGE_FLOATS + SG_T * HPS * 2) * 4 + int(sizeof(T)) - 1) / int(sizeof(T));
threadgroup alignas(16) T kv_stage[STAGES * STAGE_ELEMS > MERGE_ELEMS ? STAGES * STAGE_ELEMS : MERGE_ELEMS];
const int n_chunks = (t_end - t_begin + STAGE - 1) / STAGE;
// Every thread copies some 16-byte pieces of the chunk's K and V rows (one address for both;
// tokens past the end are zero-filled), on pages whose ids it read one chunk earlier
// (pg[x]), so that no copy waits for a block-table read.
constexpr int COPIES = STAGE * ROW_COPIES;                           // 16-byte pieces of K (or V)
constexpr int COPY_ITERS = (COPIES + NUM_THREADS - 1) / NUM_THREADS;  // per thread
int pg[COPY_ITERS];
#define MA_STAGE_PAGES(c)                                                        \
  for (int x = 0; x < COPY_ITERS; ++x) {                                         \
    const int i = tid + x * NUM_THREADS;                                          \
    const int tok = t_begin + (c) * STAGE + i / ROW_COPIES;                       \
    const bool live = (COPIES % NUM_THREADS == 0 || i < COPIES) && tok < t_end;   \
    pg[x] = live ? block_tables[bt_row + tok / BLOCK_SIZE] : 0;                   \
  }
#define MA_STAGE_CHUNK(c)                                                                        \
  for (int x = 0; x < COPY_ITERS; ++x) {                                                       \
    const int i = tid + x * NUM_THREADS;                                                        \
    if (COPIES % NUM_THREADS == 0 || i < COPIES) {                                              \
      const int r = i / ROW_COPIES;                                                             \
      const int tok = t_begin + (c) * STAGE + r;                                                \
      const bool live = tok < t_end;                                                            \
      const int64_t src = (int64_t(pg[x]) * BLOCK_SIZE + (live ? tok % BLOCK_SIZE : 0)) * tok_stride \
                          + head_off + (i % ROW_COPIES) * VEC16;                                \
      const int piece = PA_SWIZZLE ? (i % ROW_COPIES) ^ (r & 7) : i % ROW_COPIES;                  \
      const int dst = ((c) % STAGES) * STAGE_ELEMS + r * PITCH + piece * VEC16;                  \
      ma_async_copy16(kv_stage + dst, k_cache + src, live);                                     \
      ma_async_copy16(kv_stage + dst + STAGE * PITCH, v_cache + src, live);                     \
    }                                                                                           \
  }
for (int c = 0; c < STAGES - 1; ++c) {
  if (c < n_chunks) {
    MA_STAGE_PAGES(c)
    MA_STAGE_CHUNK(c)
  }
  ma_async_commit();
}
MA_STAGE_PAGES(STAGES - 1)
for (int c = 0; c < n_chunks; ++c) {
  if (c + STAGES - 1 < n_chunks) {
    MA_STAGE_CHUNK(c + STAGES - 1)  // into the stage chunk c - 1 used (all done reading it)
    MA_STAGE_PAGES(c + STAGES)      // read now, used next iteration
  }
  ma_async_commit();
  ma_async_wait<STAGES - 1>();  // this thread's pieces of chunk c have landed
  threadgroup_barrier(mem_flags::mem_threadgroup);  // ... and everyone's
  const int cb = t_begin + c * STAGE;
  // (offsets, not pointers: CUDA's `threadgroup` is a storage class, not a pointer qualifier)
  const int k_tile = (c % STAGES) * STAGE_ELEMS;
  const int v_tile = k_tile + STAGE * PITCH;
  for (int base = cb + sgt * STEP; base < cb + STAGE; base += SG_T * STEP) {
#else
constexpr int STRIDE = SG_T * STEP;  // tokens between a simdgroup's iterations
// Page ids one iteration ahead: blk[u] is the page of token base + u * TPP + sub.
int blk[UNROLL];
for (int u = 0; u < UNROLL; ++u) {
  const int tok = t_begin + sgt * STEP + u * TPP + sub;
  blk[u] = tok < t_end ? block_tables[bt_row + tok / BLOCK_SIZE] : 0;
}
{
  for (int base = t_begin + sgt * STEP; base < t_end; base += STRIDE) {
#endif
#if PA_MMA == 2
    // This simdgroup's 16 tokens, if any is before the end (uniform over the simdgroup; those past it
    // are zero-filled and masked).
    if (base < t_end) {
      const int row = (base - cb) * PITCH;
      // S^T = K Q^T (keys x heads), the dims' tiles in two independent accumulations.
      ma_frag16 s2[2];
      for (int i = 0; i < 4; ++i) {
        s2[0].v[i] = s2[1].v[i] = 0.0f;
      }
#pragma unroll
      for (int t = 0; t < D16; ++t) {
        ma_opnd<T> ka[4];
        ma_load_a16_swz<PITCH>(kv_stage + k_tile + row, 2 * t, lane, ka);
        ma_mma16<T>(s2[t & 1], ka, q_b[t][0], q_b[t][1]);
      }
      // Online softmax per head column in log2 space, with the lazy rescale (uniform branch).
      float sc[4];
      for (int i = 0; i < 4; ++i) {
        const bool ok = 2 * kq + (i & 1) < HPS && base + kg + (i >> 1) * 8 < t_end;
        sc[i] = ok ? ma_score(s2[0].v[i] + s2[1].v[i], score_scale, softcap) : MA_NEG_FLT_MAX;
      }
      float m_new[2];
      bool grow = false;
      for (int j = 0; j < 2; ++j) {
        m_new[j] = metal::max(m_col[j], ma_frag_col_max(metal::max(sc[j], sc[j + 2])));
        grow = grow || m_new[j] > m_col[j] + MA_RESCALE_SLACK;
      }
      if (simd_any(grow)) {
        float alpha[2];
        for (int j = 0; j < 2; ++j) {
          alpha[j] = 1.0f;
          if (m_new[j] > m_col[j] + MA_RESCALE_SLACK) {
            alpha[j] = ma_rescale(m_col[j], m_new[j]);
            m_col[j] = m_new[j];
          }
          l_lane[j] *= alpha[j];
        }
        for (int t = 0; t < D16; ++t) {
          for (int i = 0; i < 4; ++i) {
            ofr[t].v[i] *= alpha[i & 1];
          }
        }
      }
      float pr[4];
      for (int i = 0; i < 4; ++i) {
        // A masked score is exactly the sentinel: exp2 of it would be 1 when m_col is too.
        pr[i] = sc[i] != MA_NEG_FLT_MAX ? metal::exp2(sc[i] - m_col[i & 1]) : 0.0f;
        l_lane[i & 1] += pr[i];
      }
      // P^T as right operands (keys x heads): each 8x8 block (keys kg, then kg + 8) transposed in registers.
      const ma_popnd<T> p_top = ma_popnd_pack<T>(pr[0], pr[1]);
      const ma_popnd<T> p_bot = ma_popnd_pack<T>(pr[2], pr[3]);
      const ma_opnd<T> b_hi0 = ma_transpose8<T>(p_top.hi);
      const ma_opnd<T> b_hi1 = ma_transpose8<T>(p_bot.hi);
      const ma_opnd<T> b_lo0 = ma_transpose8<T>(p_top.lo);
      const ma_opnd<T> b_lo1 = ma_transpose8<T>(p_bot.lo);
      // O^T += V^T P^T, one 16-dim tile of V^T per product pair.
#pragma unroll
      for (int t = 0; t < D16; ++t) {
        ma_opnd<T> va[4];
        ma_load_at16_swz<PITCH>(kv_stage + v_tile + row, 2 * t, lane, va);
        ma_mma16<T>(ofr[t], va, b_hi0, b_hi1);
        ma_mma16<T>(ofr[t], va, b_lo0, b_lo1);
      }
    }
#elif PA_MMA
    // This simdgroup's 8 tokens, if any is before the end (uniform over the simdgroup; those past
    // it are zero-filled and masked).
    if (base < t_end) {
      const int row = (base - cb) * PITCH;
      // S = Q K^T (heads x tokens).
      ma_frag8 s0;
      s0.v[0] = s0.v[1] = 0.0f;
#pragma unroll
      for (int d = 0; d < D8; d += 4) {
        ma_opnd<T> kb[4];
#if PA_SWIZZLE
        ma_load_bt4_swz<PITCH>(kv_stage + k_tile + row, d, lane, kb);
#else
        ma_load_bt4<PITCH>(kv_stage + k_tile + row + d * 8, lane, kb);
#endif
        ma_mma2<T>(s0, q_ops[d * MA_SIMD_WIDTH + lane], kb[0], q_ops[(d + 1) * MA_SIMD_WIDTH + lane], kb[1]);
        ma_mma2<T>(s0, q_ops[(d + 2) * MA_SIMD_WIDTH + lane], kb[2], q_ops[(d + 3) * MA_SIMD_WIDTH + lane], kb[3]);
      }
      // Online softmax per head row in log2 space, with the scalar path's lazy rescale.
      float sc[2];
      for (int i = 0; i < 2; ++i) {
        const bool ok = head_ok && base + fc + i < t_end;
        sc[i] = ok ? ma_score(s0.v[i], score_scale, softcap) : MA_NEG_FLT_MAX;
      }
      const float m_new = metal::max(m_row, ma_frag_row_max(metal::max(sc[0], sc[1])));
      if (m_new > m_row + MA_RESCALE_SLACK) {
        const float alpha = ma_rescale(m_row, m_new);
        l_lane *= alpha;
        for (int d = 0; d < D8; ++d) {
          ofr[d].v[0] *= alpha;
          ofr[d].v[1] *= alpha;
        }
        m_row = m_new;
      }
      float pr[2];
      for (int i = 0; i < 2; ++i) {
        // A masked score is exactly the sentinel: exp2 of it would be 1 when m_row is too.
        pr[i] = sc[i] != MA_NEG_FLT_MAX ? metal::exp2(sc[i] - m_row) : 0.0f;
        l_lane += pr[i];
      }
      const ma_popnd<T> pf = ma_popnd_pack<T>(pr[0], pr[1]);
      // O += P V, four 8-column blocks of V per fragment load.
#pragma unroll
      for (int d = 0; d < D8; d += 4) {
        ma_opnd<T> vb[4];
#if PA_SWIZZLE
        ma_load_b4d_swz<PITCH>(kv_stage + v_tile + row, d, lane, vb);
#else
        ma_load_b4d<PITCH>(kv_stage + v_tile + row + d * 8, lane, vb);
#endif
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          ma_mma_p<T>(ofr[d + x], pf, vb[x]);
        }
      }
    }
#else
    // Every K/V load of the iteration first (packed registers).
    ma_raw4<T> kraw[UNROLL][NV];
    ma_raw4<T> vraw[UNROLL][NV];
    bool ok[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int tok = base + u * TPP + sub;
      ok[u] = tok < t_end;
#if PA_STAGED
      const int row = (tok - cb) * PITCH;  // zero-filled past the end: always safe to read
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        kraw[u][j] = ma_tg_load_raw4(kv_stage + k_tile + row + (sl + TPT * j) * 4);
        vraw[u][j] = ma_tg_load_raw4(kv_stage + v_tile + row + (sl + TPT * j) * 4);
      }
#else
      if (ok[u]) {
        const int64_t addr = (int64_t(blk[u]) * BLOCK_SIZE + tok % BLOCK_SIZE) * tok_stride + head_off;
#pragma unroll
        for (int j = 0; j < NV; ++j) {
          kraw[u][j] = ma_load_raw4(k_cache + addr + (sl + TPT * j) * 4);
          vraw[u][j] = ma_load_raw4(v_cache + addr + (sl + TPT * j) * 4);
        }
      }
#endif
    }
#if !PA_STAGED
    // The next iteration's page ids (and, with PREFETCH, its rows into L2).
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int tok = base + STRIDE + u * TPP + sub;
      blk[u] = tok < t_end ? block_tables[bt_row + tok / BLOCK_SIZE] : 0;
      if (PREFETCH && tok < t_end) {
        // The TPT lanes of a token share its K and V rows' 128-byte lines.
        const int64_t addr = (int64_t(blk[u]) * BLOCK_SIZE + tok % BLOCK_SIZE) * tok_stride + head_off;
        for (int i = sl; i < 2 * ROW_LINES; i += TPT) {
          const int64_t off = addr + (i % ROW_LINES) * LINE_ELEMS;
          if (i < ROW_LINES) {
            ma_prefetch(k_cache + off);
          } else {
            ma_prefetch(v_cache + off);
          }
        }
      }
    }
#endif
    // K converted once, used by every head.
    float kf[UNROLL][E];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        if (ok[u]) {
          ma_unpack4(kraw[u][j], &kf[u][4 * j]);
        } else {
          for (int c4 = 0; c4 < 4; ++c4) {
            kf[u][4 * j + c4] = 0.0f;
          }
        }
      }
    }
    float p[HPW][UNROLL];
#pragma unroll
    for (int h = 0; h < HPW; ++h) {
      float s[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        s[u] = 0.0f;
        for (int e = 0; e < E; ++e) {
          s[u] += q_reg[h][e] * kf[u][e];
        }
      }
      // Reduce each token's partial dot over its TPT lanes (all 32 lanes take part).
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        for (int o = TPT / 2; o > 0; o >>= 1) {
          s[u] += simd_shuffle_xor(s[u], ushort(o));
        }
      }
      float m_new = m[h];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        s[u] = ok[u] ? ma_score(s[u], score_scale, softcap) : MA_NEG_FLT_MAX;
        m_new = metal::max(m_new, s[u]);
      }
      if (m_new > m[h] + MA_RESCALE_SLACK) {
        // Rescale only when the max outgrows the reference by more than the slack: the
        // token slots of a simdgroup would otherwise take this branch (E multiplies a head)
        // almost every step between them; probabilities stay below 2^MA_RESCALE_SLACK. The
        // first live token always rescales (the reference starts at -FLT_MAX).
        const float alpha = ma_rescale(m[h], m_new);
        l[h] *= alpha;
        for (int e = 0; e < E; ++e) {
          acc[h][e] *= alpha;
        }
        m[h] = m_new;
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        p[h][u] = ok[u] ? metal::exp2(s[u] - m[h]) : 0.0f;
        l[h] += p[h][u];
      }
    }
    // V converted once, accumulated into every head.
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (ok[u]) {
#pragma unroll
        for (int j = 0; j < NV; ++j) {
          float vr[4];
          ma_unpack4(vraw[u][j], vr);
#pragma unroll
          for (int h = 0; h < HPW; ++h) {
            for (int c4 = 0; c4 < 4; ++c4) {
              acc[h][4 * j + c4] += p[h][u] * vr[c4];
            }
          }
        }
      }
    }
#endif
  }
#if PA_STAGED
  threadgroup_barrier(mem_flags::mem_threadgroup);  // chunk c's stage may be refilled now
#endif
}
#if PA_STAGED
#undef MA_STAGE_CHUNK
#undef MA_STAGE_PAGES
// The merge (partial outputs, then statistics) reuses the stages: the last chunk's closing barrier
// has every thread done reading them, and every copy group committed after that chunk's was empty
// (nothing in flight).
#define MA_MERGE_ACC(i) ma_tg_floats(kv_stage)[i]
#define sg_stats (ma_tg_floats(kv_stage) + MERGE_FLOATS)
#else
threadgroup float sg_acc[SG_T * HPS * HEAD_SIZE];
#define MA_MERGE_ACC(i) sg_acc[i]
threadgroup float sg_stats[SG_T * HPS * 2];
#endif

#if PA_MMA == 2
// Each token simdgroup's state: (max, sum) per head column, its O^T fragments.
for (int j = 0; j < 2; ++j) {
  const float l_col = ma_frag_col_sum(l_lane[j]);
  const int h = 2 * kq + j;
  if (h < HPS) {
    const int slot = sgt * HPS + h;
    if (kg == 0) {
      sg_stats[slot * 2] = m_col[j];
      sg_stats[slot * 2 + 1] = l_col;
    }
    for (int t = 0; t < D16; ++t) {
      MA_MERGE_ACC(slot * HEAD_SIZE + t * 16 + kg) = ofr[t].v[j];
      MA_MERGE_ACC(slot * HEAD_SIZE + t * 16 + kg + 8) = ofr[t].v[2 + j];
    }
  }
}
#elif PA_MMA
// Each token simdgroup's state: (max, sum) per head row, its O fragments.
const float l_row = ma_frag_row_sum(l_lane);
if (head_ok) {
  const int slot = sgt * HPS + fr;
  if (fc == 0) {
    sg_stats[slot * 2] = m_row;
    sg_stats[slot * 2 + 1] = l_row;
  }
  for (int d = 0; d < D8; ++d) {
    MA_MERGE_ACC(slot * HEAD_SIZE + d * 8 + fc) = ofr[d].v[0];
    MA_MERGE_ACC(slot * HEAD_SIZE + d * 8 + fc + 1) = ofr[d].v[1];
  }
}
#else
// Merge the simdgroup's token slots (lanes sl, sl + TPT, ... hold the same slice);
// after the butterfly every slot holds the merged state.
for (int h = 0; h < HPW; ++h) {
  for (int o = TPT; o < MA_SIMD_WIDTH; o <<= 1) {
    const float m_o = simd_shuffle_xor(m[h], ushort(o));
    const float l_o = simd_shuffle_xor(l[h], ushort(o));
    const float m_n = metal::max(m[h], m_o);
    const float a = ma_rescale(m[h], m_n);
    const float b = ma_rescale(m_o, m_n);
    l[h] = l[h] * a + l_o * b;
    for (int e = 0; e < E; ++e) {
      acc[h][e] = acc[h][e] * a + simd_shuffle_xor(acc[h][e], ushort(o)) * b;
    }
    m[h] = m_n;
  }
}

// Merge the token simdgroups through threadgroup memory: each writes its (max, sum, acc)
// per head, then every thread combines some (head, element) pairs across them.
for (int h = 0; h < HPW; ++h) {
  const int slot = sgt * HPS + sgh * HPW + h;
  if (lane == 0) {
    sg_stats[slot * 2] = m[h];
    sg_stats[slot * 2 + 1] = l[h];
  }
  if (sub == 0) {
    for (int j = 0; j < NV; ++j) {
      for (int c4 = 0; c4 < 4; ++c4) {
        MA_MERGE_ACC(slot * HEAD_SIZE + (sl + TPT * j) * 4 + c4) = acc[h][4 * j + c4];
      }
    }
  }
}
#endif
threadgroup_barrier(mem_flags::mem_threadgroup);

for (int i = tid; i < HPS * HEAD_SIZE; i += NUM_THREADS) {
  const int h = i / HEAD_SIZE;
  const int d = i % HEAD_SIZE;
  float g_max = MA_NEG_FLT_MAX;
  for (int w = 0; w < SG_T; ++w) {
    g_max = metal::max(g_max, sg_stats[(w * HPS + h) * 2]);
  }
  float total = 0.0f;
  float o = 0.0f;
  for (int w = 0; w < SG_T; ++w) {
    const float wgt = ma_rescale(sg_stats[(w * HPS + h) * 2], g_max);
    total += sg_stats[(w * HPS + h) * 2 + 1] * wgt;
    o += MA_MERGE_ACC((w * HPS + h) * HEAD_SIZE + d) * wgt;
  }
  const int64_t row_head = row_head0 + h;
#if PA_SPLIT
  const int64_t stat_idx = row_head * max_parts + part;
  if (d == 0) {
    max_logits[stat_idx] = g_max;
    exp_sums[stat_idx] = total;
  }
  tmp_out[stat_idx * HEAD_SIZE + d] = o / (total + MA_SOFTMAX_EPS);
#else
  // Sinks are folded once per row, here (no value row).
  float fold = 1.0f;
  if (use_sinks) {
    const float sink = ma_sink_log2(sinks[head0 + h]);
    const float m_s = metal::max(g_max, sink);
    fold = ma_rescale(g_max, m_s);
    total = total * fold + metal::exp2(sink - m_s);
  }
  out[row_head * HEAD_SIZE + d] = ma_from_float<T>(o * fold / (total + MA_SOFTMAX_EPS));
#endif
}
#undef MA_MERGE_ACC
#if PA_STAGED
#undef sg_stats
#endif
#if PA_FUSED
MA_FUSED_REDUCE()
#undef MA_FUSED_REDUCE
#endif

// @kernel paged_attention_v2_reduce
// The split-KV reducer, shared by every kernel that writes the split contract:
// max_logits (a reference maximum in log2 space: the partition's maximum, or up to
// MA_RESCALE_SLACK below it), exp_sums (un-normalised, relative to that reference) and
// tmp_out (divided by exp_sums + eps) per (query row, head, partition); neutral partials
// carry max = -FLT_MAX, sum = 0. Sinks are folded once, here.
// One threadgroup per (query head, query row); NUM_THREADS threads in SLICES partition slices
// (ma_reduce_partials: each slice sums its share of the row's partitions, so a launch of few rows
// and heads over many partitions waits for fewer load rounds).
// Inputs : max_logits [T, H, P] f32, exp_sums [T, H, P] f32, tmp_out [T, H, P, D] (TT),
//          seq_lens [S] int32, cu_seqlens_q [S+1] int32, sinks [H] f32,
//          params int32 [num_seqs, num_heads, max_parts, use_sinks]
// Outputs: out [T, H, D] (T)
// Template: T, TT, HEAD_SIZE, PARTITION_SIZE, NUM_THREADS, SLICES.
const int num_seqs = params[0];
const int num_heads = params[1];
const int max_parts = params[2];
const int use_sinks = params[3];
const int head = int(threadgroup_position_in_grid.x);
const int qtok = int(threadgroup_position_in_grid.y);
const int tid = int(thread_position_in_threadgroup.x);
if (head >= num_heads) {
  return;
}
const int seq = ma_seq_of(cu_seqlens_q, num_seqs, qtok);
const int q_start = cu_seqlens_q[seq];
const int q_len = cu_seqlens_q[seq + 1] - q_start;
const int ctx = seq_lens[seq] - q_len + (qtok - q_start) + 1;
const int n_parts = (ctx + PARTITION_SIZE - 1) / PARTITION_SIZE;
const int64_t base = (int64_t(qtok) * num_heads + head) * max_parts;
threadgroup float sg_part[NUM_THREADS / MA_SIMD_WIDTH];
threadgroup float w_block[NUM_THREADS];
threadgroup float slice_out[SLICES > 1 ? (SLICES - 1) * HEAD_SIZE : 1];
// Partitions per load round: 16, so that a thread holds DPT x 16 loads in flight (rows of 128
// partitions at head 256 take 8 rounds, not 32 at 8; the fused reducer keeps 8, its registers
// being the per-token kernel's).
constexpr int REDUCE_UNROLL = 16;
ma_reduce_partials<T, HEAD_SIZE, NUM_THREADS, false, REDUCE_UNROLL, SLICES>(
    max_logits, exp_sums, tmp_out, out + (int64_t(qtok) * num_heads + head) * HEAD_SIZE, base, n_parts, use_sinks != 0,
    use_sinks ? ma_sink_log2(sinks[head]) : MA_NEG_FLT_MAX, sg_part, w_block, slice_out, tid);
