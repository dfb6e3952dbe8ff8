//! A small hand-written SVG line chart (no plotting crates): a few series
//! of `(x, y)` points, each scaled to its own axis range.

use std::fmt::Write;

/// One line on the chart.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend text.
    pub label: String,
    /// Stroke colour (any SVG colour).
    pub color: String,
    /// Points `(x, y)`.
    pub points: Vec<(f64, f64)>,
    /// The y value drawn at the top of the plot (bottom is 0).
    pub y_max: f64,
    /// Dashed line.
    pub dashed: bool,
}

const W: f64 = 900.0;
const H: f64 = 420.0;
const LEFT: f64 = 60.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 110.0;

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Renders the series as an SVG document; `x_max` is the right edge and
/// `x_label` names the x axis.
pub fn render(title: &str, x_label: &str, x_max: f64, series: &[Series]) -> String {
    let pw = W - LEFT - RIGHT;
    let ph = H - TOP - BOTTOM;
    let x_max = if x_max > 0.0 { x_max } else { 1.0 };
    let mut s = String::new();
    // Writing to a String cannot fail.
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="22" font-size="15" text-anchor="middle">{}</text>"#,
        W / 2.0,
        escape(title)
    );
    let _ = writeln!(
        s,
        r##"<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>"##
    );
    for i in 0..=4 {
        let x = LEFT + pw * f64::from(i) / 4.0;
        let _ = writeln!(
            s,
            r##"<line x1="{x:.1}" y1="{TOP}" x2="{x:.1}" y2="{:.1}" stroke="#eee"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{:.0}</text>"##,
            TOP + ph,
            TOP + ph + 16.0,
            x_max * f64::from(i) / 4.0
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{:.1}" text-anchor="middle">{}</text>"#,
        LEFT + pw / 2.0,
        TOP + ph + 34.0,
        escape(x_label)
    );
    for (i, line) in series.iter().enumerate() {
        let y_max = if line.y_max > 0.0 { line.y_max } else { 1.0 };
        let points: Vec<String> = line
            .points
            .iter()
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .map(|(x, y)| {
                let px = LEFT + pw * (x / x_max).clamp(0.0, 1.0);
                let py = TOP + ph * (1.0 - (y / y_max).clamp(0.0, 1.0));
                format!("{px:.1},{py:.1}")
            })
            .collect();
        let dash = if line.dashed {
            r#" stroke-dasharray="6,4""#
        } else {
            ""
        };
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{}" stroke-width="2"{dash} points="{}"/>"#,
            escape(&line.color),
            points.join(" ")
        );
        let lx = LEFT + (i % 2) as f64 * (pw / 2.0);
        let ly = TOP + ph + 56.0 + (i / 2) as f64 * 18.0;
        let _ = writeln!(
            s,
            r#"<line x1="{lx:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{}" stroke-width="3"{dash}/><text x="{:.1}" y="{ly:.1}">{} (top = {})</text>"#,
            ly - 4.0,
            lx + 24.0,
            ly - 4.0,
            escape(&line.color),
            lx + 30.0,
            escape(&line.label),
            y_max
        );
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_one_polyline_per_series_and_escapes_text() {
        let svg = render(
            "a < b",
            "s",
            10.0,
            &[
                Series {
                    label: "one".into(),
                    color: "red".into(),
                    points: vec![(0.0, 0.0), (10.0, 1.0)],
                    y_max: 1.0,
                    dashed: false,
                },
                Series {
                    label: "two".into(),
                    color: "blue".into(),
                    points: vec![(5.0, f64::NAN)],
                    y_max: 0.0,
                    dashed: true,
                },
            ],
        );
        assert!(svg.starts_with("<svg"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("a &lt; b"));
        assert!(svg.contains("60.0,310.0 880.0,40.0"));
    }
}
