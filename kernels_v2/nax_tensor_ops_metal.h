// metal-attn: Metal 4 tensor ops for the NAX prefill kernel (Metal only).
// The kernel uses MetalPerformancePrimitives' matmul2d on cooperative tensors (the subset is
// listed in kernels_v2/README.md). The Metal source check on Linux has no such framework: its shim
// (msl_shim.h) declares that subset and defines MA_MSL_SHIM_MPP, so the include is skipped there.
#ifndef MA_MSL_SHIM_MPP
#include <MetalPerformancePrimitives/MetalPerformancePrimitives.h>
#endif
