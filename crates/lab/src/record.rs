//! The raw per-run record written to `DIR/runs/CELL/bBLOCK-CONDITION.run.json` as soon as the
//! run finishes (a crash of the lab loses nothing already measured).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::spec::Cell;

/// The lab process's own CPU over one run (server start to server stop).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ObserverCpu {
    /// Wall time.
    pub wall_ns: u64,
    /// User time (ticks).
    pub user_ns: u64,
    /// System time (ticks).
    pub system_ns: u64,
    /// schedstat run time.
    pub run_ns: u64,
}

/// What happened to the server process.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ServerOutcome {
    /// Its pid.
    pub pid: Option<u32>,
    /// The address it printed.
    pub addr: Option<String>,
    /// Seconds from spawn to `bgs: listening on`.
    pub startup_s: Option<f64>,
    /// Exit code after SIGTERM (None: killed by a signal or never started).
    pub exit_code: Option<i32>,
    /// It had to be killed with SIGKILL.
    pub killed: bool,
    /// It had exited before the lab stopped it.
    pub exited_early: bool,
    /// The counters it printed at shutdown (stderr from the executor's summary on).
    pub shutdown: Vec<String>,
}

/// One run: one condition of one block of one cell.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunRecord {
    /// Experiment name.
    pub experiment: String,
    /// "screen" or "confirm".
    pub phase: String,
    /// The grid cell.
    pub cell: Cell,
    /// Block index (0-based).
    pub block: usize,
    /// Position of this condition within its block (0-based).
    pub position: usize,
    /// Condition name.
    pub condition: String,
    /// Payload seed (shared by every condition of the block).
    pub seed: u64,
    /// `bgs serve` arguments.
    pub server_args: Vec<String>,
    /// `bgs load` arguments.
    pub load_args: Vec<String>,
    /// Server CPUs (resolved).
    pub server_cpu_set: Option<Vec<usize>>,
    /// Load generator CPUs (resolved).
    pub client_cpu_set: Option<Vec<usize>>,
    /// Unix ms at the start of the run.
    pub started_unix_ms: u64,
    /// Wall seconds of the whole run.
    pub wall_s: f64,
    /// The server.
    pub server: ServerOutcome,
    /// Exit code of `bgs load` (None: killed or not started).
    pub load_exit: Option<i32>,
    /// `bgs load` ran past its deadline and was killed.
    pub load_timed_out: bool,
    /// The last lines `bgs load` printed.
    pub load_output_tail: Vec<String>,
    /// The `bgs load --json` document (None when it wrote none).
    pub load: Option<Value>,
    /// The lab's own CPU over the run.
    pub observer: Option<ObserverCpu>,
    /// Metrics computed when the run finished (the report recomputes them from the above;
    /// NaN is written as null).
    #[serde(deserialize_with = "nan_map")]
    pub metrics: BTreeMap<String, f64>,
    /// False when the run must not be read as a clean measurement.
    pub valid: bool,
    /// Why not.
    pub invalid_reasons: Vec<String>,
}

/// JSON has no NaN: serde_json writes it as null, read back here as NaN.
fn nan_map<'de, D: serde::Deserializer<'de>>(d: D) -> Result<BTreeMap<String, f64>, D::Error> {
    let m: BTreeMap<String, Option<f64>> = Deserialize::deserialize(d)?;
    Ok(m.into_iter()
        .map(|(k, v)| (k, v.unwrap_or(f64::NAN)))
        .collect())
}

/// Why a run is invalid, from its raw contents (empty: valid).
pub fn invalid_reasons(rec: &RunRecord, asked_rate: f64, behind_fraction: f64) -> Vec<String> {
    let mut why = Vec::new();
    let s = &rec.server;
    if s.addr.is_none() {
        why.push("the server did not start".to_string());
    }
    if s.exited_early {
        why.push("the server exited during the run".into());
    }
    if s.killed {
        why.push("the server did not stop after SIGTERM and was killed".into());
    }
    if rec.load_timed_out {
        why.push("the load generator ran past its deadline and was killed".into());
    } else if s.addr.is_some() && rec.load_exit != Some(0) {
        why.push(format!(
            "the load generator failed (exit {:?}): {}",
            rec.load_exit,
            rec.load_output_tail.last().cloned().unwrap_or_default()
        ));
    }
    let Some(r) = rec.load.as_ref().and_then(|d| d.get("report")) else {
        if s.addr.is_some() {
            why.push("no load report".into());
        }
        return why;
    };
    let n = |path: &[&str]| -> u64 {
        let mut c = r;
        for p in path {
            match c.get(p) {
                Some(x) => c = x,
                None => return 0,
            }
        }
        c.as_u64().unwrap_or(0)
    };
    let fails = n(&["failures"]) + n(&["warmup_failures"]);
    if fails > 0 {
        let k = |f: &str| n(&["counts", f]) + n(&["warmup_counts", f]);
        why.push(format!(
            "{fails} failed requests (wrong {}, error {}, timed out {}, connection failed {}, cancelled {})",
            k("wrong"),
            k("error"),
            k("timed_out"),
            k("conn_failed"),
            k("cancelled")
        ));
    }
    let total: u64 = [
        "ok",
        "busy",
        "wrong",
        "error",
        "timed_out",
        "conn_failed",
        "cancelled",
    ]
    .iter()
    .map(|f| n(&["counts", f]))
    .sum();
    if total != n(&["scheduled"]) {
        why.push(format!(
            "{} of {} measured requests have no outcome",
            n(&["scheduled"]).saturating_sub(total),
            n(&["scheduled"])
        ));
    }
    if n(&["counts", "ok"]) == 0 {
        why.push("no ok replies".into());
    }
    let offered = r
        .get("offered_rate")
        .and_then(|v| v.as_f64())
        .unwrap_or(0.0);
    if offered < behind_fraction * asked_rate {
        why.push(format!(
            "the load generator fell behind schedule: offered {offered:.1}/s of {asked_rate}/s asked (< {:.0}%)",
            behind_fraction * 100.0
        ));
    }
    if r.get("server_cpu").is_none_or(Value::is_null) {
        why.push("server CPU not accounted".into());
    }
    why
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn rec(report: Value) -> RunRecord {
        RunRecord {
            experiment: "t".into(),
            phase: "screen".into(),
            cell: Cell {
                id: "main".into(),
                slug: "main".into(),
                op: "gemm8".into(),
                rate: 1000.0,
                repeat: 1,
                words: 64,
                connections: 1,
                server_cpus: None,
            },
            block: 0,
            position: 0,
            condition: "a".into(),
            seed: 1,
            server_args: vec![],
            load_args: vec![],
            server_cpu_set: None,
            client_cpu_set: None,
            started_unix_ms: 0,
            wall_s: 1.0,
            server: ServerOutcome {
                addr: Some("127.0.0.1:1".into()),
                ..Default::default()
            },
            load_exit: Some(0),
            load_timed_out: false,
            load_output_tail: vec![],
            load: Some(serde_json::json!({ "report": report })),
            observer: None,
            metrics: BTreeMap::new(),
            valid: true,
            invalid_reasons: vec![],
        }
    }

    fn report(ok: u64, timed_out: u64, offered: f64) -> Value {
        serde_json::json!({
            "scheduled": ok + timed_out,
            "failures": timed_out,
            "warmup_failures": 0,
            "counts": { "ok": ok, "busy": 0, "wrong": 0, "error": 0, "timed_out": timed_out, "conn_failed": 0, "cancelled": 0 },
            "warmup_counts": { "ok": 10 },
            "offered_rate": offered,
            "server_cpu": { "delta": { "run_ns": 1000 } },
        })
    }

    #[test]
    fn clean_runs_are_valid_and_bad_ones_say_why() {
        assert!(invalid_reasons(&rec(report(1000, 0, 999.0)), 1000.0, 0.95).is_empty());
        let why = invalid_reasons(&rec(report(990, 10, 999.0)), 1000.0, 0.95);
        assert_eq!(why.len(), 1, "{why:?}");
        assert!(why[0].contains("10 failed requests") && why[0].contains("timed out 10"));
        let why = invalid_reasons(&rec(report(1000, 0, 800.0)), 1000.0, 0.95);
        assert!(why[0].contains("fell behind schedule"), "{why:?}");
        let mut r = rec(report(1000, 0, 1000.0));
        r.load_timed_out = true;
        r.load_exit = None;
        assert!(invalid_reasons(&r, 1000.0, 0.95)[0].contains("past its deadline"));
        let mut r = rec(report(1000, 0, 1000.0));
        r.server.addr = None;
        r.load = None;
        assert_eq!(
            invalid_reasons(&r, 1000.0, 0.95),
            vec!["the server did not start".to_string()]
        );
    }
}
