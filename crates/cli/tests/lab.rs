//! `bgs lab` end to end: run `experiments/ci-smoke.toml`, write its report, and recompute the
//! report's numbers from the raw per-run records.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

const BGS: &str = env!("CARGO_BIN_EXE_bgs");

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn bgs(args: &[&str]) -> std::process::Output {
    let out = Command::new(BGS).args(args).output().expect("running bgs");
    println!(
        "bgs {args:?}: {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * (1.0 + a.abs().max(b.abs()))
}

#[test]
fn ci_smoke_runs_end_to_end_and_the_report_matches_the_raw_records() {
    let dir = std::env::temp_dir().join(format!("bgs-lab-e2e-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let exp = repo().join("experiments/ci-smoke.toml");
    let d = dir.to_str().unwrap();
    let run = bgs(&[
        "lab",
        "run",
        exp.to_str().unwrap(),
        "--out",
        d,
        "--no-report",
    ]);
    assert!(run.status.success());
    // A second run into the same directory is refused (results are never overwritten).
    assert!(
        !bgs(&[
            "lab",
            "run",
            exp.to_str().unwrap(),
            "--out",
            d,
            "--no-report"
        ])
        .status
        .success()
    );
    let rep = bgs(&["lab", "report", d]);
    assert!(rep.status.success());

    let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert!(md.contains("## Cell `main`"), "{md}");
    assert!(md.contains("**Criterion: "), "{md}");
    assert!(md.contains("Loopback caveat"));
    for csv in ["runs.csv", "summary.csv", "comparisons.csv"] {
        let text = std::fs::read_to_string(dir.join(csv)).unwrap();
        assert!(text.lines().count() >= 2, "{csv}: {text}");
    }
    let runs_csv = std::fs::read_to_string(dir.join("runs.csv")).unwrap();
    assert_eq!(runs_csv.lines().count(), 1 + 4, "{runs_csv}");
    let svgs: Vec<_> = std::fs::read_dir(dir.join("plots"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "svg"))
        .collect();
    assert!(!svgs.is_empty());
    for s in &svgs {
        assert!(
            std::fs::read_to_string(s).unwrap().contains("<svg"),
            "{}",
            s.display()
        );
    }

    // Recompute from the raw records: per-run server CPU per request, the per-condition
    // means, and the paired difference and ratio intervals of floor against native.
    let mut runs: Vec<Value> = std::fs::read_dir(dir.join("runs/main"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".run.json"))
        .map(|p| serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap())
        .collect();
    assert_eq!(runs.len(), 4);
    runs.sort_by_key(|r| (r["block"].as_u64(), r["position"].as_u64()));
    // Counterbalanced: native first in block 0, floor first in block 1; a block shares a seed.
    let order: Vec<(u64, &str)> = runs
        .iter()
        .map(|r| {
            (
                r["block"].as_u64().unwrap(),
                r["condition"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        order,
        [(0, "native"), (0, "floor"), (1, "floor"), (1, "native")]
    );
    assert_eq!(runs[0]["seed"], runs[1]["seed"]);
    assert_ne!(runs[0]["seed"], runs[2]["seed"]);
    let cpu = |r: &Value| {
        let rep = &r["load"]["report"];
        f(&rep["server_cpu"]["delta"]["run_ns"]) / 1000.0 / f(&rep["counts"]["ok"])
    };
    let of = |cond: &str, block: u64| {
        runs.iter()
            .find(|r| r["condition"] == cond && r["block"] == block)
            .map(cpu)
            .unwrap()
    };
    let (n0, n1, f0, f1) = (
        of("native", 0),
        of("native", 1),
        of("floor", 0),
        of("floor", 1),
    );
    for v in [n0, n1, f0, f1] {
        assert!(v.is_finite() && v > 0.0, "server CPU per request {v}");
    }
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("report.json")).unwrap()).unwrap();
    let cell = &report["cells"][0];
    let cond_mean = |name: &str| {
        cell["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["condition"] == name)
            .map(|c| f(&c["metrics"]["cpu"]["point"]))
            .unwrap()
    };
    assert!(close(cond_mean("native"), (n0 + n1) / 2.0));
    assert!(close(cond_mean("floor"), (f0 + f1) / 2.0));
    let cmp = &cell["comparisons"][0];
    assert_eq!(cmp["baseline"], "native");
    assert_eq!(cmp["treatment"], "floor");
    let t = 12.706_204_736_174_7; // t(0.975, 1)
    let (d0, d1) = (f0 - n0, f1 - n1);
    let dm = (d0 + d1) / 2.0;
    let half = t * ((d0 - dm).powi(2) + (d1 - dm).powi(2)).sqrt() / 2f64.sqrt();
    let diff = &cmp["metrics"]["cpu"]["diff"];
    assert!(close(f(&diff["point"]), dm));
    assert!((f(&diff["lower"]) - (dm - half)).abs() < 1e-6 * (1.0 + half));
    assert!((f(&diff["upper"]) - (dm + half)).abs() < 1e-6 * (1.0 + half));
    let (l0, l1) = ((f0 / n0).ln(), (f1 / n1).ln());
    let lm = (l0 + l1) / 2.0;
    let lhalf = t * ((l0 - lm).powi(2) + (l1 - lm).powi(2)).sqrt() / 2f64.sqrt();
    let ratio = &cmp["metrics"]["cpu"]["ratio"];
    assert!(close(f(&ratio["point"]), lm.exp()));
    assert!((f(&ratio["upper"]).ln() - (lm + lhalf)).abs() < 1e-6);
    // The verdict is decided from the throughput ratio, recomputed here too.
    let tp = |r: &Value| f(&r["load"]["report"]["achieved_rate"]);
    let tpr = |b: u64| {
        let g = |c: &str| {
            runs.iter()
                .find(|r| r["condition"] == c && r["block"] == b)
                .map(tp)
                .unwrap()
        };
        (g("floor") / g("native")).ln()
    };
    let tratio = ((tpr(0) + tpr(1)) / 2.0).exp();
    let verdict = &cell["verdict"];
    let invalid = report["invalid_runs"].as_u64().unwrap();
    let expect = if invalid > 0 {
        "undecided"
    } else if tratio >= 0.9 {
        "met"
    } else {
        "not met"
    };
    assert_eq!(verdict["outcome"], expect, "{verdict}");
    assert!(close(f(&verdict["evaluated"][0]["value"]), tratio));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_experiment_files_are_rejected_naming_the_key() {
    let dir = std::env::temp_dir().join(format!("bgs-lab-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = std::fs::read_to_string(repo().join("experiments/ci-smoke.toml")).unwrap();
    for (bad, key) in [
        (
            good.replace("blocks = 2", "blocks = 2\nblokcs = 3"),
            "blokcs",
        ),
        (
            good.replace("treatment = \"floor\"", "treatment = \"flor\""),
            "criterion.treatment",
        ),
        (good.replace("rate = 500", "rate = 0"), "load.rate"),
    ] {
        let p = dir.join("bad.toml");
        std::fs::write(&p, bad).unwrap();
        let out = bgs(&["lab", "check", p.to_str().unwrap()]);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(key), "{key}: {err}");
        // Nothing ran: no results directory was created.
        let o = dir.join("out");
        assert!(
            !bgs(&[
                "lab",
                "run",
                p.to_str().unwrap(),
                "--out",
                o.to_str().unwrap()
            ])
            .status
            .success()
        );
        assert!(!o.exists());
    }
    let ok = bgs(&[
        "lab",
        "check",
        repo().join("experiments/ci-smoke.toml").to_str().unwrap(),
    ]);
    assert!(ok.status.success());
    let _ = std::fs::remove_dir_all(&dir);
}
