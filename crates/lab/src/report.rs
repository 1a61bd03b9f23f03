//! `bgs lab report DIR`: statistics over the raw per-run records, then `report.md`, CSV, JSON
//! and SVG plots.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde::Serialize;
use serde_json::Value;

use crate::criterion::{Evaluated, Expr, split_stat};
use crate::metrics::{self, METRICS};
use crate::record::{RunRecord, invalid_reasons};
use crate::spec::{Cell, CriterionSpec, Experiment};
use crate::stats::{Interval, mean_interval, paired_diff, paired_ratio};

/// Statistics of one metric between two conditions.
#[derive(Clone, Debug, Serialize)]
pub struct MetricComparison {
    /// Mean of the baseline's block values.
    pub baseline: f64,
    /// Mean of the treatment's block values.
    pub treatment: f64,
    /// treatment − baseline, paired t interval.
    pub diff: Interval,
    /// treatment / baseline, paired log-ratio interval.
    pub ratio: Interval,
}

/// One condition against the baseline, in one cell.
#[derive(Clone, Debug, Serialize)]
pub struct Comparison {
    /// Baseline condition.
    pub baseline: String,
    /// Treatment condition.
    pub treatment: String,
    /// Blocks where both ran.
    pub pairs: usize,
    /// Invalid runs among those pairs.
    pub invalid_runs: usize,
    /// Per metric (only metrics measured in both).
    pub metrics: BTreeMap<String, MetricComparison>,
}

impl Comparison {
    /// Look up a statistic such as `cpu_ratio_upper` (NaN if unknown or not computable).
    pub fn stat(&self, name: &str) -> f64 {
        let Some((m, s)) = split_stat(name) else {
            return f64::NAN;
        };
        let Some(c) = self.metrics.get(m) else {
            return f64::NAN;
        };
        match s {
            "ratio" => c.ratio.point,
            "ratio_lower" => c.ratio.lower,
            "ratio_upper" => c.ratio.upper,
            "diff" => c.diff.point,
            "diff_lower" => c.diff.lower,
            "diff_upper" => c.diff.upper,
            "baseline" => c.baseline,
            "treatment" => c.treatment,
            _ => f64::NAN,
        }
    }
}

/// The criterion's outcome in one cell.
#[derive(Clone, Debug, Serialize)]
pub struct Verdict {
    /// "met", "not met" or "undecided".
    pub outcome: String,
    /// The comparisons with the numbers that decided them.
    pub evaluated: Vec<Evaluated>,
    /// Why undecided, if so.
    pub why: Option<String>,
}

/// One condition's runs in one cell.
#[derive(Clone, Debug, Serialize)]
pub struct ConditionSummary {
    /// Condition name.
    pub condition: String,
    /// Runs found.
    pub runs: usize,
    /// Invalid runs among them.
    pub invalid: usize,
    /// Mean over blocks with a 95% interval, per metric.
    pub metrics: BTreeMap<String, Interval>,
}

/// One run's row.
#[derive(Clone, Debug, Serialize)]
pub struct RunRow {
    /// Block.
    pub block: usize,
    /// Position in its block.
    pub position: usize,
    /// Condition.
    pub condition: String,
    /// Seed.
    pub seed: u64,
    /// Valid.
    pub valid: bool,
    /// Why not.
    pub invalid_reasons: Vec<String>,
    /// Metrics recomputed from the raw record.
    pub metrics: BTreeMap<String, f64>,
    /// Server CPU per request by thread name (us/req), recomputed from the raw record.
    pub server_threads: BTreeMap<String, f64>,
    /// Record file, relative to DIR.
    pub file: String,
}

/// One cell.
#[derive(Clone, Debug, Serialize)]
pub struct CellAnalysis {
    /// The cell.
    pub cell: Cell,
    /// Per condition, in the experiment's order.
    pub conditions: Vec<ConditionSummary>,
    /// Every run, by block then position.
    pub runs: Vec<RunRow>,
    /// Each other condition against the baseline.
    pub comparisons: Vec<Comparison>,
    /// The criterion, when the experiment has one.
    pub verdict: Option<Verdict>,
    /// CPU sets the runs used (server, load generator), as resolved at run time.
    pub cpu_sets: Option<(String, String)>,
}

/// The whole analysis (`report.json`).
#[derive(Clone, Debug, Serialize)]
pub struct Analysis {
    /// Experiment name.
    pub experiment: String,
    /// Its description.
    pub description: String,
    /// screen or confirm.
    pub phase: String,
    /// Notes from the file.
    pub notes: Vec<String>,
    /// Condition names.
    pub conditions: Vec<String>,
    /// Condition flags (name, serve args, note).
    pub condition_args: Vec<(String, Vec<String>, String)>,
    /// The criterion.
    pub criterion: Option<CriterionSpec>,
    /// Runs read.
    pub total_runs: usize,
    /// Invalid runs.
    pub invalid_runs: usize,
    /// Git revisions of the binaries that ran (from the load reports).
    pub revisions: Vec<String>,
    /// Machines.
    pub machines: Vec<Value>,
    /// First and last run start (UTC).
    pub started: Option<String>,
    /// Per cell.
    pub cells: Vec<CellAnalysis>,
}

/// Read every record under `DIR/runs`.
pub fn read_records(dir: &Path) -> Result<Vec<(PathBuf, RunRecord)>> {
    let mut out = Vec::new();
    let runs = dir.join("runs");
    let mut stack = vec![runs.clone()];
    while let Some(d) = stack.pop() {
        let rd = fs::read_dir(&d).with_context(|| format!("reading {}", d.display()))?;
        for ent in rd {
            let p = ent?.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.to_string_lossy().ends_with(".run.json") {
                let text = fs::read_to_string(&p)?;
                let rec: RunRecord = serde_json::from_str(&text)
                    .with_context(|| format!("parsing {}", p.display()))?;
                let rel = p.strip_prefix(dir).unwrap_or(&p).to_path_buf();
                out.push((rel, rec));
            }
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

fn utc(ms: u64) -> String {
    let secs = ms / 1000;
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Thread groups shown per cell in the report (the rest are in `report.json`).
const THREADS_SHOWN: usize = 8;

/// The server's CPU per request by thread name, mean over each condition's valid runs: where
/// the schedstat total of the condition table goes. Nothing when no run has a breakdown.
fn thread_table(s: &mut String, c: &CellAnalysis) {
    let mean = |cond: &str, name: &str| -> f64 {
        let xs: Vec<f64> = c
            .runs
            .iter()
            .filter(|r| r.valid && r.condition == cond && !r.server_threads.is_empty())
            .map(|r| r.server_threads.get(name).copied().unwrap_or(0.0))
            .collect();
        if xs.is_empty() {
            f64::NAN
        } else {
            xs.iter().sum::<f64>() / xs.len() as f64
        }
    };
    // Names ordered by their largest mean over the conditions.
    let mut names: Vec<(String, f64)> = Vec::new();
    for r in &c.runs {
        for n in r.server_threads.keys() {
            if !names.iter().any(|(x, _)| x == n) {
                let top = c
                    .conditions
                    .iter()
                    .map(|x| mean(&x.condition, n))
                    .filter(|v| !v.is_nan())
                    .fold(0.0, f64::max);
                names.push((n.clone(), top));
            }
        }
    }
    if names.is_empty() {
        return;
    }
    names.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let _ = writeln!(
        s,
        "\nServer CPU by thread (schedstat us/req, mean of valid runs; top {THREADS_SHOWN}):\n"
    );
    let header: Vec<&str> = c.conditions.iter().map(|x| x.condition.as_str()).collect();
    let _ = writeln!(s, "| thread | {} |", header.join(" | "));
    let _ = writeln!(s, "|---|{}", "---|".repeat(header.len()));
    for (n, _) in names.iter().take(THREADS_SHOWN) {
        let row: Vec<String> = c
            .conditions
            .iter()
            .map(|x| fnum(mean(&x.condition, n)))
            .collect();
        let _ = writeln!(s, "| `{n}` | {} |", row.join(" | "));
    }
}

/// Analyse the results in `dir` (the experiment file is `dir/experiment.toml`).
pub fn analyse(dir: &Path) -> Result<Analysis> {
    let e = Experiment::load(&dir.join("experiment.toml"))?;
    let recs = read_records(dir)?;
    if recs.is_empty() {
        bail!("{}: no run records under runs/", dir.display());
    }
    let phase = recs[0].1.phase.clone();
    let baseline = e
        .criterion
        .as_ref()
        .map_or_else(|| e.conditions[0].name.clone(), |c| c.baseline.clone());
    let expr = e
        .criterion
        .as_ref()
        .map(|c| Expr::parse(&c.expr))
        .transpose()?;
    // Cells in grid order, then any others found on disk (a different grid is not expected).
    let mut cell_ids: Vec<Cell> = e.cells();
    for (_, r) in &recs {
        if !cell_ids.iter().any(|c| c.id == r.cell.id) {
            cell_ids.push(r.cell.clone());
        }
    }
    let mut cells = Vec::new();
    let mut revisions = Vec::new();
    let mut machines: Vec<Value> = Vec::new();
    let mut invalid_total = 0;
    for cell in cell_ids {
        let mine: Vec<&(PathBuf, RunRecord)> =
            recs.iter().filter(|(_, r)| r.cell.id == cell.id).collect();
        if mine.is_empty() {
            continue;
        }
        let mut runs: Vec<RunRow> = mine
            .iter()
            .map(|(p, r)| {
                // Recompute from the raw contents: the report never trusts stored summaries.
                let why = invalid_reasons(r, e.asked_rate(&r.cell), e.load.behind_fraction);
                if let Some(doc) = &r.load {
                    if let Some(rev) = doc.get("git_revision").and_then(Value::as_str)
                        && !revisions.iter().any(|x| x == rev)
                    {
                        revisions.push(rev.to_string());
                    }
                    if let Some(m) = doc.get("machine")
                        && !machines.contains(m)
                    {
                        machines.push(m.clone());
                    }
                }
                RunRow {
                    block: r.block,
                    position: r.position,
                    condition: r.condition.clone(),
                    seed: r.seed,
                    valid: why.is_empty(),
                    invalid_reasons: why,
                    metrics: metrics::compute(r),
                    server_threads: metrics::server_threads(r),
                    file: p.display().to_string(),
                }
            })
            .collect();
        runs.sort_by_key(|r| (r.block, r.position));
        invalid_total += runs.iter().filter(|r| !r.valid).count();
        let blocks: Vec<usize> = {
            let mut b: Vec<usize> = runs.iter().map(|r| r.block).collect();
            b.sort_unstable();
            b.dedup();
            b
        };
        let value = |cond: &str, block: usize, m: &str| -> Option<f64> {
            runs.iter()
                .find(|r| r.condition == cond && r.block == block)
                .map(|r| r.metrics.get(m).copied().unwrap_or(f64::NAN))
        };
        let mut conditions = Vec::new();
        for c in &e.conditions {
            let rs: Vec<&RunRow> = runs.iter().filter(|r| r.condition == c.name).collect();
            let mut ms = BTreeMap::new();
            for d in METRICS {
                let xs: Vec<f64> = rs
                    .iter()
                    .map(|r| r.metrics.get(d.name).copied().unwrap_or(f64::NAN))
                    .collect();
                if xs.iter().all(|x| x.is_nan()) {
                    continue;
                }
                ms.insert(d.name.to_string(), mean_interval(&xs));
            }
            conditions.push(ConditionSummary {
                condition: c.name.clone(),
                runs: rs.len(),
                invalid: rs.iter().filter(|r| !r.valid).count(),
                metrics: ms,
            });
        }
        let mut comparisons = Vec::new();
        // The criterion's treatment first, then the others in file order.
        let mut others: Vec<String> = e
            .conditions
            .iter()
            .map(|c| c.name.clone())
            .filter(|n| *n != baseline)
            .collect();
        if let Some(c) = &e.criterion {
            others.sort_by_key(|n| *n != c.treatment);
        }
        for t in others {
            let paired: Vec<usize> = blocks
                .iter()
                .copied()
                .filter(|&b| {
                    value(&baseline, b, "throughput").is_some()
                        && value(&t, b, "throughput").is_some()
                })
                .collect();
            let invalid_runs = runs
                .iter()
                .filter(|r| {
                    !r.valid
                        && paired.contains(&r.block)
                        && (r.condition == baseline || r.condition == t)
                })
                .count();
            let mut ms = BTreeMap::new();
            for d in METRICS {
                let b: Vec<f64> = paired
                    .iter()
                    .map(|&k| value(&baseline, k, d.name).unwrap_or(f64::NAN))
                    .collect();
                let tr: Vec<f64> = paired
                    .iter()
                    .map(|&k| value(&t, k, d.name).unwrap_or(f64::NAN))
                    .collect();
                if b.iter().chain(&tr).all(|x| x.is_nan()) {
                    continue;
                }
                ms.insert(
                    d.name.to_string(),
                    MetricComparison {
                        baseline: crate::stats::mean(&b),
                        treatment: crate::stats::mean(&tr),
                        diff: paired_diff(&b, &tr),
                        ratio: paired_ratio(&b, &tr),
                    },
                );
            }
            comparisons.push(Comparison {
                baseline: baseline.clone(),
                treatment: t,
                pairs: paired.len(),
                invalid_runs,
                metrics: ms,
            });
        }
        let verdict = match (&expr, &e.criterion) {
            (Some(x), Some(cs)) => {
                let cmp = comparisons.iter().find(|c| c.treatment == cs.treatment);
                let (res, evaluated) = match cmp {
                    Some(c) => x.eval(&|s: &str| c.stat(s)),
                    None => x.eval(&|_: &str| f64::NAN),
                };
                let invalid = cmp.map_or(0, |c| c.invalid_runs);
                let (outcome, why) = if invalid > 0 {
                    (
                        "undecided".to_string(),
                        Some(format!(
                            "{invalid} invalid run(s) in the compared conditions (numbers shown, not trusted)"
                        )),
                    )
                } else {
                    match res {
                        Some(true) => ("met".into(), None),
                        Some(false) => ("not met".into(), None),
                        None => (
                            "undecided".into(),
                            Some("a statistic could not be computed (too few pairs, or a zero/missing value)".into()),
                        ),
                    }
                };
                Some(Verdict {
                    outcome,
                    evaluated,
                    why,
                })
            }
            _ => None,
        };
        let cpu_sets = mine.first().map(|(_, r)| {
            let f = |v: &Option<Vec<usize>>| {
                v.as_ref().map_or("unpinned".to_string(), |v| {
                    v.iter().map(usize::to_string).collect::<Vec<_>>().join(",")
                })
            };
            (f(&r.server_cpu_set), f(&r.client_cpu_set))
        });
        cells.push(CellAnalysis {
            cpu_sets,
            cell,
            conditions,
            runs,
            comparisons,
            verdict,
        });
    }
    let started = recs.iter().map(|(_, r)| r.started_unix_ms).min().map(utc);
    Ok(Analysis {
        experiment: e.name.clone(),
        description: e.description.clone(),
        phase,
        notes: e.notes.clone(),
        conditions: e.conditions.iter().map(|c| c.name.clone()).collect(),
        condition_args: e
            .conditions
            .iter()
            .map(|c| (c.name.clone(), c.args.clone(), c.note.clone()))
            .collect(),
        criterion: e.criterion.clone(),
        total_runs: recs.len(),
        invalid_runs: invalid_total,
        revisions,
        machines,
        started,
        cells,
    })
}

/// Format a number for a table: "-" for NaN, fewer decimals for large values.
pub fn fnum(v: f64) -> String {
    if !v.is_finite() {
        "-".into()
    } else if v.abs() >= 1000.0 {
        format!("{v:.0}")
    } else if v.abs() >= 100.0 {
        format!("{v:.1}")
    } else if v.abs() >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

fn fint(i: &Interval) -> String {
    if i.lower.is_finite() {
        format!("{} [{}, {}]", fnum(i.point), fnum(i.lower), fnum(i.upper))
    } else {
        fnum(i.point)
    }
}

fn get(m: &BTreeMap<String, Interval>, k: &str) -> f64 {
    m.get(k).map_or(f64::NAN, |i| i.point)
}

/// The metrics shown in a comparison table (those measured).
const COMPARED: &[&str] = &[
    "cpu",
    "server_user",
    "server_sys",
    "server_helpers",
    "host_cpu",
    "host_server_cpus",
    "host_client_cpus",
    "host_softirq",
    "net_rx",
    "net_tx",
    "client_cpu",
    "p50",
    "p99",
    "p999",
    "throughput",
    "tokens_per_s",
    "ttft_p99",
    "gap_p99",
    "cpu_per_token",
    "host_cpu_per_token",
];

/// Render `report.md`.
pub fn markdown(a: &Analysis, e: &Experiment, plots: &[String]) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# Experiment `{}` ({})\n", a.experiment, a.phase);
    if !a.description.is_empty() {
        let _ = writeln!(s, "{}\n", a.description.trim());
    }
    let _ = writeln!(
        s,
        "- runs: {} ({} invalid), started {}; revision(s): {}",
        a.total_runs,
        a.invalid_runs,
        a.started.as_deref().unwrap_or("-"),
        if a.revisions.is_empty() {
            "-".into()
        } else {
            a.revisions.join(", ")
        }
    );
    for m in &a.machines {
        let _ = writeln!(s, "- machine: {m}");
    }
    let _ = writeln!(
        s,
        "- design: {} paired blocks per cell; every block starts a fresh server process per condition; \
         order counterbalanced (two conditions: AB, BA, AB, ...; more: rotated, odd blocks reversed); \
         both conditions of a block share its payload seed.",
        a.cells
            .iter()
            .flat_map(|c| c.runs.iter().map(|r| r.block + 1))
            .max()
            .unwrap_or(e.blocks)
    );
    let _ = writeln!(
        s,
        "- server: `bgs serve {}` + condition flags, CPUs {}; load: `bgs load` (child process) CPUs {}",
        e.server.args.join(" "),
        e.server.cpus.as_deref().unwrap_or("unpinned"),
        e.load.cpus.as_deref().unwrap_or("unpinned")
    );
    let _ = writeln!(
        s,
        "- intervals: nominal paired 95% t intervals over blocks (t quantiles from statrs). Ratios: \
         the paired log-ratio t interval, exponentiated (point = geometric mean of per-block ratios). \
         Failures and timeouts stay in every statistic; a run that failed requests or fell behind \
         schedule is marked invalid below, and a criterion over invalid runs is reported undecided."
    );
    let _ = writeln!(
        s,
        "- CPU scopes are reported separately and never summed: server process (schedstat, all threads \
         incl. SQPOLL/io-wq; tick-based user/system beside it), softirq (/proc/softirqs NET_RX/NET_TX: \
         exact counts; /proc/stat softirq column: tick-sampled estimate), whole host (/proc/stat busy = \
         wall x CPUs − idle − iowait − steal), the load generator, and this lab process (observer)."
    );
    let _ = writeln!(
        s,
        "- **Loopback caveat:** on loopback the receive softirq runs in the *sender's* context, so \
         process CPU moves between client and server with the transport. Whole-host CPU with disjoint \
         server/client CPU sets (`host_cpu`, `host_server_cpus`) is part of every kernel-versus-native verdict.\n"
    );
    for (name, args, note) in &a.condition_args {
        let _ = writeln!(
            s,
            "- condition `{name}`: `{}`{}",
            args.join(" "),
            if note.is_empty() {
                String::new()
            } else {
                format!(" — {note}")
            }
        );
    }
    for n in &a.notes {
        let _ = writeln!(s, "- note: {n}");
    }
    if let Some(c) = &a.criterion {
        let _ = writeln!(
            s,
            "\n**Success criterion (fixed before the run)**, `{}` over `{}`: `{}`",
            c.treatment, c.baseline, c.expr
        );
    }
    for c in &a.cells {
        let _ = writeln!(s, "\n## Cell `{}`\n", c.cell.id);
        let _ = writeln!(
            s,
            "rate {} req/s, {} connections, repeat {}, server CPUs {}\n",
            fnum(c.cell.rate),
            c.cell.connections,
            c.cell.repeat,
            c.cell.server_cpus.as_deref().unwrap_or("unpinned")
        );
        if let Some((sc, cc)) = &c.cpu_sets {
            let _ = writeln!(s, "resolved CPU sets: server {sc}, load generator {cc}\n");
        }
        let gen_ = c
            .conditions
            .iter()
            .any(|x| x.metrics.contains_key("tokens_per_s"));
        let _ = writeln!(
            s,
            "| condition | runs (invalid) | rate | achieved/s |{} p50 us | p99 us | server us/req user / sys / schedstat | host us/req | server CPUs us/req | host softirq us/req | NET_RX/req | client us/req | observer us/req | failures |",
            if gen_ {
                " tokens/s | TTFT p99 us | us/token |"
            } else {
                ""
            }
        );
        let _ = writeln!(
            s,
            "|---|---|---|---|{}---|---|---|---|---|---|---|---|---|---|",
            if gen_ { "---|---|---|" } else { "" }
        );
        for x in &c.conditions {
            let m = &x.metrics;
            let _ = writeln!(
                s,
                "| {} | {} ({}) | {} | {} |{} {} | {} | {} / {} / **{}** | {} | {} | {} | {} | {} | {} | {} |",
                x.condition,
                x.runs,
                x.invalid,
                fnum(c.cell.rate),
                fnum(get(m, "throughput")),
                if gen_ {
                    format!(
                        " {} | {} | {} |",
                        fnum(get(m, "tokens_per_s")),
                        fnum(get(m, "ttft_p99")),
                        fnum(get(m, "cpu_per_token"))
                    )
                } else {
                    String::new()
                },
                fnum(get(m, "p50")),
                fnum(get(m, "p99")),
                fnum(get(m, "server_user")),
                fnum(get(m, "server_sys")),
                fnum(get(m, "cpu")),
                fnum(get(m, "host_cpu")),
                fnum(get(m, "host_server_cpus")),
                fnum(get(m, "host_softirq")),
                fnum(get(m, "net_rx")),
                fnum(get(m, "client_cpu")),
                fnum(get(m, "observer_cpu")),
                fnum(get(m, "failures")),
            );
        }
        thread_table(&mut s, c);
        for cmp in &c.comparisons {
            let _ = writeln!(
                s,
                "\n`{}` against `{}` ({} pairs{}):\n",
                cmp.treatment,
                cmp.baseline,
                cmp.pairs,
                if cmp.invalid_runs > 0 {
                    format!(", **{} invalid run(s)**", cmp.invalid_runs)
                } else {
                    String::new()
                }
            );
            let _ = writeln!(
                s,
                "| metric | unit | {} | {} | difference [95%] | ratio [95%] |",
                cmp.baseline, cmp.treatment
            );
            let _ = writeln!(s, "|---|---|---|---|---|---|");
            for name in COMPARED {
                if let Some(mc) = cmp.metrics.get(*name) {
                    if mc.baseline.is_nan() && mc.treatment.is_nan() {
                        continue;
                    }
                    let unit = metrics::def(name).map_or("", |d| d.unit);
                    let _ = writeln!(
                        s,
                        "| {name} | {unit} | {} | {} | {} | {} |",
                        fnum(mc.baseline),
                        fnum(mc.treatment),
                        fint(&mc.diff),
                        fint(&mc.ratio)
                    );
                }
            }
        }
        if let Some(v) = &c.verdict {
            let _ = writeln!(
                s,
                "\n**Criterion: {}**{}",
                v.outcome.to_uppercase(),
                v.why.as_ref().map_or(String::new(), |w| format!(" ({w})"))
            );
            for ev in &v.evaluated {
                let _ = writeln!(
                    s,
                    "- `{}`: value {} -> {}",
                    ev.text,
                    fnum(ev.value),
                    match ev.holds {
                        Some(true) => "holds",
                        Some(false) => "fails",
                        None => "not computable",
                    }
                );
            }
        }
        let _ = writeln!(
            s,
            "\nPer block (raw records under `runs/{}/`):\n",
            c.cell.slug
        );
        let _ = writeln!(
            s,
            "| block | pos | condition | seed | valid | achieved/s | p99 us | server us/req | host us/req | client us/req | notes |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|");
        for r in &c.runs {
            let g = |k: &str| r.metrics.get(k).copied().unwrap_or(f64::NAN);
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                r.block,
                r.position,
                r.condition,
                r.seed,
                if r.valid { "yes" } else { "**no**" },
                fnum(g("throughput")),
                fnum(g("p99")),
                fnum(g("cpu")),
                fnum(g("host_cpu")),
                fnum(g("client_cpu")),
                r.invalid_reasons.join("; ")
            );
        }
    }
    if !plots.is_empty() {
        let _ = writeln!(s, "\n## Plots\n");
        for p in plots {
            let _ = writeln!(s, "![{p}]({p})");
        }
    }
    let _ = writeln!(s, "\n## Metrics\n");
    for d in METRICS {
        let _ = writeln!(s, "- `{}` ({}): {}", d.name, d.unit, d.about);
    }
    let _ = writeln!(
        s,
        "\nFiles: `runs.csv` (one row per run), `summary.csv` (means per cell and condition), \
         `comparisons.csv`, `report.json` (everything above)."
    );
    s
}

fn csv_num(v: f64) -> String {
    if v.is_finite() {
        format!("{v}")
    } else {
        String::new()
    }
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// `runs.csv`, `summary.csv`, `comparisons.csv`.
pub fn csvs(a: &Analysis) -> (String, String, String) {
    let names: Vec<&str> = METRICS.iter().map(|d| d.name).collect();
    let mut runs = format!(
        "cell,block,position,condition,seed,valid,invalid_reasons,{}\n",
        names.join(",")
    );
    let mut summary = String::from("cell,condition,runs,invalid,metric,mean,lower95,upper95,n\n");
    let mut cmps = String::from(
        "cell,baseline,treatment,pairs,invalid_runs,metric,baseline_mean,treatment_mean,diff,diff_lower95,diff_upper95,ratio,ratio_lower95,ratio_upper95\n",
    );
    for c in &a.cells {
        for r in &c.runs {
            let vals: Vec<String> = names
                .iter()
                .map(|n| csv_num(r.metrics.get(*n).copied().unwrap_or(f64::NAN)))
                .collect();
            let _ = writeln!(
                runs,
                "{},{},{},{},{},{},{},{}",
                csv_field(&c.cell.id),
                r.block,
                r.position,
                csv_field(&r.condition),
                r.seed,
                r.valid,
                csv_field(&r.invalid_reasons.join("; ")),
                vals.join(",")
            );
        }
        for x in &c.conditions {
            for (m, i) in &x.metrics {
                let _ = writeln!(
                    summary,
                    "{},{},{},{},{m},{},{},{},{}",
                    csv_field(&c.cell.id),
                    csv_field(&x.condition),
                    x.runs,
                    x.invalid,
                    csv_num(i.point),
                    csv_num(i.lower),
                    csv_num(i.upper),
                    i.n
                );
            }
        }
        for cmp in &c.comparisons {
            for (m, mc) in &cmp.metrics {
                let _ = writeln!(
                    cmps,
                    "{},{},{},{},{},{m},{},{},{},{},{},{},{},{}",
                    csv_field(&c.cell.id),
                    csv_field(&cmp.baseline),
                    csv_field(&cmp.treatment),
                    cmp.pairs,
                    cmp.invalid_runs,
                    csv_num(mc.baseline),
                    csv_num(mc.treatment),
                    csv_num(mc.diff.point),
                    csv_num(mc.diff.lower),
                    csv_num(mc.diff.upper),
                    csv_num(mc.ratio.point),
                    csv_num(mc.ratio.lower),
                    csv_num(mc.ratio.upper)
                );
            }
        }
    }
    (runs, summary, cmps)
}

/// Write `report.md`, the CSVs, `report.json` and the plots into `dir`. Returns the analysis.
pub fn write_report(dir: &Path) -> Result<Analysis> {
    let e = Experiment::load(&dir.join("experiment.toml"))?;
    let a = analyse(dir)?;
    let plots = crate::plot::write_plots(dir, &a).context("drawing plots")?;
    fs::write(dir.join("report.md"), markdown(&a, &e, &plots))?;
    let (runs, summary, cmps) = csvs(&a);
    fs::write(dir.join("runs.csv"), runs)?;
    fs::write(dir.join("summary.csv"), summary)?;
    fs::write(dir.join("comparisons.csv"), cmps)?;
    fs::write(
        dir.join("report.json"),
        serde_json::to_string_pretty(&a)? + "\n",
    )?;
    Ok(a)
}

/// Pick cells from a screen's analysis by a confirmation rule (`lowest:STAT` or
/// `highest:STAT`, STAT of the criterion's treatment against its baseline, or of the first
/// comparison without a criterion): the `count` best cells whose statistic is a number.
pub fn pick_cells(a: &Analysis, rule: &str, count: usize) -> Result<Vec<String>> {
    let (dir, stat) = rule.split_once(':').ok_or_else(|| {
        anyhow::anyhow!("confirm.rule: {rule:?} is not lowest:STAT or highest:STAT")
    })?;
    let treatment = a.criterion.as_ref().map(|c| c.treatment.clone());
    let mut scored: Vec<(f64, String)> = a
        .cells
        .iter()
        .filter_map(|c| {
            let cmp = match &treatment {
                Some(t) => c.comparisons.iter().find(|x| &x.treatment == t),
                None => c.comparisons.first(),
            }?;
            let v = cmp.stat(stat);
            v.is_finite().then(|| (v, c.cell.id.clone()))
        })
        .collect();
    scored.sort_by(|x, y| x.0.total_cmp(&y.0));
    if dir == "highest" {
        scored.reverse();
    }
    let picked: Vec<String> = scored.into_iter().take(count).map(|s| s.1).collect();
    if picked.is_empty() {
        bail!("confirm.rule {rule:?}: no cell of the screen has that statistic");
    }
    Ok(picked)
}
