// See init_from.h.
#include "init_from.h"

#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <set>
#include <stdexcept>

#include "fsdp/checkpoint.h"
#include "hf.h"

namespace train {

nlohmann::json with_hf_model(const std::string& hf_dir, nlohmann::json doc,
                             const std::vector<std::pair<std::string, std::string>>& overrides) {
  const llama::LlamaConfig hf = llama::hf::read_hf_config(hf_dir);
  const std::set<std::string> allowed = {"attn_implementation", "vocab_size"};
  const std::string allowed_text = "model.attn_implementation and model.vocab_size";
  nlohmann::json model = hf.to_json();
  if (doc.is_object() && doc.contains("model")) {
    const auto& user = doc["model"];
    if (!user.is_object()) throw std::invalid_argument("config: model must be an object");
    for (const auto& [key, value] : user.items()) {
      if (!allowed.count(key)) {
        throw std::invalid_argument("config: model." + key + " is set, but with --init-from " + hf_dir +
                                    " the model comes from its config.json (only " + allowed_text + " may be set)");
      }
      model[key] = value;
    }
  }
  for (const auto& [key, value] : overrides) {
    if (key.rfind("model.", 0) == 0 && !allowed.count(key.substr(6))) {
      throw std::invalid_argument("--set " + key + ": with --init-from " + hf_dir +
                                  " the model comes from its config.json (only " + allowed_text + " may be set)");
    }
  }
  if (!doc.is_object()) doc = nlohmann::json::object();
  doc["model"] = model;
  return doc;
}

void check_hf_vocab(const std::string& hf_dir, int64_t vocab_size) {
  const int64_t hf_vocab = llama::hf::read_hf_config(hf_dir).vocab_size;
  if (vocab_size >= hf_vocab) return;
  throw std::invalid_argument("config: model.vocab_size=" + std::to_string(vocab_size) + " is smaller than " + hf_dir +
                              "/config.json's vocab_size " + std::to_string(hf_vocab) +
                              ": the vocabulary can grow (new rows are added) but not shrink, which would drop the "
                              "rows of trained tokens; set model.vocab_size to at least " +
                              std::to_string(hf_vocab) + " or leave it out");
}

nlohmann::json import_hf_weights(const std::string& hf_dir, fsdp::FSDPModule& root, int rank, int64_t vocab_size,
                                 std::function<bool(const std::string&)> select, bool codes_in_place) {
  const int64_t hf_vocab = llama::hf::read_hf_config(hf_dir).vocab_size;
  fsdp::checkpoint::ImportOptions options;
  options.select(std::move(select)).codes_in_place(codes_in_place);
  if (vocab_size > hf_vocab) options.grow_rows({"model.embed_tokens.weight", "lm_head.weight"});
  const auto report = fsdp::checkpoint::import_weights(hf_dir, root, options);
  if (rank == 0) {
    std::printf("init: %s: %" PRId64 " tensors (%s, %.1f MiB) from %zu file(s); rank 0 read %.1f MiB of them\n",
                hf_dir.c_str(), report.tensors, report.dtypes.c_str(),
                static_cast<double>(report.total_bytes) / (1 << 20), report.files.size(),
                static_cast<double>(report.bytes_read) / (1 << 20));
    for (const auto& g : report.grown) {
      std::printf("init: grew %s (model.vocab_size %" PRId64 " > %" PRId64
                  "): each new row is the mean of the pretrained rows (transformers' resize_token_embeddings "
                  "default, without its 1e-9-scaled noise)\n",
                  g.c_str(), vocab_size, hf_vocab);
    }
    std::fflush(stdout);
  }
  return init_from_record(hf_dir, vocab_size);
}

nlohmann::json init_from_record(const std::string& hf_dir, int64_t vocab_size) {
  char* real = ::realpath(hf_dir.c_str(), nullptr);
  const std::string dir = real != nullptr ? real : hf_dir;
  std::free(real);
  return {{"dir", dir}, {"vocab_size", llama::hf::read_hf_config(hf_dir).vocab_size}, {"model_vocab_size", vocab_size}};
}

bool bnb_4bit_source(const std::string& hf_dir) {
  const bool file = hf_dir.size() > 5 && hf_dir.compare(hf_dir.size() - 5, 5, ".json") == 0;
  std::ifstream in(file ? hf_dir : hf_dir + "/config.json");
  const nlohmann::json doc = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  return doc.is_object() && doc.contains("quantization_config");
}

}  // namespace train
