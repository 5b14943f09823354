// The CUDA kernels' switches in the environment (SHARDKIT_EMA_V1, the fused kernels' variants),
// read on every call so that one process can time both settings.
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <string>

namespace shardkit {

// "1" -> true, "0" -> false, unset or empty -> `fallback`; anything else warns once (naming
// `fallback_means`, what the fallback does) and gives `fallback`.
inline bool env_flag(const char* name, bool fallback, const char* fallback_means) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  if (std::strcmp(v, "1") == 0) return true;
  if (std::strcmp(v, "0") == 0) return false;
  TORCH_WARN_ONCE(name, "=", v, " is neither 0 nor 1: ", fallback_means);
  return fallback;
}

// A variant chosen by name: unset, empty or `usual` -> false, `other` -> true; anything else
// warns (once per variable) that `usual` runs and gives false.
inline bool env_choice(const char* name, const char* usual, const char* other) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0' || std::strcmp(v, usual) == 0) return false;
  if (std::strcmp(v, other) == 0) return true;
  static std::mutex mu;
  static std::set<std::string> warned;
  {
    const std::lock_guard<std::mutex> lock(mu);
    if (!warned.insert(name).second) return false;
  }
  TORCH_WARN(name, "=", v, " is neither ", usual, " nor ", other, ": ", usual, " runs");
  return false;
}

}  // namespace shardkit
