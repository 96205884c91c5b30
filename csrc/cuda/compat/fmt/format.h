// metal-attn: a stand-in for {fmt}'s format.h, which MLX's CUDA headers include but its wheel does
// not ship. Only `fmt::format` with sequential "{}" fields is provided: the one form those headers use.
#pragma once

#include <sstream>
#include <string>
#include <string_view>

namespace fmt {

namespace detail {
inline void format_rest(std::ostringstream& out, std::string_view f) { out << f; }

template <typename A, typename... Rest>
void format_rest(std::ostringstream& out, std::string_view f, const A& a, const Rest&... rest) {
  auto at = f.find("{}");
  if (at == std::string_view::npos) {
    out << f;
    return;
  }
  out << f.substr(0, at) << a;
  format_rest(out, f.substr(at + 2), rest...);
}
}  // namespace detail

template <typename... Args>
std::string format(std::string_view f, const Args&... args) {
  std::ostringstream out;
  detail::format_rest(out, f, args...);
  return out.str();
}

}  // namespace fmt
