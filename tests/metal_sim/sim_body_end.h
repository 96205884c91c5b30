// metal-attn tests: after the kernel body (see sim_body_begin.h).
#undef alignas
#undef threadgroup
#define threadgroup
