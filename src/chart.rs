//! SVG line charts drawn with `plotters`: plain data in, an SVG document
//! out. Used by `sluicegate demo` and `sluicegate eval`.
//!
//! A figure is a title over panels stacked vertically. The panels share
//! the x axis (time in seconds); each has its own y axis, label and legend
//! (right of the plot, so it never covers a line).
//! Text is written as SVG `<text>` elements and laid out by the viewer, so
//! no font files are read (plotters' `ttf` feature is off; its width
//! estimate only places the legend box).

use plotters::coord::Shift;
use plotters::element::{DashedPathElement, PathElement, Text};
use plotters::prelude::*;
use plotters::series::{DashedLineSeries, LineSeries};
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// Width of the figure, in pixels.
const WIDTH: u32 = 1000;
/// Height of one panel, in pixels.
const PANEL_HEIGHT: u32 = 220;
/// Height of the figure's title band.
const TITLE_HEIGHT: u32 = 40;
/// Room right of each plot for its legend, so the legend never covers
/// a line (about 36 characters of 12 px text).
const LEGEND_WIDTH: u32 = 250;
/// Extra room under the bottom panel for the x axis name.
const X_DESC_HEIGHT: u32 = 24;

/// A sans-serif font of `px` pixels: plotters' SVG backend writes
/// `font-size` as the given size / 1.24, so the size is scaled up here.
fn font(px: f64) -> (&'static str, f64) {
    ("sans-serif", px * 1.24)
}

/// Colours picked by a line's index in its panel (Tableau 10: tells
/// apart well on white and for the common colour blindnesses).
const PALETTE: [(u8, u8, u8); 10] = [
    (31, 119, 180),
    (214, 39, 40),
    (44, 160, 44),
    (255, 127, 14),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
];

/// How a line is stroked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Stroke {
    /// A solid line.
    #[default]
    Solid,
    /// A dashed line (a reference, e.g. a batch-free baseline or a limit).
    Dashed,
}

/// How a line is drawn: its stroke and, if given, its colour.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LineStyle {
    /// Solid or dashed.
    pub stroke: Stroke,
    /// RGB colour; `None` picks one by the line's index in its panel.
    pub color: Option<(u8, u8, u8)>,
}

impl LineStyle {
    /// A solid line in the palette colour of its index.
    pub const fn solid() -> Self {
        Self {
            stroke: Stroke::Solid,
            color: None,
        }
    }

    /// A dashed line in the palette colour of its index.
    pub const fn dashed() -> Self {
        Self {
            stroke: Stroke::Dashed,
            color: None,
        }
    }

    /// The same stroke in the given RGB colour.
    #[must_use]
    pub const fn with_color(self, r: u8, g: u8, b: u8) -> Self {
        Self {
            stroke: self.stroke,
            color: Some((r, g, b)),
        }
    }
}

/// One line of a panel.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Line {
    /// Legend text.
    pub label: String,
    /// Points `(x, y)` in x order; NaN and infinite points are skipped.
    pub points: Vec<(f64, f64)>,
    /// Stroke and colour.
    pub style: LineStyle,
}

impl Line {
    /// A line with the given label, points and style.
    pub fn new(label: impl Into<String>, points: Vec<(f64, f64)>, style: LineStyle) -> Self {
        Self {
            label: label.into(),
            points,
            style,
        }
    }
}

/// One panel: its own y axis and legend, the figure's x axis.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Panel {
    /// Caption above the panel.
    pub title: String,
    /// Name of the y axis (with its unit).
    pub y_label: String,
    /// The lines, drawn in order.
    pub lines: Vec<Line>,
    /// Fixed y range `(bottom, top)`; points outside are drawn at the
    /// edge. `None` fits the data, starting at 0.
    pub y_range: Option<(f64, f64)>,
}

/// Why a chart could not be drawn.
#[derive(Debug, thiserror::Error)]
pub enum ChartError {
    /// No panel was given.
    #[error("a chart needs at least one panel")]
    NoPanels,
    /// A panel's fixed y range is empty, reversed or not finite.
    #[error("panel {panel} ({title:?}): y range {bottom}..{top} is empty or not finite")]
    InvalidYRange {
        /// Index of the panel.
        panel: usize,
        /// Its title.
        title: String,
        /// The bottom given.
        bottom: f64,
        /// The top given.
        top: f64,
    },
    /// plotters failed to draw (writing into a `String` does not fail, so
    /// this is a layout error).
    #[error("drawing the chart")]
    Draw(#[source] DrawingAreaErrorKind<std::io::Error>),
}

impl From<DrawingAreaErrorKind<std::io::Error>> for ChartError {
    fn from(e: DrawingAreaErrorKind<std::io::Error>) -> Self {
        Self::Draw(e)
    }
}

/// The finite points of a line.
fn finite(points: &[(f64, f64)]) -> impl Iterator<Item = (f64, f64)> + '_ {
    points
        .iter()
        .copied()
        .filter(|(x, y)| x.is_finite() && y.is_finite())
}

/// Widens a degenerate `(lo, hi)` so plotters gets a non-empty range.
fn widen(lo: f64, hi: f64) -> (f64, f64) {
    if hi > lo { (lo, hi) } else { (lo, lo + 1.0) }
}

/// The x range shared by all panels: from 0 (or the lowest x, if below)
/// to the highest x.
fn x_range(panels: &[Panel]) -> (f64, f64) {
    let (lo, hi) = panels
        .iter()
        .flat_map(|p| &p.lines)
        .flat_map(|l| finite(&l.points))
        .fold((0.0_f64, f64::NEG_INFINITY), |(lo, hi), (x, _)| {
            (lo.min(x), hi.max(x))
        });
    widen(lo, if hi.is_finite() { hi } else { lo })
}

/// A panel's y range: the fixed one if valid, else 0 (or the lowest y)
/// to 5 % above the highest y.
fn y_range(index: usize, panel: &Panel) -> Result<(f64, f64), ChartError> {
    if let Some((bottom, top)) = panel.y_range {
        if !(bottom.is_finite() && top.is_finite() && top > bottom) {
            return Err(ChartError::InvalidYRange {
                panel: index,
                title: panel.title.clone(),
                bottom,
                top,
            });
        }
        return Ok((bottom, top));
    }
    let (lo, hi) = panel
        .lines
        .iter()
        .flat_map(|l| finite(&l.points))
        .fold((0.0_f64, 0.0_f64), |(lo, hi), (_, y)| {
            (lo.min(y), hi.max(y))
        });
    Ok(widen(lo, hi + (hi - lo) * 0.05))
}

/// A tick label: whole numbers without decimals, others with up to three
/// (plotters' default writes `10.0`).
fn tick(v: &f64) -> String {
    if (v - v.round()).abs() < 1e-9 {
        // `+ 0.0` turns -0 into 0.
        format!("{:.0}", v.round() + 0.0)
    } else {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    }
}

/// The colour of line `index` with `style`.
fn color_of(index: usize, style: LineStyle) -> RGBColor {
    let (r, g, b) = style.color.unwrap_or(PALETTE[index % PALETTE.len()]);
    RGBColor(r, g, b)
}

/// Renders `panels` stacked under `title` as an SVG document; `x_label`
/// names the shared x axis (shown under the bottom panel).
pub fn render_svg(title: &str, x_label: &str, panels: &[Panel]) -> Result<String, ChartError> {
    if panels.is_empty() {
        return Err(ChartError::NoPanels);
    }
    let ranges = panels
        .iter()
        .enumerate()
        .map(|(i, p)| y_range(i, p))
        .collect::<Result<Vec<_>, _>>()?;
    let x = x_range(panels);
    let rows = u32::try_from(panels.len()).unwrap_or(u32::MAX);
    let height = TITLE_HEIGHT
        .saturating_add(PANEL_HEIGHT.saturating_mul(rows))
        .saturating_add(X_DESC_HEIGHT);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE)?;
        let body = root.titled(title, font(20.0))?;
        // The bottom panel is taller by the x axis name's band, so every
        // plot area keeps the same height.
        let (upper, bottom) =
            body.split_vertically(PANEL_HEIGHT.saturating_mul(rows.saturating_sub(1)));
        let mut areas = if rows > 1 {
            upper.split_evenly((panels.len() - 1, 1))
        } else {
            Vec::new()
        };
        areas.push(bottom);
        let last = panels.len() - 1;
        for (i, ((panel, area), y)) in panels.iter().zip(&areas).zip(ranges).enumerate() {
            draw_panel(area, panel, x, y, (i == last).then_some(x_label))?;
        }
        root.present()?;
    }
    Ok(svg)
}

/// Draws one panel into `area`; `x_label` only on the bottom panel.
fn draw_panel(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    panel: &Panel,
    (x0, x1): (f64, f64),
    (y0, y1): (f64, f64),
    x_label: Option<&str>,
) -> Result<(), ChartError> {
    let mut chart = ChartBuilder::on(area)
        .caption(&panel.title, font(14.0))
        .margin_left(10)
        .margin_right(LEGEND_WIDTH)
        .margin_top(4)
        .x_label_area_size(if x_label.is_some() { 46 } else { 24 })
        .y_label_area_size(70)
        .build_cartesian_2d(x0..x1, y0..y1)?;
    let mut mesh = chart.configure_mesh();
    mesh.light_line_style(RGBColor(238, 238, 238))
        .bold_line_style(RGBColor(215, 215, 215))
        .axis_style(RGBColor(120, 120, 120))
        .x_labels(12)
        .y_labels(5)
        .x_label_formatter(&tick)
        .y_label_formatter(&tick)
        .label_style(font(12.0))
        .axis_desc_style(font(13.0))
        .y_desc(panel.y_label.as_str());
    if let Some(x_label) = x_label {
        mesh.x_desc(x_label);
    }
    mesh.draw()?;

    // The plot's top-right corner in the panel's own pixels: the legend
    // goes right of it, in the room the margin keeps.
    let (plot_x, plot_y) = chart.plotting_area().get_pixel_range();
    let (base_x, base_y) = area.get_base_pixel();
    let legend_x = plot_x.end - base_x + 12;
    let legend_y = plot_y.start - base_y + 8;
    for (i, line) in panel.lines.iter().enumerate() {
        let style = color_of(i, line.style).stroke_width(2);
        // Points outside a fixed range are drawn at its edge (plotters
        // would pin them to the edge pixel too; here it is explicit).
        let points: Vec<(f64, f64)> = finite(&line.points)
            .map(|(x, y)| (x, y.clamp(y0, y1)))
            .collect();
        match line.style.stroke {
            Stroke::Solid => chart.draw_series(LineSeries::new(points, style))?,
            Stroke::Dashed => chart.draw_series(DashedLineSeries::new(points, 6, 4, style))?,
        };
        // The legend is drawn on the panel, not through plotters' series
        // labels: those clip their box and samples to the plot, so they
        // would have to sit over the lines.
        let row = i32::try_from(i).unwrap_or(i32::MAX).saturating_mul(18);
        let y = legend_y.saturating_add(row);
        let sample = vec![(legend_x, y), (legend_x + 24, y)];
        match line.style.stroke {
            Stroke::Solid => area.draw(&PathElement::new(sample, style))?,
            Stroke::Dashed => area.draw(&DashedPathElement::new(sample, 5, 3, style))?,
        }
        let text = font(12.0)
            .into_text_style(area)
            .pos(Pos::new(HPos::Left, VPos::Center));
        area.draw(&Text::new(line.label.as_str(), (legend_x + 30, y), text))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether the SVG has a `<text>` element reading exactly `text`
    /// (plotters writes the text on its own line).
    fn has_text(svg: &str, text: &str) -> bool {
        svg.lines().any(|l| l.trim() == text)
    }

    /// The points of the series polylines stroked in `color` (`#RRGGBB`)
    /// at width 2, in order (the legend's sample lines come last).
    fn polylines(svg: &str, color: &str) -> Vec<Vec<(f64, f64)>> {
        svg.lines()
            .filter(|l| {
                l.contains("<polyline")
                    && l.contains(&format!("stroke=\"{color}\""))
                    && l.contains("stroke-width=\"2\"")
            })
            .map(|l| {
                let points = l
                    .split("points=\"")
                    .nth(1)
                    .and_then(|s| s.split('"').next())
                    .expect("points");
                points
                    .split_whitespace()
                    .map(|xy| {
                        let (x, y) = xy.split_once(',').expect("x,y");
                        (x.parse().expect("x"), y.parse().expect("y"))
                    })
                    .collect()
            })
            .collect()
    }

    fn panel(title: &str, y_label: &str, lines: Vec<Line>) -> Panel {
        Panel {
            title: title.into(),
            y_label: y_label.into(),
            lines,
            y_range: None,
        }
    }

    #[test]
    fn svg_names_title_axes_and_every_legend_label() {
        let svg = render_svg(
            "load & latency",
            "seconds",
            &[
                panel(
                    "interactive",
                    "requests/s",
                    vec![Line::new(
                        "arrivals",
                        vec![(0.0, 1.0), (10.0, 4.0)],
                        LineStyle::solid(),
                    )],
                ),
                panel(
                    "TTFT",
                    "ms",
                    vec![
                        Line::new("with batch", vec![(0.0, 50.0)], LineStyle::solid()),
                        Line::new(
                            "twin <no batch>",
                            vec![(0.0, 40.0), (10.0, 45.0)],
                            LineStyle::dashed().with_color(0, 0, 0),
                        ),
                    ],
                ),
            ],
        )
        .expect("renders");
        assert!(svg.starts_with("<svg"), "{svg}");
        // Text is escaped for XML.
        for text in [
            "load &amp; latency",
            "seconds",
            "requests/s",
            "ms",
            "interactive",
            "TTFT",
            "arrivals",
            "with batch",
            "twin &lt;no batch&gt;",
        ] {
            assert!(has_text(&svg, text), "no {text:?} in\n{svg}");
        }
        // The x axis name is written once, under the bottom panel.
        assert_eq!(svg.lines().filter(|l| l.trim() == "seconds").count(), 1);
        // Tick labels on both axes.
        assert!(has_text(&svg, "10") && has_text(&svg, "0"), "{svg}");
        // The palette's first colour, then the given one (dashed: many
        // short pieces, legend sample included).
        // Each panel's first line and its legend sample.
        assert_eq!(polylines(&svg, "#1F77B4").len(), 4, "{svg}");
        assert!(polylines(&svg, "#000000").len() > 2, "{svg}");
    }

    #[test]
    fn empty_panels_and_lines_render() {
        let svg = render_svg(
            "nothing yet",
            "seconds",
            &[
                panel("no lines", "requests", Vec::new()),
                panel(
                    "no points",
                    "ms",
                    vec![Line::new("empty", Vec::new(), LineStyle::solid())],
                ),
            ],
        )
        .expect("renders");
        for text in ["nothing yet", "no lines", "no points", "requests", "empty"] {
            assert!(has_text(&svg, text), "no {text:?}");
        }
        assert!(matches!(
            render_svg("t", "s", &[]),
            Err(ChartError::NoPanels)
        ));
    }

    #[test]
    fn skips_non_finite_points_and_clamps_points_outside_a_fixed_range() {
        let mut p = panel(
            "budget",
            "fraction",
            vec![Line::new(
                "D",
                vec![
                    (0.0, 0.5),
                    (1.0, f64::NAN),
                    (f64::INFINITY, 0.5),
                    (2.0, 7.0),
                    (3.0, -2.0),
                ],
                LineStyle::solid(),
            )],
        );
        p.y_range = Some((0.0, 1.0));
        let svg = render_svg("t", "seconds", std::slice::from_ref(&p)).expect("renders");
        assert!(!svg.contains("NaN") && !svg.contains("inf"), "{svg}");
        // Three finite points; the two outside the range are drawn at its
        // top and bottom edges, where the 0.5 point is halfway between.
        let series = polylines(&svg, "#1F77B4");
        let points = series.first().expect("the series");
        assert_eq!(points.len(), 3, "{points:?}");
        let (mid, top, bottom) = (points[0].1, points[1].1, points[2].1);
        assert!(top < mid && mid < bottom, "{points:?}");
        assert!((mid - (top + bottom) / 2.0).abs() <= 1.0, "{points:?}");
        assert!(top > 40.0 && bottom < f64::from(TITLE_HEIGHT + PANEL_HEIGHT + X_DESC_HEIGHT));
    }

    #[test]
    fn tick_labels_drop_needless_decimals() {
        assert_eq!(tick(&10.0), "10");
        assert_eq!(tick(&-0.0), "0");
        assert_eq!(tick(&0.25), "0.25");
        assert_eq!(tick(&1.5000001), "1.5");
    }

    #[test]
    fn rejects_an_empty_or_non_finite_fixed_range() {
        for range in [(1.0, 1.0), (2.0, 1.0), (0.0, f64::NAN)] {
            let mut p = panel("p", "y", Vec::new());
            p.y_range = Some(range);
            assert!(
                matches!(
                    render_svg("t", "s", &[p]),
                    Err(ChartError::InvalidYRange { panel: 0, .. })
                ),
                "{range:?}"
            );
        }
    }

    #[test]
    fn a_single_point_and_a_flat_line_render() {
        let svg = render_svg(
            "t",
            "s",
            &[panel(
                "p",
                "y",
                vec![
                    Line::new("one", vec![(5.0, 0.0)], LineStyle::solid()),
                    Line::new("flat", vec![(5.0, 0.0), (5.0, 0.0)], LineStyle::dashed()),
                ],
            )],
        )
        .expect("renders");
        assert!(svg.contains("one") && svg.contains("flat"));
    }
}
