// Rendering of the evaluation engine's results (veloxquant/eval.h) for the CLI: Markdown tables,
// CSV, JSON (written by `eval --json` and read back by `eval report`, so tables and charts can be
// re-rendered without re-running), peer rows from tools/peers/*.py merged into the tables, and
// SVG charts of quality against memory. The engine never renders; this library
// (vq_cli_report, tools/cli/report.cpp + svg_chart.cpp) is linked by the `veloxquant`
// executable and the tests.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "veloxquant/eval.h"

namespace vq {

// ---- reports ------------------------------------------------------------------------------------

enum class ReportFormat : uint8_t { kMarkdown, kJson, kCsv };

// Rows produced by a peer tool (tools/peers/*.py), merged into our tables marked as peers. JSON:
// {"tool": "kvpress 0.x", "text": [{"label": ..., "ppl": .., "delta_ppl_pct": .., "kld_mean": ..,
// "kld_p99": .., "bits_per_element": .., "ratio_to_fp16": ..}], "passkey": [{"label": ..,
// "aware": .., "agnostic": .., "kept_fraction": .., "ratio_to_fp16": ..}]} (accuracies in [0, 1];
// any field may be absent or null). Numbers are kept as given.
struct PeerRow {
  std::string label;
  std::map<std::string, double> values;      // field -> value (absent = not measured)
  std::map<std::string, std::string> notes;  // string fields (e.g. "note", "cache_type")
  bool has(const std::string& k) const { return values.count(k) != 0; }
};
struct PeerRows {
  std::string tool;
  std::vector<PeerRow> text, passkey;
};
// Reads one peer JSON file; several files merge with append_peer_rows.
PeerRows load_peer_rows(const std::string& path);
void append_peer_rows(PeerRows& into, const PeerRows& more);

std::string render(const TextEvalResult& r, ReportFormat f, const PeerRows* peers = nullptr);
// Results back from their JSON rendering (so tables and charts can be re-rendered, for example
// with peer rows added later, without re-running). Peers in the JSON are not read back.
TextEvalResult text_result_from_json(const std::string& json_text);
PasskeyResult passkey_result_from_json(const std::string& json_text);
std::string render(const AttnErrorResult& r, ReportFormat f);
std::string render(const PasskeyResult& r, ReportFormat f, const PeerRows* peers = nullptr);

// The side-by-side table of compare_methods (`veloxquant compare`): method, its answer (the
// decoded continuation answers[i], on one line), whether it contains `expected` (column shown
// only when expected is not empty), the cache's bytes (accounted, KiB/MiB) and their ratio to the
// fp16 bytes of every token seen, with how many times smaller, then resident / fp16. Markdown.
std::string render_compare(const CompareResult& r, const std::vector<std::string>& answers,
                           const std::string& expected);

// ---- charts -------------------------------------------------------------------------------------

struct ChartPoint {
  double x = 0, y = 0;
  std::string label;  // shown beside the point
};
struct ChartSeries {
  std::string name;
  std::vector<ChartPoint> points;  // drawn in this order, joined by a line
};
struct ChartSpec {
  std::string title, x_label, y_label;
  bool log_x = false;
  bool log_y = false;    // values <= 0 are dropped from a log axis
  bool connect = false;  // join each series' points in x order
  // Pareto lines: per series, the points no other point of the series beats on both axes (less
  // or equal x and better or equal y, one strictly) are joined in x order and labelled; the
  // dominated ones are drawn faint, unlabelled. "Better" y is higher when higher_is_better.
  bool pareto = false;
  bool higher_is_better = false;
  std::vector<ChartSeries> series;
};
// A self-contained SVG scatter/line chart (axes with ticks, one colour per series, legend).
// Point labels go beside their point on the first of four sides where they overlap no other
// label and stay inside the plot; a label with no free side is left out.
std::string render_svg_chart(const ChartSpec& spec);
// Keeps only the series whose name starts with one of the prefixes (empty list: all).
ChartSpec filter_series(ChartSpec spec, const std::vector<std::string>& name_prefixes);

// Memory ratio (accounted / fp16, x) against delta ppl % and against passkey accuracy (y), one
// series per method family drawn as its Pareto line (the full cache is a point at x = 1); points
// in row order, labelled with chart_label.
// Peer rows with a ratio_to_fp16 and the y field join as their own series, named "peer: <tool>"
// up to the tool's first " (".
// A short label for a chart point: the spec without its family, each key=value abbreviated
// ("keep=0.25:scoring=query:pool_kernel=7" -> "25% q pool7"; bits_key=4:bits_value=4 -> "K4V4").
std::string chart_label(const std::string& label, const std::string& family);
ChartSpec chart_ppl_vs_memory(const TextEvalResult& text, const PeerRows* peers = nullptr);
ChartSpec chart_passkey_vs_memory(const PasskeyResult& passkey, bool question_aware,
                                  const PeerRows* peers = nullptr);

}  // namespace vq
