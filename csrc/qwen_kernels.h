// Launch parameters, tiling constants and launch plans of the CUDA kernels (qwen_kernels.cuh).
//
// Plain C++ with neither torch nor CUDA headers: qwen_kernels.cu (nvcc), qwen_ops.cpp (torch)
// and the host emulator in tests/emulation/ all include it. Strides are in elements. Index tensors are
// int32, as DESIGN.md section 3 states.
#pragma once

#include <cstdint>

#include "qwen_index.h"

namespace qwen_cuda {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

constexpr int dtype_size(DType t) { return t == DType::kFloat32 ? 4 : 2; }

// The attention kernels are templates on a head dim D of 16, 32, 64, 128 or 256; another head_dim
// runs in the smallest D above it, its extra dims read as zeros and never written. A row must be a
// whole number of 16-byte vectors (head_dim a multiple of 8 in fp16/bf16, of 4 in fp32).
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t padded_head_dim(int64_t d) {
  return d <= 16 ? 16 : d <= 32 ? 32 : d <= 64 ? 64 : d <= 128 ? 128 : 256;
}
constexpr bool supported_head_dim(int64_t d, int64_t elem_size) {
  return d >= 1 && d <= kMaxHeadDim && (d * elem_size) % 16 == 0;
}

// ---- Decode tiling (shared by the kernel templates and the host launch plan) ----------------
// Each key row of head_dim elements is read with 16-byte vectors by `threads_per_key` lanes of a
// warp (at most 32); a warp reads 32 / threads_per_key keys at once, and each thread handles
// `decode_unroll` keys per tile, so a tile is 4 warps x keys-per-warp x unroll keys.
constexpr int kDecodeWarps = 4;
constexpr int kDecodeThreads = kDecodeWarps * 32;
constexpr int kMaxDecodeSplits = 64;
constexpr int kMinDecodeSplitKeys = 256;

constexpr int decode_row_vectors(int elem_size, int head_dim) { return head_dim * elem_size / 16; }
constexpr int decode_threads_per_key(int elem_size, int head_dim) {
  return decode_row_vectors(elem_size, head_dim) < 32 ? decode_row_vectors(elem_size, head_dim) : 32;
}
constexpr int decode_vectors_per_thread(int elem_size, int head_dim) {
  return decode_row_vectors(elem_size, head_dim) / decode_threads_per_key(elem_size, head_dim);
}
constexpr int decode_unroll(int elem_size, int head_dim) {
  return decode_vectors_per_thread(elem_size, head_dim) == 1 ? 4 : 2;
}
constexpr int decode_key_groups(int elem_size, int head_dim) {
  return kDecodeWarps * (32 / decode_threads_per_key(elem_size, head_dim));
}
constexpr int decode_tile_keys(int elem_size, int head_dim) {
  return decode_key_groups(elem_size, head_dim) * decode_unroll(elem_size, head_dim);
}

// Query heads of one GQA group handled by one decode thread block (a template parameter).
constexpr int decode_heads_per_block(int64_t group) { return group <= 1 ? 1 : group <= 4 ? 4 : 8; }

// ---- Prefill tiling: query rows per block and keys per tile, so that the static shared memory
// (query tile + key tile + value tile + fp32 probabilities) stays under 48 KiB on every arch.
constexpr int prefill_tile_rows(int elem_size, int head_dim) { return head_dim * elem_size <= 512 ? 32 : 16; }
constexpr int prefill_tile_keys(int elem_size, int head_dim) {
  return head_dim * elem_size <= 256 ? 32 : (head_dim * elem_size <= 512 ? 16 : 8);
}

struct KvWriteParams {
  const char* key;          // [num_tokens, num_kv_heads, head_dim]
  const char* value;
  char* key_cache;          // [num_blocks, block_size, num_kv_heads, head_dim]
  char* value_cache;
  const int32_t* slot_ids;  // [num_tokens]
  const int32_t* positions; // [num_tokens]
  const int32_t* block_table;  // [num_slots, max_blocks_per_slot]
  int64_t num_tokens, num_kv_heads, head_dim, elem_size;
  int64_t key_stride_token, key_stride_head, value_stride_token, value_stride_head;
  int64_t kc_stride_block, kc_stride_row, kc_stride_head;
  int64_t vc_stride_block, vc_stride_row, vc_stride_head;
  int64_t slot_ids_stride, positions_stride, bt_stride_slot, bt_stride_col;
  int64_t num_slots, max_blocks_per_slot, block_size, num_blocks;
  int vector_bytes;         // 16 when every row start is 16-byte aligned, else elem_size
};

struct AttentionParams {
  DType dtype;
  const void* query;        // [num_tokens, num_heads, head_dim]
  const void* key_cache;    // [num_blocks, block_size, num_kv_heads, head_dim]
  const void* value_cache;
  const void* gate;         // [num_tokens, num_heads, head_dim] or nullptr
  void* out;                // [num_tokens, num_heads, head_dim], contiguous
  const int32_t* block_table;      // [num_slots, max_blocks_per_slot]
  const int32_t* seq_slots;        // [num_seqs]
  const int32_t* query_start_loc;  // [num_seqs + 1]
  const int32_t* seq_lens;         // [num_seqs]
  float* partial_acc;       // split decode workspace [num_seqs, num_heads, num_splits, head_dim]
  float* partial_ml;        // [num_seqs, num_heads, num_splits, 2]: running max (log2 domain), sum
  int64_t num_tokens, num_heads, num_kv_heads, head_dim, num_seqs;
  int64_t q_stride_token, q_stride_head, gate_stride_token, gate_stride_head;
  int64_t out_stride_token, out_stride_head;
  int64_t kc_stride_block, kc_stride_row, kc_stride_head;
  int64_t vc_stride_block, vc_stride_row, vc_stride_head;
  int64_t bt_stride_slot, bt_stride_col, seq_slots_stride, qsl_stride, seq_lens_stride;
  int64_t num_slots, max_blocks_per_slot, block_size, num_blocks;
  float scale_log2;         // softmax scale x log2(e): the kernels use exp2
  int64_t max_query_len;    // 1 selects the split decode kernel
  int64_t num_splits;       // decode splits (1: the decode kernel writes `out` directly)
  int64_t head_chunks;      // decode: ceil(group / heads_per_block)
};

// Launch plan of the decode kernel, from static shapes and the device's SM count only (so a
// decode step is CUDA-graph capturable).
struct DecodePlan {
  int64_t heads_per_block;  // template parameter HPB of the decode kernel
  int64_t head_chunks;      // thread blocks per KV head along the GQA group
  int64_t tile_keys;        // keys per tile; split ranges are multiples of it
  int64_t num_splits;       // context splits (1: no merge kernel)
};

inline DecodePlan make_decode_plan(int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                   int64_t elem_size, int64_t capacity, int64_t num_sms) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t hpb = decode_heads_per_block(group);
  const int64_t chunks = qwen_index::num_head_chunks(group, hpb);
  const int64_t tile = decode_tile_keys(static_cast<int>(elem_size), static_cast<int>(padded_head_dim(head_dim)));
  const int64_t min_split = qwen_index::max64(kMinDecodeSplitKeys, tile);
  const int64_t splits = qwen_index::num_decode_splits(num_seqs * num_kv_heads * chunks, capacity, num_sms,
                                                       min_split, kMaxDecodeSplits);
  return {hpb, chunks, tile, splits};
}

// True when every row start of a tensor (all dims but the last, ignoring dims of size 1) is
// 16-byte aligned, so kernels may move it with 16-byte vectors.
inline bool rows_aligned16(const void* data, const int64_t* sizes, const int64_t* strides, int64_t dims,
                           int64_t elem_size) {
  if (reinterpret_cast<uintptr_t>(data) % 16 != 0) return false;
  if (dims == 0 || (sizes[dims - 1] * elem_size) % 16 != 0) return false;
  for (int64_t d = 0; d + 1 < dims; ++d) {
    if (sizes[d] > 1 && (strides[d] * elem_size) % 16 != 0) return false;
  }
  return true;
}

// ---- Hybrid-model state ops (qwen_gated_delta_kernels.cuh) ---------------------------------------------
// causal_conv1d: one thread per channel; a block covers kConvTokens tokens of one sequence x
// kConvThreads channels. Token blocks are numbered over the batch: block b of sequence s has id
// query_start_loc[s] / kConvTokens + s + b, so the grid (num_tokens / kConvTokens + num_seqs)
// comes from static shapes and covers every sequence whatever its length.
constexpr int kConvThreads = 128;
constexpr int kConvTokens = 16;
constexpr int64_t conv_token_blocks(int64_t num_tokens, int64_t num_seqs) { return num_tokens / kConvTokens + num_seqs; }

struct ConvParams {
  DType dtype;                     // x, weight, bias, conv_state and out
  const void* x;                   // [num_tokens, dim]
  const void* weight;              // [dim, kernel]
  const void* bias;                // [dim] or nullptr
  void* conv_state;                // [num_slots, dim, kernel - 1]
  void* out;                       // [num_tokens, dim], zeros on entry
  const int32_t* seq_slots;        // [num_seqs]
  const int32_t* query_start_loc;  // [num_seqs + 1]
  const int32_t* seq_lens;         // [num_seqs]
  int64_t num_tokens, dim, kernel, num_seqs, num_slots;
  int64_t x_stride_token, out_stride_token, w_stride_dim, w_stride_tap, bias_stride;
  int64_t cs_stride_slot, cs_stride_dim, cs_stride_tap;
  int64_t seq_slots_stride, qsl_stride, seq_lens_stride;
};

// gated_delta_rule: one block of kDeltaThreads per (sequence, value head, tile of kDeltaTileV
// value columns). Lane l of every warp owns column l of the tile (coalesced 128-byte state rows);
// warp w owns key rows w, w + kDeltaWarps, ... of the fp32 state tile, kept in registers. The
// kernels are templates on k_dim padded to 32, 64, 128 or 256.
constexpr int kDeltaWarps = 4;
constexpr int kDeltaThreads = kDeltaWarps * 32;
constexpr int kDeltaTileV = 32;
constexpr int64_t kMaxDeltaKeyDim = 256;
constexpr float kDeltaL2NormEps = 1e-6f;  // transformers' / FLA's l2norm epsilon (reference_linear.L2NORM_EPS)
constexpr int64_t delta_padded_k_dim(int64_t k) { return k <= 32 ? 32 : k <= 64 ? 64 : k <= 128 ? 128 : 256; }
constexpr bool supported_delta_k_dim(int64_t k) { return k >= 1 && k <= kMaxDeltaKeyDim; }

struct DeltaParams {
  DType dtype;                     // q, k, v and out
  DType g_dtype, beta_dtype;       // any float dtype each
  const void* q;                   // [num_tokens, num_k_heads, k_dim]
  const void* k;
  const void* v;                   // [num_tokens, num_v_heads, v_dim]
  const void* g;                   // [num_tokens, num_v_heads] log decay
  const void* beta;                // [num_tokens, num_v_heads]
  float* state;                    // [num_slots, num_v_heads, k_dim, v_dim] fp32
  void* out;                       // [num_tokens, num_v_heads, v_dim], zeros on entry
  const int32_t* seq_slots;        // [num_seqs]
  const int32_t* query_start_loc;  // [num_seqs + 1]
  const int32_t* seq_lens;         // [num_seqs]
  int64_t num_tokens, num_k_heads, num_v_heads, k_dim, v_dim, num_seqs, num_slots;
  int64_t q_stride_token, q_stride_head, k_stride_token, k_stride_head, v_stride_token, v_stride_head;
  int64_t out_stride_token, out_stride_head, g_stride_token, g_stride_head, beta_stride_token, beta_stride_head;
  int64_t st_stride_slot, st_stride_head, st_stride_k;
  int64_t seq_slots_stride, qsl_stride, seq_lens_stride;
  float scale;                     // applied to q after its L2 norm
  float eps;                       // L2 norm epsilon: x * rsqrt(sum x^2 + eps)
};

// Launchers on a cudaStream_t (passed as void*, so this header needs no CUDA header). They return
// false for a configuration without a compiled kernel (the caller checks dtype and head_dim
// first, so this is a second line of defence).
bool launch_kv_write(const KvWriteParams& p, void* stream);
bool launch_slot_attention(const AttentionParams& p, void* stream);
bool launch_causal_conv1d(const ConvParams& p, void* stream);
bool launch_gated_delta_rule(const DeltaParams& p, void* stream);

}  // namespace qwen_cuda
