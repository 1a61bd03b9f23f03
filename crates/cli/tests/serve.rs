//! End to end on loopback: correctness with exact replay, HTTP, floor mode, clean shutdown.

mod common;

use bgs_protocol::Op;
use common::{Server, load_config, with_each_transport};

#[test]
fn gemm8_100k_requests_128_connections_exact_replay() {
    for args in with_each_transport(&[]) {
        let server = Server::start(&args);
        let mut cfg = load_config(server.addr, Op::Gemm8);
        cfg.requests = Some(100_000);
        cfg.connections = 128;
        cfg.rate = 25_000.0;
        cfg.warmup = std::time::Duration::from_millis(500);
        cfg.server_pid = Some(server.pid());
        let report = bgs_load::run(&cfg).expect("load run");
        println!("{args:?}\n{report}");
        assert_eq!(report.failures, 0, "{report}");
        assert_eq!(report.counts.ok + report.counts.busy, 100_000, "{report}");
        assert_eq!(
            report.counts.busy, 0,
            "default ring never fills at this rate: {report}"
        );
    }
}

#[test]
fn fft32_and_echo_over_http_with_repeats() {
    for args in with_each_transport(&[]) {
        let server = Server::start(&args);
        for (op, repeat, http) in [
            (Op::Fft32, 16, false),
            (Op::Fft32, 1, true),
            (Op::Gemm8, 256, true),
            (Op::Echo, 1, true),
        ] {
            let mut cfg = load_config(server.addr, op);
            cfg.repeat = repeat;
            cfg.http = http;
            cfg.requests = Some(3000);
            cfg.rate = 5000.0;
            let report = bgs_load::run(&cfg).expect("load run");
            assert_eq!(
                report.failures, 0,
                "{op:?} r={repeat} http={http}: {report}"
            );
            assert_eq!(report.counts.ok, 3000, "{report}");
        }
    }
}

#[test]
fn floor_mode_answers_echo_without_executor() {
    let server = Server::start(&["--transport", "native", "--floor"]);
    let mut cfg = load_config(server.addr, Op::Echo);
    cfg.requests = Some(5000);
    cfg.rate = 10_000.0;
    let report = bgs_load::run(&cfg).expect("load run");
    assert_eq!(report.failures, 0, "{report}");
    // Other ops are not served in floor mode, and say so.
    let mut c = bgs_load::client::FrameClient::connect(server.addr).unwrap();
    let h = bgs_protocol::RequestHeader::new(Op::Gemm8, 3, 64, 1);
    let r = c.request(&h, &[0; 64]).unwrap();
    assert_eq!(r.header.status, bgs_protocol::Status::UnknownOp as u16);
    assert_eq!(r.header.request_id, 3);
}

#[test]
fn sigterm_shuts_down_cleanly_and_prints_counters() {
    for args in with_each_transport(&[]) {
        let mut server = Server::start(&args);
        let mut c = bgs_load::client::FrameClient::connect(server.addr).unwrap();
        let h = bgs_protocol::RequestHeader::new(Op::Echo, 1, 2, 0);
        assert_eq!(c.request(&h, &[5, 6]).unwrap().words, vec![5, 6]);
        let (ok, stderr) = server.stop();
        assert!(ok, "exit status: {stderr}");
        assert!(stderr.contains("shut down"), "{stderr}");
        assert!(stderr.contains("executor: 1 requests"), "{stderr}");
    }
}

#[test]
fn executor_auto_falls_back_to_cpu_and_says_why() {
    use std::io::{BufRead, BufReader, Read};
    use std::process::{Command, Stdio};
    let mut child = Command::new(env!("CARGO_BIN_EXE_bgs"))
        .args(["serve", "--listen", "127.0.0.1:0", "--executor", "auto"])
        .env("BGS_LOG", "info")
        // No GPU in CI; on a GPU machine, hide it so the fallback path is what runs.
        .env("CUDA_VISIBLE_DEVICES", "")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.contains("executor cpu"), "{line}");
    child.kill().unwrap();
    child.wait().unwrap();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(err.contains("executor auto: no usable GPU"), "{err}");
}

#[test]
fn executor_gpu_without_a_gpu_fails_with_a_message() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_bgs"))
        .args(["serve", "--listen", "127.0.0.1:0", "--executor", "gpu"])
        .env("CUDA_VISIBLE_DEVICES", "")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--executor gpu"), "{err}");
}

#[test]
fn kernel_executor_sqe_with_the_gpu_reaches_the_executor() {
    // No longer refused: the kernel transport builds the send table and the GPU's ring, and
    // only starting the GPU executor fails on a machine without one.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_bgs"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--transport",
            "kernel",
            "--reply",
            "executor-sqe",
            "--executor",
            "gpu",
        ])
        .env("CUDA_VISIBLE_DEVICES", "")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--executor gpu"), "{err}");
    assert!(!err.contains("not supported"), "{err}");
}

#[test]
fn counters_are_printed_while_running() {
    for args in with_each_transport(&["--stats-every", "0.2"]) {
        let mut server = Server::start(&args);
        let mut c = bgs_load::client::FrameClient::connect(server.addr).unwrap();
        let h = bgs_protocol::RequestHeader::new(Op::Echo, 1, 1, 0);
        assert_eq!(c.request(&h, &[9]).unwrap().words, vec![9]);
        std::thread::sleep(std::time::Duration::from_millis(700));
        let (ok, stderr) = server.stop();
        assert!(ok, "{stderr}");
        let running = stderr.split("bgs: shut down").next().unwrap_or("");
        assert!(
            running.matches("bgs: stats").count() >= 2,
            "{args:?}: no periodic counters before shutdown:\n{stderr}"
        );
    }
}
