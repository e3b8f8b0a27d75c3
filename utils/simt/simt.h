// simt.h — CUDA C++ kernels compiled by g++ and run on the CPU, thread by thread.
//
// Every CUDA thread of a block is a fiber (a ucontext with its own stack); the blocks of a grid run one
// after another, and a cooperative scheduler switches fibers where CUDA threads wait for each other:
// __syncthreads() (a block barrier: a warp that returned whole no longer counts, as on sm_70+; part of a warp
// returning while its other lanes wait there is reported — CUDA leaves that barrier undefined), the warp
// collectives (__shfl_*_sync, __ballot/__any/__all_sync, __syncwarp, the nvcuda::wmma *_sync calls: every
// lane named in the mask must arrive, they exchange, they go on). Nothing else runs "in parallel": between
// two waits a thread runs alone, so a result never depends on a race the hardware would lose.
//
// What differs from a GPU, on purpose:
// * __shared__ variables are static storage shared by the block's threads (blocks run one at a time); the
//   Python side (utils/simt.py) fills them with 0xFF bytes (NaN, -1) before every block, as unwritten
//   shared memory holds garbage on a GPU.
// * __pipeline_memcpy_async copies when the thread waits for it (__pipeline_wait_prior), not before: the
//   latest a GPU may complete it, so a read of the destination before the wait sees the old bytes.
// * wmma fragments hold the whole 16x16 tile in every lane (fragment.x[i] over num_elements works, as it
//   must for any layout); the warp's lanes must pass the same pointer, ldm and layout, and a store writes
//   once. mma_sync sums each dot product exactly (in double) and rounds once to the accumulator's type.
// * Math functions (rsqrtf, __expf, __fdividef, ...) are the C library's, more exact than the GPU's
//   approximations; bf16 and fp16 conversions round to nearest even exactly as CUDA's do.
// * Deadlocks are reported, not hung in: a barrier no thread can leave names its kind, place, the block and
//   which threads arrived.
//
// The header is the runtime too (everything is inline); utils/simt.py generates the extern "C" entry that
// launches one kernel instantiation, compiles it with g++ -std=c++20 -O1 and calls it with ctypes.
#ifndef SIMT_H
#define SIMT_H

#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <type_traits>

// Built with AddressSanitizer (utils.simt.run_checked): every switch between fibers is announced to it, as it
// asks of user-level context switching, so that it knows which stack runs.
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define SIMT_ASAN 1
#else
#define SIMT_ASAN 0
#endif

// --------------------------------------------------------------------------------------------------------
// Built-in types and qualifiers
// --------------------------------------------------------------------------------------------------------

#define __global__
#define __device__
#define __host__
#define __constant__
#define __managed__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static __attribute__((aligned(16)))
#define __SIMT__ 1

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
  constexpr operator uint3() const { return uint3{x, y, z}; }
};

#define SIMT_VEC2(name, T, align)                                          \
  struct __attribute__((aligned(align))) name {                            \
    T x, y;                                                                \
  };                                                                       \
  inline name make_##name(T x, T y) { return name{x, y}; }
#define SIMT_VEC3(name, T)                                                 \
  struct name {                                                            \
    T x, y, z;                                                             \
  };                                                                       \
  inline name make_##name(T x, T y, T z) { return name{x, y, z}; }
#define SIMT_VEC4(name, T, align)                                          \
  struct __attribute__((aligned(align))) name {                            \
    T x, y, z, w;                                                          \
  };                                                                       \
  inline name make_##name(T x, T y, T z, T w) { return name{x, y, z, w}; }

// Counted 16-byte reads (defined SIMT_COUNT_READS, utils.simt.run_checked's count_reads): a float4, int4 or uint4
// copied from the bytes of a registered range (a tensor argument) counts as one 16-byte read of it. The type then
// has constructors (float4{a, b, c, d}, float4 v = {...}, float4 v{} still work) and is no aggregate.
namespace simt {
namespace detail {
inline long long g_read_ranges[32];  // (first byte, one past the last) of each registered range
inline long long g_reads16[16];
inline int g_nread_ranges = 0;
inline void count_read16(const void* p) {
  long long a = (long long)(uintptr_t)p;
  for (int i = 0; i < g_nread_ranges; ++i)
    if (a >= g_read_ranges[2 * i] && a < g_read_ranges[2 * i + 1]) {
      ++g_reads16[i];
      return;
    }
}
}  // namespace detail
}  // namespace simt
#if defined(SIMT_COUNT_READS)
#define SIMT_VEC4_16(name, T)                                                                  \
  struct __attribute__((aligned(16))) name {                                                   \
    T x, y, z, w;                                                                              \
    name() = default;                                                                          \
    constexpr name(T vx, T vy = T(), T vz = T(), T vw = T()) : x(vx), y(vy), z(vz), w(vw) {}   \
    name(const name& o) { *this = o; }                                                         \
    name& operator=(const name& o) { /* one 16-byte access, as AddressSanitizer is to see it */ \
      struct __attribute__((aligned(16), may_alias)) Raw {                                     \
        T v[4];                                                                                \
      };                                                                                       \
      *reinterpret_cast<Raw*>(this) = *reinterpret_cast<const Raw*>(&o);                       \
      ::simt::detail::count_read16(&o);                                                        \
      return *this;                                                                            \
    }                                                                                          \
  };                                                                                           \
  inline name make_##name(T x, T y, T z, T w) { return name(x, y, z, w); }
#else
#define SIMT_VEC4_16(name, T) SIMT_VEC4(name, T, 16)
#endif

SIMT_VEC2(float2, float, 8)
SIMT_VEC3(float3, float)
SIMT_VEC4_16(float4, float)
SIMT_VEC2(double2, double, 16)
SIMT_VEC2(int2, int, 8)
SIMT_VEC3(int3, int)
SIMT_VEC4_16(int4, int)
SIMT_VEC2(uint2, unsigned, 8)
SIMT_VEC4_16(uint4, unsigned)
SIMT_VEC2(short2, short, 4)
SIMT_VEC4(short4, short, 8)
SIMT_VEC2(ushort2, unsigned short, 4)
SIMT_VEC4(ushort4, unsigned short, 8)
SIMT_VEC4(char4, signed char, 4)
SIMT_VEC4(uchar4, unsigned char, 4)
SIMT_VEC2(longlong2, long long, 16)
SIMT_VEC2(ulonglong2, unsigned long long, 16)
inline uint3 make_uint3(unsigned x, unsigned y, unsigned z) { return uint3{x, y, z}; }
#undef SIMT_VEC2
#undef SIMT_VEC3
#undef SIMT_VEC4
#undef SIMT_VEC4_16

static constexpr int warpSize = 32;

// --------------------------------------------------------------------------------------------------------
// The runtime: fibers, the scheduler, barriers and warp collectives
// --------------------------------------------------------------------------------------------------------

namespace simt {
namespace detail {

enum FiberState : int { RUNNABLE = 0, WAITING = 1, EXITED = 2 };
enum WaitKind : int {
  W_NONE = 0,
  W_SYNCTHREADS,
  W_SYNCWARP,
  W_SHFL_IDX,
  W_SHFL_UP,
  W_SHFL_DOWN,
  W_SHFL_XOR,
  W_BALLOT,
  W_WMMA,
};

inline const char* kind_name(int kind) {
  switch (kind) {
    case W_SYNCTHREADS: return "__syncthreads()";
    case W_SYNCWARP: return "__syncwarp";
    case W_SHFL_IDX: return "__shfl_sync";
    case W_SHFL_UP: return "__shfl_up_sync";
    case W_SHFL_DOWN: return "__shfl_down_sync";
    case W_SHFL_XOR: return "__shfl_xor_sync";
    case W_BALLOT: return "__ballot_sync/__any_sync/__all_sync";
    case W_WMMA: return "nvcuda::wmma";
    default: return "nothing";
  }
}

struct Fiber;
using WarpOp = void (*)(Fiber** lanes, unsigned mask);  // completes a collective: lanes[i] for i in mask

struct AsyncCopy {
  void* dst;
  const void* src;
  unsigned bytes, zfill;
  long long group;
};

struct Fiber {
  ucontext_t ctx;
  uint3 idx;
  int linear;
  int state;
  // where it waits (W_NONE when running)
  int kind;
  const char* file;
  int line;
  unsigned mask;
  // a warp collective's arguments and result
  unsigned long long value, result;
  int param, width;
  const void* ptr[4];
  long long ldm;
  int layout;
  WarpOp op;
  const char* op_name;
  // __syncthreads_count/and/or
  int predicate;
  // deferred cp.async copies
  AsyncCopy* copies;
  int ncopies, capcopies;
  long long committed;
  // its stack, and AddressSanitizer's record of it while another fiber runs
  void* stack_lo;
  size_t stack_bytes;
  void* fake_stack;
};

// The warp shuffles each thread of the last launch executed, by thread (block after block, x fastest).
inline long long* g_shuffles = nullptr;
inline long long g_nshuffles = 0;

struct State {
  // the launch
  dim3 grid, block;
  uint3 block_idx;
  int nthreads, live;
  Fiber* fibers;
  Fiber* cur;
  ucontext_t sched;
  const void* sched_stack_lo;  // the scheduler's stack (AddressSanitizer's fiber switches)
  size_t sched_stack_bytes;
  ucontext_t proto;
  char* stacks;
  size_t stack_size;
  void (*body)(void*);
  void* body_args;
  // the block barrier
  int bar_arrived;
  // warp collectives: lanes waiting, by warp
  unsigned* warp_pending;
  int nwarps;
  // run queue
  int* queue;
  int qhead, qcount;
  bool reverse;
  // shared memory to poison before each block
  const long long* poison;  // (address, bytes) pairs
  int npoison;
  // the outcome
  int failed;  // 0 ok, 1 deadlock, 2 error
  char* err;
  size_t errlen;
};

inline State* g_state = nullptr;

// One stack pool, kept between launches (a fresh mmap per launch would cost more than the launch).
struct StackPool {
  char* base;
  size_t count, size;
};
inline StackPool g_pool = {nullptr, 0, 0};

inline size_t page_size() {
  static const size_t size = (size_t)sysconf(_SC_PAGESIZE);
  return size;
}

inline char* stacks_for(int count, size_t size) {
  size_t page = page_size();
  size = (size + page - 1) / page * page;
  if (g_pool.base && g_pool.count >= (size_t)count && g_pool.size == size) return g_pool.base;
  if (g_pool.base) munmap(g_pool.base, g_pool.count * (g_pool.size + page));
  size_t total = (size_t)count * (size + page);
  void* mem = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (mem == MAP_FAILED) {
    g_pool = {nullptr, 0, 0};
    return nullptr;
  }
  char* base = (char*)mem;
  for (int i = 0; i < count; ++i) mprotect(base + (size_t)i * (size + page), page, PROT_NONE);  // guard page
  g_pool = {base, (size_t)count, size};
  return base;
}

// Appends to the launch's error message (printf-style).
inline void say(const char* fmt, ...) {
  State* s = g_state;
  size_t used = strlen(s->err);
  if (used + 1 >= s->errlen) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(s->err + used, s->errlen - used, fmt, ap);
  va_end(ap);
}

inline const char* base_name(const char* file) {
  const char* slash = file ? strrchr(file, '/') : nullptr;
  return slash ? slash + 1 : (file ? file : "?");
}

// "0-31, 40, 42-47": a set of indices in words.
inline void say_ranges(const int* items, int n) {
  if (n == 0) {
    say("none");
    return;
  }
  int shown = 0;
  for (int i = 0; i < n;) {
    int j = i;
    while (j + 1 < n && items[j + 1] == items[j] + 1) ++j;
    if (shown == 8) {
      say(", ...");
      return;
    }
    say(shown ? ", " : "");
    if (j == i) say("%d", items[i]);
    else say("%d-%d", items[i], items[j]);
    ++shown;
    i = j + 1;
  }
}

inline void say_block() {
  State* s = g_state;
  say("block (%u, %u, %u) of grid (%u, %u, %u), %u x %u x %u threads", s->block_idx.x, s->block_idx.y,
      s->block_idx.z, s->grid.x, s->grid.y, s->grid.z, s->block.x, s->block.y, s->block.z);
}

inline void say_thread(const Fiber* f) {
  State* s = g_state;
  if (s->block.y == 1 && s->block.z == 1) say("thread %u", f->idx.x);
  else say("thread (%u, %u, %u)", f->idx.x, f->idx.y, f->idx.z);
}

// Stops the launch with an error (from a fiber: never returns).
[[noreturn]] inline void fail_now();
inline void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
inline void fail(const char* fmt, ...) {
  State* s = g_state;
  if (s->failed) return;
  s->failed = 2;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(s->err, s->errlen, fmt, ap);
  va_end(ap);
}

// The running fiber gives the CPU back to the scheduler; ``for_good``: it will never run again.
inline void to_scheduler(bool for_good) {
  State* s = g_state;
  Fiber* f = s->cur;
#if SIMT_ASAN
  __sanitizer_start_switch_fiber(for_good ? nullptr : &f->fake_stack, s->sched_stack_lo, s->sched_stack_bytes);
#else
  (void)for_good;
#endif
  swapcontext(&f->ctx, &s->sched);
#if SIMT_ASAN
  __sanitizer_finish_switch_fiber(f->fake_stack, &s->sched_stack_lo, &s->sched_stack_bytes);
#endif
}

// The scheduler runs fiber ``f`` until it waits or returns.
inline void to_fiber(Fiber* f) {
  State* s = g_state;
#if SIMT_ASAN
  void* fake_stack = nullptr;
  __sanitizer_start_switch_fiber(&fake_stack, f->stack_lo, f->stack_bytes);
#endif
  swapcontext(&s->sched, &f->ctx);
#if SIMT_ASAN
  __sanitizer_finish_switch_fiber(fake_stack, nullptr, nullptr);
#endif
}

[[noreturn]] inline void fail_now() {
  to_scheduler(true);
  abort();  // a failed launch never resumes a fiber
}

inline void make_runnable(Fiber* f) {
  State* s = g_state;
  f->state = RUNNABLE;
  f->kind = W_NONE;
  s->queue[(s->qhead + s->qcount) % s->nthreads] = f->linear;
  s->qcount++;
}

// The current fiber waits until someone makes it runnable.
inline void block_here() {
  State* s = g_state;
  Fiber* f = s->cur;
  f->state = WAITING;
  to_scheduler(false);
}

inline bool same_site(const Fiber* a, const Fiber* b) {
  return a->line == b->line && (a->file == b->file || (a->file && b->file && strcmp(a->file, b->file) == 0));
}

// Every live thread of the block is at a __syncthreads(): release them (if they are at the same one).
inline void complete_block_barrier() {
  State* s = g_state;
  Fiber* first = nullptr;
  bool diverged = false;
  for (int i = 0; i < s->nthreads; ++i) {
    Fiber* f = &s->fibers[i];
    if (f->state == EXITED || f->kind != W_SYNCTHREADS) continue;
    if (!first) first = f;
    else if (!same_site(first, f)) diverged = true;
  }
  if (diverged) {
    fail("divergent __syncthreads() in ");
    say_block();
    say(": the live threads wait at different __syncthreads() (a barrier in a branch some threads skip):");
    int* ids = (int*)malloc(sizeof(int) * s->nthreads);
    bool* done = (bool*)calloc(s->nthreads, 1);
    for (int i = 0; i < s->nthreads; ++i) {
      Fiber* f = &s->fibers[i];
      if (done[i] || f->state == EXITED || f->kind != W_SYNCTHREADS) continue;
      int n = 0;
      for (int j = i; j < s->nthreads; ++j) {
        Fiber* g = &s->fibers[j];
        if (!done[j] && g->state != EXITED && g->kind == W_SYNCTHREADS && same_site(f, g)) {
          ids[n++] = j;
          done[j] = true;
        }
      }
      say("\n  at %s:%d: threads ", base_name(f->file), f->line);
      say_ranges(ids, n);
    }
    free(ids);
    free(done);
    return;
  }
  // CUDA defines a barrier only when every thread of the block reaches it. A warp that returned whole is no
  // longer waited for (sm_70+ drops exited warps from the count: `if (row >= rows) return;` per warp works), but
  // a warp some of whose lanes returned while the others wait here has threads that skipped this barrier.
  int* skipped = (int*)malloc(sizeof(int) * s->nthreads);
  int* waiting = (int*)malloc(sizeof(int) * s->nthreads);
  int nskipped = 0, nwaiting = 0;
  for (int w = 0; w < s->nwarps; ++w) {
    int lo = w * 32, hi = lo + 32 < s->nthreads ? lo + 32 : s->nthreads, exited = 0;
    for (int i = lo; i < hi; ++i) exited += s->fibers[i].state == EXITED;
    if (exited == 0 || exited == hi - lo) continue;
    for (int i = lo; i < hi; ++i) {
      if (s->fibers[i].state == EXITED) skipped[nskipped++] = i;
      else waiting[nwaiting++] = i;
    }
  }
  if (nskipped) {
    fail("__syncthreads() at %s:%d not reached by every thread of ", base_name(first->file), first->line);
    say_block();
    say(": it completed with threads ");
    say_ranges(waiting, nwaiting);
    say(" there while threads ");
    say_ranges(skipped, nskipped);
    say(" of the same warps had returned without reaching it (CUDA: a __syncthreads() in code that not every "
        "thread of the block runs is undefined; a warp that returns whole is not waited for, part of one is)");
  }
  free(skipped);
  free(waiting);
  if (nskipped) return;
  int count = 0;
  for (int i = 0; i < s->nthreads; ++i) {
    Fiber* f = &s->fibers[i];
    if (f->state != EXITED && f->kind == W_SYNCTHREADS) count += f->predicate != 0;
  }
  for (int i = 0; i < s->nthreads; ++i) {
    Fiber* f = &s->fibers[i];
    if (f->state == EXITED || f->kind != W_SYNCTHREADS) continue;
    f->result = (unsigned long long)count;
    if (f != s->cur) make_runnable(f);
    else f->kind = W_NONE;
  }
  s->bar_arrived = 0;
}

inline int syncthreads_at(int predicate, const char* file, int line) {
  State* s = g_state;
  Fiber* f = s->cur;
  f->kind = W_SYNCTHREADS;
  f->file = file;
  f->line = line;
  f->predicate = predicate;
  s->bar_arrived++;
  if (s->bar_arrived == s->live) {
    complete_block_barrier();
    if (s->failed) fail_now();
  } else {
    block_here();
  }
  return (int)f->result;
}

inline void say_lanes(unsigned bits) {
  int ids[32], n = 0;
  for (int i = 0; i < 32; ++i)
    if (bits >> i & 1u) ids[n++] = i;
  say_ranges(ids, n);
}

// The current lane arrives at a warp collective; returns when every lane of ``mask`` has.
inline void warp_arrive(int kind, unsigned mask, const char* file, int line) {
  State* s = g_state;
  Fiber* f = s->cur;
  int lane = f->linear & 31, warp = f->linear >> 5;
  f->kind = kind;
  f->mask = mask;
  f->file = file;
  f->line = line;
  if (!(mask >> lane & 1u)) {
    fail("%s at %s:%d: ", f->op_name ? f->op_name : kind_name(kind), base_name(file), line);
    say_thread(f);
    say(" (lane %d of warp %d) of ", lane, warp);
    say_block();
    say(" calls it with mask 0x%08x, which does not name its own lane", mask);
    fail_now();
  }
  unsigned& pending = s->warp_pending[warp];
  pending |= 1u << lane;
  if ((pending & mask) != mask) {
    block_here();
    return;
  }
  Fiber* lanes[32] = {};
  for (int i = 0; i < 32; ++i) {
    if (!(mask >> i & 1u)) continue;
    Fiber* g = &s->fibers[warp * 32 + i];
    if (g->mask != mask || g->kind != kind || g->op != f->op) {  // lane i waits in another group (for now)
      block_here();
      return;
    }
    lanes[i] = g;
  }
  pending &= ~mask;
  f->op(lanes, mask);
  if (s->failed) fail_now();
  for (int i = 0; i < 32; ++i)
    if (lanes[i] && lanes[i] != f) make_runnable(lanes[i]);
  f->kind = W_NONE;
}

// A fiber returned from the kernel.
inline void thread_exit() {
  State* s = g_state;
  Fiber* f = s->cur;
  f->state = EXITED;
  f->kind = W_NONE;
  s->live--;
  if (s->bar_arrived > 0 && s->bar_arrived == s->live) complete_block_barrier();
  free(f->copies);
  f->copies = nullptr;
  f->ncopies = f->capcopies = 0;
}

inline void fiber_main() {
  State* s = g_state;
#if SIMT_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &s->sched_stack_lo, &s->sched_stack_bytes);
#endif
  s->body(s->body_args);
  thread_exit();
  to_scheduler(true);
}

// No fiber can run, and some have not returned: say who waits where.
inline void report_deadlock() {
  State* s = g_state;
  s->failed = 1;
  s->err[0] = 0;
  say("deadlock in ");
  say_block();
  say(": every live thread waits at a barrier that cannot complete");
  int* ids = (int*)malloc(sizeof(int) * s->nthreads);
  int n = 0;
  // The block barrier: who is there, who is not.
  for (int i = 0; i < s->nthreads; ++i)
    if (s->fibers[i].state == WAITING && s->fibers[i].kind == W_SYNCTHREADS) ids[n++] = i;
  if (n) {
    Fiber* f = &s->fibers[ids[0]];
    say("\n  __syncthreads() at %s:%d: threads ", base_name(f->file), f->line);
    say_ranges(ids, n);
    say(" arrived (%d of %d live threads)", n, s->live);
    int m = 0;
    for (int i = 0; i < s->nthreads; ++i)
      if (s->fibers[i].state == EXITED) ids[m++] = i;
    if (m) {
      say("; threads ");
      say_ranges(ids, m);
      say(" returned");
    }
  }
  // Each warp's collectives.
  for (int w = 0; w < s->nwarps; ++w) {
    unsigned waiting = 0, exited = 0, absent = 0;
    for (int i = 0; i < 32; ++i) {
      int t = w * 32 + i;
      if (t >= s->nthreads) absent |= 1u << i;
      else if (s->fibers[t].state == EXITED) exited |= 1u << i;
      else if (s->fibers[t].state == WAITING && s->fibers[t].kind != W_SYNCTHREADS) waiting |= 1u << i;
    }
    unsigned shown = 0;
    for (int i = 0; i < 32; ++i) {
      if (!(waiting >> i & 1u) || (shown >> i & 1u)) continue;
      Fiber* f = &s->fibers[w * 32 + i];
      unsigned same = 0;
      for (int j = i; j < 32; ++j) {
        Fiber* g = &s->fibers[w * 32 + j];
        if ((waiting >> j & 1u) && g->kind == f->kind && g->mask == f->mask && g->op == f->op && same_site(f, g))
          same |= 1u << j;
      }
      shown |= same;
      say("\n  %s(mask 0x%08x) at %s:%d in warp %d: lanes ", f->op_name ? f->op_name : kind_name(f->kind), f->mask,
          base_name(f->file), f->line, w);
      say_lanes(same);
      say(" arrived");
      unsigned missing = f->mask & ~same;
      if (missing & exited) {
        say("; lanes ");
        say_lanes(missing & exited);
        say(" returned");
      }
      if (missing & absent) {
        say("; lanes ");
        say_lanes(missing & absent);
        say(" do not exist (the block has %d threads)", s->nthreads);
      }
      unsigned elsewhere = missing & ~exited & ~absent;
      if (elsewhere) {
        say("; lanes ");
        say_lanes(elsewhere);
        say(" wait elsewhere");
      }
    }
  }
  free(ids);
}

inline void run_block() {
  State* s = g_state;
  for (int i = 0; i < s->npoison; ++i) memset((void*)(uintptr_t)s->poison[2 * i], 0xFF, (size_t)s->poison[2 * i + 1]);
  size_t page = page_size();
  size_t stride = (s->stack_size + page - 1) / page * page + page;
  s->live = s->nthreads;
  s->bar_arrived = 0;
  s->qhead = 0;
  s->qcount = 0;
  for (int w = 0; w < s->nwarps; ++w) s->warp_pending[w] = 0;
  for (int i = 0; i < s->nthreads; ++i) {
    int t = s->reverse ? s->nthreads - 1 - i : i;
    Fiber* f = &s->fibers[t];
    memset((void*)f, 0, sizeof(Fiber));
    f->linear = t;
    f->idx = uint3{t % s->block.x, (t / s->block.x) % s->block.y, t / (s->block.x * s->block.y)};
    memcpy((void*)&f->ctx, &s->proto, sizeof(ucontext_t));
#if defined(__x86_64__) && defined(__GLIBC__)
    f->ctx.uc_mcontext.fpregs = &f->ctx.__fpregs_mem;  // the copy's own floating-point state, not the prototype's
#endif
    f->ctx.uc_stack.ss_sp = f->stack_lo = s->stacks + (size_t)t * stride + page;
    f->ctx.uc_stack.ss_size = f->stack_bytes = stride - page;
    f->ctx.uc_link = &s->sched;
    makecontext(&f->ctx, (void (*)())fiber_main, 0);
    s->queue[s->qcount++] = t;
  }
  while (s->live > 0 && !s->failed) {
    if (s->qcount == 0) {
      report_deadlock();
      return;
    }
    int t = s->queue[s->qhead];
    s->qhead = (s->qhead + 1) % s->nthreads;
    s->qcount--;
    s->cur = &s->fibers[t];
    to_fiber(s->cur);
  }
}

// options: [0] reverse order (1 = threads start last to first), [1] stack bytes per thread (0: default)
inline int launch(const long long* dims, void (*body)(void*), void* args, char* err, long long errlen,
                  const long long* options, const long long* poison, int npoison) {
  static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
  pthread_mutex_lock(&lock);
  State state;
  memset((void*)&state, 0, sizeof(state));
  State* s = &state;
  State* outer = g_state;
  g_state = s;
  s->err = err;
  s->errlen = (size_t)errlen;
  err[0] = 0;
  s->grid = dim3((unsigned)dims[0], (unsigned)dims[1], (unsigned)dims[2]);
  s->block = dim3((unsigned)dims[3], (unsigned)dims[4], (unsigned)dims[5]);
  s->body = body;
  s->body_args = args;
  s->poison = poison;
  s->npoison = npoison;
  s->reverse = options && options[0];
  s->stack_size = options && options[1] > 0 ? (size_t)options[1] : (size_t)256 * 1024;
  long long threads = dims[3] * dims[4] * dims[5];
  for (int i = 0; i < 6; ++i) {
    if (dims[i] < 0 || dims[i] > 0x7fffffffLL) {
      fail("invalid launch configuration: grid (%lld, %lld, %lld), block (%lld, %lld, %lld)", dims[0], dims[1],
           dims[2], dims[3], dims[4], dims[5]);
    }
  }
  if (!s->failed && (threads > 1024 || dims[5] > 64 || dims[1] > 65535 || dims[2] > 65535)) {
    fail("invalid launch configuration: block (%lld, %lld, %lld) has %lld threads (at most 1024, z at most 64), "
         "grid (%lld, %lld, %lld) (y and z at most 65535)", dims[3], dims[4], dims[5], threads, dims[0], dims[1],
         dims[2]);
  }
  long long blocks = dims[0] * dims[1] * dims[2];
  free(g_shuffles);
  g_shuffles = nullptr;
  g_nshuffles = 0;
  if (!s->failed && threads > 0 && blocks > 0) {
    g_shuffles = (long long*)calloc((size_t)(blocks * threads), sizeof(long long));
    g_nshuffles = g_shuffles ? blocks * threads : 0;
    s->nthreads = (int)threads;
    s->nwarps = (s->nthreads + 31) / 32;
    s->fibers = (Fiber*)calloc(s->nthreads, sizeof(Fiber));
    s->queue = (int*)calloc(s->nthreads, sizeof(int));
    s->warp_pending = (unsigned*)calloc(s->nwarps, sizeof(unsigned));
    s->stacks = stacks_for(s->nthreads, s->stack_size);
    if (!s->stacks || !s->fibers || !s->queue || !s->warp_pending) fail("out of memory for %d fibers", s->nthreads);
    getcontext(&s->proto);
    for (unsigned z = 0; z < s->grid.z && !s->failed; ++z)
      for (unsigned y = 0; y < s->grid.y && !s->failed; ++y)
        for (unsigned x = 0; x < s->grid.x && !s->failed; ++x) {
          s->block_idx = uint3{x, y, z};
          run_block();
        }
    if (s->fibers)
      for (int i = 0; i < s->nthreads; ++i) free(s->fibers[i].copies);
    free(s->fibers);
    free(s->queue);
    free(s->warp_pending);
  }
  int failed = s->failed;
  g_state = outer;
  pthread_mutex_unlock(&lock);
  return failed;
}

// ---- a fault handler for a child process (utils.simt.run_checked): who was running when it crashed ----

inline void write_str(const char* text) {
  ssize_t r = write(2, text, strlen(text));
  (void)r;
}

inline void on_fault(int sig, siginfo_t* info, void*) {
  char buf[512];
  State* s = g_state;
  const char* name = sig == SIGSEGV ? "SIGSEGV" : sig == SIGBUS ? "SIGBUS" : sig == SIGFPE ? "SIGFPE" : "signal";
  if (s && s->cur) {
    snprintf(buf, sizeof buf, "\nSIMT-FAULT %s addr=%p block=%u,%u,%u thread=%u,%u,%u\n", name, info->si_addr,
             s->block_idx.x, s->block_idx.y, s->block_idx.z, s->cur->idx.x, s->cur->idx.y, s->cur->idx.z);
  } else {
    snprintf(buf, sizeof buf, "\nSIMT-FAULT %s addr=%p\n", name, info->si_addr);
  }
  write_str(buf);
  _exit(86);
}

#if SIMT_ASAN
// AddressSanitizer found an access to poisoned memory (run_checked poisons every byte of a tensor argument that is
// no element of its view): its report, and which thread of which block made the access.
inline void on_asan_report(const char* report) {
  char buf[256];
  State* s = g_state;
  if (s && s->cur) {
    snprintf(buf, sizeof buf, "\nSIMT-ASAN block=%u,%u,%u thread=%u,%u,%u\n", s->block_idx.x, s->block_idx.y,
             s->block_idx.z, s->cur->idx.x, s->cur->idx.y, s->cur->idx.z);
  } else {
    snprintf(buf, sizeof buf, "\nSIMT-ASAN\n");
  }
  write_str(buf);
  write_str(report);
  write_str("\nSIMT-ASAN-END\n");
}
#endif

inline void install_fault_handler() {
#if SIMT_ASAN
  __asan_set_error_report_callback(on_asan_report);
#endif
  static char altstack[65536];
  stack_t ss;
  ss.ss_sp = altstack;
  ss.ss_size = sizeof altstack;
  ss.ss_flags = 0;
  sigaltstack(&ss, nullptr);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigaction(SIGSEGV, &sa, nullptr);
  sigaction(SIGBUS, &sa, nullptr);
  sigaction(SIGFPE, &sa, nullptr);
}

template <class T>
inline unsigned long long to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "warp shuffles move at most 8 bytes");
  unsigned long long bits = 0;
  memcpy(&bits, &v, sizeof(T));
  return bits;
}

template <class T>
inline T from_bits(unsigned long long bits) {
  T v;
  memcpy(&v, &bits, sizeof(T));
  return v;
}

inline void shuffle_op(Fiber** lanes, unsigned mask) {
  for (int i = 0; i < 32; ++i) {
    Fiber* f = lanes[i];
    if (!f) continue;
    int width = f->width, start = i & ~(width - 1), src = i;
    bool own = false;
    switch (f->kind) {
      case W_SHFL_IDX: src = start + (f->param & (width - 1)); break;
      case W_SHFL_UP:
        src = i - f->param;
        own = src < start;
        break;
      case W_SHFL_DOWN:
        src = i + f->param;
        own = src >= start + width;
        break;
      case W_SHFL_XOR:
        src = i ^ f->param;
        own = src >= start + width;
        break;
    }
    if (own || src == i) f->result = f->value;
    else if (src >= 0 && src < 32 && (mask >> src & 1u)) f->result = lanes[src]->value;
    else f->result = ~0ull;  // a lane outside the mask: undefined on a GPU; all ones here (NaN, -1)
  }
}

inline void ballot_op(Fiber** lanes, unsigned mask) {
  unsigned bits = 0;
  for (int i = 0; i < 32; ++i)
    if (lanes[i] && lanes[i]->param) bits |= 1u << i;
  for (int i = 0; i < 32; ++i)
    if (lanes[i]) lanes[i]->result = bits & mask;
}

inline void nothing_op(Fiber**, unsigned) {}

template <class T>
inline T shuffle(int kind, const char* name, unsigned mask, T var, int param, int width, const char* file, int line) {
  State* s = g_state;
  Fiber* f = s->cur;
  {
    long long block = s->block_idx.x + (long long)s->grid.x * (s->block_idx.y + (long long)s->grid.y * s->block_idx.z);
    long long t = block * s->nthreads + f->linear;
    if (t < g_nshuffles) ++g_shuffles[t];
  }
  if (width < 1 || width > 32 || (width & (width - 1))) {
    fail("%s at %s:%d: width %d is not a power of two from 1 to 32", name, base_name(file), line, width);
    fail_now();
  }
  f->value = to_bits(var);
  f->param = param;
  f->width = width;
  f->op = shuffle_op;
  f->op_name = name;
  warp_arrive(kind, mask, file, line);
  return from_bits<T>(f->result);
}

}  // namespace detail
}  // namespace simt

#define threadIdx (static_cast<const ::uint3&>(::simt::detail::g_state->cur->idx))
#define blockIdx (static_cast<const ::uint3&>(::simt::detail::g_state->block_idx))
#define blockDim (static_cast<const ::dim3&>(::simt::detail::g_state->block))
#define gridDim (static_cast<const ::dim3&>(::simt::detail::g_state->grid))

inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::simt::detail::syncthreads_at(1, file, line);
}
inline int __syncthreads_count(int predicate, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return ::simt::detail::syncthreads_at(predicate != 0, file, line);
}
inline int __syncthreads_and(int predicate, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  using namespace ::simt::detail;
  return syncthreads_at(predicate != 0, file, line) == g_state->live;
}
inline int __syncthreads_or(int predicate, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return ::simt::detail::syncthreads_at(predicate != 0, file, line) > 0;
}

inline void __syncwarp(unsigned mask = 0xffffffffu, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  using namespace ::simt::detail;
  Fiber* f = g_state->cur;
  f->op = nothing_op;
  f->op_name = "__syncwarp";
  warp_arrive(W_SYNCWARP, mask, file, line);
}

template <class T>
inline T __shfl_sync(unsigned mask, T var, int srcLane, int width = 32, const char* file = __builtin_FILE(),
                     int line = __builtin_LINE()) {
  using namespace ::simt::detail;
  return shuffle(W_SHFL_IDX, "__shfl_sync", mask, var, srcLane, width, file, line);
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32, const char* file = __builtin_FILE(),
                        int line = __builtin_LINE()) {
  using namespace ::simt::detail;
  return shuffle(W_SHFL_UP, "__shfl_up_sync", mask, var, (int)delta, width, file, line);
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32, const char* file = __builtin_FILE(),
                          int line = __builtin_LINE()) {
  using namespace ::simt::detail;
  return shuffle(W_SHFL_DOWN, "__shfl_down_sync", mask, var, (int)delta, width, file, line);
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T var, int laneMask, int width = 32, const char* file = __builtin_FILE(),
                         int line = __builtin_LINE()) {
  using namespace ::simt::detail;
  return shuffle(W_SHFL_XOR, "__shfl_xor_sync", mask, var, laneMask, width, file, line);
}

inline unsigned __ballot_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(),
                              int line = __builtin_LINE()) {
  using namespace ::simt::detail;
  Fiber* f = g_state->cur;
  f->param = predicate != 0;
  f->op = ballot_op;
  f->op_name = "__ballot_sync";
  warp_arrive(W_BALLOT, mask, file, line);
  return (unsigned)f->result;
}
inline int __any_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return __ballot_sync(mask, predicate, file, line) != 0;
}
inline int __all_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return __ballot_sync(mask, predicate, file, line) == mask;
}
inline unsigned __activemask() {
  using namespace ::simt::detail;
  State* s = g_state;
  int warp = s->cur->linear >> 5;
  unsigned bits = 0;
  for (int i = 0; i < 32 && warp * 32 + i < s->nthreads; ++i)
    if (s->fibers[warp * 32 + i].state != EXITED) bits |= 1u << i;
  return bits;
}

inline void __trap() {
  using namespace ::simt::detail;
  fail("__trap() in ");
  say_thread(g_state->cur);
  say(" of ");
  say_block();
  fail_now();
}

// --------------------------------------------------------------------------------------------------------
// Memory: loads through the read-only path, atomics (one thread runs at a time: plain read-modify-write)
// --------------------------------------------------------------------------------------------------------

namespace simt {
namespace detail {
template <class T>
inline void check_aligned(const T* p, const char* what, const char* file, int line) {
  if ((uintptr_t)p % alignof(T)) {
    fail("%s at %s:%d: misaligned address %p for a %zu-byte type (needs %zu-byte alignment), ", what, base_name(file),
         line, (const void*)p, sizeof(T), alignof(T));
    say_thread(g_state->cur);
    say(" of ");
    say_block();
    fail_now();
  }
}
}  // namespace detail
}  // namespace simt

template <class T>
inline T __ldg(const T* p, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::simt::detail::check_aligned(p, "__ldg", file, line);
  return *p;
}
template <class T>
inline T __ldcg(const T* p, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::simt::detail::check_aligned(p, "__ldcg", file, line);
  return *p;
}
template <class T>
inline T __ldcs(const T* p, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::simt::detail::check_aligned(p, "__ldcs", file, line);
  return *p;
}
template <class T>
inline T __ldlu(const T* p, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::simt::detail::check_aligned(p, "__ldlu", file, line);
  return *p;
}
template <class T>
inline void __stcs(T* p, T v, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::simt::detail::check_aligned(p, "__stcs", file, line);
  *p = v;
}
template <class T>
inline void __stcg(T* p, T v, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::simt::detail::check_aligned(p, "__stcg", file, line);
  *p = v;
}

#define SIMT_ATOMIC(T)                                                      \
  inline T atomicAdd(T* p, T v) { T old = *p; *p = old + v; return old; }  \
  inline T atomicSub(T* p, T v) { T old = *p; *p = old - v; return old; }  \
  inline T atomicExch(T* p, T v) { T old = *p; *p = v; return old; }       \
  inline T atomicMax(T* p, T v) { T old = *p; *p = old < v ? v : old; return old; } \
  inline T atomicMin(T* p, T v) { T old = *p; *p = v < old ? v : old; return old; } \
  inline T atomicCAS(T* p, T compare, T v) { T old = *p; if (old == compare) *p = v; return old; }
SIMT_ATOMIC(int)
SIMT_ATOMIC(unsigned)
SIMT_ATOMIC(unsigned long long)
SIMT_ATOMIC(long long)
#undef SIMT_ATOMIC
inline float atomicAdd(float* p, float v) { float old = *p; *p = old + v; return old; }
inline double atomicAdd(double* p, double v) { double old = *p; *p = old + v; return old; }
inline float atomicExch(float* p, float v) { float old = *p; *p = v; return old; }
inline int atomicAnd(int* p, int v) { int old = *p; *p = old & v; return old; }
inline int atomicOr(int* p, int v) { int old = *p; *p = old | v; return old; }
inline unsigned atomicAnd(unsigned* p, unsigned v) { unsigned old = *p; *p = old & v; return old; }
inline unsigned atomicOr(unsigned* p, unsigned v) { unsigned old = *p; *p = old | v; return old; }
inline unsigned atomicInc(unsigned* p, unsigned limit) { unsigned old = *p; *p = old >= limit ? 0 : old + 1; return old; }
inline void __threadfence() {}
inline void __threadfence_block() {}

// --------------------------------------------------------------------------------------------------------
// Math: the device functions CUDA has and the C library lacks; integer intrinsics
// --------------------------------------------------------------------------------------------------------

inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float rcbrtf(float x) { return 1.0f / cbrtf(x); }
inline float __expf(float x) { return expf(x); }
inline float __exp10f(float x) { return exp10f(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __log10f(float x) { return log10f(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline void __sincosf(float x, float* s, float* c) { *s = sinf(x); *c = cosf(x); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __frsqrt_rn(float x) { return 1.0f / sqrtf(x); }
inline float __fadd_rn(float x, float y) { return x + y; }
inline float __fsub_rn(float x, float y) { return x - y; }
inline float __fmul_rn(float x, float y) { return x * y; }
inline float __fdiv_rn(float x, float y) { return x / y; }
inline float __fmaf_rn(float x, float y, float z) { return fmaf(x, y, z); }
inline float __saturatef(float x) { return x != x ? 0.0f : x < 0.0f ? 0.0f : x > 1.0f ? 1.0f : x; }
inline float normcdff(float x) { return 0.5f * erfcf(-x * 0.70710678118654752f); }

inline int __float_as_int(float x) { int i; memcpy(&i, &x, 4); return i; }
inline unsigned __float_as_uint(float x) { unsigned i; memcpy(&i, &x, 4); return i; }
inline float __int_as_float(int i) { float x; memcpy(&x, &i, 4); return x; }
inline float __uint_as_float(unsigned i) { float x; memcpy(&x, &i, 4); return x; }
inline long long __double_as_longlong(double x) { long long i; memcpy(&i, &x, 8); return i; }
inline double __longlong_as_double(long long i) { double x; memcpy(&x, &i, 8); return x; }
inline int __float2int_rn(float x) { return (int)nearbyintf(x); }
inline int __float2int_rz(float x) { return (int)x; }
inline int __float2int_rd(float x) { return (int)floorf(x); }
inline int __float2int_ru(float x) { return (int)ceilf(x); }
inline float __int2float_rn(int i) { return (float)i; }

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
  x = ((x >> 8) & 0x00ff00ffu) | ((x & 0x00ff00ffu) << 8);
  return (x >> 16) | (x << 16);
}
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
inline int __mulhi(int a, int b) { return (int)(((long long)a * b) >> 32); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}

// CUDA's min/max for mixed integer and float arguments (std::min needs equal types).
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

// --------------------------------------------------------------------------------------------------------
// bf16 and fp16: storage types with CUDA's round-to-nearest-even conversions
// --------------------------------------------------------------------------------------------------------

namespace simt {
namespace detail {

inline unsigned short float_to_bf16_bits(float f) {
  unsigned x;
  memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;  // NaN: CUDA's canonical NaN
  return (unsigned short)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

inline unsigned short float_to_bf16_bits_rz(float f) {
  unsigned x;
  memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
  return (unsigned short)(x >> 16);
}

// A double rounded to float toward zero, its last bit set if anything was cut off ("round to odd"): rounding
// that float to bf16 or fp16 (nearest even) then rounds the double correctly, with no double rounding.
inline float float_round_to_odd(double d) {
  float f = (float)d;
  if ((double)f == d || d != d || !isfinite(f)) return f;
  unsigned b;
  memcpy(&b, &f, 4);
  if (fabs((double)f) > fabs(d)) b -= 1;  // rounded away from zero: step back toward it
  b |= 1u;
  memcpy(&f, &b, 4);
  return f;
}

inline float bf16_bits_to_float(unsigned short h) {
  unsigned x = (unsigned)h << 16;
  float f;
  memcpy(&f, &x, 4);
  return f;
}

inline unsigned short float_to_half_bits(float f) {
  unsigned x;
  memcpy(&x, &f, 4);
  unsigned sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return 0x7fffu;                    // NaN: CUDA's canonical NaN
  if (ax >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  // >= 65520 rounds to infinity
  if (ax >= 0x38800000u) {                                 // a normal half (>= 2^-14)
    unsigned r = ax + 0xfffu + ((ax >> 13) & 1u) - (112u << 23);
    return (unsigned short)(sign | (r >> 13));
  }
  if (ax <= 0x33000000u) return (unsigned short)sign;  // <= 2^-25: rounds to zero (2^-25 is a tie, 0 is even)
  unsigned e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u, shift = 126u - e;  // units of 2^-24
  unsigned q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return (unsigned short)(sign | q);
}

inline float half_bits_to_float(unsigned short h) {
  unsigned sign = (unsigned)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, x;
  if (exp == 0x1fu) x = sign | 0x7f800000u | (man << 13);
  else if (exp != 0) x = sign | ((exp + 112u) << 23) | (man << 13);
  else {
    float v = (float)man * 5.9604644775390625e-08f;  // man * 2^-24, exact
    return sign ? -v : v;
  }
  float f;
  memcpy(&f, &x, 4);
  return f;
}

}  // namespace detail
}  // namespace simt

#define SIMT_HALF_TYPE(NAME, TO, FROM)                                                                  \
  struct __attribute__((aligned(2))) NAME {                                                             \
    unsigned short __x;                                                                                 \
    NAME() = default;                                                                                   \
    template <class V, std::enable_if_t<std::is_arithmetic<V>::value, int> = 0>                          \
    NAME(V v) : __x(::simt::detail::TO(::simt::detail::float_round_to_odd(static_cast<double>(v)))) {}   \
    operator float() const { return ::simt::detail::FROM(__x); }                                        \
    NAME& operator+=(const NAME& o) { return *this = NAME((double)float(*this) + float(o)); }            \
    NAME& operator-=(const NAME& o) { return *this = NAME((double)float(*this) - float(o)); }            \
    NAME& operator*=(const NAME& o) { return *this = NAME((double)float(*this) * float(o)); }            \
    NAME& operator/=(const NAME& o) { return *this = NAME((double)float(*this) / float(o)); }            \
  };                                                                                                    \
  inline NAME operator+(const NAME& a, const NAME& b) { return NAME((double)float(a) + float(b)); }     \
  inline NAME operator-(const NAME& a, const NAME& b) { return NAME((double)float(a) - float(b)); }     \
  inline NAME operator*(const NAME& a, const NAME& b) { return NAME((double)float(a) * float(b)); }     \
  inline NAME operator/(const NAME& a, const NAME& b) { return NAME((double)float(a) / float(b)); }     \
  inline NAME operator-(const NAME& a) { NAME r = a; r.__x ^= 0x8000u; return r; }                       \
  inline bool operator==(const NAME& a, const NAME& b) { return float(a) == float(b); }                 \
  inline bool operator!=(const NAME& a, const NAME& b) { return float(a) != float(b); }                 \
  inline bool operator<(const NAME& a, const NAME& b) { return float(a) < float(b); }                   \
  inline bool operator>(const NAME& a, const NAME& b) { return float(a) > float(b); }                   \
  inline bool operator<=(const NAME& a, const NAME& b) { return float(a) <= float(b); }                 \
  inline bool operator>=(const NAME& a, const NAME& b) { return float(a) >= float(b); }                 \
  struct __attribute__((aligned(4))) NAME##2 {                                                          \
    NAME x, y;                                                                                          \
  };

// Arithmetic on two bf16 or fp16 values is done in double and rounded once to the type, as CUDA rounds it.
SIMT_HALF_TYPE(__nv_bfloat16, float_to_bf16_bits, bf16_bits_to_float)
SIMT_HALF_TYPE(__half, float_to_half_bits, half_bits_to_float)
#undef SIMT_HALF_TYPE

using nv_bfloat16 = __nv_bfloat16;
using nv_bfloat162 = __nv_bfloat162;
using half = __half;
using half2 = __half2;

inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { __nv_bfloat16 h; h.__x = u; return h; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline __half __ushort_as_half(unsigned short u) { __half h; h.__x = u; return h; }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }

inline __nv_bfloat16 __float2bfloat16(float f) { return __ushort_as_bfloat16(::simt::detail::float_to_bf16_bits(f)); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __float2bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rz(float f) {
  return __ushort_as_bfloat16(::simt::detail::float_to_bf16_bits_rz(f));
}
inline float __bfloat162float(__nv_bfloat16 h) { return ::simt::detail::bf16_bits_to_float(h.__x); }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {__float2bfloat16(a), __float2bfloat16(b)}; }
inline __nv_bfloat162 __float22bfloat162_rn(float2 v) { return __floats2bfloat162_rn(v.x, v.y); }
inline float2 __bfloat1622float2(__nv_bfloat162 v) { return {__bfloat162float(v.x), __bfloat162float(v.y)}; }
inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) { return {a, b}; }
inline __nv_bfloat162 __bfloat162bfloat162(__nv_bfloat16 a) { return {a, a}; }
inline float __low2float(__nv_bfloat162 v) { return __bfloat162float(v.x); }
inline float __high2float(__nv_bfloat162 v) { return __bfloat162float(v.y); }
inline __nv_bfloat16 __low2bfloat16(__nv_bfloat162 v) { return v.x; }
inline __nv_bfloat16 __high2bfloat16(__nv_bfloat162 v) { return v.y; }
inline __nv_bfloat16 __hadd(__nv_bfloat16 a, __nv_bfloat16 b) { return a + b; }
inline __nv_bfloat16 __hsub(__nv_bfloat16 a, __nv_bfloat16 b) { return a - b; }
inline __nv_bfloat16 __hmul(__nv_bfloat16 a, __nv_bfloat16 b) { return a * b; }
inline __nv_bfloat16 __hfma(__nv_bfloat16 a, __nv_bfloat16 b, __nv_bfloat16 c) {
  return __float2bfloat16((float)((double)float(a) * float(b) + float(c)));
}
inline __nv_bfloat16 __hmax(__nv_bfloat16 a, __nv_bfloat16 b) { return __float2bfloat16(fmaxf(a, b)); }
inline __nv_bfloat16 __hmin(__nv_bfloat16 a, __nv_bfloat16 b) { return __float2bfloat16(fminf(a, b)); }
inline __nv_bfloat162 __hadd2(__nv_bfloat162 a, __nv_bfloat162 b) { return {a.x + b.x, a.y + b.y}; }
inline __nv_bfloat162 __hmul2(__nv_bfloat162 a, __nv_bfloat162 b) { return {a.x * b.x, a.y * b.y}; }

inline __half __float2half(float f) { return __ushort_as_half(::simt::detail::float_to_half_bits(f)); }
inline __half __float2half_rn(float f) { return __float2half(f); }
inline float __half2float(__half h) { return ::simt::detail::half_bits_to_float(h.__x); }
inline __half2 __floats2half2_rn(float a, float b) { return {__float2half(a), __float2half(b)}; }
inline __half2 __float22half2_rn(float2 v) { return __floats2half2_rn(v.x, v.y); }
inline float2 __half22float2(__half2 v) { return {__half2float(v.x), __half2float(v.y)}; }
inline __half2 __halves2half2(__half a, __half b) { return {a, b}; }
inline __half2 __half2half2(__half a) { return {a, a}; }
inline float __low2float(__half2 v) { return __half2float(v.x); }
inline float __high2float(__half2 v) { return __half2float(v.y); }
inline __half __hadd(__half a, __half b) { return a + b; }
inline __half __hsub(__half a, __half b) { return a - b; }
inline __half __hmul(__half a, __half b) { return a * b; }
inline __half __hfma(__half a, __half b, __half c) {
  return __float2half((float)((double)float(a) * float(b) + float(c)));
}
inline __half __hmax(__half a, __half b) { return __float2half(fmaxf(a, b)); }
inline __half __hmin(__half a, __half b) { return __float2half(fminf(a, b)); }
inline __half2 __hadd2(__half2 a, __half2 b) { return {a.x + b.x, a.y + b.y}; }
inline __half2 __hmul2(__half2 a, __half2 b) { return {a.x * b.x, a.y * b.y}; }
inline bool __hisnan(__half h) { return (h.__x & 0x7fffu) > 0x7c00u; }
inline bool __hisnan(__nv_bfloat16 h) { return (h.__x & 0x7fffu) > 0x7f80u; }

// --------------------------------------------------------------------------------------------------------
// cuda_pipeline.h: cp.async, completed when the thread waits for it
// --------------------------------------------------------------------------------------------------------

inline void __pipeline_memcpy_async(void* dst, const void* src, size_t size_and_align, size_t zfill = 0,
                                    const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  using namespace ::simt::detail;
  Fiber* f = g_state->cur;
  if (!(size_and_align == 4 || size_and_align == 8 || size_and_align == 16) || zfill > size_and_align) {
    fail("__pipeline_memcpy_async at %s:%d: size %zu (must be 4, 8 or 16) with zfill %zu (at most the size)",
         base_name(file), line, size_and_align, zfill);
    fail_now();
  }
  if ((uintptr_t)dst % size_and_align || (uintptr_t)src % size_and_align) {
    fail("__pipeline_memcpy_async at %s:%d: a %zu-byte copy from %p to %p: both must be %zu-byte aligned, ",
         base_name(file), line, size_and_align, src, dst, size_and_align);
    say_thread(f);
    say(" of ");
    say_block();
    fail_now();
  }
  if (f->ncopies == f->capcopies) {
    f->capcopies = f->capcopies ? 2 * f->capcopies : 16;
    f->copies = (AsyncCopy*)realloc((void*)f->copies, sizeof(AsyncCopy) * f->capcopies);
  }
  f->copies[f->ncopies++] = AsyncCopy{dst, src, (unsigned)size_and_align, (unsigned)zfill, f->committed};
}

inline void __pipeline_commit() { ::simt::detail::g_state->cur->committed++; }

// Completes every copy but those of the ``prior`` groups committed last (and those not committed yet).
inline void __pipeline_wait_prior(size_t prior) {
  using namespace ::simt::detail;
  Fiber* f = g_state->cur;
  long long limit = f->committed - (long long)prior;
  int kept = 0;
  for (int i = 0; i < f->ncopies; ++i) {
    AsyncCopy& c = f->copies[i];
    if (c.group < limit) {
      memcpy(c.dst, c.src, c.bytes - c.zfill);
      memset((char*)c.dst + (c.bytes - c.zfill), 0, c.zfill);
    } else {
      f->copies[kept++] = c;
    }
  }
  f->ncopies = kept;
}

inline void __pipeline_wait_all() { __pipeline_wait_prior(0); }

// --------------------------------------------------------------------------------------------------------
// mma.h: nvcuda::wmma, warp-collective; every lane's fragment holds the whole tile
// --------------------------------------------------------------------------------------------------------

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <class Use, int M, int N, int K>
struct tile_shape;
template <int M, int N, int K>
struct tile_shape<matrix_a, M, N, K> {
  static constexpr int rows = M, cols = K;
};
template <int M, int N, int K>
struct tile_shape<matrix_b, M, N, K> {
  static constexpr int rows = K, cols = N;
};
template <int M, int N, int K>
struct tile_shape<accumulator, M, N, K> {
  static constexpr int rows = M, cols = N;
};

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
  static_assert((M == 16 && N == 16 && K == 16) || (M == 32 && N == 8 && K == 16) || (M == 8 && N == 32 && K == 16),
                "wmma shapes: 16x16x16, 32x8x16, 8x32x16");
  using element_type = T;
  using storage_element_type = T;
  static constexpr int rows = tile_shape<Use, M, N, K>::rows, cols = tile_shape<Use, M, N, K>::cols;
  static constexpr int num_elements = rows * cols;
  T x[num_elements];  // the whole tile, row by row (x[r * cols + c]), in every lane
};

template <class Use, int M, int N, int K, class T, class Layout, class V>
inline void fill_fragment(fragment<Use, M, N, K, T, Layout>& f, const V& value) {
  T v = T(value);
  for (int i = 0; i < f.num_elements; ++i) f.x[i] = v;
}

namespace detail {
using ::simt::detail::Fiber;
using ::simt::detail::fail;
using ::simt::detail::say;

inline bool same_arguments(Fiber** lanes, unsigned mask, const char* what) {
  Fiber* first = nullptr;
  for (int i = 0; i < 32; ++i) {
    Fiber* f = lanes[i];
    if (!f) continue;
    if (!first) {
      first = f;
      continue;
    }
    if (f->ptr[1] != first->ptr[1] || f->ldm != first->ldm || f->layout != first->layout) {
      fail("%s at %s:%d: the lanes of a warp must pass the same pointer, ldm and layout; lane 0 passed %p (ldm %lld), "
           "lane %d passed %p (ldm %lld)", what, ::simt::detail::base_name(first->file), first->line, first->ptr[1],
           first->ldm, i, f->ptr[1], f->ldm);
      return false;
    }
  }
  (void)mask;
  return true;
}

// Element (r, c) of a tile in memory: row-major at p[r * ldm + c], column-major at p[c * ldm + r].
template <class Frag, class T>
inline void load_op(Fiber** lanes, unsigned mask) {
  if (!same_arguments(lanes, mask, "load_matrix_sync")) return;
  Fiber* first = nullptr;
  for (int i = 0; i < 32 && !first; ++i) first = lanes[i];
  const T* p = (const T*)first->ptr[1];
  long long ldm = first->ldm;
  Frag tile;
  for (int r = 0; r < Frag::rows; ++r)
    for (int c = 0; c < Frag::cols; ++c)
      tile.x[r * Frag::cols + c] = first->layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r];
  for (int i = 0; i < 32; ++i)
    if (lanes[i]) memcpy((void*)lanes[i]->ptr[0], &tile, sizeof(Frag));
}

template <class Frag, class T>
inline void store_op(Fiber** lanes, unsigned mask) {
  if (!same_arguments(lanes, mask, "store_matrix_sync")) return;
  Fiber* first = nullptr;
  for (int i = 0; i < 32 && !first; ++i) first = lanes[i];
  const Frag& tile = *(const Frag*)first->ptr[0];
  T* p = (T*)first->ptr[1];
  long long ldm = first->ldm;
  for (int r = 0; r < Frag::rows; ++r)
    for (int c = 0; c < Frag::cols; ++c)
      (first->layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r]) = tile.x[r * Frag::cols + c];
}

// d = a b + c: each dot product summed in double (products of bf16/fp16 are exact), rounded once.
template <class FragD, class FragA, class FragB, class FragC>
inline void mma_op(Fiber** lanes, unsigned) {
  Fiber* first = nullptr;
  for (int i = 0; i < 32 && !first; ++i) first = lanes[i];
  const FragA& a = *(const FragA*)first->ptr[1];
  const FragB& b = *(const FragB*)first->ptr[2];
  const FragC& c = *(const FragC*)first->ptr[3];
  constexpr int M = FragA::rows, K = FragA::cols, N = FragB::cols;
  FragD d;
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      double sum = (double)(float)c.x[m * N + n];
      for (int k = 0; k < K; ++k) sum += (double)(float)a.x[m * K + k] * (double)(float)b.x[k * N + n];
      d.x[m * N + n] = typename FragD::element_type((float)sum);
    }
  for (int i = 0; i < 32; ++i)
    if (lanes[i]) memcpy((void*)lanes[i]->ptr[0], &d, sizeof(FragD));
}

inline void collective(::simt::detail::WarpOp op, const char* name, const void* frag, const void* p1, const void* p2,
                       const void* p3, long long ldm, int layout, const char* file, int line) {
  using namespace ::simt::detail;
  Fiber* f = g_state->cur;
  f->ptr[0] = frag;
  f->ptr[1] = p1;
  f->ptr[2] = p2;
  f->ptr[3] = p3;
  f->ldm = ldm;
  f->layout = layout;
  f->op = op;
  f->op_name = name;
  warp_arrive(W_WMMA, 0xffffffffu, file, line);
}
}  // namespace detail

template <class Use, int M, int N, int K, class T, class Layout>
inline void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& f, const T* p, unsigned ldm,
                             const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  static_assert(!std::is_same<Use, accumulator>::value, "an accumulator's load needs its layout_t");
  using Frag = fragment<Use, M, N, K, T, Layout>;
  detail::collective(detail::load_op<Frag, T>, "load_matrix_sync", &f, p, nullptr, nullptr, ldm,
                     std::is_same<Layout, row_major>::value ? mem_row_major : mem_col_major, file, line);
}

template <int M, int N, int K, class T>
inline void load_matrix_sync(fragment<accumulator, M, N, K, T>& f, const T* p, unsigned ldm, layout_t layout,
                             const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  using Frag = fragment<accumulator, M, N, K, T>;
  detail::collective(detail::load_op<Frag, T>, "load_matrix_sync", &f, p, nullptr, nullptr, ldm, layout, file, line);
}

template <int M, int N, int K, class T>
inline void store_matrix_sync(T* p, const fragment<accumulator, M, N, K, T>& f, unsigned ldm, layout_t layout,
                              const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  using Frag = fragment<accumulator, M, N, K, T>;
  detail::collective(detail::store_op<Frag, T>, "store_matrix_sync", &f, p, nullptr, nullptr, ldm, layout, file, line);
}

template <int M, int N, int K, class TA, class LA, class TB, class LB, class TC, class TD>
inline void mma_sync(fragment<accumulator, M, N, K, TD>& d, const fragment<matrix_a, M, N, K, TA, LA>& a,
                     const fragment<matrix_b, M, N, K, TB, LB>& b, const fragment<accumulator, M, N, K, TC>& c,
                     const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  using FD = fragment<accumulator, M, N, K, TD>;
  using FA = fragment<matrix_a, M, N, K, TA, LA>;
  using FB = fragment<matrix_b, M, N, K, TB, LB>;
  using FC = fragment<accumulator, M, N, K, TC>;
  detail::collective(detail::mma_op<FD, FA, FB, FC>, "mma_sync", &d, &a, &b, &c, 0, 0, file, line);
}

}  // namespace wmma
}  // namespace nvcuda

#ifndef __CUDACC__
#define __CUDACC__ 1
#endif

#endif  // SIMT_H
