// explain's view of a Selection (selection.h): one line per choice with its reason, and the
// overrides that are set.
#include <string>

#include "selection.h"

namespace gemmfuse::cuda {

const char* row_kind_name(RowKind k) {
  switch (k) {
    case RowKind::None: return "none";
    case RowKind::Register: return "register kernel";
    case RowKind::Warp: return "interpreter (warp per row)";
    case RowKind::Block: return "interpreter (CTA per row)";
    case RowKind::Scratch: return "interpreter (global scratch rows)";
  }
  return "?";
}

std::string Selection::describe() const {
  std::string s;
  auto line = [&s](const std::string& text) {
    if (!s.empty()) s += '\n';
    s += "cuda: " + text;
  };
  if (fused.matches) line(fused.reason);
  if (!fused.used && gemm.kind != GemmKind::None)
    line("Gemm on " + std::string(gemm_kind_name(gemm.kind)) + ": " + gemm.reason);
  for (size_t i = 0; i < rows.size() && !fused.used; ++i)
    if (rows[i].kind != RowKind::None)
      line("step " + std::to_string(i) + " RowPass on the " + row_kind_name(rows[i].kind) + ": " +
           rows[i].reason);
  for (size_t i = 0; i < colstats.size(); ++i)
    if (colstats[i].kind != ColStatsKind::None)
      line("step " + std::to_string(i) + " ColumnStats: " + colstats[i].reason);
  const std::vector<std::string> set = overrides.set();
  if (!set.empty()) {
    std::string o;
    for (const std::string& v : set) o += (o.empty() ? "" : ", ") + v;
    line("overrides set: " + o);
  }
  return s;
}

std::string Selection::describe_backward() const {
  if (!backward.present) return "";
  std::string s = "cuda backward: " + backward.dw_reason + "; " + backward.dx_reason;
  if (!backward.rows_reason.empty()) s += "; " + backward.rows_reason;
  const std::vector<std::string> set = overrides.set();
  for (size_t i = 0; i < set.size(); ++i) s += (i == 0 ? " (overrides set: " : ", ") + set[i];
  if (!set.empty()) s += ")";
  return s;
}

}  // namespace gemmfuse::cuda
