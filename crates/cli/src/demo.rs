//! `bgs demo`: a CPU-executor server on loopback (a child process, so its CPU is accounted
//! separately), a short load of each kind against it, a floor-mode server for comparison, and
//! one table.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use bgs_load::{LoadConfig, LoadReport};
use bgs_protocol::Op;

use crate::args;

#[derive(clap::Args, Debug, Clone)]
pub struct DemoArgs {
    /// Offered rate of each run, requests per second, 0 < R <= 10000000.
    #[arg(long, default_value_t = 2000.0, value_parser = args::positive(crate::MAX_RATE))]
    rate: f64,
    /// Measured seconds of each run, 0 < S <= 3600.
    #[arg(long, default_value_t = 2.0, value_parser = args::positive(3600.0))]
    duration: f64,
    /// Connections, 1..=65536.
    #[arg(long, default_value_t = 128,
          value_parser = args::int(1usize, crate::serve::MAX_CONNECTIONS))]
    connections: usize,
    /// Executor slots of the demo server, 1..=512.
    #[arg(long, default_value_t = 2, value_parser = args::int(1usize, crate::serve::MAX_SLOTS))]
    slots: usize,
    /// Write all reports as JSON (the file is opened before the runs).
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

/// A child `bgs serve`, terminated on drop.
struct ChildServer {
    child: Child,
    addr: SocketAddr,
}

impl ChildServer {
    fn start(extra: &[String]) -> Result<Self> {
        let exe = std::env::current_exe().context("locating the bgs binary")?;
        let mut child = Command::new(exe)
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("starting the demo server")?;
        let mut line = String::new();
        BufReader::new(child.stdout.take().context("server stdout")?)
            .read_line(&mut line)
            .context("reading the server's address")?;
        let addr = line.split_whitespace().nth(3).and_then(|a| a.parse().ok());
        let Some(addr) = addr else {
            let _ = child.kill();
            bail!("the demo server did not print its address (got {line:?})");
        };
        Ok(ChildServer { child, addr })
    }
}

impl Drop for ChildServer {
    fn drop(&mut self) {
        if let Ok(pid) = i32::try_from(self.child.id())
            && let Some(pid) = rustix::process::Pid::from_raw(pid)
        {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        let _ = self.child.wait();
    }
}

pub fn run(args: &DemoArgs) -> Result<()> {
    let json = args.json.as_deref().map(crate::JsonOut::open).transpose()?;
    let runs: [(&str, Op, u32); 4] = [
        ("full", Op::Gemm8, 1),
        ("full", Op::Fft32, 1),
        ("full", Op::Gemm8, 16),
        ("full", Op::Echo, 1),
    ];
    println!(
        "bgs demo: native transport + CPU executor ({} slots) on loopback; {} connections, {} req/s, {} s per run",
        args.slots, args.connections, args.rate, args.duration
    );
    // Client and server on disjoint CPUs where there are several, so that CPU per request
    // is not mixed between them (see docs/load.md on loopback accounting).
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut pin_server: Vec<String> = Vec::new();
    if cpus >= 2 {
        pin_server = vec!["--cpus".into(), "0".into()];
        crate::affinity::pin(&format!("1-{}", cpus - 1))?;
        println!(
            "server pinned to CPU 0, load generator to CPUs 1-{}",
            cpus - 1
        );
    }
    let mut rows = Vec::new();
    {
        let mut a = vec!["--slots".into(), args.slots.to_string()];
        a.extend(pin_server.iter().cloned());
        let server = ChildServer::start(&a)?;
        for (path, op, repeat) in runs {
            let report = run_one(args, server.addr, server.child.id(), op, repeat)?;
            rows.push((path, op, repeat, report));
        }
    }
    {
        let mut a = vec!["--floor".to_string()];
        a.extend(pin_server.iter().cloned());
        let server = ChildServer::start(&a)?;
        let report = run_one(args, server.addr, server.child.id(), Op::Echo, 1)?;
        rows.push(("floor", Op::Echo, 1, report));
    }
    println!();
    println!(
        "{:<6} {:<6} {:>3} {:>9} {:>9} {:>8} {:>8} {:>8} {:>6} {:>10} {:>10}",
        "path",
        "op",
        "r",
        "offered/s",
        "achieved/s",
        "p50 us",
        "p99 us",
        "p99.9 us",
        "fail",
        "srv us/req",
        "host us/req"
    );
    let mut failed = 0;
    for (path, op, repeat, r) in &rows {
        let (p50, p99, p999) = r.latency.map_or((f64::NAN, f64::NAN, f64::NAN), |l| {
            (l.p50_us, l.p99_us, l.p999_us)
        });
        let srv = r
            .server_cpu
            .as_ref()
            .map_or(f64::NAN, |c| c.per_request.run_us);
        let host = r
            .host_cpu
            .as_ref()
            .map_or(f64::NAN, |c| c.per_request.busy_us);
        failed += r.failures + r.warmup_failures;
        println!(
            "{:<6} {:<6} {:>3} {:>9.0} {:>10.0} {:>8.1} {:>8.1} {:>8.1} {:>6} {:>10.1} {:>11.1}",
            path,
            op.name(),
            repeat,
            r.offered_rate,
            r.achieved_rate,
            p50,
            p99,
            p999,
            r.failures + r.warmup_failures,
            srv,
            host
        );
    }
    println!(
        "\nsrv us/req: server process CPU per request (schedstat, all threads); host us/req: whole-host busy CPU per request, \
         client included (on loopback the receive softirq runs in the sender's context)."
    );
    if let Some(json) = json {
        let all: Vec<_> = rows.iter().map(|(_, _, _, r)| r).collect();
        let doc = crate::meta::with_metadata(serde_json::to_value(all)?);
        json.write(&doc)?;
    }
    if failed > 0 {
        bail!("{failed} requests failed");
    }
    Ok(())
}

fn run_one(args: &DemoArgs, addr: SocketAddr, pid: u32, op: Op, repeat: u32) -> Result<LoadReport> {
    let cfg = LoadConfig {
        target: addr,
        op,
        repeat,
        words: 64,
        rate: args.rate,
        connections: args.connections,
        duration: Some(Duration::from_secs_f64(args.duration)),
        requests: None,
        warmup: Duration::from_millis(500),
        pipeline: 16,
        http: false,
        timeout: Duration::from_secs(10),
        distinct_payloads: 64,
        seed: 1,
        server_pid: Some(pid),
        progress: false,
        threads: 1,
        generate: Default::default(),
    };
    bgs_load::run(&cfg).with_context(|| format!("{} r={repeat} run", op.name()))
}
