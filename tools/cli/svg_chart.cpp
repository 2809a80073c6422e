// A tiny SVG chart writer for the evaluation reports: one plot area, x/y axes with "nice" ticks
// (1-2-5 steps on a linear axis, decades with 2 and 5 on a log axis), one colour and marker per
// series, points joined in order, a small label beside each point, a legend on the right.
// Coordinates: the plot area is [kLeft, kLeft + plot_w] x [kTop, kTop + plot_h] in SVG pixels,
// y growing downwards; data map linearly (or by log10) onto it with 5% padding. Points of a
// series are joined (in x order) when ChartSpec::connect is set; with ChartSpec::pareto only the
// series' Pareto front is joined and labelled, the dominated points drawn faint.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "cli/report.h"

namespace vq {

namespace {

constexpr double kWidth = 900, kHeight = 520;
constexpr double kLeft = 80, kRight = 260, kTop = 50, kBottom = 60;
const char* const kColours[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                                "#8c564b", "#e377c2", "#7f7f7f", "#17becf", "#bcbd22"};

std::string esc(const std::string& s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '<':
        o += "&lt;";
        break;
      case '>':
        o += "&gt;";
        break;
      case '&':
        o += "&amp;";
        break;
      case '"':
        o += "&quot;";
        break;
      default:
        o += c;
    }
  }
  return o;
}

std::string num(double v) {
  char b[32];
  std::snprintf(b, sizeof(b), "%.1f", v);
  return b;
}

std::string tick_text(double v) {
  char b[32];
  if (v != 0 && (std::fabs(v) < 1e-3 || std::fabs(v) >= 1e5))
    std::snprintf(b, sizeof(b), "%.0e", v);
  else
    std::snprintf(b, sizeof(b), "%g", v);
  return b;
}

struct Axis {
  bool log = false;
  double lo = 0, hi = 1;      // in data units (log10 units when log)
  std::vector<double> ticks;  // data units

  double t(double v) const { return log ? std::log10(v) : v; }
  // Fraction along the axis in [0, 1].
  double frac(double v) const { return (t(v) - lo) / (hi - lo); }
};

Axis make_axis(std::vector<double> vals, bool log) {
  Axis a;
  a.log = log;
  if (log)
    vals.erase(std::remove_if(vals.begin(), vals.end(), [](double v) { return !(v > 0); }),
               vals.end());
  vals.erase(std::remove_if(vals.begin(), vals.end(), [](double v) { return !std::isfinite(v); }),
             vals.end());
  if (vals.empty()) vals = log ? std::vector<double>{1, 10} : std::vector<double>{0, 1};
  double mn = a.t(*std::min_element(vals.begin(), vals.end()));
  double mx = a.t(*std::max_element(vals.begin(), vals.end()));
  if (mx - mn < 1e-12) {
    mn -= log ? 0.5 : (std::fabs(mn) > 0 ? std::fabs(mn) * 0.5 : 1);
    mx += log ? 0.5 : (std::fabs(mx) > 0 ? std::fabs(mx) * 0.5 : 1);
  }
  const double pad = 0.05 * (mx - mn);
  a.lo = mn - pad;
  a.hi = mx + pad;
  if (log) {
    for (int e = static_cast<int>(std::floor(a.lo)); e <= static_cast<int>(std::ceil(a.hi)); ++e)
      for (double m : {1.0, 2.0, 5.0}) {
        const double v = m * std::pow(10.0, e);
        if (std::log10(v) >= a.lo && std::log10(v) <= a.hi) a.ticks.push_back(v);
      }
  } else {
    const double raw = (a.hi - a.lo) / 6;
    const double p = std::pow(10.0, std::floor(std::log10(raw)));
    double step = p;
    for (double m : {1.0, 2.0, 5.0, 10.0})
      if (m * p >= raw) {
        step = m * p;
        break;
      }
    for (double v = std::ceil(a.lo / step) * step; v <= a.hi + 1e-9 * step; v += step)
      a.ticks.push_back(std::fabs(v) < 1e-12 * step ? 0.0 : v);
  }
  return a;
}

}  // namespace

std::string render_svg_chart(const ChartSpec& spec) {
  const double pw = kWidth - kLeft - kRight, ph = kHeight - kTop - kBottom;
  std::vector<double> xs, ys;
  for (const auto& s : spec.series)
    for (const auto& p : s.points) {
      xs.push_back(p.x);
      ys.push_back(p.y);
    }
  const Axis ax = make_axis(xs, spec.log_x), ay = make_axis(ys, spec.log_y);
  auto px = [&](double x) { return kLeft + ax.frac(x) * pw; };
  auto py = [&](double y) { return kTop + (1 - ay.frac(y)) * ph; };
  auto ok = [&](const ChartPoint& p) {
    return std::isfinite(p.x) && std::isfinite(p.y) && (!spec.log_x || p.x > 0) &&
           (!spec.log_y || p.y > 0);
  };

  std::string o;
  o += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + num(kWidth) + "\" height=\"" +
       num(kHeight) + "\" viewBox=\"0 0 " + num(kWidth) + " " + num(kHeight) +
       "\" font-family=\"sans-serif\" font-size=\"12\">\n";
  o += "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  o += "<text x=\"" + num(kLeft + pw / 2) + "\" y=\"24\" text-anchor=\"middle\" font-size=\"15\">" +
       esc(spec.title) + "</text>\n";
  // Grid and ticks.
  for (double v : ax.ticks) {
    const double x = px(v);
    o += "<line x1=\"" + num(x) + "\" y1=\"" + num(kTop) + "\" x2=\"" + num(x) + "\" y2=\"" +
         num(kTop + ph) + "\" stroke=\"#e6e6e6\"/>\n";
    o += "<text x=\"" + num(x) + "\" y=\"" + num(kTop + ph + 16) + "\" text-anchor=\"middle\">" +
         tick_text(v) + "</text>\n";
  }
  for (double v : ay.ticks) {
    const double y = py(v);
    o += "<line x1=\"" + num(kLeft) + "\" y1=\"" + num(y) + "\" x2=\"" + num(kLeft + pw) +
         "\" y2=\"" + num(y) + "\" stroke=\"#e6e6e6\"/>\n";
    o += "<text x=\"" + num(kLeft - 6) + "\" y=\"" + num(y + 4) + "\" text-anchor=\"end\">" +
         tick_text(v) + "</text>\n";
  }
  o += "<rect x=\"" + num(kLeft) + "\" y=\"" + num(kTop) + "\" width=\"" + num(pw) +
       "\" height=\"" + num(ph) + "\" fill=\"none\" stroke=\"#333\"/>\n";
  o += "<text x=\"" + num(kLeft + pw / 2) + "\" y=\"" + num(kHeight - 18) +
       "\" text-anchor=\"middle\">" + esc(spec.x_label) + "</text>\n";
  o += "<text transform=\"translate(20," + num(kTop + ph / 2) +
       ") rotate(-90)\" text-anchor=\"middle\">" + esc(spec.y_label) + "</text>\n";
  // Series. A point label takes the first side of its point where it overlaps no label already
  // drawn (boxes estimated at 5.5 px per character, 11 px high) and stays in the plot area.
  std::vector<std::array<double, 4>> placed;  // x0, y0, x1, y1 of drawn labels
  auto fits = [&](double x0, double y0, double x1, double y1) {
    for (const auto& b : placed)
      if (x0 < b[2] && b[0] < x1 && y0 < b[3] && b[1] < y1) return false;
    return true;
  };
  // Four candidate label boxes beside a point: right-above, right-below, left-above, left-below.
  auto place_label = [&](double x, double y, const std::string& label, const std::string& col) {
    const double w = 5.5 * static_cast<double>(label.size()), h = 11;
    const double cand[4][2] = {{x + 6, y - 6},
                               {x + 6, y + 14},
                               {x - 6 - w, y - 6},
                               {x - 6 - w, y + 14}};  // text baseline start
    for (const auto& c : cand) {
      const double x0 = c[0], y0 = c[1] - h + 2, x1 = c[0] + w, y1 = c[1] + 2;
      if (x0 < kLeft || x1 > kLeft + pw || y0 < kTop || y1 > kTop + ph) continue;
      if (!fits(x0, y0, x1, y1)) continue;
      placed.push_back({x0, y0, x1, y1});
      o += "<text x=\"" + num(x0) + "\" y=\"" + num(c[1]) + "\" font-size=\"10\" fill=\"" + col +
           "\">" + esc(label) + "</text>\n";
      return;
    }
  };
  for (size_t si = 0; si < spec.series.size(); ++si) {
    const auto& s = spec.series[si];
    const std::string col = kColours[si % (sizeof(kColours) / sizeof(kColours[0]))];
    // Which points are drawn in full (and labelled): all, or the series' Pareto front.
    std::vector<bool> front(s.points.size(), true);
    if (spec.pareto) {
      const double sign = spec.higher_is_better ? -1.0 : 1.0;  // compare sign * y, lower wins
      for (size_t i = 0; i < s.points.size(); ++i) {
        const ChartPoint& p = s.points[i];
        if (!ok(p)) continue;
        for (size_t j = 0; j < s.points.size() && front[i]; ++j) {
          const ChartPoint& q = s.points[j];
          if (j == i || !ok(q)) continue;
          const bool no_worse = q.x <= p.x && sign * q.y <= sign * p.y;
          const bool better = q.x < p.x || sign * q.y < sign * p.y;
          if (no_worse && better) front[i] = false;
        }
      }
    }
    if (spec.connect || spec.pareto) {
      std::vector<ChartPoint> pts;
      for (size_t i = 0; i < s.points.size(); ++i)
        if (ok(s.points[i]) && front[i]) pts.push_back(s.points[i]);
      std::stable_sort(pts.begin(), pts.end(),
                       [](const ChartPoint& a, const ChartPoint& b) { return a.x < b.x; });
      std::string path;
      for (const auto& p : pts)
        path += (path.empty() ? "M" : " L") + num(px(p.x)) + " " + num(py(p.y));
      if (pts.size() > 1)
        o += "<path d=\"" + path + "\" fill=\"none\" stroke=\"" + col +
             "\" stroke-width=\"2\" opacity=\"0.8\"/>\n";
    }
    for (size_t i = 0; i < s.points.size(); ++i) {
      const ChartPoint& p = s.points[i];
      if (!ok(p)) continue;
      const double x = px(p.x), y = py(p.y);
      const std::string faint = front[i] ? "" : " opacity=\"0.3\"";
      if (si % 2 == 0)
        o += "<circle cx=\"" + num(x) + "\" cy=\"" + num(y) + "\" r=\"" + (front[i] ? "4" : "3") +
             "\" fill=\"" + col + "\"" + faint + "/>\n";
      else
        o += "<rect x=\"" + num(x - 4) + "\" y=\"" + num(y - 4) +
             "\" width=\"8\" height=\"8\" fill=\"" + col + "\"" + faint + "/>\n";
    }
    // Labels after the markers of the series, front points only.
    for (size_t i = 0; i < s.points.size(); ++i) {
      const ChartPoint& p = s.points[i];
      if (!ok(p) || !front[i] || p.label.empty()) continue;
      std::string label = p.label;
      if (label.size() > 34) label = label.substr(0, 33) + "~";
      place_label(px(p.x), py(p.y), label, col);
    }
    const double ly = kTop + 10 + 20 * static_cast<double>(si);
    o += "<rect x=\"" + num(kLeft + pw + 16) + "\" y=\"" + num(ly - 8) +
         "\" width=\"12\" height=\"12\" fill=\"" + col + "\"/>\n";
    std::string name = s.name;
    if (name.size() > 36) name = name.substr(0, 35) + "~";
    o += "<text x=\"" + num(kLeft + pw + 34) + "\" y=\"" + num(ly + 2) + "\">" + esc(name) +
         "</text>\n";
  }
  o += "</svg>\n";
  return o;
}

}  // namespace vq
