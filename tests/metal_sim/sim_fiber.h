// metal-attn tests: cooperative fibers for the Metal threadgroup simulation (sim_metal.h).
//
// A threadgroup's threads run as fibers on one OS thread and switch only where a kernel
// synchronises (a simd_* call, a threadgroup_barrier, a simdgroup matrix product), so a switch
// must be cheap: on x86-64 ELF it is a few instructions of assembly (callee-saved registers,
// the SSE and x87 control words, the stack pointer); elsewhere (or with -DSIM_UCONTEXT) it is
// POSIX swapcontext, slower (a system call per switch) but portable.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sys/mman.h>
#include <unistd.h>

#if !defined(SIM_UCONTEXT) && !(defined(__x86_64__) && defined(__ELF__))
#define SIM_UCONTEXT 1
#endif
#if SIM_UCONTEXT
#include <ucontext.h>
#endif

// One execution context: a stack and the state saved while it is switched out.
struct SimContext {
#if SIM_UCONTEXT
  ucontext_t uc;
#else
  void* sp = nullptr;  // the saved stack pointer (the registers are pushed on the stack)
#endif
  char* stack = nullptr;  // lowest address of the mapping (a guard page, then the stack)
  size_t stack_bytes = 0;
};

#if !SIM_UCONTEXT
// sim_ctx_switch(&from->sp, to->sp): push the callee-saved registers and control words, save the
// stack pointer, load the other one and pop its registers; `ret` resumes it (or, the first time,
// enters sim_ctx_start with the stack that sim_ctx_make laid out).
extern "C" void sim_ctx_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .p2align 4
  .globl sim_ctx_switch
  .type sim_ctx_switch, @function
sim_ctx_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $16, %rsp
  stmxcsr 8(%rsp)
  fnstcw (%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  fldcw (%rsp)
  ldmxcsr 8(%rsp)
  addq $16, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size sim_ctx_switch, .-sim_ctx_switch
  .section .note.GNU-stack,"",@progbits
  .text
)");
#endif

// The stack of a fiber: `bytes` usable, below it one inaccessible guard page (an overflow faults).
inline void sim_ctx_alloc(SimContext& c, size_t bytes) {
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  bytes = (bytes + page - 1) / page * page;
  void* p = mmap(nullptr, bytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    std::fprintf(stderr, "sim: mmap of a fiber stack failed\n");
    std::abort();
  }
  mprotect(p, page, PROT_NONE);
  c.stack = static_cast<char*>(p);
  c.stack_bytes = bytes + page;
}

// Lay out `c` so that the first switch to it calls entry() on its own stack (entry never returns).
inline void sim_ctx_make(SimContext& c, void (*entry)()) {
#if SIM_UCONTEXT
  getcontext(&c.uc);
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  c.uc.uc_stack.ss_sp = c.stack + page;
  c.uc.uc_stack.ss_size = c.stack_bytes - page;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
#else
  uintptr_t top = reinterpret_cast<uintptr_t>(c.stack + c.stack_bytes) & ~uintptr_t(15);
  uint64_t* s = reinterpret_cast<uint64_t*>(top);
  *--s = 0;                                    // entry's (never used) return address: rsp = 8 mod 16 there
  *--s = reinterpret_cast<uint64_t>(entry);    // popped by `ret`
  for (int i = 0; i < 6; ++i) *--s = 0;        // rbp rbx r12 r13 r14 r15
  *--s = 0x1F80;                               // mxcsr (at 8(%rsp); the default)
  *--s = 0x037F;                               // x87 control word (at (%rsp); the default)
  c.sp = s;
#endif
}

inline void sim_ctx_switch_to(SimContext& from, SimContext& to) {
#if SIM_UCONTEXT
  swapcontext(&from.uc, &to.uc);
#else
  sim_ctx_switch(&from.sp, to.sp);
#endif
}
