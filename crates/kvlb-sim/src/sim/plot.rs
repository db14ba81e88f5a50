//! `--plot FILE.svg`: a hand-written SVG of a comparison. Top: the TTFT CDF per policy on a
//! log-scale time axis. Bottom: prompt tokens each replica computed, one group of bars per
//! policy (an even row of bars is a balanced fleet; one tall bar is a hot replica).

#![forbid(unsafe_code)]

use super::report::Summary;
use std::fmt::Write;

/// Policy colours (colour-blind friendly, Okabe-Ito), reused in order.
const COLORS: &[&str] = &[
    "#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442",
];

const WIDTH: f64 = 1100.0;
const CDF_TOP: f64 = 70.0;
const CDF_HEIGHT: f64 = 380.0;
const LEFT: f64 = 80.0;
const PLOT_WIDTH: f64 = 760.0;
const BARS_TOP: f64 = CDF_TOP + CDF_HEIGHT + 110.0;
const BARS_HEIGHT: f64 = 260.0;
const HEIGHT: f64 = BARS_TOP + BARS_HEIGHT + 90.0;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

fn time_label(decade: i32) -> String {
    match decade {
        d if d <= -4 => format!("1e{d} s"),
        -3 => "1 ms".into(),
        -2 => "10 ms".into(),
        -1 => "100 ms".into(),
        0 => "1 s".into(),
        1 => "10 s".into(),
        2 => "100 s".into(),
        3 => "1000 s".into(),
        d => format!("1e{d} s"),
    }
}

fn token_label(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.0}M", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.0}k", v / 1e3)
    } else {
        format!("{v:.0}")
    }
}

/// A "nice" axis step (1, 2 or 5 times a power of ten) giving about `ticks` ticks up to `max`.
fn nice_step(max: f64, ticks: f64) -> f64 {
    let raw = (max / ticks).max(1e-9);
    let p = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * p)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * p)
}

/// `name` on one line if it fits `width` pixels (about 7 per character), else two.
fn label_lines(name: &str, width: f64) -> Vec<String> {
    if name.len() as f64 * 7.0 <= width * 0.95 {
        return vec![name.to_string()];
    }
    let mid = name.len() / 2;
    match name
        .match_indices('_')
        .map(|(i, _)| i)
        .min_by_key(|&i| i.abs_diff(mid))
    {
        Some(i) => vec![name[..=i].to_string(), name[i + 1..].to_string()],
        None => vec![name.to_string()],
    }
}

fn secs(v: f64) -> String {
    if !v.is_finite() {
        "-".into()
    } else if v < 10.0 {
        format!("{v:.2} s")
    } else {
        format!("{v:.0} s")
    }
}

/// The SVG for `summaries` and, per summary, its sorted TTFTs in seconds.
pub fn render(title: &str, summaries: &[Summary], ttfts: &[Vec<f64>]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="Helvetica, Arial, sans-serif" font-size="13">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="30" font-size="18" font-weight="bold">{}</text>"#,
        LEFT,
        esc(title)
    );
    cdf(&mut s, summaries, ttfts);
    bars(&mut s, summaries);
    s.push_str("</svg>\n");
    s
}

fn cdf(s: &mut String, summaries: &[Summary], ttfts: &[Vec<f64>]) {
    let positive = |v: &&f64| **v > 0.0 && v.is_finite();
    let lo = ttfts
        .iter()
        .flat_map(|v| v.iter().filter(positive))
        .fold(f64::INFINITY, |a, &b| a.min(b));
    let hi = ttfts
        .iter()
        .flat_map(|v| v.iter().filter(positive))
        .fold(0.0f64, |a, &b| a.max(b));
    let (d0, d1) = if lo.is_finite() && hi > 0.0 {
        let d0 = lo.log10().floor() as i32;
        (d0, (hi.log10().ceil() as i32).max(d0 + 1))
    } else {
        (-3, 1)
    };
    let x = |t: f64| LEFT + (t.log10() - d0 as f64) / (d1 - d0) as f64 * PLOT_WIDTH;
    let y = |p: f64| CDF_TOP + (1.0 - p) * CDF_HEIGHT;
    let _ = writeln!(
        s,
        r#"<text x="{LEFT}" y="{}" font-size="15" font-weight="bold">Time to first token, CDF (log scale)</text>"#,
        CDF_TOP - 12.0
    );
    // Grid: decades (with 2x and 5x minor lines) and tenths of the CDF.
    for d in d0..=d1 {
        let xd = x(10f64.powi(d));
        let _ = writeln!(
            s,
            r##"<line x1="{xd:.1}" y1="{CDF_TOP}" x2="{xd:.1}" y2="{}" stroke="#bbb"/>"##,
            CDF_TOP + CDF_HEIGHT
        );
        let _ = writeln!(
            s,
            r#"<text x="{xd:.1}" y="{}" text-anchor="middle">{}</text>"#,
            CDF_TOP + CDF_HEIGHT + 18.0,
            time_label(d)
        );
        if d < d1 {
            for m in [2.0, 5.0] {
                let xm = x(m * 10f64.powi(d));
                let _ = writeln!(
                    s,
                    r##"<line x1="{xm:.1}" y1="{CDF_TOP}" x2="{xm:.1}" y2="{}" stroke="#eee"/>"##,
                    CDF_TOP + CDF_HEIGHT
                );
            }
        }
    }
    for k in 0..=10 {
        let p = k as f64 / 10.0;
        let yp = y(p);
        let color = if k == 5 || k == 9 { "#999" } else { "#e4e4e4" };
        let _ = writeln!(
            s,
            r#"<line x1="{LEFT}" y1="{yp:.1}" x2="{}" y2="{yp:.1}" stroke="{color}"/>"#,
            LEFT + PLOT_WIDTH
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{:.1}" text-anchor="end">{p:.1}</text>"#,
            LEFT - 8.0,
            yp + 4.0
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">time to first token</text>"#,
        LEFT + PLOT_WIDTH / 2.0,
        CDF_TOP + CDF_HEIGHT + 40.0
    );
    let _ = writeln!(
        s,
        r#"<text transform="translate({},{}) rotate(-90)" text-anchor="middle">fraction of requests</text>"#,
        LEFT - 50.0,
        CDF_TOP + CDF_HEIGHT / 2.0
    );
    // One step line per policy, at most ~600 points.
    for (i, v) in ttfts.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let n = v.len();
        if n == 0 {
            continue;
        }
        let stride = n.div_ceil(600).max(1);
        let mut pts = String::new();
        let mut k = 0;
        while k < n {
            let t = v[k].max(10f64.powi(d0));
            let _ = write!(pts, "{:.1},{:.1} ", x(t), y((k + 1) as f64 / n as f64));
            k += stride;
        }
        let _ = write!(pts, "{:.1},{:.1}", x(v[n - 1].max(10f64.powi(d0))), y(1.0));
        let _ = writeln!(
            s,
            r#"<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2"/>"#
        );
    }
    let _ = writeln!(
        s,
        r##"<rect x="{LEFT}" y="{CDF_TOP}" width="{PLOT_WIDTH}" height="{CDF_HEIGHT}" fill="none" stroke="#333"/>"##
    );
    // Legend with the percentiles.
    let lx = LEFT + PLOT_WIDTH + 25.0;
    let _ = writeln!(
        s,
        r#"<text x="{lx}" y="{}" font-weight="bold">policy  (p50 / p99 TTFT)</text>"#,
        CDF_TOP + 10.0
    );
    for (i, sm) in summaries.iter().enumerate() {
        let ly = CDF_TOP + 36.0 + i as f64 * 38.0;
        let color = COLORS[i % COLORS.len()];
        let _ = writeln!(
            s,
            r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="4"/>"#,
            lx + 24.0
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}">{}</text>"#,
            lx + 32.0,
            ly + 4.0,
            esc(&sm.policy)
        );
        let _ = writeln!(
            s,
            r##"<text x="{}" y="{}" fill="#555" font-size="12">{} / {}, hit {:.0}%</text>"##,
            lx + 32.0,
            ly + 19.0,
            secs(sm.ttft_p50_s),
            secs(sm.ttft_p99_s),
            sm.hit_rate * 100.0
        );
    }
}

fn bars(s: &mut String, summaries: &[Summary]) {
    let _ = writeln!(
        s,
        r#"<text x="{LEFT}" y="{}" font-size="15" font-weight="bold">Prompt tokens computed per replica (prefill work; even bars = balanced)</text>"#,
        BARS_TOP - 14.0
    );
    let max = summaries
        .iter()
        .flat_map(|sm| sm.replica_prefill_tokens.iter())
        .copied()
        .max()
        .unwrap_or(0) as f64;
    let step = nice_step(max.max(1.0), 5.0);
    let top = (max / step).ceil().max(1.0) * step;
    let y = |v: f64| BARS_TOP + (1.0 - v / top) * BARS_HEIGHT;
    let mut v = 0.0;
    while v <= top + step * 0.01 {
        let yv = y(v);
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{yv:.1}" x2="{}" y2="{yv:.1}" stroke="#e4e4e4"/>"##,
            LEFT + PLOT_WIDTH
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{:.1}" text-anchor="end">{}</text>"#,
            LEFT - 8.0,
            yv + 4.0,
            token_label(v)
        );
        v += step;
    }
    let _ = writeln!(
        s,
        r#"<text transform="translate({},{}) rotate(-90)" text-anchor="middle">prompt tokens computed</text>"#,
        LEFT - 55.0,
        BARS_TOP + BARS_HEIGHT / 2.0
    );
    let groups = summaries.len().max(1) as f64;
    let group_w = PLOT_WIDTH / groups;
    for (i, sm) in summaries.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let n = sm.replica_prefill_tokens.len().max(1) as f64;
        let inner = group_w * 0.8;
        let bar_w = inner / n;
        let gx = LEFT + i as f64 * group_w + group_w * 0.1;
        for (r, &tok) in sm.replica_prefill_tokens.iter().enumerate() {
            let bx = gx + r as f64 * bar_w;
            let by = y(tok as f64);
            let opacity = if r % 2 == 0 { 1.0 } else { 0.7 };
            let _ = writeln!(
                s,
                r#"<rect x="{bx:.1}" y="{by:.1}" width="{:.1}" height="{:.1}" fill="{color}" fill-opacity="{opacity}"><title>{} replica {r}: {tok} tokens</title></rect>"#,
                (bar_w - 1.0).max(0.5),
                (BARS_TOP + BARS_HEIGHT - by).max(0.0),
                esc(&sm.policy)
            );
        }
        let cx = gx + inner / 2.0;
        // A name wider than its group breaks at the underscore nearest its middle.
        let lines = label_lines(&sm.policy, group_w);
        for (k, line) in lines.iter().enumerate() {
            let _ = writeln!(
                s,
                r#"<text x="{cx:.1}" y="{}" text-anchor="middle">{}</text>"#,
                BARS_TOP + BARS_HEIGHT + 18.0 + 15.0 * k as f64,
                esc(line)
            );
        }
        let _ = writeln!(
            s,
            r##"<text x="{cx:.1}" y="{}" text-anchor="middle" fill="#555" font-size="12">max/mean {:.2}</text>"##,
            BARS_TOP + BARS_HEIGHT + 19.0 + 15.0 * lines.len() as f64,
            sm.max_mean_load
        );
    }
    let _ = writeln!(
        s,
        r##"<rect x="{LEFT}" y="{BARS_TOP}" width="{PLOT_WIDTH}" height="{BARS_HEIGHT}" fill="none" stroke="#333"/>"##
    );
    let _ = writeln!(
        s,
        r##"<text x="{LEFT}" y="{}" fill="#555" font-size="12">one bar per replica, in replica order, within each policy's group</text>"##,
        BARS_TOP + BARS_HEIGHT + 74.0
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nice_steps() {
        assert_eq!(nice_step(100.0, 5.0), 20.0);
        assert_eq!(nice_step(9e6, 5.0), 2e6);
        assert_eq!(nice_step(1.0, 5.0), 0.2);
        assert_eq!(label_lines("random", 100.0), vec!["random"]);
        assert_eq!(
            label_lines("sglang_cache_aware", 100.0),
            vec!["sglang_", "cache_aware"]
        );
    }
}
