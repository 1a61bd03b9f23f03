//! SVG plots with `plotters` (SVG backend only: the bitmap backend needs a font rasteriser and
//! system fonts to draw text, which this project does not assume).

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Result, anyhow};
use plotters::prelude::*;

use crate::report::Analysis;

const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

fn e<E: std::fmt::Debug>(x: E) -> anyhow::Error {
    anyhow!("plotting: {x:?}")
}

fn mean_of(a: &Analysis, ci: usize, cond: &str, m: &str) -> f64 {
    a.cells[ci]
        .conditions
        .iter()
        .find(|c| c.condition == cond)
        .and_then(|c| c.metrics.get(m))
        .map_or(f64::NAN, |i| i.point)
}

/// Stacked user/system CPU per request with the schedstat total on top, one file per cell.
fn cpu_bars(dir: &Path, a: &Analysis, ci: usize) -> Result<Option<String>> {
    let cell = &a.cells[ci];
    let rows: Vec<(String, f64, f64, f64)> = cell
        .conditions
        .iter()
        .map(|c| {
            let g = |k: &str| c.metrics.get(k).map_or(f64::NAN, |i| i.point);
            (
                c.condition.clone(),
                g("server_user"),
                g("server_sys"),
                g("cpu"),
            )
        })
        .filter(|r| r.3.is_finite() || (r.1.is_finite() && r.2.is_finite()))
        .collect();
    if rows.is_empty() {
        return Ok(None);
    }
    let name = format!("plots/cpu-{}.svg", cell.cell.slug);
    let path = dir.join(&name);
    let ymax = rows
        .iter()
        .map(|r| r.3.max(r.1.max(0.0) + r.2.max(0.0)))
        .fold(0.0f64, f64::max)
        .max(1e-3)
        * 1.2;
    let root = SVGBackend::new(&path, (720, 440)).into_drawing_area();
    root.fill(&WHITE).map_err(e)?;
    let n = rows.len();
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("Server CPU per request, cell {}", cell.cell.id),
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(-0.5f64..(n as f64 - 0.5), 0f64..ymax)
        .map_err(e)?;
    let labels: Vec<String> = rows.iter().map(|r| r.0.clone()).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n)
        .x_label_formatter(&|x| {
            let i = x.round();
            if (x - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < labels.len() {
                labels[i as usize].clone()
            } else {
                String::new()
            }
        })
        .y_desc("us per request")
        .draw()
        .map_err(e)?;
    let user_c = PALETTE[0];
    let sys_c = PALETTE[1];
    for (i, (_, user, sys, total)) in rows.iter().enumerate() {
        let x = i as f64;
        let (u, s) = (user.max(0.0), sys.max(0.0));
        if user.is_finite() {
            chart
                .draw_series([Rectangle::new(
                    [(x - 0.3, 0.0), (x + 0.3, u)],
                    user_c.filled(),
                )])
                .map_err(e)?;
        }
        if sys.is_finite() {
            chart
                .draw_series([Rectangle::new(
                    [(x - 0.3, u), (x + 0.3, u + s)],
                    sys_c.filled(),
                )])
                .map_err(e)?;
        }
        if total.is_finite() {
            chart
                .draw_series([PathElement::new(
                    vec![(x - 0.35, *total), (x + 0.35, *total)],
                    BLACK.stroke_width(2),
                )])
                .map_err(e)?;
            chart
                .draw_series([Text::new(
                    format!("{total:.1}"),
                    (x - 0.1, *total + ymax * 0.03),
                    ("sans-serif", 14),
                )])
                .map_err(e)?;
        }
    }
    // Legend entries drawn as empty series so the legend shows the colours.
    chart
        .draw_series(std::iter::empty::<Rectangle<(f64, f64)>>())
        .map_err(e)?
        .label("user (ticks)")
        .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], user_c.filled()));
    chart
        .draw_series(std::iter::empty::<Rectangle<(f64, f64)>>())
        .map_err(e)?
        .label("system (ticks)")
        .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], sys_c.filled()));
    chart
        .draw_series(std::iter::empty::<PathElement<(f64, f64)>>())
        .map_err(e)?
        .label("schedstat total")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 14, y)], BLACK.stroke_width(2)));
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(e)?;
    root.present().map_err(e)?;
    Ok(Some(name))
}

/// Series for metric-against-offered-rate plots: one per condition and non-rate cell
/// dimensions. Points are (offered rate mean, metric mean).
fn series(a: &Analysis, metric: &str) -> BTreeMap<String, Vec<(f64, f64)>> {
    let mut out: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for (ci, c) in a.cells.iter().enumerate() {
        let rest: Vec<&str> = c
            .cell
            .id
            .split(',')
            .filter(|p| !p.starts_with("rate=") && *p != "main")
            .collect();
        for cond in &a.conditions {
            let x = mean_of(a, ci, cond, "offered");
            let y = mean_of(a, ci, cond, metric);
            if x.is_finite() && y.is_finite() {
                let key = if rest.is_empty() {
                    cond.clone()
                } else {
                    format!("{cond} {}", rest.join(","))
                };
                out.entry(key).or_default().push((x, y));
            }
        }
    }
    for v in out.values_mut() {
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    out
}

/// A labelled line: label, points, drawn thin, colour index (one colour per condition).
type Line = (String, Vec<(f64, f64)>, bool, usize);

fn line_plot(
    dir: &Path,
    name: &str,
    title: &str,
    ylabel: &str,
    lines: &[Line],
) -> Result<Option<String>> {
    let pts: Vec<(f64, f64)> = lines.iter().flat_map(|l| l.1.iter().copied()).collect();
    if pts.is_empty() {
        return Ok(None);
    }
    let xmax = pts.iter().map(|p| p.0).fold(0.0f64, f64::max).max(1e-9) * 1.1;
    let ymax = pts.iter().map(|p| p.1).fold(0.0f64, f64::max).max(1e-9) * 1.15;
    let path = dir.join(name);
    let root = SVGBackend::new(&path, (720, 440)).into_drawing_area();
    root.fill(&WHITE).map_err(e)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..xmax, 0f64..ymax)
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_desc("offered rate (requests/s)")
        .y_desc(ylabel)
        .draw()
        .map_err(e)?;
    for (label, v, dashed, ci) in lines {
        let color = PALETTE[ci % PALETTE.len()];
        let style = if *dashed {
            color.stroke_width(1)
        } else {
            color.stroke_width(2)
        };
        chart
            .draw_series(LineSeries::new(v.iter().copied(), style))
            .map_err(e)?
            .label(label.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2))
            });
        chart
            .draw_series(v.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(e)?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(e)?;
    root.present().map_err(e)?;
    Ok(Some(name.to_string()))
}

/// Time to first token in the first and last 10 s of the measured interval, per condition.
fn ttft_plot(dir: &Path, a: &Analysis) -> Result<Option<String>> {
    let mut lines = Vec::new();
    for (ci, c) in a.cells.iter().enumerate() {
        for cond in &a.conditions {
            let first = mean_of(a, ci, cond, "ttft_first");
            let last = mean_of(a, ci, cond, "ttft_last");
            if first.is_finite() && last.is_finite() {
                lines.push((
                    format!("{cond} {}", c.cell.id),
                    first / 1000.0,
                    last / 1000.0,
                ));
            }
        }
    }
    if lines.is_empty() {
        return Ok(None);
    }
    let name = "plots/ttft-over-run.svg";
    let path = dir.join(name);
    let ymax = lines
        .iter()
        .map(|l| l.1.max(l.2))
        .fold(0.0f64, f64::max)
        .max(1e-6)
        * 1.2;
    let root = SVGBackend::new(&path, (720, 440)).into_drawing_area();
    root.fill(&WHITE).map_err(e)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("Time to first token over the run", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(-0.2f64..1.2f64, 0f64..ymax)
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_labels(2)
        .x_label_formatter(&|x| {
            if x.abs() < 1e-6 {
                "first 10 s".into()
            } else if (x - 1.0).abs() < 1e-6 {
                "last 10 s".into()
            } else {
                String::new()
            }
        })
        .y_desc("mean TTFT (ms)")
        .draw()
        .map_err(e)?;
    for (i, (label, f, l)) in lines.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        chart
            .draw_series(LineSeries::new(
                [(0.0, *f), (1.0, *l)],
                color.stroke_width(2),
            ))
            .map_err(e)?
            .label(label.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(e)?;
    root.present().map_err(e)?;
    Ok(Some(name.into()))
}

/// Draw every plot into `dir/plots/`; returns their paths relative to `dir`.
pub fn write_plots(dir: &Path, a: &Analysis) -> Result<Vec<String>> {
    std::fs::create_dir_all(dir.join("plots"))?;
    let mut out = Vec::new();
    for ci in 0..a.cells.len() {
        out.extend(cpu_bars(dir, a, ci)?);
    }
    // One colour per series key (condition and other cell dimensions), p50 thin, p99 thick.
    let keys: Vec<String> = series(a, "p99").into_keys().collect();
    let colour = |k: &str| keys.iter().position(|x| x == k).unwrap_or(keys.len());
    let mut lat = Vec::new();
    for (k, v) in series(a, "p50") {
        let c = colour(&k);
        lat.push((format!("{k} p50"), v, true, c));
    }
    for (k, v) in series(a, "p99") {
        let c = colour(&k);
        lat.push((format!("{k} p99"), v, false, c));
    }
    out.extend(line_plot(
        dir,
        "plots/latency-vs-rate.svg",
        "Latency against offered rate",
        "latency (us)",
        &lat,
    )?);
    let tp: Vec<_> = series(a, "throughput")
        .into_iter()
        .enumerate()
        .map(|(i, (k, v))| (k, v, false, i))
        .collect();
    out.extend(line_plot(
        dir,
        "plots/throughput-vs-rate.svg",
        "Throughput against offered rate",
        "achieved (requests/s)",
        &tp,
    )?);
    let tok: Vec<_> = series(a, "tokens_per_s")
        .into_iter()
        .enumerate()
        .map(|(i, (k, v))| (k, v, false, i))
        .collect();
    out.extend(line_plot(
        dir,
        "plots/tokens-vs-rate.svg",
        "Tokens/s against offered rate",
        "tokens/s",
        &tok,
    )?);
    out.extend(ttft_plot(dir, a)?);
    Ok(out)
}
