// See lora_setup.h.
#include "lora_setup.h"

#include <cinttypes>
#include <cstdio>
#include <set>
#include <stdexcept>

#include "base/file_io.h"
#include "fsdp/checkpoint.h"
#include "base/strings.h"
#include "fsdp/errors.h"

namespace train {
namespace {

using nlohmann::json;

json read_adapter_config(const std::string& dir) {
  const std::string path = fsdp::io::join(dir, "adapter_config.json");
  if (!fsdp::io::exists(path)) {
    throw std::invalid_argument("config: lora.adapter_from=" + dir +
                                ": no adapter_config.json there (a PEFT adapter directory holds adapter_config.json "
                                "and adapter_model.safetensors)");
  }
  json j = json::parse(fsdp::io::read_small_file(path), nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) throw std::invalid_argument("config: lora.adapter_from=" + dir + ": " + path + " is not JSON");
  return j;
}

// The adapter's r, lora_alpha and target_modules against the section's.
void check_adapter_config(const std::string& dir, const json& a, const LoraConfig& cfg) {
  auto differs = [&](const std::string& what, const json& theirs, const json& ours) {
    throw std::invalid_argument("config: lora.adapter_from=" + dir + ": the adapter's " + what + " is " +
                                theirs.dump() + " but this run's is " + ours.dump() +
                                " (set the lora section to the adapter's)");
  };
  if (a.value("peft_type", std::string()) != "LORA") differs("peft_type", a.value("peft_type", json()), "LORA");
  if (a.value("r", json()) != json(cfg.r)) differs("r (lora.r)", a.value("r", json()), cfg.r);
  if (!a.contains("lora_alpha") || !a["lora_alpha"].is_number() || a["lora_alpha"].get<double>() != cfg.alpha)
    differs("lora_alpha (lora.alpha)", a.value("lora_alpha", json()), cfg.alpha);
  if (a.value("use_rslora", false) || a.value("use_dora", false))
    differs("variant (use_rslora / use_dora)", true, false);
  const json targets = a.value("target_modules", json());
  std::set<std::string> theirs, ours(cfg.targets.begin(), cfg.targets.end());
  if (targets.is_array()) {
    for (const auto& t : targets)
      if (t.is_string()) theirs.insert(t.get<std::string>());
  }
  if (theirs != ours) differs("target_modules (lora.targets)", targets, cfg.targets);
}

}  // namespace

fsdp::LoraModel apply_lora(llama::LlamaForCausalLM& model, const LoraConfig& cfg, uint64_t seed) {
  try {
    return fsdp::lora(*model, cfg.options(), seed);
  } catch (const fsdp::ConfigError& e) {
    throw std::invalid_argument("config: lora.targets=" + json(cfg.targets).dump() + ": " + e.what());
  }
}

void load_peft_adapter(const std::string& dir, fsdp::FSDPModule& root, const LoraConfig& cfg, int rank) {
  check_adapter_config(dir, read_adapter_config(dir), cfg);
  const auto options = fsdp::checkpoint::ImportOptions()
                           .select(fsdp::is_lora_adapter)
                           .source_prefix("base_model.model.")
                           .file_name("adapter_model.safetensors");
  fsdp::checkpoint::ImportReport report;
  try {
    report = fsdp::checkpoint::import_weights(dir, root, options);
  } catch (const fsdp::CheckpointError& e) {
    throw std::invalid_argument("config: lora.adapter_from=" + dir +
                                ": the adapter does not fit this model (made for another base model, or other "
                                "targets?): " +
                                e.what());
  }
  if (rank == 0) {
    std::printf("lora: %s: %" PRId64 " adapter tensors (%s) from %zu file(s)\n", dir.c_str(), report.tensors,
                report.dtypes.c_str(), report.files.size());
    std::fflush(stdout);
  }
}

void check_lora_resume(const json& saved_extra, const LoraConfig& now, const std::string& checkpoint) {
  const json saved = saved_extra.is_object() && saved_extra.contains("config") && saved_extra["config"].is_object()
                         ? saved_extra["config"].value("lora", json())
                         : json();
  const bool was = saved.is_object() && saved.value("enabled", false);
  auto describe = [](bool on, const json& r, const json& targets) {
    return on ? "LoRA (lora.r=" + r.dump() + ", lora.targets=" + targets.dump() + ")" : std::string("no LoRA");
  };
  const std::string then = describe(was, saved.value("r", json()), saved.value("targets", json()));
  const std::string ours = describe(now.enabled, json(now.r), json(now.targets));
  const bool same =
      was == now.enabled &&
      (!was || (saved.value("r", json()) == json(now.r) && saved.value("targets", json()) == json(now.targets)));
  if (!same) {
    throw std::invalid_argument("checkpoint " + checkpoint + " was trained with " + then + " but this run has " + ours +
                                ": resume with the checkpoint's lora section (its train_state.json, "
                                "extra.config.lora)");
  }
}

bool holds_base(const json& saved_extra) {
  if (!saved_extra.is_object() || !saved_extra.contains("config") || !saved_extra["config"].is_object()) return true;
  const json lora = saved_extra["config"].value("lora", json());
  if (!lora.is_object() || !lora.value("enabled", false)) return true;
  return lora.value("save_base", false);
}

}  // namespace train
