//! A `bgs serve` child process for end-to-end tests.
#![allow(dead_code)] // Each test binary uses a different subset of these helpers.

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running server; stopped with SIGTERM when dropped.
pub struct Server {
    child: Option<Child>,
    pub addr: SocketAddr,
}

impl Server {
    /// Start `bgs serve --listen 127.0.0.1:0 EXTRA...` and wait for its address line.
    pub fn start(extra: &[&str]) -> Server {
        Server::start_reading(extra, 0).0
    }

    /// As [`Server::start`], with `--model` and `--api-listen 127.0.0.1:0` in `extra`: also
    /// waits for the API's address line and returns that address.
    pub fn start_with_api(extra: &[&str]) -> (Server, SocketAddr) {
        let (server, lines) = Server::start_reading(extra, 1);
        let api = lines[0]
            .split_whitespace()
            .find_map(|w| w.strip_prefix("http://"))
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("no API address in {:?}", lines[0]));
        (server, api)
    }

    /// Start the server and read `more` stdout lines after the address line.
    fn start_reading(extra: &[&str], more: usize) -> (Server, Vec<String>) {
        let mut child = Command::new(env!("CARGO_BIN_EXE_bgs"))
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(extra)
            .env("BGS_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn bgs serve");
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).expect("read address line");
        let addr = line
            .split_whitespace()
            .nth(3)
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("no address in {line:?}"));
        let lines = (0..more)
            .map(|_| {
                let mut l = String::new();
                stdout.read_line(&mut l).expect("read stdout line");
                l
            })
            .collect();
        let server = Server {
            child: Some(child),
            addr,
        };
        (server, lines)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// Open file descriptors of the server process.
    pub fn fd_count(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    /// Sockets of the server's port in CLOSE_WAIT (state 08 in /proc/net/tcp).
    pub fn close_wait_count(&self) -> usize {
        let port = format!(":{:04X}", self.addr.port());
        std::fs::read_to_string("/proc/net/tcp")
            .unwrap_or_default()
            .lines()
            .skip(1)
            .filter(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                f.len() > 3 && f[1].ends_with(&port) && f[3] == "08"
            })
            .count()
    }

    /// Sockets of the server's port that still hold kernel state for a connection: every
    /// state but LISTEN (0A) and TIME_WAIT (06). A socket leaves this set when it reaches
    /// TCP_CLOSE, which is when the kernel transport's BPF program drops its connection state
    /// and the sockhash loses its entry; a TIME_WAIT socket has already passed TCP_CLOSE.
    pub fn connection_sockets(&self) -> usize {
        let port = format!(":{:04X}", self.addr.port());
        std::fs::read_to_string("/proc/net/tcp")
            .unwrap_or_default()
            .lines()
            .skip(1)
            .filter(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                f.len() > 3 && f[1].ends_with(&port) && f[3] != "0A" && f[3] != "06"
            })
            .count()
    }

    /// Wait until `cond` holds (polling), up to `limit`.
    pub fn wait_for(&self, limit: Duration, mut cond: impl FnMut(&Server) -> bool) -> bool {
        let end = Instant::now() + limit;
        while Instant::now() < end {
            if cond(self) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        cond(self)
    }

    /// SIGTERM, wait for exit; returns (exit success, stderr).
    pub fn stop(&mut self) -> (bool, String) {
        let Some(mut child) = self.child.take() else {
            return (false, String::new());
        };
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let end = Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break Some(s);
            }
            if Instant::now() > end {
                let _ = child.kill();
                break None;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let mut err = String::new();
        if let Some(mut e) = child.stderr.take() {
            let _ = e.read_to_string(&mut err);
        }
        let _ = child.wait();
        (status.is_some_and(|s| s.success()), err)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A load config against `addr` with test-friendly defaults.
pub fn load_config(addr: SocketAddr, op: bgs_protocol::Op) -> bgs_load::LoadConfig {
    bgs_load::LoadConfig {
        target: addr,
        op,
        repeat: 1,
        words: 64,
        rate: 2000.0,
        connections: 16,
        duration: None,
        requests: Some(2000),
        warmup: Duration::from_millis(200),
        pipeline: 16,
        http: false,
        timeout: Duration::from_secs(10),
        distinct_payloads: 64,
        seed: 7,
        server_pid: None,
        progress: false,
        threads: 1,
        generate: Default::default(),
    }
}

/// Server argument sets under test: every end-to-end test runs against each transport
/// configuration listed here.
pub fn transports() -> Vec<Vec<&'static str>> {
    vec![
        vec!["--transport", "native"],
        vec!["--transport", "kernel", "--reply", "loop"],
        vec!["--transport", "kernel", "--reply", "executor-sqe"],
    ]
}

/// True for argument sets of the kernel transport.
pub fn is_kernel(args: &[&str]) -> bool {
    args.windows(2).any(|w| w == ["--transport", "kernel"])
}

/// `transports()` with `extra` appended to each.
pub fn with_each_transport(extra: &[&'static str]) -> Vec<Vec<&'static str>> {
    transports()
        .into_iter()
        .map(|mut t| {
            t.extend_from_slice(extra);
            t
        })
        .collect()
}
