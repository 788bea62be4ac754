// The CPU fast path's ops as dispatcher kernels (the qwen namespace's CPU key) for linear_packed,
// linear_silu_mul_packed, rms_norm, add_rms_norm, qk_norm_rope, silu_mul, attention_block, moe_packed and
// the quantized products linear_int8 / linear_int4 / linear_fp8 (schemas in
// torch_library/qwen.schema, defined by Python; references in kernels/reference_fused.py).
//
// Why C++: these ops run ~50 times in a CPU decode step of the embedded model, and a Python kernel
// behind torch.ops (dispatcher -> Python -> ctypes) costs ~20 us a call against ~3 us here. The
// arithmetic is qwen_cpu.c's. Built on first use by kernels/cpu.py: qwen_cpu.c compiled with the system C compiler, linked with
// this file (the system C++ compiler, torch's headers) into one library, the only CPU build.
// The checks mirror qwen_ops/ops/validation.py (which the fake kernels run): every error names the
// argument, the value and what was expected, before anything is written.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

extern "C" {
int qwen_linear(const void *x, int64_t xs, int64_t M, const void *wp, const float *bias, int64_t N, int64_t K,
                void *y, int64_t ys, int dtype, int64_t threads);
int qwen_rms_norm(const void *x, int64_t x_s0, const void *add, int64_t add_s0, void *sum, int64_t sum_s0,
                  const void *w, void *out, int64_t out_s0, int64_t rows, int64_t dim, float eps, int dtype);
int qwen_qk_norm_rope(const void *q, int64_t q_s0, int64_t q_s1, int64_t nq, const void *k, int64_t k_s0,
                      int64_t k_s1, int64_t nk, const void *q_w, const void *k_w, float eps, const float *table,
                      int64_t table_s0, const int32_t *positions, void *qo, void *ko, int64_t T, int64_t D,
                      int dtype);
int qwen_group_mins_add(void *y, int64_t ys, int64_t y_bf16, const void *x, int64_t xs, int64_t x_bf16, int64_t M,
                        int64_t K, const float *mt, int64_t ld, int64_t G, int64_t N);
int qwen_silu_mul(const void *gate, int64_t g_s0, const void *up, int64_t u_s0, void *out, int64_t rows,
                  int64_t dim, int dtype);
int qwen_linear_silu_mul(const void *x, int64_t xs, int64_t M, const void *wp, const float *bias, int64_t N, int64_t K,
                         void *out, int dtype, int64_t threads);
void qwen_kv_write(const void *key, const void *value, void *key_cache, void *value_cache, const int32_t *slot_ids,
                   const int32_t *positions, const int32_t *block_table, int64_t num_tokens, int64_t num_kv_heads,
                   int64_t head_dim, int64_t elem_size, int64_t k_s0, int64_t k_s1, int64_t v_s0, int64_t v_s1,
                   int64_t block_size, int64_t c_sb, int64_t c_sr, int64_t c_sh, int64_t vc_sb, int64_t vc_sr,
                   int64_t vc_sh, int64_t bt_s0, int64_t bt_s1);
void qwen_kv_write_fp8(const void *key, const void *value, void *key_cache, void *value_cache,
                       const int32_t *slot_ids, const int32_t *positions, const int32_t *block_table,
                       int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim, int src_dtype, int fp8_kind,
                       float k_scale, float v_scale, int64_t k_s0, int64_t k_s1, int64_t v_s0, int64_t v_s1,
                       int64_t block_size, int64_t c_sb, int64_t c_sr, int64_t c_sh, int64_t vc_sb, int64_t vc_sr,
                       int64_t vc_sh, int64_t bt_s0, int64_t bt_s1);
int qwen_slot_attention(const void *query, void *out, const void *key_cache, const void *value_cache,
                        const int32_t *block_table, const int32_t *seq_slots, const int32_t *query_start_loc,
                        const int32_t *seq_lens, const void *gate, int64_t num_seqs, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int dtype, float scale,
                        int64_t q_s0, int64_t q_s1, int64_t g_s0, int64_t g_s1, int64_t k_sb, int64_t k_sr,
                        int64_t k_sh, int64_t v_sb, int64_t v_sr, int64_t v_sh, int64_t bt_s0, int64_t bt_s1,
                        int64_t threads, int kv_dtype, float k_scale, float v_scale);
int qwen_moe_packed(const float *x, int64_t T, int64_t H, const int32_t *ids, const float *weights, int64_t k,
                    int64_t E, const int64_t *w13, const int64_t *w2, int64_t I, float *out, int64_t threads);
int qwen_linear_quant(int kind, const float *x, int64_t xs, int64_t M, const uint8_t *q, const float *s,
                      const uint8_t *z, int64_t g, int64_t bn, const float *bias, int64_t N, int64_t K, float *y,
                      int64_t ys, int64_t threads);
int qwen_linear_quant_a8(int kind, const float *x, int64_t xs, int64_t M, const uint8_t *q, const float *s,
                         const uint8_t *z, int64_t g, const float *bias, int64_t N, int64_t K, float *y, int64_t ys,
                         int64_t threads, int64_t portable);
int qwen_linear_a8_panels(int kind, const void *x, int64_t xs, int64_t x_bf16, int64_t M, const uint8_t *w,
                          const float *s, const uint8_t *z, int64_t g, const float *bias, int64_t N, int64_t K,
                          void *out, int64_t ys, int64_t out_bf16, int64_t threads, int64_t portable);
int qwen_lora_shrink(const void *x, int64_t xs, int64_t T, int64_t K, const void *a, int64_t SR, const int32_t *idx,
                     const float *scalings, int dtype, float *out, int64_t threads);
int qwen_lora_expand(void *y, int64_t ys, int64_t T, int64_t N, const float *buffer, int64_t bs, const void *b,
                     int64_t R, const int32_t *idx, const int64_t *slice_sizes, int64_t S, int dtype, int64_t threads);
}

namespace {

int dtype_code(const at::Tensor &t, const char *name) {
  if (t.scalar_type() == at::kFloat) return 0;
  if (t.scalar_type() == at::kBFloat16) return 2;
  TORCH_CHECK_VALUE(false, name, " has dtype ", t.scalar_type(), ", expected float32 or bfloat16");
}

void check_rows(const at::Tensor &t, const char *name) {
  TORCH_CHECK_VALUE(t.size(-1) <= 1 || t.stride(-1) == 1, name, " has stride ", t.strides(),
                    ": its last dimension must be contiguous (stride 1)");
}

void check_alloc(int status, const char *op) {
  TORCH_CHECK(status == 0, "qwen_ops cpu ", op, " could not allocate its scratch memory");
}

// A new output. QWEN_OPS_POISON_OUTPUTS=1 (the tests) fills it with NaN first, so an element a
// kernel skips shows (torch.empty in Python is patched for the same purpose).
at::Tensor fresh(at::IntArrayRef sizes, const at::TensorOptions &options) {
  at::Tensor t = at::empty(sizes, options);
  const char *poison = std::getenv("QWEN_OPS_POISON_OUTPUTS");
  if (poison != nullptr && poison[0] != '\0' && poison[0] != '0') t.fill_(NAN);
  return t;
}

std::vector<int64_t> packed_shape(int64_t n, int64_t k, bool bf16) {
  if (bf16) return {(n + 31) / 32, (k + 1) / 2, 32, 2};
  return {(n + 31) / 32, k, 32};
}

// linear_packed's arguments checked (validation.py's check_linear_packed); returns the bias's data (or null).
const float *check_linear_packed(const at::Tensor &x, const at::Tensor &packed, const std::optional<at::Tensor> &bias,
                                 int64_t out_features, int code) {
  TORCH_CHECK_VALUE(x.dim() == 2, "x has shape ", x.sizes(), " (rank ", x.dim(), "), expected rank 2: [rows, in_features]");
  check_rows(x, "x");
  const int64_t k = x.size(1);
  const auto want = packed_shape(out_features, k, code == 2);
  TORCH_CHECK_VALUE(packed.scalar_type() == x.scalar_type() && packed.sizes() == at::IntArrayRef(want) &&
                        packed.is_contiguous(),
                    "packed has shape ", packed.sizes(), " and dtype ", packed.scalar_type(), ", expected a contiguous ",
                    at::IntArrayRef(want), " ", x.scalar_type(), " tensor (pack_panels of a [", out_features, ", ", k,
                    "] weight of x's dtype)");
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK_VALUE(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == out_features &&
                        bias->is_contiguous(),
                    "bias has shape ", bias->sizes(), " and dtype ", bias->scalar_type(), ", expected contiguous float32 [",
                    out_features, "]");
  return bias->const_data_ptr<float>();
}

at::Tensor linear_packed(const at::Tensor &x, const at::Tensor &packed, const std::optional<at::Tensor> &bias,
                         int64_t out_features) {
  const int code = dtype_code(x, "x");
  const float *b = check_linear_packed(x, packed, bias, out_features, code);
  at::Tensor out = fresh({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return out;   // no rows: nothing to compute (the kernels assume at least one)
  check_alloc(qwen_linear(x.const_data_ptr(), x.stride(0), x.size(0), packed.const_data_ptr(), b, out_features,
                          x.size(1), out.mutable_data_ptr(), out_features, code, at::get_num_threads()),
              "linear_packed");
  return out;
}

// silu_mul(linear_packed(x, ...)): an MLP's gate | up product and its SiLU in one call.
at::Tensor linear_silu_mul_packed(const at::Tensor &x, const at::Tensor &packed, const std::optional<at::Tensor> &bias,
                                  int64_t out_features) {
  const int code = dtype_code(x, "x");
  TORCH_CHECK_VALUE(out_features > 0 && out_features % 2 == 0, "out_features is ", out_features,
                    ", expected a positive even count (gate | up features)");
  const float *b = check_linear_packed(x, packed, bias, out_features, code);
  at::Tensor out = fresh({x.size(0), out_features / 2}, x.options());
  if (x.size(0) == 0) return out;
  check_alloc(qwen_linear_silu_mul(x.const_data_ptr(), x.stride(0), x.size(0), packed.const_data_ptr(), b,
                                   out_features, x.size(1), out.mutable_data_ptr(), code, at::get_num_threads()),
              "linear_silu_mul_packed");
  return out;
}

void check_norm(const at::Tensor &x, const at::Tensor &weight, const at::Tensor *residual) {
  dtype_code(x, "x");
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.is_contiguous(), "x has shape ", x.sizes(), " and strides ", x.strides(),
                    ", expected a contiguous [..., dim]");
  TORCH_CHECK_VALUE(weight.scalar_type() == x.scalar_type() && weight.dim() == 1 && weight.size(0) == x.size(-1) &&
                        weight.is_contiguous(),
                    "weight has shape ", weight.sizes(), " and dtype ", weight.scalar_type(), ", expected contiguous [",
                    x.size(-1), "] ", x.scalar_type(), " (x's last dim and dtype)");
  if (residual != nullptr)
    TORCH_CHECK_VALUE(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type() &&
                          residual->is_contiguous(),
                      "residual has shape ", residual->sizes(), " and dtype ", residual->scalar_type(), ", expected x's ",
                      x.sizes(), " ", x.scalar_type(), ", contiguous");
}

void norm(const at::Tensor &x, const at::Tensor *residual, const at::Tensor &weight, double eps, at::Tensor &out,
          at::Tensor *total) {
  const int64_t dim = x.size(-1), rows = dim == 0 ? 0 : x.numel() / dim;
  check_alloc(qwen_rms_norm(x.const_data_ptr(), dim, residual ? residual->const_data_ptr() : nullptr, dim,
                            total ? total->mutable_data_ptr() : nullptr, dim, weight.const_data_ptr(),
                            out.mutable_data_ptr(), dim, rows, dim, (float)eps, dtype_code(x, "x")),
              "rms_norm");
}

at::Tensor rms_norm(const at::Tensor &x, const at::Tensor &weight, double eps) {
  check_norm(x, weight, nullptr);
  at::Tensor out = fresh(x.sizes(), x.options());
  norm(x, nullptr, weight, eps, out, nullptr);
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor &x, const at::Tensor &residual,
                                                const at::Tensor &weight, double eps) {
  check_norm(x, weight, &residual);
  at::Tensor out = fresh(x.sizes(), x.options()), total = fresh(x.sizes(), x.options());
  norm(x, &residual, weight, eps, out, &total);
  return {out, total};
}

void check_positions(const at::Tensor &positions, int64_t T, const at::Tensor &cos_sin) {
  TORCH_CHECK_VALUE(positions.scalar_type() == at::kInt && positions.dim() == 1 && positions.size(0) == T,
                    "positions has shape ", positions.sizes(), " and dtype ", positions.scalar_type(),
                    ", expected int32 [", T, "]");
  const int32_t *p = positions.const_data_ptr<int32_t>();   // contiguous: checked by the caller
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK_VALUE(p[t] >= 0 && p[t] < cos_sin.size(0), "positions[", t, "] = ", p[t], ", expected 0 <= position < ",
                      cos_sin.size(0), " (cos_sin's rows)");
}

void check_rope(const at::Tensor &q, const at::Tensor &k, const std::optional<at::Tensor> &q_weight,
                const std::optional<at::Tensor> &k_weight, const at::Tensor &cos_sin) {
  const int64_t D = q.size(2);
  TORCH_CHECK_VALUE(k.size(0) == q.size(0) && k.size(2) == D && D % 2 == 0, "k has shape ", k.sizes(), ", expected [",
                    q.size(0), ", kv_heads, ", D, "] (q's tokens and an even head_dim)");
  for (const auto *w : {&q_weight, &k_weight})
    if (w->has_value())
      TORCH_CHECK_VALUE((*w)->scalar_type() == q.scalar_type() && (*w)->dim() == 1 && (*w)->size(0) == D &&
                            (*w)->is_contiguous(),
                        (w == &q_weight ? "q_weight" : "k_weight"), " has shape ", (*w)->sizes(), " and dtype ",
                        (*w)->scalar_type(), ", expected contiguous [", D, "] ", q.scalar_type());
  TORCH_CHECK_VALUE(cos_sin.scalar_type() == at::kFloat && cos_sin.dim() == 2 && cos_sin.size(1) == D &&
                        cos_sin.stride(1) == 1,
                    "cos_sin has shape ", cos_sin.sizes(), " and dtype ", cos_sin.scalar_type(),
                    ", expected float32 [max_positions, ", D, "] (cos | sin over the whole head) with contiguous rows");
}

std::tuple<at::Tensor, at::Tensor> qk_norm_rope(const at::Tensor &q, const at::Tensor &k,
                                                const std::optional<at::Tensor> &q_weight,
                                                const std::optional<at::Tensor> &k_weight, double eps,
                                                const at::Tensor &cos_sin, const at::Tensor &positions) {
  TORCH_CHECK_VALUE(q.dim() == 3 && k.dim() == 3, "q has shape ", q.sizes(), " and k ", k.sizes(),
                    ", expected rank 3: [num_tokens, heads, head_dim]");
  const int code = dtype_code(q, "q");
  TORCH_CHECK_VALUE(k.scalar_type() == q.scalar_type(), "k has dtype ", k.scalar_type(), ", expected q's ", q.scalar_type());
  check_rows(q, "q");
  check_rows(k, "k");
  check_rope(q, k, q_weight, k_weight, cos_sin);
  const at::Tensor pos = positions.contiguous();
  check_positions(pos, q.size(0), cos_sin);
  at::Tensor qo = fresh(q.sizes(), q.options()), ko = fresh(k.sizes(), k.options());
  check_alloc(qwen_qk_norm_rope(q.const_data_ptr(), q.stride(0), q.stride(1), q.size(1), k.const_data_ptr(), k.stride(0),
                                k.stride(1), k.size(1), q_weight ? q_weight->const_data_ptr() : nullptr,
                                k_weight ? k_weight->const_data_ptr() : nullptr, (float)eps,
                                cos_sin.const_data_ptr<float>(), cos_sin.stride(0), pos.const_data_ptr<int32_t>(),
                                qo.mutable_data_ptr(), ko.mutable_data_ptr(), q.size(0), q.size(2), code),
              "qk_norm_rope");
  return {qo, ko};
}

at::Tensor silu_mul(const at::Tensor &gate_up) {
  TORCH_CHECK_VALUE(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up has shape ", gate_up.sizes(),
                    ", expected [rows, 2 * intermediate_size] (gate | up)");
  const int code = dtype_code(gate_up, "gate_up");
  check_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = fresh({rows, inter}, gate_up.options());
  const char *base = static_cast<const char *>(gate_up.const_data_ptr());
  check_alloc(qwen_silu_mul(base, gate_up.stride(0), base + inter * gate_up.element_size(), gate_up.stride(0),
                            out.mutable_data_ptr(), rows, inter, code),
              "silu_mul");
  return out;
}

// y [M, N] += (x [M, K] summed per group of K / G, fp32) @ mins_t [G, N] (rows ld apart): GGUF's per-group
// minimums (validation.py's check_group_mins_add). One row's group sums, then one pass over mins_t per row.
void group_mins_add(const at::Tensor &y, const at::Tensor &x, const at::Tensor &mins_t) {
  TORCH_CHECK_VALUE(y.dim() == 2 && x.dim() == 2 && mins_t.dim() == 2 && x.size(0) == y.size(0) &&
                        mins_t.scalar_type() == at::kFloat && mins_t.size(1) == y.size(1) && mins_t.size(0) >= 1 &&
                        x.size(1) % mins_t.size(0) == 0 && (mins_t.size(1) <= 1 || mins_t.stride(1) == 1),
                    "group_mins_add: y ", y.sizes(), ", x ", x.sizes(), " and mins_t ", mins_t.sizes(), " ",
                    mins_t.scalar_type(), " strides ", mins_t.strides(),
                    ", expected y [rows, N], x [rows, K], mins_t float32 [G, N] with G dividing K, last dim contiguous");
  const int yc = dtype_code(y, "y"), xc = dtype_code(x, "x");
  check_rows(y, "y");
  check_rows(x, "x");
  const int64_t G = mins_t.size(0), N = y.size(1);
  check_alloc(qwen_group_mins_add(y.mutable_data_ptr(), y.stride(0), yc == 2, x.const_data_ptr(), x.stride(0), xc == 2,
                                  x.size(0), x.size(1), mins_t.const_data_ptr<float>(),
                                  mins_t.size(1) <= 1 ? N : mins_t.stride(0), G, N),
              "group_mins_add");
}

// The slot metadata that the C kernels index memory with: every value in range (validation.py's
// check_kv_write_values / check_slot_attention_values, the parts that guard memory).
void check_slot_values(const at::Tensor &slot_ids, const at::Tensor &positions, const at::Tensor &block_table,
                       const at::Tensor &seq_slots, const at::Tensor &query_start_loc, const at::Tensor &seq_lens,
                       int64_t num_tokens, int64_t num_blocks, int64_t block_size) {
  const int64_t max_slots = block_table.size(0), cols = block_table.size(1), num_seqs = seq_slots.size(0);
  const int32_t *slots = slot_ids.const_data_ptr<int32_t>(), *pos = positions.const_data_ptr<int32_t>();
  const int32_t *bt = block_table.const_data_ptr<int32_t>();
  const int64_t bt0 = block_table.stride(0), bt1 = block_table.stride(1);
  auto block_of = [&](int64_t slot, int64_t col, const char *what) {
    const int32_t b = bt[slot * bt0 + col * bt1];
    TORCH_CHECK_VALUE(b >= 0 && b < num_blocks, "block_table[", slot, ", ", col, "] = ", b, " (", what,
                      "), expected 0 <= block id < ", num_blocks, " (key_cache's blocks)");
  };
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int32_t s = slots[t];
    TORCH_CHECK_VALUE(s >= -1 && s < max_slots, "slot_ids[", t, "] = ", s, ", but only ", max_slots,
                      " slots exist (block_table's rows); -1 marks padding");
    if (s < 0) continue;
    TORCH_CHECK_VALUE(pos[t] >= 0 && pos[t] / block_size < cols, "positions[", t, "] = ", pos[t], ", expected 0 <= ",
                      "position < ", cols * block_size, " (block_table's ", cols, " blocks of ", block_size, ")");
    block_of(s, pos[t] / block_size, "a token's block");
  }
  const int32_t *ss = seq_slots.const_data_ptr<int32_t>(), *qsl = query_start_loc.const_data_ptr<int32_t>();
  const int32_t *lens = seq_lens.const_data_ptr<int32_t>();
  TORCH_CHECK_VALUE(qsl[0] == 0 && qsl[num_seqs] == num_tokens, "query_start_loc spans [", qsl[0], ", ", qsl[num_seqs],
                    "], expected [0, ", num_tokens, "] (the query's tokens)");
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t q_len = qsl[i + 1] - qsl[i];
    TORCH_CHECK_VALUE(q_len >= 0, "query_start_loc[", i + 1, "] = ", qsl[i + 1], " < query_start_loc[", i, "] = ", qsl[i],
                      ", expected a non-decreasing vector");
    const int32_t s = ss[i];
    TORCH_CHECK_VALUE(s >= -1 && s < max_slots, "seq_slots[", i, "] = ", s, ", but only ", max_slots,
                      " slots exist (block_table's rows); -1 marks padding");
    if (s < 0) continue;
    TORCH_CHECK_VALUE(lens[i] >= q_len && (lens[i] + block_size - 1) / block_size <= cols, "seq_lens[", i, "] = ",
                      lens[i], ", expected query rows ", q_len, " <= seq_len <= ", cols * block_size, " (the slot's capacity)");
    for (int64_t c = 0; c < (lens[i] + block_size - 1) / block_size; ++c) block_of(s, c, "a sequence's block");
  }
}

at::Tensor attention_block(const at::Tensor &qkv, const std::optional<at::Tensor> &q_weight,
                           const std::optional<at::Tensor> &k_weight, double eps, const at::Tensor &cos_sin,
                           const at::Tensor &positions, at::Tensor &key_cache, at::Tensor &value_cache,
                           const at::Tensor &slot_ids, const at::Tensor &block_table, const at::Tensor &seq_slots,
                           const at::Tensor &query_start_loc, const at::Tensor &seq_lens, double scale,
                           int64_t max_query_len, int64_t num_heads, const std::optional<at::Tensor> &k_scale,
                           const std::optional<at::Tensor> &v_scale) {
  const int code = dtype_code(qkv, "qkv");
  const auto kv_type = key_cache.scalar_type();
  const int fp8 = kv_type == at::kFloat8_e4m3fn ? 3 : kv_type == at::kFloat8_e5m2 ? 4 : 0;
  TORCH_CHECK_VALUE(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes() &&
                        (kv_type == qkv.scalar_type() || fp8) && value_cache.scalar_type() == kv_type &&
                        key_cache.strides() == value_cache.strides() && key_cache.stride(3) == 1,
                    "key_cache ", key_cache.sizes(), " ", key_cache.scalar_type(), " and value_cache ", value_cache.sizes(),
                    " ", value_cache.scalar_type(), ": expected one [num_blocks, block_size, num_kv_heads, head_dim] layout "
                    "in qkv's dtype ", qkv.scalar_type(), " or an fp8 dtype, last dim contiguous");
  float ks = 1.0f, vs = 1.0f;
  for (const auto &[t, f, name] : {std::tuple{&k_scale, &ks, "k_scale"}, std::tuple{&v_scale, &vs, "v_scale"}}) {
    if (!t->has_value()) continue;
    TORCH_CHECK_VALUE((*t)->scalar_type() == at::kFloat && (*t)->numel() == 1 && (*t)->device().is_cpu(), name,
                      " has dtype ", (*t)->scalar_type(), " and shape ", (*t)->sizes(),
                      ", expected a one-element float32 CPU tensor or None");
    *f = *(*t)->const_data_ptr<float>();
  }
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1), nk = key_cache.size(2),
                D = key_cache.size(3);
  TORCH_CHECK_VALUE(num_heads >= 1 && num_heads % nk == 0, "num_heads = ", num_heads,
                    ", expected a positive multiple of the caches' num_kv_heads = ", nk);
  TORCH_CHECK_VALUE(qkv.dim() == 2 && qkv.size(1) == (num_heads + 2 * nk) * D && qkv.stride(1) == 1, "qkv has shape ",
                    qkv.sizes(), ", expected [num_tokens, ", (num_heads + 2 * nk) * D, "] (q | k | v of ", num_heads, " + 2 x ",
                    nk, " heads of ", D, ") with contiguous rows");
  const int64_t T = qkv.size(0), s0 = qkv.stride(0);
  for (const auto *t : {&slot_ids, &positions, &seq_slots, &query_start_loc, &seq_lens})
    TORCH_CHECK_VALUE(t->scalar_type() == at::kInt && t->dim() == 1 && t->is_contiguous(),
                      "slot metadata has shape ", t->sizes(), " and dtype ", t->scalar_type(),
                      ", expected contiguous int32 vectors (slot_ids, positions, seq_slots, query_start_loc, seq_lens)");
  TORCH_CHECK_VALUE(slot_ids.size(0) == T && positions.size(0) == T, "slot_ids ", slot_ids.sizes(), " and positions ",
                    positions.sizes(), ", expected [", T, "] (qkv's tokens)");
  const int64_t num_seqs = seq_slots.size(0);
  TORCH_CHECK_VALUE(query_start_loc.size(0) == num_seqs + 1 && seq_lens.size(0) == num_seqs, "query_start_loc ",
                    query_start_loc.sizes(), " and seq_lens ", seq_lens.sizes(), ", expected [", num_seqs + 1, "] and [",
                    num_seqs, "] (seq_slots has ", num_seqs, " sequences)");
  TORCH_CHECK_VALUE(block_table.scalar_type() == at::kInt && block_table.dim() == 2, "block_table has shape ",
                    block_table.sizes(), " and dtype ", block_table.scalar_type(), ", expected int32 [max_slots, max_blocks]");
  TORCH_CHECK_VALUE(max_query_len >= 1, "max_query_len = ", max_query_len, ", expected >= 1");
  const char *base = static_cast<const char *>(qkv.const_data_ptr());
  const int64_t es = qkv.element_size();
  // q and k views: [T, heads, D] with row stride s0.
  at::Tensor q = qkv.as_strided({T, num_heads, D}, {s0, D, 1});
  at::Tensor k = qkv.as_strided({T, nk, D}, {s0, D, 1}, qkv.storage_offset() + num_heads * D);
  check_rope(q, k, q_weight, k_weight, cos_sin);
  check_positions(positions, T, cos_sin);
  check_slot_values(slot_ids, positions, block_table, seq_slots, query_start_loc, seq_lens, T, num_blocks, block_size);
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int32_t q_len = query_start_loc.const_data_ptr<int32_t>()[i + 1] - query_start_loc.const_data_ptr<int32_t>()[i];
    TORCH_CHECK_VALUE(q_len <= max_query_len, "sequence ", i, " has ", q_len, " query rows, more than max_query_len = ",
                      max_query_len);
  }
  at::Tensor qr = fresh({T, num_heads, D}, qkv.options()), kr = fresh({T, nk, D}, qkv.options());
  check_alloc(qwen_qk_norm_rope(base, s0, D, num_heads, base + num_heads * D * es, s0, D, nk,
                                q_weight ? q_weight->const_data_ptr() : nullptr,
                                k_weight ? k_weight->const_data_ptr() : nullptr, (float)eps,
                                cos_sin.const_data_ptr<float>(), cos_sin.stride(0), positions.const_data_ptr<int32_t>(),
                                qr.mutable_data_ptr(), kr.mutable_data_ptr(), T, D, code),
              "attention_block");
  const auto cs = key_cache.strides();
  if (fp8)
    qwen_kv_write_fp8(kr.const_data_ptr(), base + (num_heads + nk) * D * es, key_cache.mutable_data_ptr(),
                      value_cache.mutable_data_ptr(), slot_ids.const_data_ptr<int32_t>(),
                      positions.const_data_ptr<int32_t>(), block_table.const_data_ptr<int32_t>(), T, nk, D, code, fp8,
                      ks, vs, nk * D, D, s0, D, block_size, cs[0], cs[1], cs[2], cs[0], cs[1], cs[2],
                      block_table.stride(0), block_table.stride(1));
  else
    qwen_kv_write(kr.const_data_ptr(), base + (num_heads + nk) * D * es, key_cache.mutable_data_ptr(),
                  value_cache.mutable_data_ptr(), slot_ids.const_data_ptr<int32_t>(), positions.const_data_ptr<int32_t>(),
                  block_table.const_data_ptr<int32_t>(), T, nk, D, es, nk * D, D, s0, D, block_size, cs[0], cs[1], cs[2],
                  cs[0], cs[1], cs[2], block_table.stride(0), block_table.stride(1));
  at::Tensor out = fresh({T, num_heads * D}, qkv.options());
  if (T == 0 || num_seqs == 0) return out.zero_();
  check_alloc(qwen_slot_attention(qr.const_data_ptr(), out.mutable_data_ptr(), key_cache.const_data_ptr(),
                                  value_cache.const_data_ptr(), block_table.const_data_ptr<int32_t>(),
                                  seq_slots.const_data_ptr<int32_t>(), query_start_loc.const_data_ptr<int32_t>(),
                                  seq_lens.const_data_ptr<int32_t>(), nullptr, num_seqs, num_heads, nk, D, block_size,
                                  code, (float)scale, num_heads * D, D, 0, 0, cs[0], cs[1], cs[2], cs[0], cs[1], cs[2],
                                  block_table.stride(0), block_table.stride(1), at::get_num_threads(),
                                  fp8 ? fp8 : code, ks, vs),
              "attention_block");
  return out;
}

at::Tensor moe_packed(const at::Tensor &hidden_states, const at::Tensor &w13, const at::Tensor &w2,
                      const at::Tensor &topk_weights, const at::Tensor &topk_ids) {
  TORCH_CHECK_VALUE(hidden_states.scalar_type() == at::kFloat && hidden_states.dim() == 2, "hidden_states has shape ",
                    hidden_states.sizes(), " and dtype ", hidden_states.scalar_type(), ", expected float32 [num_tokens, hidden]");
  const at::Tensor x = hidden_states.contiguous();
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK_VALUE(w13.dim() == 4 && w2.dim() == 4 && w13.size(0) == w2.size(0) && w13.size(0) >= 1, "w13 ", w13.sizes(),
                    " and w2 ", w2.sizes(), ": expected [num_experts, panels, K, 32] stacks of one expert count");
  const int64_t E = w13.size(0), I = w2.size(2);
  const auto p13 = packed_shape(2 * I, H, false), p2 = packed_shape(H, I, false);
  TORCH_CHECK_VALUE(w13.scalar_type() == at::kFloat && w2.scalar_type() == at::kFloat && w13.is_contiguous() &&
                        w2.is_contiguous() && w13.sizes().slice(1) == at::IntArrayRef(p13) &&
                        w2.sizes().slice(1) == at::IntArrayRef(p2),
                    "w13 ", w13.sizes(), " ", w13.scalar_type(), " and w2 ", w2.sizes(), " ", w2.scalar_type(),
                    ": expected contiguous float32 stacks of each expert's pack_panels of its [2 * I, ", H, "] and [", H,
                    ", I] weights (I = w2.shape[2] = ", I, ")");
  TORCH_CHECK_VALUE(topk_ids.scalar_type() == at::kInt && topk_ids.dim() == 2 && topk_ids.size(0) == T &&
                        topk_weights.sizes() == topk_ids.sizes(),
                    "topk_weights ", topk_weights.sizes(), " and topk_ids ", topk_ids.sizes(), " ", topk_ids.scalar_type(),
                    ", expected one shape [", T, ", top_k], topk_ids int32");
  const at::Tensor ids = topk_ids.contiguous(), weights = topk_weights.to(at::kFloat).contiguous();
  const int32_t *id = ids.const_data_ptr<int32_t>();
  for (int64_t i = 0; i < ids.numel(); ++i)
    TORCH_CHECK_VALUE(id[i] >= 0 && id[i] < E, "topk_ids[", i / ids.size(1), ", ", i % ids.size(1), "] = ", id[i],
                      ", but w13 has ", E, " experts; expected 0 <= expert id < ", E);
  std::vector<int64_t> a13(E), a2(E);
  for (int64_t e = 0; e < E; ++e) {
    a13[e] = reinterpret_cast<int64_t>(w13.const_data_ptr<float>() + e * w13.stride(0));
    a2[e] = reinterpret_cast<int64_t>(w2.const_data_ptr<float>() + e * w2.stride(0));
  }
  at::Tensor out = fresh({T, H}, x.options());
  check_alloc(qwen_moe_packed(x.const_data_ptr<float>(), T, H, id, weights.const_data_ptr<float>(), ids.size(1), E,
                              a13.data(), a2.data(), I, out.mutable_data_ptr<float>(), at::get_num_threads()),
              "moe_packed");
  return out;
}

// ---- Quantized linear products (linear_int8 / linear_int4 / linear_fp8). The checks and their messages are
// validation.py's check_linear_* (shapes printed as Python tuples, dtypes as torch names), so an error reads
// the same whichever kernel runs.
std::string py_shape(const at::Tensor &t) {
  std::string out = "(";
  for (int64_t i = 0; i < t.dim(); ++i) out += (i ? ", " : "") + std::to_string(t.size(i));
  return out + (t.dim() == 1 ? ",)" : ")");
}

std::string py_dtype(const at::Tensor &t) {
  switch (t.scalar_type()) {
    case at::kFloat: return "torch.float32";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kHalf: return "torch.float16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kDouble: return "torch.float64";
    case at::kFloat8_e4m3fn: return "torch.float8_e4m3fn";
    default: return std::string("torch.") + c10::toString(t.scalar_type());
  }
}

std::string py_list(std::initializer_list<int64_t> v) {
  std::string out = "[";
  bool first = true;
  for (int64_t x : v) { out += (first ? "" : ", ") + std::to_string(x); first = false; }
  return out + "]";
}

void quant_common(const at::Tensor &x, const std::optional<at::Tensor> &bias, int64_t n, int64_t k,
                  std::initializer_list<std::pair<const char *, const at::Tensor *>> others) {
  TORCH_CHECK_VALUE(x.dim() == 2, "x has shape ", py_shape(x), " (rank ", x.dim(), "), expected rank 2: [rows, in_features]");
  const auto st = x.scalar_type();
  TORCH_CHECK_VALUE(st == at::kFloat || st == at::kHalf || st == at::kBFloat16, "x has dtype ", py_dtype(x),
                    ", expected one of float32, float16, bfloat16");
  TORCH_CHECK_VALUE(x.size(1) <= 1 || x.stride(1) == 1, "x has stride ", x.strides(),
                    ": its last dimension must be contiguous (stride 1)");
  TORCH_CHECK_VALUE(x.size(1) == k, "x has shape ", py_shape(x), ", expected [rows, ", k, "] (the weight's in_features)");
  for (const auto &named : others)
    TORCH_CHECK_VALUE(named.second->is_contiguous(), named.first, " has shape ", py_shape(*named.second), " and strides ",
                      named.second->strides(), ", expected a contiguous tensor");
  if (bias.has_value())
    TORCH_CHECK_VALUE(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous(),
                      "bias has shape ", py_shape(*bias), " and dtype ", py_dtype(*bias), ", expected contiguous float32 [", n, "]");
}

int64_t quant_groups(const char *name, const at::Tensor &t, at::ScalarType dtype, const char *dtype_name, int64_t rows,
                     int64_t k) {
  TORCH_CHECK_VALUE(t.scalar_type() == dtype && t.dim() == 2 && t.size(0) == rows && t.size(1) >= 1 && k % t.size(1) == 0,
                    name, " has shape ", py_shape(t), " and dtype ", py_dtype(t), ", expected ", dtype_name, " [", rows,
                    ", G] with G dividing in_features = ", k, " (G groups of in_features / G elements)");
  return k / t.size(1);
}

// kind 0 int8, 1 int4, 2 fp8; a8: the products with int8 activations (linear_int8_a8 / linear_int4_a8).
at::Tensor quant_run(int kind, const at::Tensor &x, const at::Tensor &w, const at::Tensor &s, const at::Tensor *z,
                     const std::optional<at::Tensor> &bias, int64_t n, int64_t k, int64_t g, int64_t bn, bool a8 = false) {
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  at::Tensor out = fresh({x.size(0), n}, xf.options());
  const auto *wq = static_cast<const uint8_t *>(w.const_data_ptr());
  const uint8_t *zq = z == nullptr ? nullptr : z->const_data_ptr<uint8_t>();
  const float *b = bias.has_value() ? bias->const_data_ptr<float>() : nullptr;
  if (a8)
    check_alloc(qwen_linear_quant_a8(kind, xf.const_data_ptr<float>(), xf.stride(0), x.size(0), wq,
                                     s.const_data_ptr<float>(), zq, g, b, n, k, out.mutable_data_ptr<float>(), n,
                                     at::get_num_threads(), 0),
                "linear quant a8");
  else
    check_alloc(qwen_linear_quant(kind, xf.const_data_ptr<float>(), xf.stride(0), x.size(0), wq, s.const_data_ptr<float>(),
                                  zq, g, bn, b, n, k, out.mutable_data_ptr<float>(), n, at::get_num_threads()),
                "linear quant");
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

at::Tensor int8_product(const at::Tensor &x, const at::Tensor &qweight, const at::Tensor &scales,
                        const std::optional<at::Tensor> &bias, bool a8) {
  TORCH_CHECK_VALUE(qweight.scalar_type() == at::kChar && qweight.dim() == 2, "qweight has shape ", py_shape(qweight),
                    " and dtype ", py_dtype(qweight), ", expected int8 [out_features, in_features]");
  const int64_t n = qweight.size(0), k = qweight.size(1);
  quant_common(x, bias, n, k, {{"qweight", &qweight}, {"scales", &scales}});
  const int64_t g = quant_groups("scales", scales, at::kFloat, "torch.float32", n, k);
  return quant_run(0, x, qweight, scales, nullptr, bias, n, k, g, 1, a8);
}

at::Tensor int4_product(const at::Tensor &x, const at::Tensor &qweight, const at::Tensor &scales, const at::Tensor &zeros,
                        const std::optional<at::Tensor> &bias, bool a8) {
  TORCH_CHECK_VALUE(qweight.scalar_type() == at::kByte && qweight.dim() == 2, "qweight has shape ", py_shape(qweight),
                    " and dtype ", py_dtype(qweight), ", expected uint8 [out_features, in_features / 2] (two 4-bit "
                    "elements a byte)");
  const int64_t n = qweight.size(0), k = 2 * qweight.size(1);
  quant_common(x, bias, n, k, {{"qweight", &qweight}, {"scales", &scales}, {"zeros", &zeros}});
  const int64_t g = quant_groups("scales", scales, at::kFloat, "torch.float32", n, k);
  TORCH_CHECK_VALUE(zeros.scalar_type() == at::kByte && zeros.sizes() == scales.sizes(), "zeros has shape ",
                    py_shape(zeros), " and dtype ", py_dtype(zeros), ", expected uint8 ",
                    py_list({scales.size(0), scales.size(1)}), " (scales' shape)");
  TORCH_CHECK_VALUE(g % 2 == 0, "scales has ", scales.size(1), " groups of ", g, " elements; expected an even group size");
  return quant_run(1, x, qweight, scales, &zeros, bias, n, k, g, 1, a8);
}

at::Tensor linear_int8(const at::Tensor &x, const at::Tensor &qweight, const at::Tensor &scales,
                       const std::optional<at::Tensor> &bias) {
  return int8_product(x, qweight, scales, bias, false);
}

at::Tensor linear_int8_a8(const at::Tensor &x, const at::Tensor &qweight, const at::Tensor &scales,
                          const std::optional<at::Tensor> &bias) {
  return int8_product(x, qweight, scales, bias, true);
}

at::Tensor linear_int4(const at::Tensor &x, const at::Tensor &qweight, const at::Tensor &scales, const at::Tensor &zeros,
                       const std::optional<at::Tensor> &bias) {
  return int4_product(x, qweight, scales, zeros, bias, false);
}

at::Tensor linear_int4_a8(const at::Tensor &x, const at::Tensor &qweight, const at::Tensor &scales,
                          const at::Tensor &zeros, const std::optional<at::Tensor> &bias) {
  return int4_product(x, qweight, scales, zeros, bias, true);
}

at::Tensor linear_fp8(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &scale_inv,
                      const std::optional<at::Tensor> &bias, int64_t block_n, int64_t block_k) {
  TORCH_CHECK_VALUE(weight.scalar_type() == at::kFloat8_e4m3fn && weight.dim() == 2, "weight has shape ",
                    py_shape(weight), " and dtype ", py_dtype(weight), ", expected float8_e4m3fn [out_features, in_features]");
  const int64_t n = weight.size(0), k = weight.size(1);
  quant_common(x, bias, n, k, {{"weight", &weight}, {"scale_inv", &scale_inv}});
  TORCH_CHECK_VALUE(block_n >= 1, "block_n = ", block_n, ", expected a positive int");
  TORCH_CHECK_VALUE(block_k >= 1, "block_k = ", block_k, ", expected a positive int");
  const int64_t rows = (n + block_n - 1) / block_n, cols = (k + block_k - 1) / block_k;
  TORCH_CHECK_VALUE(scale_inv.scalar_type() == at::kFloat && scale_inv.dim() == 2 && scale_inv.size(0) == rows &&
                        scale_inv.size(1) == cols,
                    "scale_inv has shape ", py_shape(scale_inv), " and dtype ", py_dtype(scale_inv), ", expected float32 ",
                    py_list({rows, cols}), " (ceil(", n, " / block_n = ", block_n, "), ceil(", k, " / block_k = ",
                    block_k, "))");
  return quant_run(2, x, weight, scale_inv, nullptr, bias, n, k, block_k, block_n);
}

// linear_a8_panels: int8 (zeros None) or int4 weights in 64-feature panels (the contract: validation.py).
at::Tensor linear_a8_panels(const at::Tensor &x, const at::Tensor &weight, const at::Tensor &scales,
                            const std::optional<at::Tensor> &zeros, const std::optional<at::Tensor> &bias,
                            int64_t out_features) {
  TORCH_CHECK_VALUE(out_features >= 1, "out_features = ", out_features, ", expected a positive int");
  const int64_t panels = (out_features + 63) / 64, per = zeros.has_value() ? 8 : 4;
  TORCH_CHECK_VALUE(weight.scalar_type() == at::kByte && weight.dim() == 4 && weight.size(0) == panels &&
                        weight.size(1) >= 1 && weight.size(2) == 64 && weight.size(3) == 4,
                    "weight has shape ", py_shape(weight), " and dtype ", py_dtype(weight), ", expected uint8 [", panels,
                    ", in_features / ", per, ", 64, 4] (pack_a8_panels of ", out_features, " output features, ",
                    zeros.has_value() ? "int4" : "int8", ")");
  const int64_t k = per * weight.size(1);
  quant_common(x, bias, out_features, k, {{"weight", &weight}, {"scales", &scales}});
  TORCH_CHECK_VALUE(scales.scalar_type() == at::kFloat && scales.dim() == 3 && scales.size(0) == panels &&
                        scales.size(1) >= 1 && k % scales.size(1) == 0 && scales.size(2) == 64,
                    "scales has shape ", py_shape(scales), " and dtype ", py_dtype(scales), ", expected float32 [", panels,
                    ", G, 64] with G dividing in_features = ", k);
  const int64_t g = k / scales.size(1);
  TORCH_CHECK_VALUE(g % 128 == 0 || g % per == 0, "scales has ", scales.size(1), " groups of ", g,
                    " elements; expected a group size that is a multiple of ", per, " or of 128");
  if (zeros.has_value()) {
    TORCH_CHECK_VALUE(zeros->scalar_type() == at::kByte && zeros->sizes() == scales.sizes() && zeros->is_contiguous(),
                      "zeros has shape ", py_shape(*zeros), " and dtype ", py_dtype(*zeros), ", expected contiguous uint8 ",
                      py_list({scales.size(0), scales.size(1), 64}), " (scales' shape)");
  }
  // fp32 and bf16 rows are read and written as they are (bf16 rounded once from the fp32 product); fp16 converts
  const bool direct = x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16;
  const at::Tensor xf = direct ? x : x.to(at::kFloat);
  at::Tensor out = fresh({x.size(0), out_features}, xf.options());
  const int64_t bf16 = xf.scalar_type() == at::kBFloat16;
  check_alloc(qwen_linear_a8_panels(zeros.has_value() ? 1 : 0, xf.const_data_ptr(), xf.stride(0), bf16, x.size(0),
                                    weight.const_data_ptr<uint8_t>(), scales.const_data_ptr<float>(),
                                    zeros.has_value() ? zeros->const_data_ptr<uint8_t>() : nullptr, g,
                                    bias.has_value() ? bias->const_data_ptr<float>() : nullptr, out_features, k,
                                    out.mutable_data_ptr(), out_features, bf16, at::get_num_threads(), 0),
              "linear_a8_panels");
  return direct ? out : out.to(x.scalar_type());
}

// silu_mul_linear_a8_panels: linear_a8_panels(silu_mul(gate_up), ...) (the contract: validation.py): the two
// kernels above called in turn, so the same bits as the two ops, with one dispatch less in a model step.
at::Tensor silu_mul_linear_a8_panels(const at::Tensor &gate_up, const at::Tensor &weight, const at::Tensor &scales,
                                     const std::optional<at::Tensor> &zeros, const std::optional<at::Tensor> &bias,
                                     int64_t out_features) {
  TORCH_CHECK_VALUE(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up has shape ", py_shape(gate_up),
                    ", expected [rows, 2 * in_features] (gate | up)");
  if (weight.dim() == 4) {
    const int64_t k = (zeros.has_value() ? 8 : 4) * weight.size(1);
    TORCH_CHECK_VALUE(gate_up.size(1) == 2 * k, "gate_up has shape ", py_shape(gate_up), ", expected [rows, ", 2 * k,
                      "] (gate | up of the weight's in_features = ", k, ")");
  }
  return linear_a8_panels(silu_mul(gate_up), weight, scales, zeros, bias, out_features);
}

// ---- Multi-LoRA (lora_shrink / lora_expand). The checks and their messages are validation.py's check_lora_*,
// and the index values are always checked here: the C kernels index the weight pools with them.
int lora_dtype_code(const at::Tensor &t) {
  return t.scalar_type() == at::kFloat ? 0 : t.scalar_type() == at::kHalf ? 1 : 2;
}

void lora_float(const at::Tensor &t, const char *name) {
  const auto st = t.scalar_type();
  TORCH_CHECK_VALUE(st == at::kFloat || st == at::kHalf || st == at::kBFloat16, name, " has dtype ", py_dtype(t),
                    ", expected one of float32, float16, bfloat16");
  TORCH_CHECK_VALUE(t.size(-1) <= 1 || t.stride(-1) == 1, name, " has stride ", t.strides(),
                    ": its last dimension must be contiguous (stride 1)");
}

void lora_same_device(std::initializer_list<std::pair<const char *, const at::Tensor *>> tensors) {
  const auto &first = *tensors.begin();
  for (const auto &named : tensors)
    TORCH_CHECK_VALUE(named.second->device() == first.second->device(), named.first, " is on ",
                      named.second->device(), " but ", first.first, " is on ", first.second->device(),
                      "; all tensors must be on one device");
}

void lora_rank(const at::Tensor &t, const char *name, int64_t rank, const char *layout) {
  TORCH_CHECK_VALUE(t.dim() == rank, name, " has shape ", py_shape(t), " (rank ", t.dim(), "), expected rank ", rank,
                    ": ", layout);
}

void lora_weights(const at::Tensor &w, const char *name, const at::Tensor &holder, const char *holder_name,
                  const char *layout) {
  lora_rank(w, name, 3, layout);
  TORCH_CHECK_VALUE(w.scalar_type() == holder.scalar_type(), name, " has dtype ", py_dtype(w), ", expected ",
                    holder_name, "'s ", py_dtype(holder));
  TORCH_CHECK_VALUE(w.is_contiguous(), name, " has shape ", py_shape(w), " and strides ", w.strides(),
                    ", expected a contiguous tensor");
  TORCH_CHECK_VALUE(w.size(0) >= 1 && w.size(1) >= 1 && w.size(2) >= 1, name, " has shape ", py_shape(w),
                    ", expected every dim >= 1: ", layout);
}

// lora_indices int32 [T] (the metadata; lora_slots_checked reads the values).
void lora_indices_meta(const at::Tensor &lora_indices, int64_t T, const char *holder) {
  TORCH_CHECK_VALUE(lora_indices.scalar_type() == at::kInt, "lora_indices has dtype ", py_dtype(lora_indices),
                    ", expected torch.int32");
  lora_rank(lora_indices, "lora_indices", 1, "[num_tokens] (each row's adapter slot, -1 = none)");
  TORCH_CHECK_VALUE(lora_indices.size(0) == T, "lora_indices has shape ", py_shape(lora_indices), ", expected [", T,
                    "] (one adapter slot per row of ", holder, ")");
}

// lora_indices contiguous, every value -1 or a slot < L.
at::Tensor lora_slots_checked(const at::Tensor &lora_indices, int64_t L) {
  at::Tensor idx = lora_indices.contiguous();
  const int32_t *p = idx.const_data_ptr<int32_t>();
  for (int64_t t = 0; t < idx.size(0); ++t)
    TORCH_CHECK_VALUE(p[t] >= -1 && p[t] < L, "lora_indices[", t, "] = ", p[t], ", but only ", L,
                      " adapter slots exist; expected -1 (no adapter) or 0 <= slot < ", L);
  return idx;
}

at::Tensor lora_shrink(const at::Tensor &x, const at::Tensor &lora_a, const at::Tensor &lora_indices,
                       const at::Tensor &scalings) {
  lora_same_device({{"x", &x}, {"lora_a", &lora_a}, {"lora_indices", &lora_indices}, {"scalings", &scalings}});
  lora_rank(x, "x", 2, "[num_tokens, in_features]");
  lora_float(x, "x");
  lora_weights(lora_a, "lora_a", x, "x", "[max_loras, num_slices * max_rank, in_features]");
  TORCH_CHECK_VALUE(lora_a.size(2) == x.size(1), "lora_a has shape ", py_shape(lora_a),
                    ", expected [max_loras, num_slices * max_rank, ", x.size(1), "] (x's in_features)");
  const int64_t T = x.size(0), K = x.size(1), L = lora_a.size(0), SR = lora_a.size(1);
  lora_indices_meta(lora_indices, T, "x");
  TORCH_CHECK_VALUE(scalings.scalar_type() == at::kFloat && scalings.dim() == 1 && scalings.size(0) == L,
                    "scalings has shape ", py_shape(scalings), " and dtype ", py_dtype(scalings), ", expected float32 [",
                    L, "] (one per slot of lora_a)");
  const at::Tensor idx = lora_slots_checked(lora_indices, L);
  const at::Tensor scale = scalings.contiguous();
  at::Tensor out = fresh({T, SR}, x.options().dtype(at::kFloat));
  check_alloc(qwen_lora_shrink(x.const_data_ptr(), x.stride(0), T, K, lora_a.const_data_ptr(), SR,
                               idx.const_data_ptr<int32_t>(), scale.const_data_ptr<float>(), lora_dtype_code(x),
                               out.mutable_data_ptr<float>(), at::get_num_threads()),
              "lora_shrink");
  return out;
}

void lora_expand(const at::Tensor &y, const at::Tensor &buffer, const at::Tensor &lora_b, const at::Tensor &lora_indices,
                 at::IntArrayRef slice_sizes) {
  lora_same_device({{"y", &y}, {"buffer", &buffer}, {"lora_b", &lora_b}, {"lora_indices", &lora_indices}});
  lora_rank(y, "y", 2, "[num_tokens, out_features]");
  lora_float(y, "y");
  lora_rank(buffer, "buffer", 2, "[num_tokens, num_slices * max_rank]");
  TORCH_CHECK_VALUE(buffer.scalar_type() == at::kFloat, "buffer has dtype ", py_dtype(buffer),
                    ", expected torch.float32 (lora_shrink's output)");
  TORCH_CHECK_VALUE(buffer.size(1) <= 1 || buffer.stride(1) == 1, "buffer has stride ", buffer.strides(),
                    ": its last dimension must be contiguous (stride 1)");
  const int64_t T = y.size(0);
  TORCH_CHECK_VALUE(buffer.size(0) == T, "buffer has shape ", py_shape(buffer), ", expected [", T,
                    ", num_slices * max_rank] (y's rows)");
  lora_weights(lora_b, "lora_b", y, "y", "[max_loras, out_features, max_rank]");
  const int64_t L = lora_b.size(0), N = lora_b.size(1), R = lora_b.size(2), S = (int64_t)slice_sizes.size();
  bool sizes_ok = S >= 1;
  int64_t total = 0;
  for (int64_t s : slice_sizes) {
    sizes_ok = sizes_ok && s >= 1;
    total += s;
  }
  TORCH_CHECK_VALUE(sizes_ok, "slice_sizes = ", slice_sizes, ", expected a non-empty list of positive ints (each "
                    "slice's out_features)");
  TORCH_CHECK_VALUE(S * R == buffer.size(1), "buffer has shape ", py_shape(buffer), ", expected [", T, ", ", S * R,
                    "] (len(slice_sizes) = ", S, " slices of max_rank = ", R, ", lora_b.shape[2])");
  TORCH_CHECK_VALUE(total == N, "slice_sizes = ", slice_sizes, " sums to ", total, ", expected lora_b.shape[1] = ", N,
                    " (the slices' out_features)");
  TORCH_CHECK_VALUE(y.size(1) == N, "y has shape ", py_shape(y), ", expected [", T, ", ", N,
                    "] (lora_b's out_features)");
  lora_indices_meta(lora_indices, T, "y");
  const at::Tensor idx = lora_slots_checked(lora_indices, L);
  check_alloc(qwen_lora_expand(y.mutable_data_ptr(), y.stride(0), T, N, buffer.const_data_ptr<float>(),
                               buffer.stride(0), lora_b.const_data_ptr(), R, idx.const_data_ptr<int32_t>(),
                               slice_sizes.data(), S, lora_dtype_code(y), at::get_num_threads()),
              "lora_expand");
}

}  // namespace

// Registration is explicit, not a side effect of loading: qwen_ops.ops.registry calls
// qwen_register_cpu_kernels once (through ctypes) and keeps the handle for the process; the tests
// register a build of their own (portable loops, a forced product path) for their lifetime and
// unregister it, which brings back the kernels registered before.
extern "C" void *qwen_register_cpu_kernels() {
  auto *m = new torch::Library(torch::Library::IMPL, "qwen", c10::DispatchKey::CPU, __FILE__, __LINE__);
  m->impl("lora_shrink", &lora_shrink);
  m->impl("lora_expand", &lora_expand);
  m->impl("linear_a8_panels", &linear_a8_panels);
  m->impl("silu_mul_linear_a8_panels", &silu_mul_linear_a8_panels);
  m->impl("linear_int8", &linear_int8);
  m->impl("linear_int4", &linear_int4);
  m->impl("linear_int8_a8", &linear_int8_a8);
  m->impl("linear_int4_a8", &linear_int4_a8);
  m->impl("linear_fp8", &linear_fp8);
  m->impl("linear_packed", &linear_packed);
  m->impl("linear_silu_mul_packed", &linear_silu_mul_packed);
  m->impl("rms_norm", &rms_norm);
  m->impl("add_rms_norm", &add_rms_norm);
  m->impl("qk_norm_rope", &qk_norm_rope);
  m->impl("silu_mul", &silu_mul);
  m->impl("group_mins_add", &group_mins_add);
  m->impl("attention_block", &attention_block);
  m->impl("moe_packed", &moe_packed);
  return m;
}

extern "C" void qwen_unregister_cpu_kernels(void *handle) { delete static_cast<torch::Library *>(handle); }
