// Host stand-ins for the CUDA vocabulary that qwen_kernels.cuh uses, so g++ can compile and run
// the real kernel source on a CPU (tests only; see simt_emulator.cpp).
//
// Execution model: a launch runs its thread blocks one after another; each CUDA thread of a
// block is a std::thread. __syncthreads is a block-wide std::barrier, each warp has its own
// 32-thread barrier for __syncwarp and the shuffles, and a thread that returns drops out of both
// (as an exited GPU thread does). __shared__ becomes a function-local static, shared by the
// threads of the one block that runs at a time. Threads really run concurrently, so a missing
// barrier shows up as a race here too.
#pragma once

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) uint4 { uint32_t x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return {x, y, z, w}; }

// IEEE binary16 through GCC's _Float16 (correctly rounded conversions on x86-64).
struct __half { uint16_t bits; };
inline __half __ushort_as_half(unsigned short b) { return __half{b}; }
inline float __half2float(__half h) {
  _Float16 f;
  std::memcpy(&f, &h.bits, 2);
  return static_cast<float>(f);
}
inline __half __float2half_rn(float x) {
  const _Float16 f = static_cast<_Float16>(x);
  __half h;
  std::memcpy(&h.bits, &f, 2);
  return h;
}

inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t __float_as_uint(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float __expf(float x) { return std::exp(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
template <typename T> inline T __ldg(const T* p) { return *p; }

namespace simt {

struct Block {
  explicit Block(int threads) : sync(threads), exchange(static_cast<size_t>(threads)) {
    for (int w = 0; w < threads / 32; ++w) warp_sync.push_back(std::make_unique<std::barrier<>>(32));
  }
  std::barrier<> sync;
  std::vector<std::unique_ptr<std::barrier<>>> warp_sync;
  std::vector<uint32_t> exchange;  // one word per thread for shuffles
};

inline thread_local Block* current = nullptr;

}  // namespace simt

inline thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

inline void __syncthreads() { simt::current->sync.arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { simt::current->warp_sync[threadIdx.x / 32]->arrive_and_wait(); }

inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
  simt::Block& b = *simt::current;
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  b.exchange[threadIdx.x] = __float_as_uint(v);
  b.warp_sync[warp]->arrive_and_wait();
  const float r = __uint_as_float(b.exchange[warp * 32 + (lane ^ static_cast<unsigned>(lane_mask))]);
  b.warp_sync[warp]->arrive_and_wait();  // the word is rewritten by the next shuffle
  return r;
}

namespace simt {

// launch(kernel, grid, block, args...): runs every block of the grid, one block at a time.
struct HostLaunch {
  template <class... P, class... A>
  void operator()(void (*kernel)(P...), dim3 grid, dim3 block, A&&... args) const {
    const int threads = static_cast<int>(block.x);
    for (unsigned z = 0; z < grid.z; ++z)
      for (unsigned y = 0; y < grid.y; ++y)
        for (unsigned x = 0; x < grid.x; ++x) {
          Block ctx(threads);
          std::vector<std::thread> pool;
          pool.reserve(static_cast<size_t>(threads));
          for (int t = 0; t < threads; ++t) {
            pool.emplace_back([&, t] {
              threadIdx = dim3(static_cast<unsigned>(t));
              blockIdx = dim3(x, y, z);
              blockDim = block;
              gridDim = grid;
              current = &ctx;
              kernel(args...);
              ctx.warp_sync[static_cast<size_t>(t / 32)]->arrive_and_drop();
              ctx.sync.arrive_and_drop();
            });
          }
          for (std::thread& th : pool) th.join();
        }
  }
};

}  // namespace simt
