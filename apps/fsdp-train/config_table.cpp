// Reading and writing a config through the table of keys (config_fields.h): a section's rows,
// the dump of every key, and --help's list.
#include <algorithm>
#include <string>
#include <vector>

#include "config_fields.h"

namespace train {

using nlohmann::json;

namespace {

// The nested section of `section` that `row_section` lies in ("fsdp.offload" in "fsdp": "offload"), or "".
std::string nested_name(const std::string& section, const std::string& row_section) {
  if (row_section.size() <= section.size() + 1 || row_section.compare(0, section.size() + 1, section + ".") != 0) {
    return "";
  }
  const std::string rest = row_section.substr(section.size() + 1);
  return rest.substr(0, rest.find('.'));
}

}  // namespace

const json* section_object(const json& doc, const std::string& name) {
  if (!doc.contains(name)) return nullptr;
  const json& j = doc.at(name);
  if (!j.is_object()) reject(name, j, "must be an object");
  return &j;
}

void read_section(const json* obj, const std::string& section, TrainConfig& c,
                  const std::function<void(const std::string& nested)>& nested_done) {
  std::vector<std::string> known;
  for (const auto& f : config_fields()) {
    if (f.section == section) {
      known.push_back(f.key);
      if (obj != nullptr && obj->contains(f.key)) f.read(c, obj->at(f.key));
      continue;
    }
    const std::string nested = nested_name(section, f.section);
    if (nested.empty() || std::find(known.begin(), known.end(), nested) != known.end()) continue;
    known.push_back(nested);
    if (obj == nullptr || !obj->contains(nested)) continue;
    const json& sub = obj->at(nested);
    if (!sub.is_object()) reject(section + "." + nested, sub, "must be an object");
    read_section(&sub, section + "." + nested, c, nested_done);
    nested_done(section + "." + nested);
  }
  if (obj == nullptr) return;
  for (const auto& [k, v] : obj->items()) {
    if (std::find(known.begin(), known.end(), k) != known.end()) continue;
    std::string list;
    for (const auto& name : known) list += (list.empty() ? "" : ", ") + name;
    reject(section + "." + k, v, "unknown key (known keys in " + section + ": " + list + ")");
  }
}

json write_fields(const TrainConfig& c) {
  json j = json::object();
  for (const auto& f : config_fields()) {
    std::string path = "/" + f.section + "/" + f.key;
    for (char& ch : path)
      if (ch == '.') ch = '/';
    j[json::json_pointer(path)] = f.write(c);
  }
  return j;
}

std::string config_help() {
  const TrainConfig defaults;
  std::string out =
      "Config keys (--config FILE, --set KEY=VALUE), with what each accepts and its default:\n"
      "  model.*  transformers' config keys (models/llama/llama.h), plus attn_implementation (\"sdpa\" /\n"
      "           \"eager\") and dtype; the defaults:\n";
  const json model = defaults.model.to_json();
  for (const auto& [k, v] : model.items()) {
    out += "    model." + k + " = " + v.dump() + "\n";
  }
  for (const auto& f : config_fields()) {
    out += "  " + f.dotted() + " = " + f.write(defaults).dump() + "  (" + f.accepts + ")\n";
    out += "      " + f.help + "\n";
  }
  return out;
}

}  // namespace train
