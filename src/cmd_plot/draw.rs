//! Drawing loss curves with `plotters`, as SVG text or PNG bytes: one color per run, the
//! training loss a solid line, the validation loss a thin line with a dot per measurement, a
//! legend, a title and axis labels. Text is drawn with a font compiled into the binary
//! (epaint_default_fonts' Ubuntu Light), so no system font is needed.

use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;

/// The font family name the charts use; [`font`] registers it.
const FAMILY: &str = "sans-serif";

/// One color per run (matplotlib's `tab10`), reused after ten runs.
const COLORS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// The curves of one run, in chart coordinates.
pub struct Series {
    /// The legend's name for the run.
    pub label: String,
    /// Training loss points (x, loss).
    pub train: Vec<(f64, f64)>,
    /// Validation loss points (x, loss).
    pub val: Vec<(f64, f64)>,
}

/// What the chart says around the curves.
pub struct Chart {
    /// The caption above the chart.
    pub title: String,
    /// The x axis's label.
    pub x_label: String,
    /// Whether x counts tokens (labels as 1.5M, 2B) rather than steps.
    pub x_is_tokens: bool,
    /// Size in pixels.
    pub width: u32,
    /// Size in pixels.
    pub height: u32,
}

/// The chart as an SVG document.
pub fn svg(series: &[Series], chart: &Chart) -> Result<String, String> {
    let mut text = String::new();
    draw(SVGBackend::with_string(&mut text, (chart.width, chart.height)).into_drawing_area(), series, chart)?;
    Ok(text)
}

/// The chart as a PNG file's bytes (8-bit RGB).
pub fn png(series: &[Series], chart: &Chart) -> Result<Vec<u8>, String> {
    let (w, h) = (chart.width, chart.height);
    let mut rgb = vec![255u8; w as usize * h as usize * 3];
    draw(BitMapBackend::with_buffer(&mut rgb, (w, h)).into_drawing_area(), series, chart)?;
    let mut out = Vec::new();
    let mut enc = png::Encoder::new(&mut out, w, h);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    let mut writer = enc.write_header().map_err(|e| format!("encoding the PNG: {e}"))?;
    writer.write_image_data(&rgb).map_err(|e| format!("encoding the PNG: {e}"))?;
    writer.finish().map_err(|e| format!("encoding the PNG: {e}"))?;
    Ok(out)
}

/// Registers the embedded font under [`FAMILY`] (once).
fn font() -> Result<(), String> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        plotters::style::register_font(FAMILY, FontStyle::Normal, epaint_default_fonts::UBUNTU_LIGHT)
            .map_err(|_| "internal: the embedded font does not load".to_string())
    })
    .clone()
}

/// Draws the chart on `root` and presents it.
fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, series: &[Series], chart: &Chart) -> Result<(), String> {
    font()?;
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| format!("drawing the chart: {e}");
    let points = || series.iter().flat_map(|s| s.train.iter().chain(&s.val));
    let (x_max, y) = (points().map(|p| p.0).fold(0.0, f64::max), span(points().map(|p| p.1))?);
    let x_max = if x_max > 0.0 { x_max } else { 1.0 };
    root.fill(&WHITE).map_err(e)?;
    let mut c = ChartBuilder::on(&root)
        .caption(&chart.title, (FAMILY, 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..x_max, y.0..y.1)
        .map_err(e)?;
    let count = |x: &f64| if chart.x_is_tokens { si(*x) } else { format!("{x:.0}") };
    // Whole steps only: a short run gets one label per step.
    let x_labels = if chart.x_is_tokens || x_max >= 10.0 { 10 } else { x_max as usize + 1 };
    c.configure_mesh()
        .x_labels(x_labels)
        .x_desc(&chart.x_label)
        .y_desc("loss")
        .x_label_formatter(&count)
        .y_label_formatter(&|v| loss_label(*v, y.1 - y.0))
        .label_style((FAMILY, 14))
        .axis_desc_style((FAMILY, 16))
        .light_line_style(RGBColor(240, 240, 240))
        .bold_line_style(RGBColor(215, 215, 215))
        .draw()
        .map_err(e)?;
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let (line, thin) = (color.stroke_width(2), color.stroke_width(1));
        if !s.train.is_empty() {
            c.draw_series(LineSeries::new(s.train.iter().copied(), line).point_size(if s.train.len() == 1 { 3 } else { 0 }))
                .map_err(e)?
                .label(format!("{} train", s.label))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], line));
        }
        if !s.val.is_empty() {
            c.draw_series(LineSeries::new(s.val.iter().copied(), thin)).map_err(e)?;
            c.draw_series(s.val.iter().map(|&p| Circle::new(p, 3, color.filled()))).map_err(e)?.label(format!("{} val", s.label)).legend(
                move |(x, y)| {
                    EmptyElement::at((x, y)) + PathElement::new(vec![(0, 0), (24, 0)], thin) + Circle::new((12, 0), 3, color.filled())
                },
            );
        }
    }
    c.configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font((FAMILY, 14))
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(160, 160, 160))
        .draw()
        .map_err(e)?;
    root.present().map_err(e)
}

/// The y range: the values' span with 5% room on each side (never empty); an error when it is
/// too wide to draw (its width overflows).
fn span(values: impl Iterator<Item = f64>) -> Result<(f64, f64), String> {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    let pad = if hi > lo { 0.05 * (hi - lo) } else { 0.5 };
    let (a, b) = (lo - pad, hi + pad);
    if a.is_finite() && b.is_finite() && (b - a).is_finite() {
        Ok((a, b))
    } else {
        Err(format!("the losses range from {lo:e} to {hi:e}: too wide to draw"))
    }
}

/// A loss axis label: two decimals, up to six when the axis spans less than 0.1, and
/// scientific notation for huge values.
fn loss_label(v: f64, span: f64) -> String {
    if v.abs() >= 1e6 {
        return format!("{v:.2e}");
    }
    let decimals = ((-span.log10()).ceil() as i64 + 1).clamp(2, 6) as usize;
    format!("{v:.decimals$}")
}

/// A count with an SI suffix: 512, 65.5k, 1.2M, 3B.
fn si(x: f64) -> String {
    let (v, unit) = match x.abs() {
        a if a >= 1e9 => (x / 1e9, "B"),
        a if a >= 1e6 => (x / 1e6, "M"),
        a if a >= 1e3 => (x / 1e3, "k"),
        _ => (x, ""),
    };
    let s = format!("{v:.2}");
    let s = if s.contains('.') { s.trim_end_matches('0').trim_end_matches('.') } else { &s };
    format!("{s}{unit}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loss_labels_have_the_digits_the_axis_needs() {
        assert_eq!([loss_label(5.25, 3.0), loss_label(5.25, 0.001), loss_label(2e300, 1e300)], ["5.25", "5.2500", "2.00e300"]);
    }

    #[test]
    fn si_suffixes() {
        assert_eq!([si(0.0), si(512.0), si(65536.0), si(1.5e6), si(3e9)], ["0", "512", "65.54k", "1.5M", "3B"]);
    }

    #[test]
    fn span_is_never_empty_nor_infinite() {
        assert_eq!(span([2.0].into_iter()), Ok((1.5, 2.5)));
        let (a, b) = span([1.0, 3.0].into_iter()).unwrap();
        assert!((a - 0.9).abs() < 1e-12 && (b - 3.1).abs() < 1e-12);
        assert!(span([1e308, -1e308].into_iter()).unwrap_err().contains("too wide"));
    }
}
