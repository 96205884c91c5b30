// metal-attn tests: included between the prelude and headers (where `threadgroup` qualifies
// parameters and pointers and means nothing here) and the kernel body, whose `threadgroup`
// arrays become memory shared by the fibers of one threadgroup: `static thread_local`, the
// worker's thread-local storage, which the driver poisons before each threadgroup (a worker runs
// one threadgroup at a time). GCC accepts alignment only as a GNU attribute after `static
// thread_local`, so `alignas` reads as one inside the body.
#undef threadgroup
#define threadgroup static thread_local
#define alignas(n) __attribute__((aligned(n)))
