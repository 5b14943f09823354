// The CUDA kernels' switches in the environment (SHARDKIT_EMA_V1, SHARDKIT_FUSED, SHARDKIT_FUSED_PDL),
// read on every call so that one process can time both settings.
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>

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

}  // namespace shardkit
