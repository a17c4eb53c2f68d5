//! The PNG plots of a benchmark run: latency distributions and streaming throughput.

use std::path::Path;

use anyhow::{Result, anyhow};
use plotters::prelude::*;

/// One curve: a label and its points.
#[derive(Clone)]
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// Registers the bundled font under the family name the charts use (once per process).
fn font() -> Result<()> {
    static REGISTERED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| {
        plotters::style::register_font("sans-serif", FontStyle::Normal, epaint_default_fonts::UBUNTU_LIGHT).is_ok()
    });
    if ok { Ok(()) } else { Err(anyhow!("the bundled font did not load")) }
}

/// Latency distributions as CDFs: x is microseconds (log scale), y the fraction of samples.
pub fn latency_cdf(path: &Path, title: &str, series: &[Series]) -> Result<()> {
    let curves: Vec<Series> = series.iter().filter(|s| !s.points.is_empty()).cloned().collect();
    if curves.is_empty() {
        return Ok(());
    }
    let xs = curves.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let (min, max) = xs.fold((f64::MAX, 0f64), |(lo, hi), x| (lo.min(x), hi.max(x)));
    chart(path, title, |area| {
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 26))
            .margin(20)
            .x_label_area_size(50)
            .y_label_area_size(70)
            .build_cartesian_2d((min.max(0.1) * 0.8..max * 1.25).log_scale(), 0f64..1f64)?;
        draw(&mut chart, "microseconds (log scale)", "fraction at or below", &curves)
    })
}

/// Throughput over time: x is seconds since the first measured item, y items per second.
pub fn throughput(path: &Path, title: &str, series: &[Series]) -> Result<()> {
    let curves: Vec<Series> = series.iter().filter(|s| !s.points.is_empty()).cloned().collect();
    if curves.is_empty() {
        return Ok(());
    }
    let x_max = curves.iter().flat_map(|s| s.points.iter().map(|p| p.0)).fold(0f64, f64::max);
    let y_max = curves.iter().flat_map(|s| s.points.iter().map(|p| p.1)).fold(0f64, f64::max);
    chart(path, title, |area| {
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 26))
            .margin(20)
            .x_label_area_size(50)
            .y_label_area_size(90)
            .build_cartesian_2d(0f64..x_max.max(1e-3), 0f64..y_max * 1.15)?;
        draw(&mut chart, "seconds", "items per second", &curves)
    })
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>;
type DrawResult = std::result::Result<(), Box<dyn std::error::Error>>;

/// Draws `body` on a white 1200x700 PNG at `path`.
fn chart(path: &Path, title: &str, body: impl FnOnce(&Area<'_>) -> DrawResult) -> Result<()> {
    font()?;
    let area = BitMapBackend::new(path, (1200, 700)).into_drawing_area();
    area.fill(&WHITE).map_err(|e| anyhow!("{title}: {e}"))?;
    body(&area).map_err(|e| anyhow!("{title}: {e}"))?;
    area.present().map_err(|e| anyhow!("{title}: writing {}: {e}", path.display()))
}

fn draw<'a, X, Y>(
    chart: &mut ChartContext<'a, BitMapBackend<'a>, Cartesian2d<X, Y>>,
    x_desc: &str,
    y_desc: &str,
    curves: &[Series],
) -> DrawResult
where
    X: Ranged<ValueType = f64> + plotters::coord::ranged1d::ValueFormatter<f64>,
    Y: Ranged<ValueType = f64> + plotters::coord::ranged1d::ValueFormatter<f64>,
{
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .label_style(("sans-serif", 18))
        .axis_desc_style(("sans-serif", 20))
        .draw()?;
    for (i, series) in curves.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(series.points.iter().copied(), color.stroke_width(3)))?
            .label(series.label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(3)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .label_font(("sans-serif", 18))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}
