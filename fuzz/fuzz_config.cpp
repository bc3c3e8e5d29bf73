// libFuzzer target: fsdp-train's config and command line (apps/fsdp-train/config.cpp, flags.cpp).
// The first byte picks the mode: even = the input is a config file's text (parsed as
// read_config_file does, then build_config), odd = the rest is a command line, arguments separated
// by NUL bytes (parse_flags, then build_config with its overrides; --config is ignored so the
// fuzzer never opens files). Besides the sanitizers' findings, a crash is: an exception other than
// std::invalid_argument (the trainer's "config or usage error", exit status 2), or an accepted
// config that does not survive to_json -> from_json unchanged.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "config.h"
#include "flags.h"

using nlohmann::json;

namespace {

void check_round_trip(const train::TrainConfig& c) {
  const json once = c.to_json();
  const json again = train::TrainConfig::from_json(once).to_json();
  if (once != again) std::abort();
}

void fuzz_file(const std::string& text) {
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::exception&) {
    return;  // read_config_file turns this into std::invalid_argument naming the file
  }
  if (!doc.is_object()) return;
  try {
    check_round_trip(train::build_config(doc, {}));
  } catch (const std::invalid_argument&) {
  }
}

void fuzz_flags(const std::string& text) {
  std::vector<std::string> args{"fsdp-train"};
  std::string cur;
  for (char ch : text) {
    if (ch == '\0') {
      args.push_back(cur);
      cur.clear();
    } else {
      cur.push_back(ch);
    }
  }
  args.push_back(cur);
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  try {
    train::Flags flags = train::parse_flags(static_cast<int>(argv.size()), argv.data());
    check_round_trip(train::build_config(json(), flags.overrides));
  } catch (const std::invalid_argument&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) {
    fuzz_file(text);
  } else {
    fuzz_flags(text);
  }
  return 0;
}
