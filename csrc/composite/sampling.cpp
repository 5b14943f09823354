// PartialFC class sampling for one shard, written with ATen calls so one implementation
// serves every device (registered for CompositeExplicitAutograd: CPU and CUDA tensors run
// the same code, on their own device, without host syncs).
//
// Every positive class of the shard (a label of the global batch that falls in
// [class_offset, class_offset + num_local)) gets the score 2, every other class a uniform
// score in [0, 1); the num_sample highest scores are kept. So all positives are in (the
// caller picks num_sample >= the number of distinct labels the batch can have) and the
// remaining slots are a uniformly random subset of the negatives. The kept local ids are
// sorted, so the sampled weight rows stay in class order.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>

namespace {

std::tuple<at::Tensor, at::Tensor> partial_fc_sample(const at::Tensor& labels, int64_t class_offset,
                                                     int64_t num_local, int64_t num_sample,
                                                     std::optional<at::Generator> generator) {
  TORCH_CHECK(labels.scalar_type() == at::kLong, "argument `labels` must be int64, got ",
              labels.scalar_type());
  TORCH_CHECK(labels.dim() == 1, "argument `labels` must be 1-D [B], got ", labels.dim(), " dimensions");
  TORCH_CHECK(num_local >= 0, "argument `num_local` must be >= 0, got ", num_local);
  TORCH_CHECK(num_sample >= 0 && num_sample <= num_local,
              "argument `num_sample` must be in [0, num_local=", num_local, "], got ", num_sample);
  TORCH_CHECK(class_offset >= 0, "argument `class_offset` must be >= 0, got ", class_offset);
  // Every positive must fit, or its row would silently lose its target: the batch can have
  // up to min(B, num_local) distinct positives in this shard (a host-known bound, no sync).
  const int64_t most_positives = std::min<int64_t>(labels.size(0), num_local);
  TORCH_CHECK(num_sample >= most_positives, "argument `num_sample` must be >= min(B=", labels.size(0),
              ", num_local=", num_local, ") = ", most_positives,
              " so that every positive class of the batch fits, got ", num_sample);
  // at::rand would reject a generator of another device type with a message that names
  // no argument (a CPU generator for CUDA labels is the easy mistake); one of another
  // CUDA device would silently draw from that device's stream.
  if (generator.has_value() && generator->defined()) {
    const auto gen_device = generator->device();
    TORCH_CHECK(gen_device.type() == labels.device().type() &&
                    (!gen_device.has_index() || !labels.device().has_index() ||
                     gen_device.index() == labels.device().index()),
                "argument `generator` must be a generator of the labels' device ", labels.device(),
                ", got one of ", gen_device);
  }
  const auto long_opts = labels.options();
  // Local id of each row's label, or the dummy slot num_local for labels of other shards
  // (and ignore_index): the dummy slot absorbs their writes without a boolean mask, whose
  // nonzero() would sync the host with the device.
  const at::Tensor local = labels - class_offset;
  const at::Tensor mine = local.ge(0).logical_and(local.lt(num_local));
  const at::Tensor slot = at::where(mine, local, at::full({}, num_local, long_opts));
  at::Tensor scores = at::rand({num_local + 1}, generator, labels.options().dtype(at::kFloat));
  scores.scatter_(0, slot, 2.0);
  at::Tensor picked = std::get<1>(scores.narrow(0, 0, num_local).topk(num_sample, 0, true, false));
  at::Tensor index = std::get<0>(picked.sort());
  // Position of each kept class in the sampled set; -1 for every other slot.
  at::Tensor position = at::full({num_local + 1}, -1, long_opts);
  position.scatter_(0, index, at::arange(num_sample, long_opts));
  at::Tensor remapped = position.index_select(0, slot);
  return {index, remapped};
}

}  // namespace

TORCH_LIBRARY_IMPL(shardkit, CompositeExplicitAutograd, m) {
  m.impl("partial_fc_sample", &partial_fc_sample);
}
