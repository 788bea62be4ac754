// Runs the CUDA kernels of qwen_kernels.cuh on the CPU, for tests without a GPU.
//
// Built by tests/test_cuda_ext.py with `g++ -std=c++20 -pthread -shared -fPIC -I csrc` and loaded
// with ctypes; not part of the extension (setup.py compiles only csrc/*.cu and csrc/*.cpp). The
// kernels, their dispatch and the launch plan are the production source; only the CUDA vocabulary
// comes from simt_shim.h, and the parameter filling below mirrors csrc/qwen_ops.cpp for CPU
// tensors (pointers, sizes and strides in elements come from Python).
#include "simt_shim.h"
#include "qwen_kernels.cuh"
#include "qwen_gated_delta_kernels.cuh"

#include <limits>
#include <vector>

using qwen_cuda::AttentionParams;
using qwen_cuda::ConvParams;
using qwen_cuda::DeltaParams;
using qwen_cuda::DType;
using qwen_cuda::KvWriteParams;

extern "C" {

// dims: num_tokens, num_kv_heads, head_dim, num_slots, max_blocks_per_slot, block_size, num_blocks.
// strides: key (token, head), value (token, head), key_cache (block, row, head), value_cache
// (block, row, head), slot_ids, positions, block_table (slot, column).
// Returns the vector width used (16 or the element size), or -1 without a kernel.
int qwen_emu_kv_write(int64_t elem_size, const void* key, const void* value, void* key_cache, void* value_cache,
                      const int32_t* slot_ids, const int32_t* positions, const int32_t* block_table,
                      const int64_t* dims, const int64_t* strides) {
  KvWriteParams p{};
  p.key = static_cast<const char*>(key);
  p.value = static_cast<const char*>(value);
  p.key_cache = static_cast<char*>(key_cache);
  p.value_cache = static_cast<char*>(value_cache);
  p.slot_ids = slot_ids;
  p.positions = positions;
  p.block_table = block_table;
  p.num_tokens = dims[0];
  p.num_kv_heads = dims[1];
  p.head_dim = dims[2];
  p.num_slots = dims[3];
  p.max_blocks_per_slot = dims[4];
  p.block_size = dims[5];
  p.num_blocks = dims[6];
  p.elem_size = elem_size;
  p.key_stride_token = strides[0];
  p.key_stride_head = strides[1];
  p.value_stride_token = strides[2];
  p.value_stride_head = strides[3];
  p.kc_stride_block = strides[4];
  p.kc_stride_row = strides[5];
  p.kc_stride_head = strides[6];
  p.vc_stride_block = strides[7];
  p.vc_stride_row = strides[8];
  p.vc_stride_head = strides[9];
  p.slot_ids_stride = strides[10];
  p.positions_stride = strides[11];
  p.bt_stride_slot = strides[12];
  p.bt_stride_col = strides[13];
  const int64_t tok_sizes[3] = {p.num_tokens, p.num_kv_heads, p.head_dim};
  const int64_t cache_sizes[4] = {p.num_blocks, p.block_size, p.num_kv_heads, p.head_dim};
  const int64_t k_strides[3] = {strides[0], strides[1], 1}, v_strides[3] = {strides[2], strides[3], 1};
  const int64_t kc_strides[4] = {strides[4], strides[5], strides[6], 1};
  const int64_t vc_strides[4] = {strides[7], strides[8], strides[9], 1};
  const bool vec = qwen_cuda::rows_aligned16(key, tok_sizes, k_strides, 3, elem_size) &&
                   qwen_cuda::rows_aligned16(value, tok_sizes, v_strides, 3, elem_size) &&
                   qwen_cuda::rows_aligned16(key_cache, cache_sizes, kc_strides, 4, elem_size) &&
                   qwen_cuda::rows_aligned16(value_cache, cache_sizes, vc_strides, 4, elem_size);
  p.vector_bytes = vec ? 16 : static_cast<int>(elem_size);
  simt::HostLaunch launch;
  return qwen_cuda::dispatch_kv_write(p, launch) ? p.vector_bytes : -1;
}

// dtype: 0 float32, 1 float16, 2 bfloat16. dims: num_tokens, num_heads, num_kv_heads, head_dim,
// num_seqs, num_slots, max_blocks_per_slot, block_size, num_blocks. strides: query (token, head),
// gate (token, head), key_cache (block, row, head), value_cache (block, row, head), block_table
// (slot, column), seq_slots, query_start_loc, seq_lens. `out` is contiguous [tokens, heads, dim].
// plan_out receives the decode plan (heads_per_block, head_chunks, tile_keys, num_splits).
// Returns 0, or -1 without a kernel.
int qwen_emu_slot_attention(int dtype, const void* query, const void* key_cache, const void* value_cache,
                            const void* gate, void* out, const int32_t* block_table, const int32_t* seq_slots,
                            const int32_t* query_start_loc, const int32_t* seq_lens, const int64_t* dims,
                            const int64_t* strides, double scale, int64_t max_query_len, int64_t num_sms,
                            int64_t* plan_out) {
  AttentionParams p{};
  p.dtype = static_cast<DType>(dtype);
  p.query = query;
  p.key_cache = key_cache;
  p.value_cache = value_cache;
  p.gate = gate;
  p.out = out;
  p.block_table = block_table;
  p.seq_slots = seq_slots;
  p.query_start_loc = query_start_loc;
  p.seq_lens = seq_lens;
  p.num_tokens = dims[0];
  p.num_heads = dims[1];
  p.num_kv_heads = dims[2];
  p.head_dim = dims[3];
  p.num_seqs = dims[4];
  p.num_slots = dims[5];
  p.max_blocks_per_slot = dims[6];
  p.block_size = dims[7];
  p.num_blocks = dims[8];
  p.q_stride_token = strides[0];
  p.q_stride_head = strides[1];
  p.gate_stride_token = strides[2];
  p.gate_stride_head = strides[3];
  p.kc_stride_block = strides[4];
  p.kc_stride_row = strides[5];
  p.kc_stride_head = strides[6];
  p.vc_stride_block = strides[7];
  p.vc_stride_row = strides[8];
  p.vc_stride_head = strides[9];
  p.bt_stride_slot = strides[10];
  p.bt_stride_col = strides[11];
  p.seq_slots_stride = strides[12];
  p.qsl_stride = strides[13];
  p.seq_lens_stride = strides[14];
  p.out_stride_token = p.num_heads * p.head_dim;
  p.out_stride_head = p.head_dim;
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  p.max_query_len = max_query_len;
  p.num_splits = 1;
  p.head_chunks = 1;
  std::vector<float> partial_acc, partial_ml;  // NaN-poisoned workspace
  const qwen_cuda::DecodePlan plan = qwen_cuda::make_decode_plan(
      p.num_seqs, p.num_heads, p.num_kv_heads, p.head_dim, qwen_cuda::dtype_size(p.dtype),
      qwen_index::slot_capacity(p.max_blocks_per_slot, p.block_size), num_sms);
  plan_out[0] = plan.heads_per_block;
  plan_out[1] = plan.head_chunks;
  plan_out[2] = plan.tile_keys;
  plan_out[3] = plan.num_splits;
  if (max_query_len == 1) {
    p.head_chunks = plan.head_chunks;
    p.num_splits = plan.num_splits;
    if (p.num_splits > 1) {
      const float nan = std::numeric_limits<float>::quiet_NaN();
      partial_acc.assign(static_cast<size_t>(p.num_seqs * p.num_heads * p.num_splits * p.head_dim), nan);
      partial_ml.assign(static_cast<size_t>(p.num_seqs * p.num_heads * p.num_splits * 2), nan);
      p.partial_acc = partial_acc.data();
      p.partial_ml = partial_ml.data();
    }
  }
  simt::HostLaunch launch;
  return qwen_cuda::dispatch_slot_attention(p, launch) ? 0 : -1;
}

// dtype as above (x, weight, bias, conv_state, out). dims: num_tokens, dim, kernel, num_seqs,
// num_slots. strides: x token, out token, weight (dim, tap), bias, conv_state (slot, dim, tap),
// seq_slots, query_start_loc, seq_lens. Returns 0, or -1 without a kernel.
int qwen_emu_causal_conv1d(int dtype, const void* x, const void* weight, const void* bias, void* conv_state,
                           void* out, const int32_t* seq_slots, const int32_t* query_start_loc,
                           const int32_t* seq_lens, const int64_t* dims, const int64_t* strides) {
  ConvParams p{};
  p.dtype = static_cast<DType>(dtype);
  p.x = x;
  p.weight = weight;
  p.bias = bias;
  p.conv_state = conv_state;
  p.out = out;
  p.seq_slots = seq_slots;
  p.query_start_loc = query_start_loc;
  p.seq_lens = seq_lens;
  p.num_tokens = dims[0];
  p.dim = dims[1];
  p.kernel = dims[2];
  p.num_seqs = dims[3];
  p.num_slots = dims[4];
  p.x_stride_token = strides[0];
  p.out_stride_token = strides[1];
  p.w_stride_dim = strides[2];
  p.w_stride_tap = strides[3];
  p.bias_stride = strides[4];
  p.cs_stride_slot = strides[5];
  p.cs_stride_dim = strides[6];
  p.cs_stride_tap = strides[7];
  p.seq_slots_stride = strides[8];
  p.qsl_stride = strides[9];
  p.seq_lens_stride = strides[10];
  simt::HostLaunch launch;
  return qwen_cuda::dispatch_causal_conv1d(p, launch) ? 0 : -1;
}

// dtypes: q/k/v/out, g, beta (codes as above). dims: num_tokens, num_k_heads, num_v_heads, k_dim,
// v_dim, num_seqs, num_slots. strides: q (token, head), k (token, head), v (token, head), out
// (token, head), g (token, head), beta (token, head), state (slot, head, k row), seq_slots,
// query_start_loc, seq_lens. Returns 0, or -1 without a kernel.
int qwen_emu_gated_delta_rule(const int* dtypes, const void* q, const void* k, const void* v, const void* g,
                              const void* beta, float* state, void* out, const int32_t* seq_slots,
                              const int32_t* query_start_loc, const int32_t* seq_lens, const int64_t* dims,
                              const int64_t* strides, double scale, double eps) {
  DeltaParams p{};
  p.dtype = static_cast<DType>(dtypes[0]);
  p.g_dtype = static_cast<DType>(dtypes[1]);
  p.beta_dtype = static_cast<DType>(dtypes[2]);
  p.q = q;
  p.k = k;
  p.v = v;
  p.g = g;
  p.beta = beta;
  p.state = state;
  p.out = out;
  p.seq_slots = seq_slots;
  p.query_start_loc = query_start_loc;
  p.seq_lens = seq_lens;
  p.num_tokens = dims[0];
  p.num_k_heads = dims[1];
  p.num_v_heads = dims[2];
  p.k_dim = dims[3];
  p.v_dim = dims[4];
  p.num_seqs = dims[5];
  p.num_slots = dims[6];
  p.q_stride_token = strides[0];
  p.q_stride_head = strides[1];
  p.k_stride_token = strides[2];
  p.k_stride_head = strides[3];
  p.v_stride_token = strides[4];
  p.v_stride_head = strides[5];
  p.out_stride_token = strides[6];
  p.out_stride_head = strides[7];
  p.g_stride_token = strides[8];
  p.g_stride_head = strides[9];
  p.beta_stride_token = strides[10];
  p.beta_stride_head = strides[11];
  p.st_stride_slot = strides[12];
  p.st_stride_head = strides[13];
  p.st_stride_k = strides[14];
  p.seq_slots_stride = strides[15];
  p.qsl_stride = strides[16];
  p.seq_lens_stride = strides[17];
  p.scale = static_cast<float>(scale);
  p.eps = static_cast<float>(eps);
  simt::HostLaunch launch;
  return qwen_cuda::dispatch_gated_delta_rule(p, launch) ? 0 : -1;
}

}  // extern "C"
