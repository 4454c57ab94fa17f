// The switches that change a kernel choice (selection.h's Overrides): the environment's, read
// here and nowhere else, and the process-wide setters of tests and timing.
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "selection.h"

namespace gemmfuse::cuda {

namespace {

// A path is on unless its variable is "0".
bool switched_off(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, "0") == 0;
}

// A path that is off by default is on where its variable is "1".
bool switched_on(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, "1") == 0;
}

// The setters' values; -1: not set (the environment's, or the default, applies).
std::atomic<int> g_fused_softmax{-1}, g_register_rows{-1}, g_register_wide_threads{-1},
    g_register_one_value{-1}, g_fused_colstats{-1}, g_vector_colstats{-1}, g_f16x3_padded_n{-1},
    g_group_norm_lanes8{-1};

void apply_set(const std::atomic<int>& set, bool* field) {
  const int v = set.load();
  if (v >= 0) *field = v != 0;
}

}  // namespace

Overrides Overrides::from_environment() {
  Overrides o;
  o.f16x3 = !switched_off("GEMMFUSE_F16X3");
  o.fused_softmax = !switched_off("GEMMFUSE_FUSED_SOFTMAX");
  o.sm90_programmatic = !switched_off("GEMMFUSE_SM90_PDL");
  o.sm90_defer = !switched_off("GEMMFUSE_SM90_DEFER");
  o.f16x3_padded_n = switched_on("GEMMFUSE_F16X3_PADDED_N");
  o.group_norm_lanes8 = switched_on("GEMMFUSE_GN_LANES8");
  return o;
}

std::vector<std::string> Overrides::set() const {
  const Overrides d;
  std::vector<std::string> s;
  if (f16x3 != d.f16x3) s.push_back("GEMMFUSE_F16X3=0");
  if (fused_softmax != d.fused_softmax) s.push_back("GEMMFUSE_FUSED_SOFTMAX=0 (or set_fused_softmax)");
  if (sm90_programmatic != d.sm90_programmatic) s.push_back("GEMMFUSE_SM90_PDL=0");
  if (sm90_defer != d.sm90_defer) s.push_back("GEMMFUSE_SM90_DEFER=0");
  if (register_rows != d.register_rows) s.push_back("set_register_rows(false)");
  if (register_wide_threads != d.register_wide_threads)
    s.push_back("set_register_wide_threads(" + std::to_string(register_wide_threads) + ")");
  if (register_one_value != d.register_one_value) s.push_back("set_register_one_value(false)");
  if (fused_colstats != d.fused_colstats)
    s.push_back("set_fused_colstats(" + std::to_string(fused_colstats) + ")");
  if (vector_colstats != d.vector_colstats) s.push_back("set_vector_colstats(false)");
  if (f16x3_padded_n != d.f16x3_padded_n) s.push_back("GEMMFUSE_F16X3_PADDED_N=1 (or set_f16x3_padded_n)");
  if (group_norm_lanes8 != d.group_norm_lanes8) s.push_back("GEMMFUSE_GN_LANES8=1 (or set_group_norm_lanes8)");
  return s;
}

bool Overrides::operator==(const Overrides& o) const {
  return f16x3 == o.f16x3 && fused_softmax == o.fused_softmax &&
         sm90_programmatic == o.sm90_programmatic && sm90_defer == o.sm90_defer &&
         register_rows == o.register_rows && register_wide_threads == o.register_wide_threads &&
         register_one_value == o.register_one_value && fused_colstats == o.fused_colstats &&
         vector_colstats == o.vector_colstats && f16x3_padded_n == o.f16x3_padded_n &&
         group_norm_lanes8 == o.group_norm_lanes8;
}

Overrides current_overrides() {
  static const Overrides env = Overrides::from_environment();
  Overrides o = env;
  apply_set(g_fused_softmax, &o.fused_softmax);
  apply_set(g_register_rows, &o.register_rows);
  apply_set(g_register_one_value, &o.register_one_value);
  apply_set(g_vector_colstats, &o.vector_colstats);
  apply_set(g_f16x3_padded_n, &o.f16x3_padded_n);
  apply_set(g_group_norm_lanes8, &o.group_norm_lanes8);
  if (const int t = g_register_wide_threads.load(); t >= 0) o.register_wide_threads = t;
  if (const int m = g_fused_colstats.load(); m >= 0) o.fused_colstats = m;
  return o;
}

void set_fused_softmax(bool on) { g_fused_softmax.store(on ? 1 : 0); }
void set_register_rows(bool on) { g_register_rows.store(on ? 1 : 0); }
void set_register_wide_threads(int threads) { g_register_wide_threads.store(threads == 256 ? 256 : 512); }
void set_register_one_value(bool on) { g_register_one_value.store(on ? 1 : 0); }
void set_fused_colstats(int mode) { g_fused_colstats.store(mode); }
void set_f16x3_padded_n(bool on) { g_f16x3_padded_n.store(on ? 1 : 0); }
void set_group_norm_lanes8(bool on) { g_group_norm_lanes8.store(on ? 1 : 0); }
void set_vector_colstats(bool on) { g_vector_colstats.store(on ? 1 : 0); }

}  // namespace gemmfuse::cuda
