// Device code of the hybrid-model state ops torch.ops._qwen_C.causal_conv1d / gated_delta_rule
// (contracts: torch_library/qwen.schema, qwen_ops/kernels/reference_linear.py), shared by the same
// two includers as qwen_kernels.cuh: qwen_kernels.cu (nvcc) and tests/emulation/simt_emulator.cpp (g++
// over the SIMT shim, for CPU tests).
//
//   _causal_conv1d_kernel         block (token block, channel tile): one thread per channel walks up
//                                 to kConvTokens tokens of one sequence; taps before the chunk come
//                                 from the slot's conv state (continuing) or are zero (starting).
//   _conv_state_update_kernel     block (sequence, channel tile): the slot's last kernel - 1 inputs.
//                                 Launched after the first kernel, so no conv block reads a state
//                                 already overwritten.
//   _gated_delta_rule_kernel      block (sequence, value head, tile of 32 value columns): the fp32
//                                 state tile [k_dim, 32] lives in registers (warp w holds rows w,
//                                 w + 4, ...; lane l holds column l) and the block walks the
//                                 sequence's tokens: L2-normalise q and k in fp32, decay, delta
//                                 update, output. Correct for any q_len; for a decode step the state
//                                 is read once and written once.
//
// Every grid comes from static shapes (num_tokens, num_seqs, dims), never from device values, so the
// launches are CUDA-graph capturable. Padding sequences (slot -1, or a slot out of range) and
// sequences without rows return at once: nothing is written, and their output rows keep the zeros
// the host allocated.
#pragma once

#include <cmath>
#include <cstdint>

#include "qwen_index.h"
#include "qwen_kernels.cuh"
#include "qwen_kernels.h"

namespace qwen_cuda {
namespace {

// One float of a tensor whose dtype is known only at run time (g and beta may each be any float dtype).
__device__ __forceinline__ float load_as_float(const void* base, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat32: return Elem<float>::load(static_cast<const float*>(base) + i);
    case DType::kFloat16: return Elem<__half>::load(static_cast<const __half*>(base) + i);
    default: return Elem<Bf16>::load(static_cast<const Bf16*>(base) + i);
  }
}

// ---- causal_conv1d -----------------------------------------------------------------------------

// Sequence owning token block `block_id`: the last s with query_start_loc[s] / kConvTokens + s <=
// block_id (these first ids strictly increase with s). Binary search over num_seqs entries.
__device__ __forceinline__ int64_t conv_sequence_of_block(const ConvParams& p, int64_t block_id) {
  int64_t lo = 0, hi = p.num_seqs;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    const int64_t first = p.query_start_loc[mid * p.qsl_stride] / kConvTokens + mid;
    if (first <= block_id) lo = mid + 1; else hi = mid;
  }
  return lo - 1;
}

// grid (conv_token_blocks(num_tokens, num_seqs), ceil(dim / kConvThreads)), block kConvThreads.
// Row j of a sequence: silu(bias + sum_t weight[:, t] * in[j - (kernel - 1) + t]), where in[p] is x
// row q_start + p for p >= 0 and conv_state column kernel - 1 + p (continuing) or 0 (starting) for p < 0.
template <typename T>
__global__ void __launch_bounds__(kConvThreads) _causal_conv1d_kernel(const ConvParams p) {
  const int64_t block_id = blockIdx.x;
  const int64_t seq = conv_sequence_of_block(p, block_id);
  if (seq < 0) return;
  const int64_t q_start = p.query_start_loc[seq * p.qsl_stride];
  const int64_t q_len = p.query_start_loc[(seq + 1) * p.qsl_stride] - q_start;
  const int64_t j0 = (block_id - (q_start / kConvTokens + seq)) * kConvTokens;
  const int64_t slot = p.seq_slots[seq * p.seq_slots_stride];
  if (slot < 0 || slot >= p.num_slots || j0 >= q_len) return;  // padding, or a spare block id
  const int64_t d = static_cast<int64_t>(blockIdx.y) * kConvThreads + threadIdx.x;
  if (d >= p.dim) return;
  const bool continues = p.seq_lens[seq * p.seq_lens_stride] > q_len;
  const int64_t width = p.kernel - 1;
  const T* x = static_cast<const T*>(p.x);
  const T* w = static_cast<const T*>(p.weight) + d * p.w_stride_dim;
  const T* st = static_cast<const T*>(p.conv_state) + slot * p.cs_stride_slot + d * p.cs_stride_dim;
  T* out = static_cast<T*>(p.out);
  const float b = p.bias != nullptr ? Elem<T>::load(static_cast<const T*>(p.bias) + d * p.bias_stride) : 0.0f;
  const int64_t j1 = qwen_index::min64(j0 + kConvTokens, q_len);
  for (int64_t j = j0; j < j1; ++j) {
    float acc = b;
    for (int64_t t = 0; t < p.kernel; ++t) {
      const int64_t pos = j - width + t;  // < 0: an input before this chunk
      float in = 0.0f;
      if (pos >= 0) {
        in = Elem<T>::load(x + (q_start + pos) * p.x_stride_token + d);
      } else if (continues) {
        in = Elem<T>::load(st + (width + pos) * p.cs_stride_tap);
      }
      acc += in * Elem<T>::load(w + t * p.w_stride_tap);
    }
    Elem<T>::store(out + (q_start + j) * p.out_stride_token + d, acc / (1.0f + __expf(-acc)));
  }
}

// grid (num_seqs, ceil(dim / kConvThreads)), block kConvThreads. Column c of the slot's state becomes
// in[q_len - width + c]. Column c reads old column c + q_len (> c) when the chunk is shorter than the
// window, and the thread writes columns in increasing order, so it never reads a value it wrote.
// A copy of the element, so the state holds exactly the inputs.
template <typename T>
__global__ void __launch_bounds__(kConvThreads) _conv_state_update_kernel(const ConvParams p) {
  const int64_t seq = blockIdx.x;
  const int64_t slot = p.seq_slots[seq * p.seq_slots_stride];
  const int64_t q_start = p.query_start_loc[seq * p.qsl_stride];
  const int64_t q_len = p.query_start_loc[(seq + 1) * p.qsl_stride] - q_start;
  if (slot < 0 || slot >= p.num_slots || q_len <= 0) return;
  const int64_t d = static_cast<int64_t>(blockIdx.y) * kConvThreads + threadIdx.x;
  if (d >= p.dim) return;
  const bool continues = p.seq_lens[seq * p.seq_lens_stride] > q_len;
  const int64_t width = p.kernel - 1;
  const T* x = static_cast<const T*>(p.x);
  T* st = static_cast<T*>(p.conv_state) + slot * p.cs_stride_slot + d * p.cs_stride_dim;
  for (int64_t c = 0; c < width; ++c) {
    const int64_t pos = q_len - width + c;
    if (pos >= 0) {
      st[c * p.cs_stride_tap] = x[(q_start + pos) * p.x_stride_token + d];
    } else if (continues) {
      st[c * p.cs_stride_tap] = st[(width + pos) * p.cs_stride_tap];
    } else {
      Elem<T>::store(st + c * p.cs_stride_tap, 0.0f);
    }
  }
}

// ---- gated_delta_rule --------------------------------------------------------------------------

// grid (num_seqs, num_v_heads, ceil(v_dim / kDeltaTileV)), block kDeltaThreads. KP: k_dim padded
// (rows k_dim .. KP - 1 hold zeros and are never stored). Per token, with S the [k_dim, v] state:
//   q <- scale q / |q|, k <- k / |k|  (x rsqrt(sum x^2 + eps), fp32)
//   S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q.
template <typename T, int KP>
__global__ void __launch_bounds__(kDeltaThreads) _gated_delta_rule_kernel(const DeltaParams p) {
  constexpr int kRows = KP / kDeltaWarps;  // state rows per thread
  __shared__ float q_s[KP], k_s[KP];       // this token's raw q and k (fp32, zero past k_dim)
  __shared__ float v_s[kDeltaTileV];       // this token's v over the tile's columns
  __shared__ float coef_s[4];              // q scale (norm x scale), k scale (norm), exp(g), beta
  __shared__ float red_s[2][kDeltaWarps][kDeltaTileV];  // per-warp partial sums of S^T k and S^T q

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t seq = blockIdx.x;
  const int64_t h = blockIdx.y;  // value head
  const int64_t col = static_cast<int64_t>(blockIdx.z) * kDeltaTileV + lane;
  const int64_t slot = p.seq_slots[seq * p.seq_slots_stride];
  const int64_t q_start = p.query_start_loc[seq * p.qsl_stride];
  const int64_t q_len = p.query_start_loc[(seq + 1) * p.qsl_stride] - q_start;
  if (slot < 0 || slot >= p.num_slots || q_len <= 0) return;  // uniform over the block
  const bool continues = p.seq_lens[seq * p.seq_lens_stride] > q_len;
  const int64_t kh = h / (p.num_v_heads / p.num_k_heads);    // GQA: the q/k head of value head h
  const bool col_ok = col < p.v_dim;
  const int64_t kdim = p.k_dim;

  float* st = p.state + slot * p.st_stride_slot + h * p.st_stride_head + col;
  float s[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int64_t r = warp + i * kDeltaWarps;
    s[i] = (continues && col_ok && r < kdim) ? st[r * p.st_stride_k] : 0.0f;  // a starting sequence: zeros
  }

  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  T* out = static_cast<T*>(p.out);
  for (int64_t t = 0; t < q_len; ++t) {
    const int64_t tok = q_start + t;
    // 1. Stage the token: warp 0 q and its norm, warp 1 k and its norm, warp 2 v, warp 3 g and beta.
    //    (The last barrier of the previous token ordered every read of these buffers before this.)
    if (warp < 2) {
      const T* src = warp == 0 ? q + tok * p.q_stride_token + kh * p.q_stride_head
                               : k + tok * p.k_stride_token + kh * p.k_stride_head;
      float* dst = warp == 0 ? q_s : k_s;
      float sum_sq = 0.0f;
      for (int r = lane; r < KP; r += 32) {
        const float x = r < kdim ? Elem<T>::load(src + r) : 0.0f;
        dst[r] = x;
        sum_sq += x * x;
      }
      sum_sq = warp_sum(sum_sq);
      if (lane == 0) coef_s[warp] = rsqrtf(sum_sq + p.eps) * (warp == 0 ? p.scale : 1.0f);
    } else if (warp == 2) {
      v_s[lane] = col_ok ? Elem<T>::load(v + tok * p.v_stride_token + h * p.v_stride_head + col) : 0.0f;
    } else if (lane == 0) {
      coef_s[2] = __expf(load_as_float(p.g, p.g_dtype, tok * p.g_stride_token + h * p.g_stride_head));
      coef_s[3] = load_as_float(p.beta, p.beta_dtype, tok * p.beta_stride_token + h * p.beta_stride_head);
    }
    __syncthreads();

    // 2. Decay, and this warp's rows of S^T k (k still unnormalised: its scale is applied once).
    const float decay = coef_s[2], k_scale = coef_s[1];
    float part = 0.0f;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      s[i] *= decay;
      part += s[i] * k_s[warp + i * kDeltaWarps];
    }
    red_s[0][warp][lane] = part;
    __syncthreads();

    // 3. u = beta (v - S^T k); S += k u^T; this warp's rows of S^T q.
    float kv = 0.0f;
#pragma unroll
    for (int w = 0; w < kDeltaWarps; ++w) kv += red_s[0][w][lane];
    const float u = (v_s[lane] - kv * k_scale) * coef_s[3];
    const float ku = u * k_scale;
    part = 0.0f;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int r = warp + i * kDeltaWarps;
      s[i] += k_s[r] * ku;
      part += s[i] * q_s[r];
    }
    red_s[1][warp][lane] = part;
    __syncthreads();

    // 4. o = S^T q (q's norm and scale applied here).
    if (warp == 0 && col_ok) {
      float o = 0.0f;
#pragma unroll
      for (int w = 0; w < kDeltaWarps; ++w) o += red_s[1][w][lane];
      Elem<T>::store(out + tok * p.out_stride_token + h * p.out_stride_head + col, o * coef_s[0]);
    }
  }

#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int64_t r = warp + i * kDeltaWarps;
    if (col_ok && r < kdim) st[r * p.st_stride_k] = s[i];
  }
}

// ---- dispatch ------------------------------------------------------------------------------------
template <typename T, class Launch>
void dispatch_conv(const ConvParams& p, Launch& launch) {
  const unsigned channel_tiles = static_cast<unsigned>(qwen_index::ceil_div(p.dim, kConvThreads));
  launch(_causal_conv1d_kernel<T>, dim3(static_cast<unsigned>(conv_token_blocks(p.num_tokens, p.num_seqs)), channel_tiles),
         dim3(kConvThreads), p);
  if (p.kernel > 1) {
    launch(_conv_state_update_kernel<T>, dim3(static_cast<unsigned>(p.num_seqs), channel_tiles), dim3(kConvThreads), p);
  }
}

template <typename T, class Launch>
bool dispatch_delta(const DeltaParams& p, Launch& launch) {
  const dim3 grid(static_cast<unsigned>(p.num_seqs), static_cast<unsigned>(p.num_v_heads),
                  static_cast<unsigned>(qwen_index::ceil_div(p.v_dim, kDeltaTileV)));
  switch (delta_padded_k_dim(p.k_dim)) {
    case 32: launch(_gated_delta_rule_kernel<T, 32>, grid, dim3(kDeltaThreads), p); return true;
    case 64: launch(_gated_delta_rule_kernel<T, 64>, grid, dim3(kDeltaThreads), p); return true;
    case 128: launch(_gated_delta_rule_kernel<T, 128>, grid, dim3(kDeltaThreads), p); return true;
    case 256: launch(_gated_delta_rule_kernel<T, 256>, grid, dim3(kDeltaThreads), p); return true;
    default: return false;
  }
}

}  // namespace

// False for a configuration without a compiled kernel.
template <class Launch>
bool dispatch_causal_conv1d(const ConvParams& p, Launch& launch) {
  if (p.num_tokens == 0 || p.num_seqs == 0 || p.dim == 0) return true;
  if (p.kernel < 1) return false;
  switch (p.dtype) {
    case DType::kFloat32: dispatch_conv<float>(p, launch); return true;
    case DType::kFloat16: dispatch_conv<__half>(p, launch); return true;
    case DType::kBFloat16: dispatch_conv<Bf16>(p, launch); return true;
  }
  return false;
}

template <class Launch>
bool dispatch_gated_delta_rule(const DeltaParams& p, Launch& launch) {
  if (p.num_tokens == 0 || p.num_seqs == 0 || p.v_dim == 0) return true;
  if (!supported_delta_k_dim(p.k_dim) || p.num_k_heads <= 0 || p.num_v_heads % p.num_k_heads != 0) return false;
  switch (p.dtype) {
    case DType::kFloat32: return dispatch_delta<float>(p, launch);
    case DType::kFloat16: return dispatch_delta<__half>(p, launch);
    case DType::kBFloat16: return dispatch_delta<Bf16>(p, launch);
  }
  return false;
}

}  // namespace qwen_cuda
