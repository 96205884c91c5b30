// AVX-512 (F, BW, DQ, VL) build of the kernel (compiled with those -m flags only
// here; chosen at run time when the CPU reports them).
#define MA_ISA_NS isa_avx512
#define MA_ISA_X86_VECTOR 1
#define MA_ISA_AVX512 1
#include "attention_impl.h"
