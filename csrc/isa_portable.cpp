// Portable build of the kernel: the architecture's baseline vector unit
// (SSE2 on x86-64, NEON on arm64); correct on every CPU.
#define MA_ISA_NS isa_portable
#include "attention_impl.h"
