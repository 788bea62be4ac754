// Index arithmetic shared by the CUDA kernels and by host-side tests.
//
// Everything here is plain integer math on int64, marked __host__ __device__ under nvcc and
// plain inline under g++, so tests/test_cuda_ext.py can compile this header with g++ (no CUDA,
// no torch) and through the extension's CPU test ops, and compare it with the Python reference.
//
// Layout (DESIGN.md section 3): slot s, position p lives in physical block
// block_table[s, p / block_size], row p % block_size.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define QWEN_HD __host__ __device__ __forceinline__
#else
#define QWEN_HD inline
#endif

namespace qwen_index {

QWEN_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
QWEN_HD int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }
QWEN_HD int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
QWEN_HD int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

// Column of block_table holding position p, and the row inside that block.
QWEN_HD int64_t block_column(int64_t position, int64_t block_size) { return position / block_size; }
QWEN_HD int64_t block_row(int64_t position, int64_t block_size) { return position % block_size; }

// The same in 32 bits, as the kernels compute it (a slot holds fewer than 2^31 positions).
QWEN_HD uint32_t block_column_u32(uint32_t position, uint32_t block_size) { return position / block_size; }

// Positions a slot can hold: block_table columns x block_size.
QWEN_HD int64_t slot_capacity(int64_t max_blocks_per_slot, int64_t block_size) {
  return max_blocks_per_slot * block_size;
}

// Absolute position of query row j of a sequence with q_len query rows and seq_len cached
// keys (after this step's write): seq_len - q_len + j. It attends to keys <= that position.
QWEN_HD int64_t query_position(int64_t seq_len, int64_t q_len, int64_t j) { return seq_len - q_len + j; }

// Keys a tile of query rows [row_begin, row_end) must visit: [0, key_end), where key_end is
// one past the causal horizon of the tile's last real row, never past seq_len. Rows at or past
// q_len are padding of the tile. Returns 0 when the tile has no real row.
QWEN_HD int64_t tile_key_end(int64_t seq_len, int64_t q_len, int64_t row_begin, int64_t row_end) {
  const int64_t last = min64(row_end, q_len) - 1;
  if (last < row_begin) return 0;
  const int64_t end = query_position(seq_len, q_len, last) + 1;
  return end < 0 ? 0 : min64(end, seq_len);
}

// Flash-decoding split of one sequence's keys [0, seq_len) into num_splits ranges of
// split_len keys, split_len a multiple of `align` (the kernel's key tile) and at least align.
// Split s covers [s * split_len, min((s + 1) * split_len, seq_len)); a split whose start is at
// or past seq_len is empty. num_splits is fixed from static shapes (CUDA-graph safe); each
// sequence divides its own length on the device.
QWEN_HD int64_t split_len(int64_t seq_len, int64_t num_splits, int64_t align) {
  return max64(align, round_up(ceil_div(max64(seq_len, 1), num_splits), align));
}
QWEN_HD int64_t split_begin(int64_t seq_len, int64_t num_splits, int64_t align, int64_t split) {
  return min64(split * split_len(seq_len, num_splits, align), seq_len);
}
QWEN_HD int64_t split_end(int64_t seq_len, int64_t num_splits, int64_t align, int64_t split) {
  return min64((split + 1) * split_len(seq_len, num_splits, align), seq_len);
}

// Host-side choice of the number of decode splits, from static shapes only (never from
// seq_lens on the device, so the launch is CUDA-graph capturable):
//   base_blocks   thread blocks without splitting (num_seqs x kv-head chunks);
//   capacity      positions a slot can hold (an upper bound on every seq_len);
//   num_sms       streaming multiprocessors of the device;
//   min_split     fewest keys worth a split of their own.
// Aims at about four thread blocks per SM, so long contexts at small batch still fill the GPU,
// and never makes more splits than capacity / min_split or max_splits.
QWEN_HD int64_t num_decode_splits(int64_t base_blocks, int64_t capacity, int64_t num_sms,
                                  int64_t min_split, int64_t max_splits) {
  if (base_blocks <= 0) return 1;
  const int64_t wanted = ceil_div(4 * max64(num_sms, 1), base_blocks);
  const int64_t by_length = max64(1, ceil_div(capacity, max64(min_split, 1)));
  return max64(1, min64(min64(wanted, by_length), max_splits));
}

// Query heads handled by one decode thread block: the GQA group (query heads per KV head) is
// cut into chunks of at most `heads_per_block` heads. Chunk c covers group heads
// [c * heads_per_block, min((c + 1) * heads_per_block, group)).
QWEN_HD int64_t num_head_chunks(int64_t group, int64_t heads_per_block) {
  return ceil_div(group, heads_per_block);
}

}  // namespace qwen_index
