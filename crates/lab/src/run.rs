//! Running an experiment: a fresh `bgs serve` per condition and block, `bgs load --json` as a
//! child (its CPU stays its own), counterbalanced order, one raw record per run written as
//! soon as it completes.

use std::fs::{self, File};
use std::io::{BufRead, BufReader, IsTerminal};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use bgs_cpuacct::{ProcessCpu, ProcessSample};
use serde::Serialize;

use crate::record::{ObserverCpu, RunRecord, ServerOutcome, invalid_reasons};
use crate::spec::{Cell, Experiment, block_order, parse_cpu_list};

/// How to run.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// The `bgs` binary (serve and load are run from it).
    pub bgs: PathBuf,
    /// Output directory.
    pub out: PathBuf,
    /// Confirmation phase: only these cells, with `[confirm]`'s seed and blocks.
    pub confirm_cells: Option<Vec<String>>,
    /// Skip runs whose record already exists in `out`.
    pub resume: bool,
    /// Progress bar on stderr (else one line per run when `log` is set).
    pub progress: bool,
    /// One line per run on stderr.
    pub log: bool,
}

/// One planned run.
#[derive(Clone, Debug, Serialize)]
pub struct Planned {
    /// Index into the cells.
    pub cell: usize,
    /// Block.
    pub block: usize,
    /// Position in the block.
    pub position: usize,
    /// Index into the conditions.
    pub condition: usize,
    /// Seed.
    pub seed: u64,
}

/// The cells and run order of an experiment (screen, or confirmation of `confirm_cells`).
pub fn plan(e: &Experiment, confirm_cells: Option<&[String]>) -> (Vec<Cell>, Vec<Planned>) {
    let mut cells = e.cells();
    let (blocks, base) = match (confirm_cells, &e.confirm) {
        (Some(ids), Some(cf)) => {
            cells.retain(|c| ids.contains(&c.id));
            (cf.blocks.unwrap_or(e.blocks), Some(cf.seed))
        }
        _ => (e.blocks, None),
    };
    let mut runs = Vec::new();
    for ci in 0..cells.len() {
        for b in 0..blocks {
            for (p, cond) in block_order(e.conditions.len(), b).into_iter().enumerate() {
                runs.push(Planned {
                    cell: ci,
                    block: b,
                    position: p,
                    condition: cond,
                    seed: e.seed_of(b, base),
                });
            }
        }
    }
    (cells, runs)
}

/// The CPUs this process may run on.
fn allowed_cpus() -> Vec<usize> {
    match rustix::thread::sched_getaffinity(None) {
        Ok(set) => (0..rustix::thread::CpuSet::MAX_CPU)
            .filter(|&c| set.is_set(c))
            .collect(),
        Err(_) => Vec::new(),
    }
}

fn list_string(v: &[usize]) -> String {
    v.iter().map(usize::to_string).collect::<Vec<_>>().join(",")
}

/// Resolve "auto" CPU sets: the server gets the first allowed CPU and the load generator the
/// rest, when there are at least two; otherwise neither is pinned.
fn resolve_cpus(server: Option<&str>, client: Option<&str>) -> Result<(CpuSet, CpuSet)> {
    let allowed = allowed_cpus();
    let auto_ok = allowed.len() >= 2;
    let s = match server {
        Some("auto") if auto_ok => Some(vec![allowed[0]]),
        Some("auto") | None => None,
        Some(l) => Some(parse_cpu_list(l)?),
    };
    let c = match client {
        Some("auto") if auto_ok => {
            let taken = s.clone().unwrap_or_else(|| vec![allowed[0]]);
            Some(
                allowed
                    .iter()
                    .copied()
                    .filter(|x| !taken.contains(x))
                    .collect::<Vec<_>>(),
            )
        }
        Some("auto") | None => None,
        Some(l) => Some(parse_cpu_list(l)?),
    };
    Ok((s, c.filter(|v| !v.is_empty())))
}

/// A resolved CPU set (None: not pinned).
type CpuSet = Option<Vec<usize>>;

fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A child process that is killed if dropped while running (a lab that fails mid-run leaves
/// no server behind).
struct Guard(Option<Child>);

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn sigterm(child: &Child) {
    if let Ok(pid) = i32::try_from(child.id())
        && let Some(pid) = rustix::process::Pid::from_raw(pid)
    {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
    }
}

/// Wait for a child up to `limit`; None if it is still running.
fn wait_until(child: &mut Child, limit: Duration) -> Result<Option<std::process::ExitStatus>> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(st) = child.try_wait()? {
            return Ok(Some(st));
        }
        if Instant::now() >= deadline {
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn tail_lines(path: &Path, n: usize) -> Vec<String> {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..]
        .iter()
        .map(|s| s.to_string())
        .collect()
}

fn observer(a: &Option<ProcessSample>, b: &Option<ProcessSample>) -> Option<ObserverCpu> {
    let d = b.as_ref()?.delta(a.as_ref()?);
    Some(ObserverCpu {
        wall_ns: d.wall_ns,
        user_ns: d.user_ns,
        system_ns: d.system_ns,
        run_ns: d.run_ns,
    })
}

fn fmt_num(v: f64) -> String {
    // Integers without a trailing ".0", so flags read naturally (--rate 1000).
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        format!("{v}")
    }
}

/// The `bgs load` arguments of one run, without target, pid, json path and CPUs.
pub fn load_args(e: &Experiment, cell: &Cell, cond: usize, seed: u64) -> Vec<String> {
    let l = &e.load;
    let o = e.conditions[cond].load.clone().unwrap_or_default();
    let mut a: Vec<String> = Vec::new();
    let mut push = |k: &str, v: String| {
        a.push(k.into());
        a.push(v);
    };
    let op = o.op.clone().unwrap_or_else(|| {
        if cell.op.is_empty() {
            l.op.clone()
        } else {
            cell.op.clone()
        }
    });
    // `bgs load` refuses flags that do nothing with the op: --repeat is for gemm8/fft32,
    // --words for echo.
    match op.as_str() {
        "gemm8" | "fft32" => push("--repeat", o.repeat.unwrap_or(cell.repeat).to_string()),
        "echo" => push("--words", o.words.unwrap_or(cell.words).to_string()),
        _ => {}
    }
    push("--op", op);
    push("--connections", cell.connections.to_string());
    push("--rate", fmt_num(cell.rate));
    push("--warmup", fmt_num(l.warmup_s));
    if let Some(n) = l.requests {
        push("--requests", n.to_string());
    } else if let Some(d) = l.duration_s {
        push("--duration", fmt_num(d));
    }
    push("--seed", seed.to_string());
    if let Some(p) = l.pipeline {
        push("--pipeline", p.to_string());
    }
    if let Some(t) = l.threads {
        push("--threads", t.to_string());
    }
    if let Some(t) = l.timeout_s {
        push("--timeout", fmt_num(t));
    }
    if let Some(d) = l.distinct {
        push("--distinct", d.to_string());
    }
    if let Some(v) = l.prompt_tokens {
        push("--prompt-tokens", v.to_string());
    }
    if let Some(v) = l.max_tokens {
        push("--max-tokens", v.to_string());
    }
    if let Some(v) = l.token_range {
        push("--token-range", v.to_string());
    }
    if l.ignore_eos {
        a.push("--ignore-eos".into());
    }
    if l.http {
        a.push("--http".into());
    }
    if l.closed_loop {
        a.push("--closed-loop".into());
    }
    a.extend(l.extra.iter().cloned());
    a.extend(o.extra);
    a
}

/// The longest a `bgs load` run may take before it is killed.
fn load_deadline(e: &Experiment, cell: &Cell) -> Duration {
    let l = &e.load;
    let measured = match (l.requests, l.duration_s) {
        (Some(n), _) => n as f64 / cell.rate,
        (None, Some(d)) => d,
        _ => 0.0,
    };
    // Golden pass, connections and the final timeout wait come on top of the schedule.
    Duration::from_secs_f64(l.warmup_s + measured + l.timeout_s.unwrap_or(10.0) + 60.0)
}

/// Run an experiment and write its raw records. Returns the records of this invocation.
pub fn run(e: &Experiment, source: &str, opts: &RunOptions) -> Result<Vec<RunRecord>> {
    let out = &opts.out;
    let src_copy = out.join("experiment.toml");
    if src_copy.exists() {
        let old = fs::read_to_string(&src_copy).unwrap_or_default();
        if !opts.resume {
            bail!(
                "{} already holds results; give a new --out directory, or --resume to finish it",
                out.display()
            );
        }
        if old != source {
            bail!(
                "{} holds results of a different experiment file; --resume needs the same file",
                out.display()
            );
        }
    }
    fs::create_dir_all(out.join("runs")).with_context(|| format!("creating {}", out.display()))?;
    fs::write(&src_copy, source)?;
    let phase = if opts.confirm_cells.is_some() {
        "confirm"
    } else {
        "screen"
    };
    let (cells, runs) = plan(e, opts.confirm_cells.as_deref());
    if cells.is_empty() {
        bail!("no cells to run");
    }
    let plan_doc = serde_json::json!({
        "experiment": e.name,
        "phase": phase,
        "cells": cells,
        "conditions": e.conditions.iter().map(|c| &c.name).collect::<Vec<_>>(),
        // In execution order.
        "runs": runs,
    });
    fs::write(
        out.join("plan.json"),
        serde_json::to_string_pretty(&plan_doc)? + "\n",
    )?;

    let bar = (opts.progress && std::io::stderr().is_terminal()).then(|| {
        let b = indicatif::ProgressBar::new(runs.len() as u64);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{elapsed_precise} [{bar:30}] {pos}/{len} runs, {eta} left  {msg}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        b
    });
    let mut done = Vec::new();
    for (i, p) in runs.iter().enumerate() {
        let cell = &cells[p.cell];
        let cond = &e.conditions[p.condition];
        let dir = out.join("runs").join(&cell.slug);
        fs::create_dir_all(&dir)?;
        let stem = format!("b{:02}-{}", p.block, cond.name);
        let rec_path = dir.join(format!("{stem}.run.json"));
        let msg = format!(
            "cell {} block {}/{} {}",
            cell.id,
            p.block + 1,
            runs.iter()
                .filter(|r| r.cell == p.cell)
                .map(|r| r.block)
                .max()
                .unwrap_or(0)
                + 1,
            cond.name
        );
        if let Some(b) = &bar {
            b.set_message(msg.clone());
        }
        if opts.resume && rec_path.exists() {
            if let Some(b) = &bar {
                b.inc(1);
            }
            continue;
        }
        let rec = run_one(&opts.bgs, e, phase, cell, p, &dir, &stem)?;
        let tmp = dir.join(format!("{stem}.run.json.tmp"));
        fs::write(&tmp, serde_json::to_string_pretty(&rec)? + "\n")?;
        fs::rename(&tmp, &rec_path)?;
        if let Some(b) = &bar {
            b.inc(1);
        } else if opts.log {
            let m = &rec.metrics;
            eprintln!(
                "lab: [{}/{}] {msg}: {}, {:.0} req/s, p99 {:.0} us, server {:.1} us/req{}",
                i + 1,
                runs.len(),
                if rec.valid { "valid" } else { "INVALID" },
                m.get("throughput").copied().unwrap_or(f64::NAN),
                m.get("p99").copied().unwrap_or(f64::NAN),
                m.get("cpu").copied().unwrap_or(f64::NAN),
                if rec.valid {
                    String::new()
                } else {
                    format!(" ({})", rec.invalid_reasons.join("; "))
                }
            );
        }
        done.push(rec);
    }
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    Ok(done)
}

fn run_one(
    bin: &Path,
    e: &Experiment,
    phase: &str,
    cell: &Cell,
    p: &Planned,
    dir: &Path,
    stem: &str,
) -> Result<RunRecord> {
    let cond = &e.conditions[p.condition];
    let (server_set, client_set) =
        resolve_cpus(cell.server_cpus.as_deref(), e.load.cpus.as_deref())?;
    let started = Instant::now();
    let started_unix_ms = now_unix_ms();
    let me = std::process::id();
    let obs_before = ProcessCpu::sample(me).ok();

    let mut server_args = vec![
        "serve".to_string(),
        "--listen".into(),
        e.server.listen.clone(),
    ];
    if let Some(s) = &server_set {
        server_args.push("--cpus".into());
        server_args.push(list_string(s));
    }
    server_args.extend(e.server.args.iter().cloned());
    server_args.extend(cond.args.iter().cloned());
    let mut load_argv = load_args(e, cell, p.condition, p.seed);

    let mut outcome = ServerOutcome::default();
    let server_log = dir.join(format!("{stem}.server.log"));
    let load_json = dir.join(format!("{stem}.load.json"));
    let load_txt = dir.join(format!("{stem}.load.txt"));
    let mut server = Guard(Some(
        Command::new(bin)
            .args(&server_args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(File::create(&server_log)?))
            .spawn()
            .with_context(|| format!("starting {} serve", bin.display()))?,
    ));
    let child = server.0.as_mut().expect("just spawned");
    outcome.pid = Some(child.id());
    let stdout = child.stdout.take().context("server stdout")?;
    let (tx, rx) = mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                // Nobody listens any more; keep draining so the server never blocks on stdout.
                continue;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs_f64(e.server.startup_timeout_s);
    while Instant::now() < deadline {
        match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(line) => {
                if let Some(rest) = line.strip_prefix("bgs: listening on ") {
                    outcome.addr = rest.split_whitespace().next().map(str::to_string);
                    outcome.startup_s = Some(started.elapsed().as_secs_f64());
                    break;
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if child.try_wait()?.is_some() {
                    break;
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }

    let mut load_exit = None;
    let mut load_timed_out = false;
    if let Some(addr) = &outcome.addr {
        let mut argv = vec![
            "load".to_string(),
            "--target".into(),
            addr.clone(),
            "--server-pid".into(),
            child.id().to_string(),
            "--json".into(),
            load_json.display().to_string(),
        ];
        if let Some(c) = &client_set {
            argv.push("--cpus".into());
            argv.push(list_string(c));
        }
        argv.append(&mut load_argv);
        load_argv = argv;
        let f = File::create(&load_txt)?;
        let mut load = Guard(Some(
            Command::new(bin)
                .args(&load_argv)
                .stdin(Stdio::null())
                .stdout(Stdio::from(f.try_clone()?))
                .stderr(Stdio::from(f))
                .spawn()
                .context("starting bgs load")?,
        ));
        let lc = load.0.as_mut().expect("just spawned");
        match wait_until(lc, load_deadline(e, cell))? {
            Some(st) => load_exit = st.code(),
            None => load_timed_out = true,
        }
        if !load_timed_out {
            load.0 = None;
        }
    } else {
        load_argv.insert(0, "load".into());
    }

    // Stop the server and collect its shutdown counters.
    let child = server.0.as_mut().expect("still held");
    if child.try_wait()?.is_some() {
        outcome.exited_early = outcome.addr.is_some();
    } else {
        sigterm(child);
    }
    match wait_until(child, Duration::from_secs_f64(e.server.stop_timeout_s))? {
        Some(st) => outcome.exit_code = st.code(),
        None => {
            outcome.killed = true;
            let _ = child.kill();
            let _ = child.wait();
        }
    }
    server.0 = None;
    let log = fs::read_to_string(&server_log).unwrap_or_default();
    let from = log
        .find("bgs: executor:")
        .or_else(|| log.find("bgs: shut down"))
        .unwrap_or(log.len());
    outcome.shutdown = log[from..].lines().take(80).map(str::to_string).collect();
    if outcome.addr.is_none() {
        outcome.shutdown = log
            .lines()
            .rev()
            .take(20)
            .map(str::to_string)
            .collect::<Vec<_>>();
        outcome.shutdown.reverse();
    }
    let obs_after = ProcessCpu::sample(me).ok();

    let load_doc = fs::read_to_string(&load_json)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok());
    let mut rec = RunRecord {
        experiment: e.name.clone(),
        phase: phase.into(),
        cell: cell.clone(),
        block: p.block,
        position: p.position,
        condition: cond.name.clone(),
        seed: p.seed,
        server_args,
        load_args: load_argv,
        server_cpu_set: server_set,
        client_cpu_set: client_set,
        started_unix_ms,
        wall_s: started.elapsed().as_secs_f64(),
        server: outcome,
        load_exit,
        load_timed_out,
        load_output_tail: tail_lines(&load_txt, 30),
        load: load_doc,
        observer: observer(&obs_before, &obs_after),
        metrics: Default::default(),
        valid: false,
        invalid_reasons: Vec::new(),
    };
    rec.metrics = crate::metrics::compute(&rec);
    rec.invalid_reasons = invalid_reasons(&rec, e.asked_rate(cell), e.load.behind_fraction);
    rec.valid = rec.invalid_reasons.is_empty();
    Ok(rec)
}
