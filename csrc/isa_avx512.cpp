// AVX-512 (F, BW, DQ, VL) build of the kernel (compiled with those -m flags only
// here; chosen at run time when the CPU reports them).
#if defined(__GNUC__) && !defined(__clang__)
// GCC's own AVX-512 intrinsics (_mm512_cvtph_ps, _mm512_reduce_add_ps) start
// from _mm*_undefined_*(), which GCC 12 reports as uninitialised: a false
// positive inside the compiler's header, silenced for this unit only.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define MA_ISA_NS isa_avx512
#define MA_ISA_X86_VECTOR 1
#define MA_ISA_AVX512 1
#include "attention_impl.h"
