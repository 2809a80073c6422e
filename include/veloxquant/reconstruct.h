// Context-reconstruction scoring (KVzip's idea; docs/design.md §C3): a question-agnostic score
// for every row a prompt left in the caches, from how much the model attends to it while it
// re-reads the prompt.
//
// prefill_reconstruct prefills the prompt into the caches (the chunks of
// veloxquant/prefill_schedule.h) while a full-precision copy of every layer's rows is kept aside,
// then runs the reconstruction pass on that copy only: for each chunk of `chunk` prompt tokens,
// the repeat prompt followed by that chunk of the prompt itself, teacher-forced, one forward call
// at the positions after the prompt. The score of prompt row j in (layer, KV head h) is the
// largest softmax weight any query of any reconstruction pass in any query head of h's group
// gives it (snap_max_attention of veloxquant/snapkv.h). The reconstruction rows are never kept:
// the copy drops them after each chunk and the caches never see them. Caches that take external
// scores (KVCache::takes_external_scores: SnapKV with snap_scoring = external) get their layer's
// scores, then every cache's end_prompt() runs.
//
// Cost: the prompt's prefill plus a second pass over n + ceil(n / chunk) * |repeat| tokens (about
// 2x prefill) and one fp32 copy of the layer's K/V rows aside. Batch 1; models with a sliding
// window are refused (the score would read rows the window hides).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "veloxquant/cache.h"
#include "veloxquant/model.h"

namespace vq {

struct ReconstructOptions {
  std::vector<int32_t> repeat_ids;  // the repeat prompt (no BOS); may be empty
  // Prompt rows re-read per reconstruction pass; each pass sits at positions
  // [n, n + |repeat| + chunk), so n + |repeat| + chunk should stay within the model's context.
  int64_t chunk = 128;
  // Whether the prompt's first row (the special prefix, BOS) is re-read too.
  bool include_first = false;
  int64_t prefill_step = 512;
  DType kv_dtype = DType::kF16;
  MatmulPrecision matmul = MatmulPrecision::kExact;
};

// Scores [layer][B = 1, H_kv, n] (row order = position order). Fills *last_logits with the
// prompt's last position's logits when non-null. Bad arguments: vq::Error before any cache changes.
std::vector<std::vector<float>> prefill_reconstruct(
    const Model& model, const int32_t* prompt, int64_t n,
    const std::vector<std::unique_ptr<KVCache>>& caches, const ReconstructOptions& opts,
    std::vector<float>* last_logits, ForwardScratch* scratch = nullptr);

}  // namespace vq
