// metal-attn: the per-lane element layout of the NAX kernel's cooperative tensors (both backends).
//
// A matmul2d of the 16 x 32 x 16 descriptor runs on one simdgroup; its cooperative tensors spread
// the operands over the 32 lanes, 8 elements a lane per 16 x 16 fragment:
//   element e (0..7) of a fragment, in lane l, is at (ma_nax_frag_row(l, e), ma_nax_frag_col(l, e)):
//     rows ma_nax_row(l) and ma_nax_row(l) + 8, four consecutive columns from ma_nax_col(l);
//   the left input (16 x 16, M x K) is one fragment: element e at (row, col);
//   the right input and the destination (16 x 32) are two fragments side by side: element i at
//     (ma_nax_frag_row(l, i), 16 * (i >> 3) + ma_nax_frag_col(l, i));
//   a transposed right input is held as stored (32 x 16, N x K): element i at
//     (16 * (i >> 3) + ma_nax_frag_row(l, i), ma_nax_frag_col(l, i)).
// This is the layout MLX's own NAX kernels rely on (steel/attn/nax.h); on Metal it is a property of
// the tensor units, here it is written down once: the kernel text indexes with these functions, and
// the CUDA twin's tensor ops (nax_tensor_ops_cuda.h) place the elements with the same functions.
// The four lanes that hold one row differ in lane bits 0 and 3 (reduce with xor 1 and xor 8).

MA_FUNC int ma_nax_row(int lane) { return ((lane >> 2) & 4) | ((lane >> 1) & 3); }
MA_FUNC int ma_nax_col(int lane) { return (((lane >> 2) & 2) | (lane & 1)) * 4; }
MA_FUNC int ma_nax_frag_row(int lane, int e) { return ma_nax_row(lane) + 8 * ((e >> 2) & 1); }
MA_FUNC int ma_nax_frag_col(int lane, int e) { return ma_nax_col(lane) + (e & 3); }

// Reductions over the four lanes that hold one row of a fragment.
MA_FUNC float ma_nax_row_max(float x) {
  x = metal::max(x, simd_shuffle_xor(x, ushort(1)));
  return metal::max(x, simd_shuffle_xor(x, ushort(8)));
}
MA_FUNC float ma_nax_row_sum(float x) {
  x += simd_shuffle_xor(x, ushort(1));
  return x + simd_shuffle_xor(x, ushort(8));
}
// A 32-bit mask OR-ed over the whole simdgroup (every lane receives it).
MA_FUNC uint ma_nax_simd_or(uint x) {
  for (ushort o = 1; o < 32; o <<= 1) {
    x |= simd_shuffle_xor(x, o);
  }
  return x;
}
