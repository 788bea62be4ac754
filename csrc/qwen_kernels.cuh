// Device code of torch.ops._qwen_C (DESIGN.md section 3), shared by two includers:
//
//   qwen_kernels.cu              compiles it with nvcc and launches with <<<>>> on a CUDA stream;
//   tests/emulation/simt_emulator.cpp  compiles the same source with g++ over a small SIMT shim (one
//                                std::thread per CUDA thread, barriers for __syncthreads and warp
//                                shuffles), so tests/test_cuda_ext.py can run these kernels on a
//                                machine without a GPU.
//
// The includer provides the CUDA vocabulary first (cuda_runtime.h and cuda_fp16.h, or the shim).
//
//   _kv_write_kernel                 one thread block per token; 16-byte copies; slot -1 skipped.
//   _slot_attention_decode_kernel    max_query_len == 1: one block per (sequence, KV head, chunk of
//                                    the GQA group, split of the context). K/V are read once for
//                                    all query heads of the chunk. With one split it writes the
//                                    output; with more it writes fp32 partials (flash-decoding)
//   _slot_attention_merge_kernel     that this kernel merges.
//   _slot_attention_prefill_kernel   any max_query_len: one block per (sequence, tile of query
//                                    rows, query head); loops over the keys the tile can see
//                                    through the block table with an online softmax in fp32.
//
// Plain CUDA C++ with no sm_90-only feature (no TMA, wgmma or clusters), so the same source is
// correct on sm_75+; it is tuned for sm_90 through tile sizes only. Invalid indices (slot out of
// range, block id out of range) never fault: a bad slot reads as padding, a bad block as masked
// keys; QWEN_OPS_DEBUG=1 makes the Python side raise instead.
#pragma once

#include <cmath>
#include <cstdint>

#include "qwen_index.h"
#include "qwen_kernels.h"

namespace qwen_cuda {
namespace {

// ---- element conversion ----------------------------------------------------------------------
// bf16 is handled through its bits (the top half of an fp32), which needs no sm_80 intrinsic.
struct Bf16 { uint16_t bits; };

template <typename T> struct Elem;
template <> struct Elem<float> {
  __device__ static float to_float(float x) { return x; }
  __device__ static float load(const float* p) { return __ldg(p); }
  __device__ static void store(float* p, float x) { *p = x; }
  // 16 bytes -> 4 floats.
  __device__ static void unpack(const uint4& r, float* f) {
    f[0] = __uint_as_float(r.x); f[1] = __uint_as_float(r.y);
    f[2] = __uint_as_float(r.z); f[3] = __uint_as_float(r.w);
  }
};
template <> struct Elem<__half> {
  __device__ static float to_float(__half x) { return __half2float(x); }
  __device__ static float load(const __half* p) { return __half2float(__ushort_as_half(__ldg(reinterpret_cast<const unsigned short*>(p)))); }
  __device__ static void store(__half* p, float x) { *p = __float2half_rn(x); }
  __device__ static void unpack(const uint4& r, float* f) {
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] & 0xffffu)));
      f[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] >> 16)));
    }
  }
};
template <> struct Elem<Bf16> {
  __device__ static float to_float(Bf16 x) { return __uint_as_float(static_cast<uint32_t>(x.bits) << 16); }
  __device__ static float load(const Bf16* p) {
    return __uint_as_float(static_cast<uint32_t>(__ldg(reinterpret_cast<const unsigned short*>(p))) << 16);
  }
  // Round to nearest even; NaN stays NaN (quiet bit forced).
  __device__ static void store(Bf16* p, float x) {
    uint32_t u = __float_as_uint(x);
    uint16_t b;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      b = static_cast<uint16_t>((u >> 16) | 0x40u);
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);
      b = static_cast<uint16_t>(u >> 16);
    }
    p->bits = b;
  }
  __device__ static void unpack(const uint4& r, float* f) {
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
};

__device__ __forceinline__ uint4 load16(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
__device__ __forceinline__ uint4 zero16() { return make_uint4(0u, 0u, 0u, 0u); }

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// Where position `pos` of `slot` lives: its physical block (-1 when the table names no valid
// block) and row. Reads exactly one block-table entry, the one for `pos`; callers only ask for
// positions below seq_len. 32-bit division (the host checks that a slot holds < 2^31 positions):
// a 64-bit division is a long subroutine on the GPU, and this runs once per key.
struct KeyLocation {
  int64_t block;
  int64_t row;
};
__device__ __forceinline__ KeyLocation locate(const int32_t* bt, int64_t bt_stride_slot, int64_t bt_stride_col,
                                              int64_t slot, int64_t pos, int64_t block_size, int64_t num_blocks) {
  const uint32_t col = qwen_index::block_column_u32(static_cast<uint32_t>(pos), static_cast<uint32_t>(block_size));
  const int64_t b = bt[slot * bt_stride_slot + static_cast<int64_t>(col) * bt_stride_col];
  return {(b >= 0 && b < num_blocks) ? b : -1,
          static_cast<int64_t>(static_cast<uint32_t>(pos) - col * static_cast<uint32_t>(block_size))};
}

// Sums part[0, N) over the lanes of a key group that differ in lane bits OFF, OFF / 2, ..., 1, as
// a transposed butterfly: while a lane carries several heads, each step sends half of them to
// its partner and keeps the other half, so HPB heads over kTPK lanes cost HPB - 1 +
// log2(kTPK / HPB) shuffles instead of HPB x log2(kTPK). On return the lane holds
// max(N / (2 OFF), 1) sums in part[0, ...) for heads head, head + 1, ...
template <int N, int OFF>
__device__ __forceinline__ void butterfly_sum(float* part, int kl, int& head) {
  if constexpr (OFF > 0) {
    if constexpr (N > 1) {
      const bool hi = (kl & OFF) != 0;
#pragma unroll
      for (int i = 0; i < N / 2; ++i) {  // in place: step i reads i and i + N/2, writes i
        const float send = hi ? part[i] : part[i + N / 2];
        const float keep = hi ? part[i + N / 2] : part[i];
        part[i] = keep + __shfl_xor_sync(0xffffffffu, send, OFF);
      }
      if (hi) head += N / 2;
      butterfly_sum<N / 2, OFF / 2>(part, kl, head);
    } else {
      part[0] += __shfl_xor_sync(0xffffffffu, part[0], OFF);
      butterfly_sum<1, OFF / 2>(part, kl, head);
    }
  }
}

// ---- kv_write ----------------------------------------------------------------------------------
// grid (num_tokens), block 128. Token t's [num_kv_heads, head_dim] key and value rows are copied
// with VecT-sized moves (16 bytes when every row start is aligned, else one element at a time).
template <typename VecT>
__global__ void __launch_bounds__(128) _kv_write_kernel(const KvWriteParams p) {
  const int64_t t = blockIdx.x;
  const int64_t slot = p.slot_ids[t * p.slot_ids_stride];
  const int64_t pos = p.positions[t * p.positions_stride];
  if (slot < 0 || slot >= p.num_slots || pos < 0 ||
      pos >= qwen_index::slot_capacity(p.max_blocks_per_slot, p.block_size)) {
    return;  // slot -1 is padding: nothing is written
  }
  const KeyLocation loc = locate(p.block_table, p.bt_stride_slot, p.bt_stride_col, slot, pos, p.block_size,
                                 p.num_blocks);
  if (loc.block < 0) return;
  const int64_t block = loc.block, row = loc.row;
  const int64_t elems_per_vec = static_cast<int64_t>(sizeof(VecT)) / p.elem_size;
  const int64_t vecs_per_head = p.head_dim / elems_per_vec;
  const int64_t es = p.elem_size;
  for (int64_t i = threadIdx.x; i < p.num_kv_heads * vecs_per_head; i += blockDim.x) {
    const int64_t h = i / vecs_per_head;
    const int64_t e = (i % vecs_per_head) * elems_per_vec;
    const VecT k = *reinterpret_cast<const VecT*>(p.key + (t * p.key_stride_token + h * p.key_stride_head + e) * es);
    const VecT v = *reinterpret_cast<const VecT*>(p.value + (t * p.value_stride_token + h * p.value_stride_head + e) * es);
    *reinterpret_cast<VecT*>(p.key_cache + (block * p.kc_stride_block + row * p.kc_stride_row + h * p.kc_stride_head + e) * es) = k;
    *reinterpret_cast<VecT*>(p.value_cache + (block * p.vc_stride_block + row * p.vc_stride_row + h * p.vc_stride_head + e) * es) = v;
  }
}

// ---- decode ------------------------------------------------------------------------------------
template <typename T, int D>
struct DecodeShape {
  static constexpr int kElem = sizeof(T);
  static constexpr int kEPV = 16 / kElem;                                 // elements per vector
  static constexpr int kTPK = decode_threads_per_key(kElem, D);           // lanes per key row
  static constexpr int kVPT = decode_vectors_per_thread(kElem, D);        // vectors per lane per key
  static constexpr int kEPT = kVPT * kEPV;                                // elements per lane per key
  static constexpr int kGroups = decode_key_groups(kElem, D);             // keys read at once by the block
  static constexpr int kUnroll = decode_unroll(kElem, D);
  static constexpr int kTile = decode_tile_keys(kElem, D);                // keys per tile
  static_assert(kTPK * kVPT * kEPV == D, "head_dim must be a whole number of 16-byte vectors");
  static_assert(kTile == kGroups * kUnroll, "tile");
  // Element index of vector v, element i of a lane at position `kl` in its key group: lanes
  // take consecutive 16-byte pieces, so a key row is one coalesced read.
  __device__ static int dim(int kl, int v, int i) { return (v * kTPK + kl) * kEPV + i; }
};

// grid (num_seqs, num_kv_heads * head_chunks, num_splits), block kDecodeThreads.
// Block (seq, kv head h, chunk c, split s) computes query heads h * group + [c * HPB, ... + hpb)
// of the sequence's one query row over keys [split_begin, split_end) of its slot.
template <typename T, int D, int HPB>
__global__ void __launch_bounds__(kDecodeThreads) _slot_attention_decode_kernel(const AttentionParams p) {
  using S = DecodeShape<T, D>;
  __shared__ __align__(16) float q_s[HPB][D];          // query x scale x log2(e), fp32
  __shared__ float logit_s[HPB][S::kTile];             // logits, then probabilities, of one tile
  __shared__ float red_s[S::kGroups][D];               // cross-key-group reduction of acc
  __shared__ float m_s[HPB], l_s[HPB], alpha_s[HPB];   // running max (log2), sum, rescale

  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int kg = warp * (32 / S::kTPK) + lane / S::kTPK;  // key group of this lane
  const int kl = lane % S::kTPK;                          // lane within the key group

  const int64_t seq = blockIdx.x;
  const int64_t kv_head = blockIdx.y / p.head_chunks;
  const int64_t chunk = blockIdx.y % p.head_chunks;
  const int64_t split = blockIdx.z;
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int hpb = static_cast<int>(qwen_index::min64(HPB, group - chunk * HPB));
  const int64_t head0 = kv_head * group + chunk * HPB;
  const bool direct = p.num_splits == 1;
  const int hd = static_cast<int>(p.head_dim);  // <= D: dims [hd, D) of the template are zero padding

  const int64_t q_begin = p.query_start_loc[seq * p.qsl_stride];
  const int64_t q_end = p.query_start_loc[(seq + 1) * p.qsl_stride];
  if (q_end <= q_begin) return;  // no query row
  const int64_t row = q_begin;   // max_query_len == 1: the sequence's single row
  const int64_t slot = p.seq_slots[seq * p.seq_slots_stride];
  T* out = static_cast<T*>(p.out);
  if (slot < 0 || slot >= p.num_slots) {
    // Padding sequence: zero rows. With splits the merge kernel writes them.
    if (direct) {
      for (int i = tid; i < hpb * hd; i += kDecodeThreads) {
        Elem<T>::store(out + row * p.out_stride_token + (head0 + i / hd) * p.out_stride_head + i % hd, 0.0f);
      }
    }
    return;
  }
  const int64_t capacity = qwen_index::slot_capacity(p.max_blocks_per_slot, p.block_size);
  const int64_t seq_len = qwen_index::max64(0, qwen_index::min64(p.seq_lens[seq * p.seq_lens_stride], capacity));
  const int64_t k_begin = qwen_index::split_begin(seq_len, p.num_splits, S::kTile, split);
  const int64_t k_end = qwen_index::split_end(seq_len, p.num_splits, S::kTile, split);

  const T* query = static_cast<const T*>(p.query);
  for (int i = tid; i < hpb * D; i += kDecodeThreads) {
    const int g = i / D, d = i % D;
    q_s[g][d] = d < hd ? Elem<T>::load(query + row * p.q_stride_token + (head0 + g) * p.q_stride_head + d) * p.scale_log2
                       : 0.0f;
  }
  if (tid < HPB) { m_s[tid] = -INFINITY; l_s[tid] = 0.0f; alpha_s[tid] = 1.0f; }
  __syncthreads();

  const T* kc = static_cast<const T*>(p.key_cache);
  const T* vc = static_cast<const T*>(p.value_cache);
  float acc[HPB][S::kEPT];
#pragma unroll
  for (int g = 0; g < HPB; ++g)
#pragma unroll
    for (int e = 0; e < S::kEPT; ++e) acc[g][e] = 0.0f;

  for (int64_t tile0 = k_begin; tile0 < k_end; tile0 += S::kTile) {
    // 1. Issue every K and V load of this lane's kUnroll keys before using any of them.
    uint4 kraw[S::kUnroll][S::kVPT], vraw[S::kUnroll][S::kVPT];
    bool valid[S::kUnroll];
    int64_t kbase[S::kUnroll], vbase[S::kUnroll];
#pragma unroll
    for (int u = 0; u < S::kUnroll; ++u) {
      const int64_t k = tile0 + u * S::kGroups + kg;
      KeyLocation loc{-1, 0};
      if (k < k_end) loc = locate(p.block_table, p.bt_stride_slot, p.bt_stride_col, slot, k, p.block_size, p.num_blocks);
      valid[u] = loc.block >= 0;
      kbase[u] = loc.block * p.kc_stride_block + loc.row * p.kc_stride_row + kv_head * p.kc_stride_head;
      vbase[u] = loc.block * p.vc_stride_block + loc.row * p.vc_stride_row + kv_head * p.vc_stride_head;
    }
#pragma unroll
    for (int u = 0; u < S::kUnroll; ++u)
#pragma unroll
      for (int v = 0; v < S::kVPT; ++v) {
        const bool in_row = valid[u] && S::dim(kl, v, 0) < hd;  // head_dim is a whole number of vectors
        kraw[u][v] = in_row ? load16(kc + kbase[u] + S::dim(kl, v, 0)) : zero16();
        vraw[u][v] = in_row ? load16(vc + vbase[u] + S::dim(kl, v, 0)) : zero16();
      }

    // 2. Logits of every (head, key) of the tile: partial dot products over this lane's dims,
    //    summed over the kTPK lanes of the key by a transposed butterfly.
#pragma unroll
    for (int u = 0; u < S::kUnroll; ++u) {
      float kf[S::kEPT];
#pragma unroll
      for (int v = 0; v < S::kVPT; ++v) Elem<T>::unpack(kraw[u][v], kf + v * S::kEPV);
      float part[HPB];
#pragma unroll
      for (int g = 0; g < HPB; ++g) {
        part[g] = 0.0f;
        if (g < hpb) {  // uniform over the block; q_s rows >= hpb are not loaded
#pragma unroll
          for (int v = 0; v < S::kVPT; ++v)
#pragma unroll
            for (int i = 0; i < S::kEPV; i += 4) {
              const float4 q4 = *reinterpret_cast<const float4*>(&q_s[g][S::dim(kl, v, i)]);
              const float* kv = kf + v * S::kEPV + i;
              part[g] += q4.x * kv[0] + q4.y * kv[1] + q4.z * kv[2] + q4.w * kv[3];
            }
        }
      }
      int head = 0;
      butterfly_sum<HPB, S::kTPK / 2>(part, kl, head);
      // Lanes whose bits below the last transposed step are zero hold distinct heads' sums.
      constexpr int kHeld = HPB / S::kTPK > 1 ? HPB / S::kTPK : 1;
      constexpr int kSameSum = S::kTPK / HPB > 1 ? S::kTPK / HPB : 1;
      if (kl % kSameSum == 0) {
#pragma unroll
        for (int i = 0; i < kHeld; ++i) {
          if (head + i < hpb) logit_s[head + i][u * S::kGroups + kg] = valid[u] ? part[i] : -INFINITY;
        }
      }
    }
    __syncthreads();

    // 3. Online softmax statistics: warp w owns heads w, w + 4, ... It turns the tile's logits
    //    into probabilities relative to the new running max and publishes the rescale factor.
    for (int g = warp; g < hpb; g += kDecodeWarps) {
      float mx = -INFINITY;
      for (int k = lane; k < S::kTile; k += 32) mx = fmaxf(mx, logit_s[g][k]);
      mx = warp_max(mx);
      const float m_old = m_s[g];
      const float m_new = fmaxf(m_old, mx);
      float sum = 0.0f;
      for (int k = lane; k < S::kTile; k += 32) {
        const float pk = m_new == -INFINITY ? 0.0f : exp2f(logit_s[g][k] - m_new);
        logit_s[g][k] = pk;
        sum += pk;
      }
      sum = warp_sum(sum);
      if (lane == 0) {
        const float alpha = m_new == -INFINITY ? 1.0f : exp2f(m_old - m_new);
        alpha_s[g] = alpha;
        l_s[g] = l_s[g] * alpha + sum;
        m_s[g] = m_new;
      }
    }
    __syncthreads();

    // 4. acc = acc * alpha + P V over this lane's keys (invalid keys have p = 0 and v = 0).
#pragma unroll
    for (int g = 0; g < HPB; ++g) {
      if (g < hpb) {
        const float alpha = alpha_s[g];
#pragma unroll
        for (int e = 0; e < S::kEPT; ++e) acc[g][e] *= alpha;
      }
    }
#pragma unroll
    for (int u = 0; u < S::kUnroll; ++u) {
      float vf[S::kEPT];
#pragma unroll
      for (int v = 0; v < S::kVPT; ++v) Elem<T>::unpack(vraw[u][v], vf + v * S::kEPV);
#pragma unroll
      for (int g = 0; g < HPB; ++g) {
        if (g < hpb) {
          const float pk = logit_s[g][u * S::kGroups + kg];
#pragma unroll
          for (int e = 0; e < S::kEPT; ++e) acc[g][e] += pk * vf[e];
        }
      }
    }
    __syncthreads();  // logit_s and alpha_s are rewritten by the next tile
  }

  // Epilogue: sum acc over the key groups, head by head, then normalise (one split) or store
  // the fp32 partial for the merge kernel.
#pragma unroll
  for (int g = 0; g < HPB; ++g) {
    if (g < hpb) {
#pragma unroll
      for (int v = 0; v < S::kVPT; ++v)
#pragma unroll
        for (int i = 0; i < S::kEPV; ++i) red_s[kg][S::dim(kl, v, i)] = acc[g][v * S::kEPV + i];
      __syncthreads();
      const int64_t head = head0 + g;
      const float l = l_s[g];
      for (int d = tid; d < hd; d += kDecodeThreads) {
        float s = 0.0f;
#pragma unroll 8
        for (int k = 0; k < S::kGroups; ++k) s += red_s[k][d];
        if (direct) {
          float o = l > 0.0f ? s / l : 0.0f;
          if (p.gate != nullptr) {
            o *= sigmoid(Elem<T>::load(static_cast<const T*>(p.gate) + row * p.gate_stride_token +
                                       head * p.gate_stride_head + d));
          }
          Elem<T>::store(out + row * p.out_stride_token + head * p.out_stride_head + d, o);
        } else {
          p.partial_acc[((seq * p.num_heads + head) * p.num_splits + split) * hd + d] = s;
        }
      }
      if (!direct && tid == 0) {
        float* ml = p.partial_ml + ((seq * p.num_heads + head) * p.num_splits + split) * 2;
        ml[0] = m_s[g];
        ml[1] = l;
      }
      __syncthreads();  // red_s is rewritten for the next head
    }
  }
}

// grid (num_seqs, num_heads), block 128: out = sum_s acc_s 2^(m_s - M) / sum_s l_s 2^(m_s - M).
template <typename T, int D>
__global__ void __launch_bounds__(128) _slot_attention_merge_kernel(const AttentionParams p) {
  __shared__ float w_s[kMaxDecodeSplits];
  __shared__ float inv_l_s;
  const int64_t seq = blockIdx.x, head = blockIdx.y;
  const int64_t q_begin = p.query_start_loc[seq * p.qsl_stride];
  const int64_t q_end = p.query_start_loc[(seq + 1) * p.qsl_stride];
  if (q_end <= q_begin) return;
  const int64_t row = q_begin;
  T* out = static_cast<T*>(p.out) + row * p.out_stride_token + head * p.out_stride_head;
  const int64_t slot = p.seq_slots[seq * p.seq_slots_stride];
  if (slot < 0 || slot >= p.num_slots) {
    for (int d = threadIdx.x; d < p.head_dim; d += blockDim.x) Elem<T>::store(out + d, 0.0f);
    return;
  }
  const int64_t n = p.num_splits;
  const float* ml = p.partial_ml + (seq * p.num_heads + head) * n * 2;
  const int64_t hd = p.head_dim;
  const float* acc = p.partial_acc + (seq * p.num_heads + head) * n * hd;
  if (threadIdx.x == 0) {
    // Splits with l == 0 saw no key: their partials are skipped (their acc is never read).
    float m = -INFINITY;
    for (int64_t s = 0; s < n; ++s) if (ml[2 * s + 1] > 0.0f) m = fmaxf(m, ml[2 * s]);
    float l = 0.0f;
    for (int64_t s = 0; s < n; ++s) {
      const float w = ml[2 * s + 1] > 0.0f ? exp2f(ml[2 * s] - m) : 0.0f;
      w_s[s] = w;
      l += w * ml[2 * s + 1];
    }
    inv_l_s = l > 0.0f ? 1.0f / l : 0.0f;
  }
  __syncthreads();
  for (int64_t d = threadIdx.x; d < hd; d += blockDim.x) {
    float o = 0.0f;
    for (int64_t s = 0; s < n; ++s) if (w_s[s] > 0.0f) o += w_s[s] * acc[s * hd + d];
    o *= inv_l_s;
    if (p.gate != nullptr) {
      o *= sigmoid(Elem<T>::load(static_cast<const T*>(p.gate) + row * p.gate_stride_token +
                                 head * p.gate_stride_head + d));
    }
    Elem<T>::store(out + d, o);
  }
}

// ---- prefill / mixed ---------------------------------------------------------------------------
template <typename T, int D>
struct PrefillShape {
  static constexpr int kElem = sizeof(T);
  static constexpr int kEPV = 16 / kElem;
  static constexpr int kBM = prefill_tile_rows(kElem, D);   // query rows per block
  static constexpr int kBN = prefill_tile_keys(kElem, D);   // keys per tile
  static constexpr int kThreads = 128;
  static constexpr int kTPR = 8;             // lanes sharing a row group (consecutive lanes)
  static constexpr int kRPT = kBM / 16;      // rows per thread: 16 row groups of kRPT rows
  static constexpr int kCPT = kBN / kTPR;    // score columns per thread: lane tc, tc + 8, ...
  static constexpr int kDPT = D / kTPR;      // output dims per thread: lane tc, tc + 8, ...
  static constexpr int kLd = D + kEPV;       // smem row pitch: 16-byte rows, 4-word bank skew
  static constexpr int kRowVecs = D / kEPV;
  static_assert(kRPT >= 1 && kCPT >= 1 && kDPT >= 1, "tile");
  static_assert((kBM + 2 * kBN) * kLd * kElem + kBM * (kBN + 1) * 4 <= 48 * 1024, "static smem");
};

// grid (num_seqs * q_tiles, num_heads), block 128. Block (seq, tile, head) computes query rows
// [tile * kBM, (tile + 1) * kBM) of the sequence for one query head; row j sits at position
// seq_len - q_len + j and sees keys [0, that]. Keys beyond the tile's last visible one, and
// block-table entries beyond them, are never read.
template <typename T, int D>
__global__ void __launch_bounds__(128) _slot_attention_prefill_kernel(const AttentionParams p, const int64_t q_tiles) {
  using S = PrefillShape<T, D>;
  __shared__ __align__(16) T q_s[S::kBM][S::kLd];
  __shared__ __align__(16) T k_s[S::kBN][S::kLd];
  __shared__ __align__(16) T v_s[S::kBN][S::kLd];
  __shared__ float p_s[S::kBM][S::kBN + 1];

  const int tid = threadIdx.x;
  const int rg = tid / S::kTPR, tc = tid % S::kTPR;
  const int64_t seq = blockIdx.x / q_tiles;
  const int64_t row0 = (blockIdx.x % q_tiles) * S::kBM;
  const int64_t head = blockIdx.y;
  const int64_t kv_head = head / (p.num_heads / p.num_kv_heads);
  const int hd = static_cast<int>(p.head_dim);  // <= D: dims [hd, D) of the template are zero padding

  const int64_t q_begin = p.query_start_loc[seq * p.qsl_stride];
  const int64_t q_len = p.query_start_loc[(seq + 1) * p.qsl_stride] - q_begin;
  if (row0 >= q_len) return;  // tile past this sequence's rows
  const int64_t rows = qwen_index::min64(S::kBM, q_len - row0);
  T* out = static_cast<T*>(p.out);
  const int64_t slot = p.seq_slots[seq * p.seq_slots_stride];
  if (slot < 0 || slot >= p.num_slots) {  // padding sequence: zero rows
    for (int64_t i = tid; i < rows * hd; i += S::kThreads) {
      Elem<T>::store(out + (q_begin + row0 + i / hd) * p.out_stride_token + head * p.out_stride_head + i % hd, 0.0f);
    }
    return;
  }
  const int64_t capacity = qwen_index::slot_capacity(p.max_blocks_per_slot, p.block_size);
  const int64_t seq_len = qwen_index::max64(0, qwen_index::min64(p.seq_lens[seq * p.seq_lens_stride], capacity));
  const int64_t key_end = qwen_index::tile_key_end(seq_len, q_len, row0, row0 + S::kBM);

  // Query tile -> q_s (rows past the sequence are zero).
  const char* query = static_cast<const char*>(p.query);
  for (int i = tid; i < S::kBM * S::kRowVecs; i += S::kThreads) {
    const int r = i / S::kRowVecs, c = (i % S::kRowVecs) * S::kEPV;
    uint4 x = zero16();
    if (r < rows && c < hd) {
      x = load16(query + ((q_begin + row0 + r) * p.q_stride_token + head * p.q_stride_head + c) * S::kElem);
    }
    *reinterpret_cast<uint4*>(&q_s[r][c]) = x;
  }

  float m_i[S::kRPT], l_i[S::kRPT], acc[S::kRPT][S::kDPT];
  int64_t qpos[S::kRPT];
#pragma unroll
  for (int i = 0; i < S::kRPT; ++i) {
    const int64_t r = rg * S::kRPT + i;
    m_i[i] = -INFINITY;
    l_i[i] = 0.0f;
    // A row past the sequence gets position -1: it sees no key.
    qpos[i] = r < rows ? qwen_index::query_position(seq_len, q_len, row0 + r) : -1;
#pragma unroll
    for (int j = 0; j < S::kDPT; ++j) acc[i][j] = 0.0f;
  }

  const char* kc = static_cast<const char*>(p.key_cache);
  const char* vc = static_cast<const char*>(p.value_cache);
  for (int64_t kt0 = 0; kt0 < key_end; kt0 += S::kBN) {
    __syncthreads();  // q_s written (first tile); k_s / v_s / p_s reads of the last tile done
    for (int i = tid; i < S::kBN * S::kRowVecs; i += S::kThreads) {
      const int c = i / S::kRowVecs, e = (i % S::kRowVecs) * S::kEPV;
      const int64_t k = kt0 + c;
      uint4 kx = zero16(), vx = zero16();  // keys past key_end and bad blocks read as zeros
      if (k < key_end && e < hd) {
        const KeyLocation loc = locate(p.block_table, p.bt_stride_slot, p.bt_stride_col, slot, k, p.block_size,
                                       p.num_blocks);
        if (loc.block >= 0) {
          kx = load16(kc + (loc.block * p.kc_stride_block + loc.row * p.kc_stride_row + kv_head * p.kc_stride_head + e) *
                               S::kElem);
          vx = load16(vc + (loc.block * p.vc_stride_block + loc.row * p.vc_stride_row + kv_head * p.vc_stride_head + e) *
                               S::kElem);
        }
      }
      *reinterpret_cast<uint4*>(&k_s[c][e]) = kx;
      *reinterpret_cast<uint4*>(&v_s[c][e]) = vx;
    }
    __syncthreads();

    // Scores of rows rg*kRPT + i and keys tc + 8j, in the log2 domain.
    float s[S::kRPT][S::kCPT];
#pragma unroll
    for (int i = 0; i < S::kRPT; ++i)
#pragma unroll
      for (int j = 0; j < S::kCPT; ++j) s[i][j] = 0.0f;
#pragma unroll 2
    for (int d = 0; d < D; d += S::kEPV) {
      float qf[S::kRPT][S::kEPV], kf[S::kCPT][S::kEPV];
#pragma unroll
      for (int i = 0; i < S::kRPT; ++i) Elem<T>::unpack(*reinterpret_cast<const uint4*>(&q_s[rg * S::kRPT + i][d]), qf[i]);
#pragma unroll
      for (int j = 0; j < S::kCPT; ++j) Elem<T>::unpack(*reinterpret_cast<const uint4*>(&k_s[tc + S::kTPR * j][d]), kf[j]);
#pragma unroll
      for (int i = 0; i < S::kRPT; ++i)
#pragma unroll
        for (int j = 0; j < S::kCPT; ++j)
#pragma unroll
          for (int e = 0; e < S::kEPV; ++e) s[i][j] += qf[i][e] * kf[j][e];
    }

    // Online softmax over the row group's 8 lanes (xor 1, 2, 4 stays inside the group).
#pragma unroll
    for (int i = 0; i < S::kRPT; ++i) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < S::kCPT; ++j) {
        const int64_t k = kt0 + tc + S::kTPR * j;
        s[i][j] = (k < key_end && k <= qpos[i]) ? s[i][j] * p.scale_log2 : -INFINITY;
        mx = fmaxf(mx, s[i][j]);
      }
#pragma unroll
      for (int off = S::kTPR / 2; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_new = fmaxf(m_i[i], mx);
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < S::kCPT; ++j) {
        const float pk = m_new == -INFINITY ? 0.0f : exp2f(s[i][j] - m_new);
        p_s[rg * S::kRPT + i][tc + S::kTPR * j] = pk;
        sum += pk;
      }
#pragma unroll
      for (int off = S::kTPR / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      const float alpha = m_new == -INFINITY ? 1.0f : exp2f(m_i[i] - m_new);
      l_i[i] = l_i[i] * alpha + sum;
      m_i[i] = m_new;
#pragma unroll
      for (int j = 0; j < S::kDPT; ++j) acc[i][j] *= alpha;
    }
    __syncwarp();  // p_s rows of this row group are read back by the same 8 lanes

    // acc += P V for dims tc + 8j.
#pragma unroll 4
    for (int c = 0; c < S::kBN; ++c) {
      float pc[S::kRPT];
#pragma unroll
      for (int i = 0; i < S::kRPT; ++i) pc[i] = p_s[rg * S::kRPT + i][c];
#pragma unroll
      for (int j = 0; j < S::kDPT; ++j) {
        const float v = Elem<T>::to_float(v_s[c][tc + S::kTPR * j]);
#pragma unroll
        for (int i = 0; i < S::kRPT; ++i) acc[i][j] += pc[i] * v;
      }
    }
  }

  const T* gate = static_cast<const T*>(p.gate);
#pragma unroll
  for (int i = 0; i < S::kRPT; ++i) {
    const int64_t r = rg * S::kRPT + i;
    if (r >= rows) continue;
    const int64_t tok = q_begin + row0 + r;
    const float inv_l = l_i[i] > 0.0f ? 1.0f / l_i[i] : 0.0f;
#pragma unroll
    for (int j = 0; j < S::kDPT; ++j) {
      const int64_t d = tc + S::kTPR * j;
      if (d >= hd) continue;
      float o = acc[i][j] * inv_l;
      if (gate != nullptr) o *= sigmoid(Elem<T>::load(gate + tok * p.gate_stride_token + head * p.gate_stride_head + d));
      Elem<T>::store(out + tok * p.out_stride_token + head * p.out_stride_head + d, o);
    }
  }
}

// ---- dispatch: picks the template instance and grid, then calls launch(kernel, grid, block, args...)
template <typename T, int D, int HPB, class Launch>
void dispatch_decode(const AttentionParams& p, Launch& launch) {
  const dim3 grid(static_cast<unsigned>(p.num_seqs), static_cast<unsigned>(p.num_kv_heads * p.head_chunks),
                  static_cast<unsigned>(p.num_splits));
  launch(_slot_attention_decode_kernel<T, D, HPB>, grid, dim3(kDecodeThreads), p);
  if (p.num_splits > 1) {
    const dim3 merge_grid(static_cast<unsigned>(p.num_seqs), static_cast<unsigned>(p.num_heads));
    launch(_slot_attention_merge_kernel<T, D>, merge_grid, dim3(128), p);
  }
}

template <typename T, int D, class Launch>
void dispatch_attention(const AttentionParams& p, Launch& launch) {
  if (p.max_query_len == 1) {
    switch (decode_heads_per_block(p.num_heads / p.num_kv_heads)) {
      case 1: dispatch_decode<T, D, 1>(p, launch); break;
      case 4: dispatch_decode<T, D, 4>(p, launch); break;
      default: dispatch_decode<T, D, 8>(p, launch); break;
    }
  } else {
    const int64_t q_tiles = qwen_index::ceil_div(p.max_query_len, PrefillShape<T, D>::kBM);
    const dim3 grid(static_cast<unsigned>(p.num_seqs * q_tiles), static_cast<unsigned>(p.num_heads));
    launch(_slot_attention_prefill_kernel<T, D>, grid, dim3(PrefillShape<T, D>::kThreads), p, q_tiles);
  }
}

template <typename T, class Launch>
bool dispatch_attention_dtype(const AttentionParams& p, Launch& launch) {
  if (!supported_head_dim(p.head_dim, sizeof(T))) return false;
  switch (padded_head_dim(p.head_dim)) {
    case 16: dispatch_attention<T, 16>(p, launch); return true;
    case 32: dispatch_attention<T, 32>(p, launch); return true;
    case 64: dispatch_attention<T, 64>(p, launch); return true;
    case 128: dispatch_attention<T, 128>(p, launch); return true;
    case 256: dispatch_attention<T, 256>(p, launch); return true;
    default: return false;
  }
}

}  // namespace

// False for a configuration without a compiled kernel.
template <class Launch>
bool dispatch_kv_write(const KvWriteParams& p, Launch& launch) {
  if (p.num_tokens == 0) return true;
  const dim3 grid(static_cast<unsigned>(p.num_tokens));
  switch (p.vector_bytes) {
    case 16: launch(_kv_write_kernel<uint4>, grid, dim3(128), p); return true;
    case 4: launch(_kv_write_kernel<uint32_t>, grid, dim3(128), p); return true;
    case 2: launch(_kv_write_kernel<uint16_t>, grid, dim3(128), p); return true;
    default: return false;
  }
}

template <class Launch>
bool dispatch_slot_attention(const AttentionParams& p, Launch& launch) {
  if (p.num_seqs == 0 || p.num_tokens == 0) return true;
  switch (p.dtype) {
    case DType::kFloat32: return dispatch_attention_dtype<float>(p, launch);
    case DType::kFloat16: return dispatch_attention_dtype<__half>(p, launch);
    case DType::kBFloat16: return dispatch_attention_dtype<Bf16>(p, launch);
  }
  return false;
}

}  // namespace qwen_cuda
