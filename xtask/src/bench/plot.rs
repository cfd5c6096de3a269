//! SVG plots and the cells of the tables.

use super::*;

pub(super) fn fmt_size(n: u64) -> String {
    match n {
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{} MiB", n >> 20),
        n if n >= 1024 && n % 1024 == 0 => format!("{} KiB", n >> 10),
        n => format!("{n} B"),
    }
}

/// A log-log (or log-x) SVG line plot.
pub(super) fn svg(
    title: &str,
    ylabel: &str,
    series: &[(String, Vec<(f64, f64)>)],
    logy: bool,
) -> String {
    let (w, h, ml, mr, mt, mb) = (760.0, 440.0, 70.0, 200.0, 40.0, 50.0);
    let pts: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|s| s.1.iter().copied())
        .filter(|p| p.0 > 0.0 && (!logy || p.1 > 0.0))
        .collect();
    if pts.is_empty() {
        return String::new();
    }
    let lx = |x: f64| x.log10();
    let ly = |y: f64| if logy { y.log10() } else { y };
    let (x0, x1) = pts.iter().fold((f64::MAX, f64::MIN), |a, p| {
        (a.0.min(lx(p.0)), a.1.max(lx(p.0)))
    });
    let (mut y0, mut y1) = pts.iter().fold((f64::MAX, f64::MIN), |a, p| {
        (a.0.min(ly(p.1)), a.1.max(ly(p.1)))
    });
    if logy {
        y0 = y0.floor();
        y1 = y1.ceil();
    } else {
        y0 = 0.0;
        y1 = (y1 * 1.1).max(1e-9);
    }
    let (x0, x1) = (x0.floor(), x1.ceil().max(x0.floor() + 1.0));
    let (y0, y1) = (y0, if y1 > y0 { y1 } else { y0 + 1.0 });
    let px = |x: f64| ml + (lx(x) - x0) / (x1 - x0) * (w - ml - mr);
    let py = |y: f64| h - mb - (ly(y) - y0) / (y1 - y0) * (h - mt - mb);
    let mut s = format!("<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' font-family='sans-serif' font-size='11'>\n<rect width='100%' height='100%' fill='white'/>\n");
    let _ = writeln!(s, "<text x='{}' y='20' font-size='14'>{title}</text>", ml);
    let _ = writeln!(
        s,
        "<line x1='{ml}' y1='{}' x2='{}' y2='{}' stroke='black'/>",
        h - mb,
        w - mr,
        h - mb
    );
    let _ = writeln!(
        s,
        "<line x1='{ml}' y1='{mt}' x2='{ml}' y2='{}' stroke='black'/>",
        h - mb
    );
    for e in (x0 as i32)..=(x1 as i32) {
        let x = ml + (f64::from(e) - x0) / (x1 - x0) * (w - ml - mr);
        let _ = writeln!(s, "<line x1='{x}' y1='{mt}' x2='{x}' y2='{}' stroke='#ddd'/><text x='{x}' y='{}' text-anchor='middle'>{}</text>", h - mb, h - mb + 15.0, fmt_size(10f64.powi(e) as u64).replace(" B", "B"));
    }
    let _ = writeln!(
        s,
        "<text x='{}' y='{}' text-anchor='middle'>message size (bytes, log)</text>",
        (ml + w - mr) / 2.0,
        h - 12.0
    );
    let steps = if logy { (y1 - y0) as i32 } else { 5 };
    for i in 0..=steps {
        let v = y0 + (y1 - y0) * f64::from(i) / f64::from(steps.max(1));
        let y = h - mb - (v - y0) / (y1 - y0) * (h - mt - mb);
        let label = if logy {
            format!("{:.0e}", 10f64.powf(v))
        } else {
            format!("{v:.0}")
        };
        let _ = writeln!(s, "<line x1='{ml}' y1='{y}' x2='{}' y2='{y}' stroke='#eee'/><text x='{}' y='{}' text-anchor='end'>{label}</text>", w - mr, ml - 5.0, y + 4.0);
    }
    let _ = writeln!(
        s,
        "<text x='15' y='{}' transform='rotate(-90 15 {})' text-anchor='middle'>{ylabel}</text>",
        (mt + h - mb) / 2.0,
        (mt + h - mb) / 2.0
    );
    let colors = [
        "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
        "#bcbd22", "#17becf", "#000000", "#aec7e8",
    ];
    for (i, (name, ps)) in series.iter().enumerate() {
        let c = colors[i % colors.len()];
        let ps: Vec<&(f64, f64)> = ps
            .iter()
            .filter(|p| p.0 > 0.0 && (!logy || p.1 > 0.0))
            .collect();
        if ps.is_empty() {
            continue;
        }
        let path: Vec<String> = ps
            .iter()
            .map(|p| format!("{:.1},{:.1}", px(p.0), py(p.1)))
            .collect();
        let _ = writeln!(
            s,
            "<polyline fill='none' stroke='{c}' stroke-width='2' points='{}'/>",
            path.join(" ")
        );
        for p in &ps {
            let _ = writeln!(
                s,
                "<circle cx='{:.1}' cy='{:.1}' r='3' fill='{c}'/>",
                px(p.0),
                py(p.1)
            );
        }
        let ly = mt + 10.0 + i as f64 * 16.0;
        let _ = writeln!(s, "<line x1='{}' y1='{ly}' x2='{}' y2='{ly}' stroke='{c}' stroke-width='3'/><text x='{}' y='{}'>{name}</text>", w - mr + 10.0, w - mr + 30.0, w - mr + 35.0, ly + 4.0);
    }
    s.push_str("</svg>\n");
    s
}

/// Series of `metric` against size, one per (tool, variant) at the largest depth measured.
pub(super) fn series(
    sum: &BTreeMap<Key, (f64, f64, f64, usize)>,
    metric: &str,
    scale: f64,
) -> Vec<(String, Vec<(f64, f64)>)> {
    let mut by: BTreeMap<String, BTreeMap<u64, (usize, f64)>> = BTreeMap::new();
    for ((tool, variant, size, depth, m), v) in sum {
        if m != metric
            || tool.ends_with("-ping")
            || tool == "exs-wait"
            || tool == "exs-exposure"
            || tool == "exs-deep"
        {
            continue;
        }
        let e = by
            .entry(format!("{tool} {variant}"))
            .or_default()
            .entry(*size)
            .or_insert((0, 0.0));
        if *depth >= e.0 {
            *e = (*depth, v.0 * scale);
        }
    }
    by.into_iter()
        .map(|(k, pts)| {
            (
                k,
                pts.into_iter().map(|(s, (_, v))| (s as f64, v)).collect(),
            )
        })
        .collect()
}

pub(super) fn get(
    sum: &BTreeMap<Key, (f64, f64, f64, usize)>,
    tool: &str,
    variant: &str,
    size: u64,
    metric: &str,
) -> Option<(f64, f64, f64)> {
    sum.iter()
        .filter(|(k, _)| k.0 == tool && k.1 == variant && k.2 == size && k.4 == metric)
        .max_by_key(|(k, _)| k.3)
        .map(|(_, v)| (v.0, v.1, v.2))
}

pub(super) fn cell(v: Option<(f64, f64, f64)>, scale: f64, digits: usize) -> String {
    match v {
        Some((m, lo, hi)) => format!(
            "{:.*} ({:.*}-{:.*})",
            digits,
            m * scale,
            digits,
            lo * scale,
            digits,
            hi * scale
        ),
        None => "-".into(),
    }
}
