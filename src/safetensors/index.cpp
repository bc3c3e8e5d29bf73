// Reading, writing and cross-checking `model.safetensors.index.json`.
//
// The index is small and its "metadata" is free-form, so it is parsed to a DOM, but through a
// parser callback that refuses duplicate keys (a DOM silently keeps the last one, which would let
// two writers' views of a file set disagree unnoticed) and deep nesting (copying or printing a
// DOM recurses once per level).
#include "safetensors/index.h"

#include <set>

#include "fsdp/errors.h"

namespace fsdp {
namespace safetensors {
namespace {

using Json = nlohmann::json;

constexpr int kMaxIndexDepth = 64;

[[noreturn]] void fail(const std::string& label, const std::string& what) {
  throw CheckpointError("fsdp: checkpoint index " + label + ": " + what);
}

[[noreturn]] void fail_dir(const std::string& label, const std::string& what) {
  throw CheckpointError("fsdp: checkpoint dir " + label + ": " + what);
}

Json parse_strict(const std::string& label, const std::string& text) {
  const size_t bad = first_invalid_utf8(text);
  if (bad != std::string::npos) {
    fail(label, "not valid UTF-8 (bad byte at offset " + std::to_string(bad) + ")");
  }
  // nlohmann's lexer takes a NUL for the end of input; valid JSON has none outside escapes.
  const size_t nul = text.find('\0');
  if (nul != std::string::npos) fail(label, "has a NUL byte at offset " + std::to_string(nul));
  // Keys seen so far in each open object, innermost last. Keys only ever belong to the innermost
  // open container, and that is an object whenever a key event arrives.
  std::vector<std::set<std::string>> open_objects;
  int depth = 0;
  auto callback = [&](int, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start: open_objects.emplace_back(); [[fallthrough]];
      case Json::parse_event_t::array_start:
        if (++depth > kMaxIndexDepth) {
          fail(label, "nested deeper than " + std::to_string(kMaxIndexDepth) + " levels");
        }
        break;
      case Json::parse_event_t::object_end: open_objects.pop_back(); [[fallthrough]];
      case Json::parse_event_t::array_end: --depth; break;
      case Json::parse_event_t::key: {
        const std::string& key = parsed.get_ref<const std::string&>();
        if (!open_objects.back().insert(key).second) {
          fail(label, "key " + quote_name(key) + " appears twice in one object");
        }
        break;
      }
      default: break;
    }
    return true;
  };
  try {
    return Json::parse(text, callback);
  } catch (const Json::exception& e) {
    fail(label, std::string("not valid JSON: ") + e.what());
  }
}

// "an array", "a number", ...: what a value is, for messages.
std::string kind_of(const Json& value) {
  switch (value.type()) {
    case Json::value_t::null: return "null";
    case Json::value_t::object: return "an object";
    case Json::value_t::array: return "an array";
    case Json::value_t::string: return "a string";
    case Json::value_t::boolean: return "a boolean";
    default: return "a number";
  }
}

}  // namespace

std::vector<std::string> Index::files() const {
  std::set<std::string> unique;
  for (const auto& kv : weight_map) unique.insert(kv.second);
  return {unique.begin(), unique.end()};
}

void check_file_name(const std::string& label, const std::string& tensor, const std::string& file) {
  const char* why = nullptr;
  if (file.empty()) why = "is empty";
  else if (file == "." || file == "..") why = "names a directory";
  else if (file.find('\0') != std::string::npos) why = "contains a NUL byte";
  else if (file.find('/') != std::string::npos || file.find('\\') != std::string::npos)
    why = "is a path, not a plain file name in the checkpoint directory";
  if (why != nullptr) {
    fail(label, "tensor " + quote_name(tensor) + ": file name " + quote_name(file) + " " + why);
  }
}

Index parse_index(const std::string& label, const std::string& text) {
  const Json root = parse_strict(label, text);
  if (!root.is_object()) fail(label, "is " + kind_of(root) + ", not a JSON object");
  Index index;
  bool has_weight_map = false;
  for (const auto& item : root.items()) {
    if (item.key() == "metadata") {
      if (!item.value().is_object()) {
        fail(label, "metadata is " + kind_of(item.value()) + ", not an object");
      }
      index.metadata = item.value();
    } else if (item.key() == "weight_map") {
      if (!item.value().is_object()) {
        fail(label, "weight_map is " + kind_of(item.value()) + ", not an object");
      }
      has_weight_map = true;
      for (const auto& entry : item.value().items()) {
        if (!entry.value().is_string()) {
          fail(label, "tensor " + quote_name(entry.key()) + ": file is " + kind_of(entry.value()) + ", not a string");
        }
        const std::string& file = entry.value().get_ref<const std::string&>();
        check_file_name(label, entry.key(), file);
        index.weight_map.emplace(entry.key(), file);
      }
    } else {
      fail(label,
           "unexpected key " + quote_name(item.key()) + " (an index holds only \"metadata\" and \"weight_map\")");
    }
  }
  if (!has_weight_map) fail(label, "has no weight_map");
  return index;
}

std::string index_to_json(const Index& index) {
  const std::string label = "(being written)";
  if (!index.metadata.is_object()) {
    fail(label, "metadata is " + kind_of(index.metadata) + ", not an object");
  }
  for (const auto& kv : index.weight_map) check_file_name(label, kv.first, kv.second);
  Json root = Json::object();
  root["metadata"] = index.metadata;
  root["weight_map"] = index.weight_map;
  try {
    return root.dump(2) + "\n";
  } catch (const Json::exception& e) {  // a string that is not valid UTF-8
    fail(label, std::string("cannot be written as JSON: ") + e.what());
  }
}

void check_index_against_headers(const std::string& dir_label, const Index& index,
                                 const std::map<std::string, Header>& headers_by_file) {
  for (const auto& kv : index.weight_map) {
    if (headers_by_file.count(kv.second) == 0) {
      fail_dir(dir_label, "file " + quote_name(kv.second) + " is missing (the index lists tensor " +
                              quote_name(kv.first) + " in it)");
    }
  }
  // Which file holds each tensor; a second holder is an error whatever the index says.
  std::map<std::string, const std::string*> holder;
  for (const auto& file_header : headers_by_file) {
    for (const TensorEntry& e : file_header.second.tensors) {
      const auto inserted = holder.emplace(e.name, &file_header.first);
      if (!inserted.second) {
        fail_dir(dir_label, "tensor " + quote_name(e.name) + " is in two files, " +
                                quote_name(*inserted.first->second) + " and " + quote_name(file_header.first));
      }
    }
  }
  for (const auto& kv : index.weight_map) {
    const auto it = holder.find(kv.first);
    if (it == holder.end()) {
      fail_dir(dir_label, "tensor " + quote_name(kv.first) + " is listed in the index under file " +
                              quote_name(kv.second) + ", which does not hold it");
    }
    if (*it->second != kv.second) {
      fail_dir(dir_label, "tensor " + quote_name(kv.first) + " is listed in the index under file " +
                              quote_name(kv.second) + " but is held by file " + quote_name(*it->second));
    }
  }
  for (const auto& kv : holder) {
    if (index.weight_map.count(kv.first) == 0) {
      fail_dir(dir_label,
               "tensor " + quote_name(kv.first) + " in file " + quote_name(*kv.second) + " is not in the index");
    }
  }
}

}  // namespace safetensors
}  // namespace fsdp
