// Enums with names: one table per enum, of rows {value, name} (Named<E>), that conversions either
// way and messages listing the names all read. A row may be any struct with `value` and `name`
// members, so a table can carry more columns (safetensors' dtypes: the item size). Plain C++;
// fsdp-train's options use it too (apps/fsdp-train/named.h).
//   constexpr base::Named<Tier> kTiers[] = {{Tier::kNone, "none"}, {Tier::kDisk, "disk"}};
//   name_of(kTiers, Tier::kDisk, "unknown") == "disk", value_of(kTiers, "none") == Tier::kNone,
//   names_text(kTiers) == "none or disk"
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace fsdp::base {

template <class E>
struct Named {
  E value;
  const char* name;
};

// The row of `value`, or nullptr when the table has none (a value cast from a stray integer).
template <class Row, size_t N>
constexpr const Row* row_of(const Row (&table)[N], decltype(Row::value) value) {
  for (const Row& row : table) {
    if (row.value == value) return &row;
  }
  return nullptr;
}

// The name of `value`, or `unknown` when the table has no row for it.
template <class Row, size_t N>
constexpr const char* name_of(const Row (&table)[N], decltype(Row::value) value, const char* unknown) {
  const Row* row = row_of(table, value);
  return row != nullptr ? row->name : unknown;
}

// The value named exactly `name`, or nullopt when the table has none.
template <class Row, size_t N>
std::optional<decltype(Row::value)> value_of(const Row (&table)[N], std::string_view name) {
  for (const Row& row : table) {
    if (name == row.name) return row.value;
  }
  return std::nullopt;
}

// The names in table order, for a message: "a, b or c".
template <class Row, size_t N>
std::string names_text(const Row (&table)[N]) {
  std::string out;
  for (size_t i = 0; i < N; ++i) out += (i == 0 ? "" : i + 1 == N ? " or " : ", ") + std::string(table[i].name);
  return out;
}

}  // namespace fsdp::base
