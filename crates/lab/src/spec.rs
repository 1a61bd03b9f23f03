//! Experiment files (TOML): what to compare, under which load, how often, and what counts as
//! success. `docs/lab.md` documents every key; [`Experiment::parse`] validates a file fully
//! before anything runs, and every error names the key.

use std::collections::BTreeSet;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

use crate::criterion::Expr;

fn default_blocks() -> usize {
    5
}
fn default_seed() -> u64 {
    1
}
fn default_listen() -> String {
    "127.0.0.1:0".into()
}
fn default_startup() -> f64 {
    60.0
}
fn default_stop() -> f64 {
    20.0
}
fn default_op() -> String {
    "gemm8".into()
}
fn default_one() -> u32 {
    1
}
fn default_words() -> u32 {
    64
}
fn default_connections() -> usize {
    128
}
fn default_warmup() -> f64 {
    1.0
}
fn default_behind() -> f64 {
    0.95
}

/// A whole experiment file.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Experiment {
    /// Short name (used in the report's title).
    pub name: String,
    /// What the experiment asks, in words.
    #[serde(default)]
    pub description: String,
    /// Paired blocks: each block runs every condition once, on a fresh server process.
    #[serde(default = "default_blocks")]
    pub blocks: usize,
    /// Base payload seed: block b uses `seed + b` (both conditions of a block share it).
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// Explicit seeds, one per block (instead of `seed + b`).
    #[serde(default)]
    pub seeds: Option<Vec<u64>>,
    /// Free-form notes copied into the report (e.g. why a flag does not exist).
    #[serde(default)]
    pub notes: Vec<String>,
    /// The server side, common to every condition.
    #[serde(default)]
    pub server: ServerSpec,
    /// The load, common to every condition.
    pub load: LoadSpec,
    /// Screen grid: every combination is a cell (absent dimensions take `load`'s value).
    #[serde(default)]
    pub grid: Grid,
    /// The conditions compared (at least one; two for a comparison).
    #[serde(rename = "condition")]
    pub conditions: Vec<Condition>,
    /// The success criterion, fixed before the run.
    #[serde(default)]
    pub criterion: Option<CriterionSpec>,
    /// Confirmation: re-run chosen cells with new seeds (`bgs lab run --confirm`).
    #[serde(default)]
    pub confirm: Option<ConfirmSpec>,
}

/// `[server]`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ServerSpec {
    /// `--cpus` of `bgs serve` ("auto": the first allowed CPU when there are at least two).
    #[serde(default)]
    pub cpus: Option<String>,
    /// `bgs serve` flags common to every condition.
    #[serde(default)]
    pub args: Vec<String>,
    /// Listen address (port 0: a free port per server).
    #[serde(default = "default_listen")]
    pub listen: String,
    /// Seconds to wait for `bgs: listening on`.
    #[serde(default = "default_startup")]
    pub startup_timeout_s: f64,
    /// Seconds to wait for the server to exit after SIGTERM before SIGKILL.
    #[serde(default = "default_stop")]
    pub stop_timeout_s: f64,
}

impl Default for ServerSpec {
    fn default() -> Self {
        ServerSpec {
            cpus: None,
            args: Vec::new(),
            listen: default_listen(),
            startup_timeout_s: default_startup(),
            stop_timeout_s: default_stop(),
        }
    }
}

/// `[load]`: the `bgs load` flags.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LoadSpec {
    /// `--cpus` of `bgs load` ("auto": every allowed CPU but the server's first).
    #[serde(default)]
    pub cpus: Option<String>,
    /// echo, gemm8, fft32 or generate.
    #[serde(default = "default_op")]
    pub op: String,
    /// Repeat count of gemm8/fft32 (work size).
    #[serde(default = "default_one")]
    pub repeat: u32,
    /// Echo payload words.
    #[serde(default = "default_words")]
    pub words: u32,
    /// Connections.
    #[serde(default = "default_connections")]
    pub connections: usize,
    /// Offered rate (requests/s); the grid's `rate` list replaces it.
    #[serde(default)]
    pub rate: Option<f64>,
    /// Measured seconds per run.
    #[serde(default)]
    pub duration_s: Option<f64>,
    /// Or measured requests per run.
    #[serde(default)]
    pub requests: Option<u64>,
    /// Warm-up seconds.
    #[serde(default = "default_warmup")]
    pub warmup_s: f64,
    /// Most requests in flight per connection.
    #[serde(default)]
    pub pipeline: Option<usize>,
    /// Client I/O threads.
    #[serde(default)]
    pub threads: Option<usize>,
    /// HTTP POSTs instead of bare frames.
    #[serde(default)]
    pub http: bool,
    /// Per-request timeout, seconds.
    #[serde(default)]
    pub timeout_s: Option<f64>,
    /// Distinct payloads (generate: prompts).
    #[serde(default)]
    pub distinct: Option<usize>,
    /// Generate: prompt tokens.
    #[serde(default)]
    pub prompt_tokens: Option<u32>,
    /// Generate: max new tokens.
    #[serde(default)]
    pub max_tokens: Option<u32>,
    /// Generate: ignore EOS.
    #[serde(default)]
    pub ignore_eos: bool,
    /// Generate: token id range of prompts.
    #[serde(default)]
    pub token_range: Option<u32>,
    /// Closed loop (`bgs load --closed-loop`): saturation throughput; there is no schedule, so
    /// runs are never "behind" and latency is service time.
    #[serde(default)]
    pub closed_loop: bool,
    /// Any further `bgs load` flags, verbatim.
    #[serde(default)]
    pub extra: Vec<String>,
    /// A run whose offered rate is below this fraction of the asked rate fell behind schedule
    /// and is marked invalid.
    #[serde(default = "default_behind")]
    pub behind_fraction: f64,
}

/// `[grid]`: the screen's dimensions. Each list replaces the `[load]`/`[server]` value.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Grid {
    /// Operations (work kinds; a condition's `load.op` still wins).
    #[serde(default)]
    pub op: Vec<String>,
    /// Offered rates.
    #[serde(default)]
    pub rate: Vec<f64>,
    /// Work sizes (repeat counts).
    #[serde(default)]
    pub repeat: Vec<u32>,
    /// Echo payload words.
    #[serde(default)]
    pub words: Vec<u32>,
    /// Connection counts.
    #[serde(default)]
    pub connections: Vec<usize>,
    /// Server CPU sets (`--cpus` of serve).
    #[serde(default)]
    pub server_cpus: Vec<String>,
}

/// One `[[condition]]`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Condition {
    /// Name (unique; used by the criterion).
    pub name: String,
    /// `bgs serve` flags of this condition (after `[server] args`).
    #[serde(default)]
    pub args: Vec<String>,
    /// Load overrides of this condition (e.g. the floor answers echo only).
    #[serde(default)]
    pub load: Option<LoadOverride>,
    /// What the condition is, in words.
    #[serde(default)]
    pub note: String,
}

/// `[condition.load]`: what differs in this condition's load.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LoadOverride {
    /// Operation.
    #[serde(default)]
    pub op: Option<String>,
    /// Echo payload words.
    #[serde(default)]
    pub words: Option<u32>,
    /// Repeat count.
    #[serde(default)]
    pub repeat: Option<u32>,
    /// Further `bgs load` flags.
    #[serde(default)]
    pub extra: Vec<String>,
}

/// `[criterion]`: decided per cell between two named conditions.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CriterionSpec {
    /// The reference condition (ratios are treatment / baseline).
    pub baseline: String,
    /// The condition under test.
    pub treatment: String,
    /// E.g. `cpu_ratio_upper < 0.90 and p99_ratio_upper <= 1.05 and throughput_ratio >= 0.98`.
    pub expr: String,
}

/// `[confirm]`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ConfirmSpec {
    /// Cell ids to re-run (as printed by the screen's report, e.g. `rate=1000,repeat=1`).
    /// Empty: take them from a screen's results with `--confirm-from DIR` and `rule`.
    #[serde(default)]
    pub cells: Vec<String>,
    /// Rule picking cells from a screen: `lowest:METRIC_STAT` or `highest:METRIC_STAT`
    /// (e.g. `lowest:cpu_ratio_upper`), the `count` best cells.
    #[serde(default)]
    pub rule: Option<String>,
    /// How many cells the rule picks.
    #[serde(default)]
    pub count: Option<usize>,
    /// New base seed.
    pub seed: u64,
    /// Blocks (default: the experiment's).
    #[serde(default)]
    pub blocks: Option<usize>,
}

/// Flags the lab sets itself; an experiment may not set them.
const SERVE_OWNED: &[&str] = &["--listen", "--cpus"];
const LOAD_OWNED: &[&str] = &[
    "--target",
    "--server-pid",
    "--json",
    "--cpus",
    "--seed",
    "--strict",
];

/// Known operations of `bgs load`.
pub const OPS: &[&str] = &["echo", "gemm8", "fft32", "generate"];

/// One grid point.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Cell {
    /// Human id, `dim=value` joined by commas (only the grid's dimensions; `main` without one).
    pub id: String,
    /// File-name form of the id.
    pub slug: String,
    /// Operation.
    #[serde(default)]
    pub op: String,
    /// Offered rate.
    pub rate: f64,
    /// Repeat count.
    pub repeat: u32,
    /// Echo words.
    pub words: u32,
    /// Connections.
    pub connections: usize,
    /// Server CPU set (as written; "auto" resolved at run time).
    pub server_cpus: Option<String>,
}

fn check_cpu_list(key: &str, list: &str) -> Result<()> {
    if list == "auto" {
        return Ok(());
    }
    parse_cpu_list(list).with_context(|| format!("{key}: bad CPU list {list:?}"))?;
    Ok(())
}

/// Parse `0,2-3` into CPU numbers.
pub fn parse_cpu_list(list: &str) -> Result<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.trim().parse()?, b.trim().parse()?);
                if a > b {
                    bail!("bad CPU range {part}");
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(part.parse().with_context(|| format!("bad CPU {part:?}"))?),
        }
    }
    if cpus.is_empty() {
        bail!("empty CPU list");
    }
    Ok(cpus)
}

fn check_owned(key: &str, args: &[String], owned: &[&str]) -> Result<()> {
    for a in args {
        let flag = a.split('=').next().unwrap_or(a);
        if owned.contains(&flag) {
            bail!("{key}: {flag} is set by the lab; remove it");
        }
    }
    Ok(())
}

fn positive(key: &str, v: f64) -> Result<()> {
    if !(v.is_finite() && v > 0.0) {
        bail!("{key}: must be a positive number (got {v})");
    }
    Ok(())
}

impl Experiment {
    /// Parse and validate the text of an experiment file.
    pub fn parse(text: &str) -> Result<Experiment> {
        let e: Experiment = toml::from_str(text).map_err(|e| anyhow::anyhow!("{e}"))?;
        e.validate()?;
        Ok(e)
    }

    /// Read, parse and validate a file.
    pub fn load(path: &std::path::Path) -> Result<Experiment> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Experiment::parse(&text).with_context(|| format!("{}", path.display()))
    }

    /// Every check that can be made without running anything.
    pub fn validate(&self) -> Result<()> {
        if self.name.trim().is_empty() {
            bail!("name: must not be empty");
        }
        if self.blocks < 2 {
            bail!(
                "blocks: need at least 2 paired blocks for an interval (got {})",
                self.blocks
            );
        }
        if let Some(s) = &self.seeds
            && s.len() != self.blocks
        {
            bail!(
                "seeds: {} seeds for {} blocks; give one per block",
                s.len(),
                self.blocks
            );
        }
        let sv = &self.server;
        if let Some(c) = &sv.cpus {
            check_cpu_list("server.cpus", c)?;
        }
        check_owned("server.args", &sv.args, SERVE_OWNED)?;
        sv.listen
            .parse::<std::net::SocketAddr>()
            .with_context(|| format!("server.listen: not an address: {:?}", sv.listen))?;
        positive("server.startup_timeout_s", sv.startup_timeout_s)?;
        positive("server.stop_timeout_s", sv.stop_timeout_s)?;
        let l = &self.load;
        if let Some(c) = &l.cpus {
            check_cpu_list("load.cpus", c)?;
        }
        if !OPS.contains(&l.op.as_str()) {
            bail!("load.op: unknown operation {:?} (one of {OPS:?})", l.op);
        }
        if l.rate.is_none() && self.grid.rate.is_empty() {
            bail!("load.rate: give an offered rate (or grid.rate)");
        }
        if let Some(r) = l.rate {
            positive("load.rate", r)?;
        }
        match (l.duration_s, l.requests) {
            (None, None) => bail!("load.duration_s: give a duration (or load.requests)"),
            (Some(d), _) => positive("load.duration_s", d)?,
            (None, Some(0)) => bail!("load.requests: must be at least 1"),
            _ => {}
        }
        if !(l.warmup_s.is_finite() && l.warmup_s >= 0.0) {
            bail!("load.warmup_s: must be zero or more (got {})", l.warmup_s);
        }
        if l.connections == 0 {
            bail!("load.connections: must be at least 1");
        }
        if l.pipeline == Some(0) || l.threads == Some(0) {
            bail!("load.pipeline / load.threads: must be at least 1");
        }
        if let Some(t) = l.timeout_s {
            positive("load.timeout_s", t)?;
        }
        if !(l.behind_fraction > 0.0 && l.behind_fraction <= 1.0) {
            bail!("load.behind_fraction: must be in (0, 1]");
        }
        if matches!(l.op.as_str(), "gemm8" | "fft32") && !(1..=256).contains(&l.repeat) {
            bail!("load.repeat: must be 1..=256 (got {})", l.repeat);
        }
        check_owned("load.extra", &l.extra, LOAD_OWNED)?;
        for (i, op) in self.grid.op.iter().enumerate() {
            if !OPS.contains(&op.as_str()) {
                bail!("grid.op[{i}]: unknown operation {op:?} (one of {OPS:?})");
            }
        }
        for (i, r) in self.grid.rate.iter().enumerate() {
            positive(&format!("grid.rate[{i}]"), *r)?;
        }
        for (i, r) in self.grid.repeat.iter().enumerate() {
            if !(1..=256).contains(r) {
                bail!("grid.repeat[{i}]: must be 1..=256 (got {r})");
            }
        }
        for (i, c) in self.grid.connections.iter().enumerate() {
            if *c == 0 {
                bail!("grid.connections[{i}]: must be at least 1");
            }
        }
        for (i, c) in self.grid.server_cpus.iter().enumerate() {
            check_cpu_list(&format!("grid.server_cpus[{i}]"), c)?;
        }
        if self.conditions.is_empty() {
            bail!("condition: give at least one [[condition]]");
        }
        let mut names = BTreeSet::new();
        for (i, c) in self.conditions.iter().enumerate() {
            let key = format!("condition[{i}]");
            if c.name.trim().is_empty()
                || !c
                    .name
                    .chars()
                    .all(|ch| ch.is_ascii_alphanumeric() || "-_.".contains(ch))
            {
                bail!(
                    "{key}.name: {:?} must be non-empty letters, digits, '-', '_' or '.'",
                    c.name
                );
            }
            if !names.insert(c.name.clone()) {
                bail!("{key}.name: duplicate condition name {:?}", c.name);
            }
            check_owned(&format!("{key}.args"), &c.args, SERVE_OWNED)?;
            if let Some(o) = &c.load {
                if let Some(op) = &o.op
                    && !OPS.contains(&op.as_str())
                {
                    bail!("{key}.load.op: unknown operation {op:?} (one of {OPS:?})");
                }
                if let Some(r) = o.repeat
                    && !(1..=256).contains(&r)
                {
                    bail!("{key}.load.repeat: must be 1..=256 (got {r})");
                }
                check_owned(&format!("{key}.load.extra"), &o.extra, LOAD_OWNED)?;
            }
        }
        if let Some(c) = &self.criterion {
            for (k, n) in [
                ("criterion.baseline", &c.baseline),
                ("criterion.treatment", &c.treatment),
            ] {
                if !names.contains(n) {
                    bail!("{k}: no condition named {n:?} (conditions: {names:?})");
                }
            }
            if c.baseline == c.treatment {
                bail!("criterion.treatment: must differ from criterion.baseline");
            }
            Expr::parse(&c.expr).context("criterion.expr")?;
        }
        if let Some(cf) = &self.confirm {
            if cf.blocks.is_some_and(|b| b < 2) {
                bail!("confirm.blocks: need at least 2");
            }
            let ids: BTreeSet<String> = self.cells().into_iter().map(|c| c.id).collect();
            for (i, id) in cf.cells.iter().enumerate() {
                if !ids.contains(id) {
                    bail!("confirm.cells[{i}]: no cell {id:?} in the grid (cells: {ids:?})");
                }
            }
            if let Some(r) = &cf.rule {
                let (dir, stat) = r.split_once(':').unwrap_or(("", ""));
                if !matches!(dir, "lowest" | "highest") || !crate::criterion::is_stat(stat) {
                    bail!(
                        "confirm.rule: {r:?} is not lowest:STAT or highest:STAT \
                         (STAT like cpu_ratio_upper)"
                    );
                }
                if cf.count == Some(0) {
                    bail!("confirm.count: must be at least 1");
                }
            }
            if cf.cells.is_empty() && cf.rule.is_none() {
                bail!("confirm: give cells or a rule");
            }
        }
        Ok(())
    }

    /// The rate a run of `cell` must keep to be on schedule (0 in closed loop: no schedule).
    pub fn asked_rate(&self, cell: &Cell) -> f64 {
        if self.load.closed_loop {
            0.0
        } else {
            cell.rate
        }
    }

    /// The seed of block `b`.
    pub fn seed_of(&self, b: usize, base: Option<u64>) -> u64 {
        match (base, &self.seeds) {
            (Some(base), _) => base + b as u64,
            (None, Some(s)) => s[b],
            (None, None) => self.seed + b as u64,
        }
    }

    /// The grid's cells, in file order (rate varies fastest).
    pub fn cells(&self) -> Vec<Cell> {
        let l = &self.load;
        let g = &self.grid;
        fn or<T: Clone>(v: &[T], d: T) -> Vec<T> {
            if v.is_empty() { vec![d] } else { v.to_vec() }
        }
        let rates: Vec<f64> = or(&g.rate, l.rate.unwrap_or(f64::NAN));
        let repeats = or(&g.repeat, l.repeat);
        let ops = or(&g.op, l.op.clone());
        let words = or(&g.words, l.words);
        let conns = or(&g.connections, l.connections);
        let cpus: Vec<Option<String>> = if g.server_cpus.is_empty() {
            vec![self.server.cpus.clone()]
        } else {
            g.server_cpus.iter().cloned().map(Some).collect()
        };
        let mut out = Vec::new();
        for op in &ops {
            for c in &cpus {
                for &n in &conns {
                    for &w in &words {
                        for &r in &repeats {
                            for &rate in &rates {
                                let mut parts = Vec::new();
                                if !g.op.is_empty() {
                                    parts.push(format!("op={op}"));
                                }
                                if !g.rate.is_empty() {
                                    parts.push(format!("rate={rate}"));
                                }
                                if !g.repeat.is_empty() {
                                    parts.push(format!("repeat={r}"));
                                }
                                if !g.words.is_empty() {
                                    parts.push(format!("words={w}"));
                                }
                                if !g.connections.is_empty() {
                                    parts.push(format!("connections={n}"));
                                }
                                if !g.server_cpus.is_empty() {
                                    parts.push(format!(
                                        "server_cpus={}",
                                        c.as_deref().unwrap_or("all")
                                    ));
                                }
                                let id = if parts.is_empty() {
                                    "main".to_string()
                                } else {
                                    parts.join(",")
                                };
                                let slug = id
                                    .chars()
                                    .map(|ch| {
                                        if ch.is_ascii_alphanumeric() || ch == '.' {
                                            ch
                                        } else {
                                            '_'
                                        }
                                    })
                                    .collect();
                                out.push(Cell {
                                    id,
                                    slug,
                                    op: op.clone(),
                                    rate,
                                    repeat: r,
                                    words: w,
                                    connections: n,
                                    server_cpus: c.clone(),
                                });
                            }
                        }
                    }
                }
            }
        }
        out
    }
}

/// The order of conditions in block `b` (indices into the condition list).
///
/// Two conditions: A B in even blocks, B A in odd ones (ABBA over each pair of blocks). More:
/// even blocks rotate the list by `b / 2` (each condition takes a turn first) and odd blocks
/// reverse the previous block's order, so every condition sits early and late equally often.
pub fn block_order(n: usize, b: usize) -> Vec<usize> {
    let rot = if n > 2 { (b / 2) % n } else { 0 };
    let mut v: Vec<usize> = (0..n).map(|i| (i + rot) % n).collect();
    if b % 2 == 1 {
        v.reverse();
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    const OK: &str = r#"
name = "t"
blocks = 3
[load]
op = "gemm8"
rate = 1000
duration_s = 2
[grid]
rate = [1000, 2000]
repeat = [1, 16]
[[condition]]
name = "a"
args = ["--slots", "1"]
[[condition]]
name = "b"
args = ["--floor"]
load = { op = "echo" }
[criterion]
baseline = "a"
treatment = "b"
expr = "cpu_ratio_upper < 0.9 and throughput_ratio >= 0.98"
"#;

    #[test]
    fn parses_and_expands_cells() {
        let e = Experiment::parse(OK).unwrap();
        let cells = e.cells();
        assert_eq!(cells.len(), 4);
        assert_eq!(cells[0].id, "rate=1000,repeat=1");
        assert_eq!(cells[3].id, "rate=2000,repeat=16");
        assert_eq!(cells[3].slug, "rate_2000_repeat_16");
        assert_eq!(e.seed_of(2, None), 3);
        assert_eq!(e.seed_of(2, Some(100)), 102);
    }

    fn err(text: &str) -> String {
        format!("{:#}", Experiment::parse(text).unwrap_err())
    }

    #[test]
    fn errors_name_the_key() {
        assert!(err(&OK.replace("blocks = 3", "blocks = 3\nbogus = 1")).contains("bogus"));
        assert!(err(&OK.replace("blocks = 3", "blocks = 1")).contains("blocks"));
        assert!(
            err(&OK.replace("treatment = \"b\"", "treatment = \"c\""))
                .contains("criterion.treatment")
        );
        assert!(err(&OK.replace("cpu_ratio_upper", "cpu_ratio_uper")).contains("criterion.expr"));
        assert!(err(&OK.replace("name = \"b\"", "name = \"a\"")).contains("condition[1].name"));
        assert!(
            err(&OK.replace("\"--floor\"", "\"--listen\", \"1.2.3.4:5\""))
                .contains("condition[1].args")
        );
        assert!(err(&OK.replace("op = \"gemm8\"", "op = \"gemm9\"")).contains("load.op"));
        assert!(err(&OK.replace("duration_s = 2", "duration_s = -2")).contains("load.duration_s"));
        assert!(
            err(&OK.replace("repeat = [1, 16]", "repeat = [1, 300]")).contains("grid.repeat[1]")
        );
        assert!(err(&OK.replace("[load]", "[load]\ncpus = \"3-1\"")).contains("load.cpus"));
        assert!(
            err(&OK.replace("args = [\"--slots\", \"1\"]", "args = \"--slots\"")).contains("args")
        );
        assert!(
            err(&format!(
                "{OK}\n[confirm]\nseed = 9\ncells = [\"rate=5\"]\n"
            ))
            .contains("confirm.cells[0]")
        );
        assert!(
            Experiment::parse(&format!(
                "{OK}\n[confirm]\nseed = 9\ncells = [\"rate=1000,repeat=16\"]\n"
            ))
            .is_ok()
        );
    }

    #[test]
    fn orders_are_counterbalanced() {
        assert_eq!(block_order(2, 0), vec![0, 1]);
        assert_eq!(block_order(2, 1), vec![1, 0]);
        assert_eq!(block_order(2, 2), vec![0, 1]);
        assert_eq!(block_order(3, 0), vec![0, 1, 2]);
        assert_eq!(block_order(3, 1), vec![2, 1, 0]);
        assert_eq!(block_order(3, 2), vec![1, 2, 0]);
        assert_eq!(block_order(3, 3), vec![0, 2, 1]);
        // Over 2n blocks every condition takes every position equally often.
        for n in 2..6 {
            let mut pos = vec![vec![0; n]; n];
            for b in 0..2 * n {
                for (p, &c) in block_order(n, b).iter().enumerate() {
                    pos[c][p] += 1;
                }
            }
            let expect = if n == 2 { n } else { 2 };
            assert!(pos.iter().flatten().all(|&k| k == expect), "n {n}: {pos:?}");
        }
    }
}
