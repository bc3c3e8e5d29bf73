// See init_from.h.
#include "init_from.h"

#include <cinttypes>
#include <cstdio>
#include <stdexcept>

#include "fsdp/checkpoint.h"
#include "hf.h"

namespace train {

nlohmann::json with_hf_model(const std::string& hf_dir, nlohmann::json doc,
                             const std::vector<std::pair<std::string, std::string>>& overrides) {
  const llama::LlamaConfig hf = llama::hf::read_hf_config(hf_dir);
  const std::string allowed = "attn_implementation";
  nlohmann::json model = hf.to_json();
  if (doc.is_object() && doc.contains("model")) {
    const auto& user = doc["model"];
    if (!user.is_object()) throw std::invalid_argument("config: model must be an object");
    for (const auto& [key, value] : user.items()) {
      if (key != allowed) {
        throw std::invalid_argument("config: model." + key + " is set, but with --init-from " + hf_dir +
                                    " the model comes from its config.json (only model." + allowed + " may be set)");
      }
      model[key] = value;
    }
  }
  for (const auto& [key, value] : overrides) {
    if (key.rfind("model.", 0) == 0 && key != "model." + allowed) {
      throw std::invalid_argument("--set " + key + ": with --init-from " + hf_dir +
                                  " the model comes from its config.json (only model." + allowed + " may be set)");
    }
  }
  if (!doc.is_object()) doc = nlohmann::json::object();
  doc["model"] = model;
  return doc;
}

void import_hf_weights(const std::string& hf_dir, fsdp::FSDPModule& root, int rank) {
  const auto report = fsdp::checkpoint::import_weights(hf_dir, root);
  if (rank != 0) return;
  std::printf("init: %s: %" PRId64 " tensors (%s, %.1f MiB) from %zu file(s); rank 0 read %.1f MiB of them\n",
              hf_dir.c_str(), report.tensors, report.dtypes.c_str(),
              static_cast<double>(report.total_bytes) / (1 << 20), report.files.size(),
              static_cast<double>(report.bytes_read) / (1 << 20));
  std::fflush(stdout);
}

}  // namespace train
