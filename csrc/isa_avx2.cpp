// AVX2 + FMA + F16C build of the kernel (compiled with those -m flags only here;
// chosen at run time when the CPU reports all three).
#define MA_ISA_NS isa_avx2
#define MA_ISA_X86_VECTOR 1
#define MA_ISA_AVX2 1
#include "attention_impl.h"
