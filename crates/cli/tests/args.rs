//! Command-line checking: numbers outside their documented ranges, flags that do nothing in
//! a combination, and unwritable output paths are refused with a one-line error before
//! anything starts (no server binds, no load connects).

use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn bgs(args: &[&str]) -> Output {
    let start = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_bgs"))
        .args(args)
        .env("BGS_LOG", "warn")
        .output()
        .expect("run bgs");
    // Refusals come before any work: a server would run until killed, a load run would
    // connect and take its duration.
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "bgs {args:?} took {:?}",
        start.elapsed()
    );
    out
}

/// `bgs ARGS` fails, and its error line mentions every one of `words`.
fn refused(args: &[&str], words: &[&str]) {
    let out = bgs(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "bgs {args:?} was accepted: {err}");
    let line = err
        .lines()
        .find(|l| l.contains("error"))
        .unwrap_or_else(|| panic!("bgs {args:?}: no error line in {err:?}"));
    for w in words {
        assert!(line.contains(w), "bgs {args:?}: {line:?} does not name {w}");
    }
    assert!(
        String::from_utf8_lossy(&out.stdout).is_empty(),
        "bgs {args:?} started something: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn the_gpu_executors_slot_limit_applies_to_one_shot_ops_not_to_live_sequences() {
    // Without a model the GPU executor runs at most 64 slots, refused before any GPU work.
    refused(
        &["serve", "--executor", "gpu", "--slots", "65"],
        &["--slots 65", "64 slots"],
    );
    // With a model `--slots` counts live sequences (up to 512); 256 passes the flag checks
    // and the run fails on the missing checkpoint instead (the H200 run of 2026-12-01 was
    // refused here with the one-shot executor's limit).
    passes_the_flag_checks(&["--executor", "gpu", "--slots", "256"], "64 slots");
}

/// `bgs serve ARGS --model /nonexistent/bgs-checkpoint` gets past the flag checks: it fails
/// on the missing checkpoint, and its error does not mention `refusal` (a word of the
/// refusal it would otherwise get).
fn passes_the_flag_checks(args: &[&str], refusal: &str) {
    let mut all = vec!["serve"];
    all.extend_from_slice(args);
    all.extend([
        "--model",
        "/nonexistent/bgs-checkpoint",
        "--api-listen",
        "off",
    ]);
    let out = bgs(&all);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a missing checkpoint was accepted: {err}"
    );
    assert!(!err.contains(refusal), "{err}");
    assert!(err.contains("bgs-checkpoint"), "{err}");
}

/// The device step loop with `--reply executor-sqe`: the transport's reply stage serves the
/// loop's streams like any executor's that wakes it (it was refused before the GPU run of
/// 2026-12-07), so the flags pass and the run fails on the missing checkpoint instead.
#[test]
fn the_device_step_loop_takes_the_executor_sqe_reply_stage() {
    passes_the_flag_checks(
        &[
            "--transport",
            "kernel",
            "--reply",
            "executor-sqe",
            "--executor",
            "gpu",
            "--gpu-step-loop",
            "device",
        ],
        "--reply loop",
    );
}

#[test]
fn numbers_outside_their_ranges_are_refused() {
    refused(&["serve", "--slots", "100000"], &["--slots", "1..=512"]);
    refused(&["serve", "--slots", "0"], &["--slots"]);
    refused(
        &["serve", "--max-connections", "1000000"],
        &["--max-connections"],
    );
    refused(&["serve", "--ring-slots", "1000"], &["power of two"]);
    refused(&["serve", "--max-words", "257"], &["--max-words"]);
    refused(&["serve", "--poll-us", "0"], &["--poll-us"]);
    refused(
        &["serve", "--stream-coalesce-us", "100001"],
        &["--stream-coalesce-us"],
    );
    refused(&["serve", "--stats-every", "NaN"], &["--stats-every"]);
    refused(
        &["load", "--rate", "1e12", "--requests", "1"],
        &["--rate", "10000000"],
    );
    refused(&["load", "--rate", "0", "--requests", "1"], &["--rate"]);
    refused(
        &["load", "--connections", "100000", "--requests", "1"],
        &["--connections"],
    );
    refused(&["load", "--requests", "0"], &["--requests"]);
    refused(&["load", "--duration=-1"], &["--duration"]);
    refused(
        &["load", "--timeout", "0", "--requests", "1"],
        &["--timeout"],
    );
    refused(
        &["load", "--repeat", "257", "--requests", "1"],
        &["--repeat"],
    );
    refused(&["demo", "--slots", "100000"], &["--slots"]);
    refused(&["demo", "--rate", "1e12"], &["--rate"]);
}

#[test]
fn flags_that_do_nothing_are_refused_naming_both() {
    refused(
        &["serve", "--floor", "--executor", "gpu"],
        &["--executor", "--floor"],
    );
    refused(
        &["serve", "--floor", "--transport", "kernel"],
        &["--floor", "--transport kernel"],
    );
    refused(
        &["serve", "--dispatcher", "host"],
        &["--dispatcher", "--executor cpu"],
    );
    refused(
        &[
            "serve",
            "--executor",
            "gpu",
            "--dispatcher",
            "host",
            "--gpu-schedulers",
            "2",
        ],
        &["--gpu-schedulers", "--dispatcher host"],
    );
    refused(
        &["serve", "--reply", "executor-sqe"],
        &["--reply", "--transport native"],
    );
    refused(
        &[
            "serve",
            "--executor",
            "gpu",
            "--model",
            "/nonexistent",
            "--gpu-step-loop-check",
        ],
        &["--gpu-step-loop-check", "--gpu-step-loop device"],
    );
    refused(
        &["serve", "--executor", "gpu", "--gpu-step-loop", "device"],
        &["--gpu-step-loop", "--model"],
    );
    refused(
        &[
            "serve",
            "--model",
            "/nonexistent",
            "--gpu-step-loop",
            "device",
        ],
        &["--gpu-step-loop", "--executor gpu"],
    );
    refused(
        &["serve", "--transport", "kernel", "--poll-us", "10"],
        &["--poll-us", "--transport kernel"],
    );
    refused(
        &[
            "serve",
            "--transport",
            "kernel",
            "--stream-coalesce-us",
            "2000",
        ],
        &["--stream-coalesce-us", "--transport kernel"],
    );
    refused(
        &["serve", "--gpu-completion-wake", "interrupt"],
        &["--gpu-completion-wake", "--executor cpu"],
    );
    refused(
        &["serve", "--floor", "--gpu-completion-wake", "poll"],
        &["--gpu-completion-wake", "--floor"],
    );
    refused(
        &[
            "serve",
            "--transport",
            "kernel",
            "--reply",
            "executor-sqe",
            "--executor",
            "gpu",
            "--gpu-completion-wake",
            "interrupt",
        ],
        &["--gpu-completion-wake interrupt", "--reply executor-sqe"],
    );
    refused(
        &["serve", "--transport", "kernel", "--sqpoll-cpu", "1"],
        &["--sqpoll-cpu", "--reply loop"],
    );
    refused(
        &["serve", "--transport", "kernel", "--sqpoll-above", "0"],
        &["--sqpoll-above", "--reply loop"],
    );
    refused(
        &["serve", "--sqpoll-above", "1000"],
        &["--sqpoll-above", "--transport native"],
    );
    refused(
        &["load", "--op", "gemm8", "--words", "8", "--requests", "1"],
        &["--words", "--op gemm8"],
    );
    refused(
        &["load", "--op", "echo", "--repeat", "2", "--requests", "1"],
        &["--repeat", "--op echo"],
    );
    refused(
        &["load", "--requests", "10", "--duration", "1"],
        &["--duration", "--requests"],
    );
    // Generation: forward-pass flags of the other device, and dispatcher flags, which the
    // generation engine's step loop does not read.
    refused(&["serve", "--dtype", "f16"], &["--dtype", "--model"]);
    refused(
        &[
            "serve",
            "--model",
            "m",
            "--executor",
            "cpu",
            "--dtype",
            "f16",
        ],
        &["--dtype", "--executor cpu"],
    );
    refused(
        &[
            "serve",
            "--model",
            "m",
            "--executor",
            "gpu",
            "--model-threads",
            "2",
        ],
        &["--model-threads", "--executor gpu"],
    );
    refused(
        &[
            "serve",
            "--model",
            "m",
            "--executor",
            "gpu",
            "--dispatcher",
            "host",
        ],
        &["--dispatcher", "--model"],
    );
    refused(
        &[
            "generate",
            "--model",
            "m",
            "--prompt",
            "p",
            "--batch-invariant",
        ],
        &["--batch-invariant", "--executor"],
    );
    // The tensor-core tile flags are the GPU forward pass's too.
    refused(
        &[
            "generate",
            "--model",
            "m",
            "--prompt",
            "p",
            "--gpu-tc-large-min-tokens",
            "128",
        ],
        &["--gpu-tc-large-min-tokens", "--executor"],
    );
    refused(
        &["serve", "--gpu-tc-large-min-tokens", "0"],
        &["--gpu-tc-large-min-tokens", "--model"],
    );
    refused(
        &[
            "generate",
            "--model",
            "m",
            "--prompt",
            "p",
            "--gpu-tc-large-split",
            "8",
        ],
        &["--gpu-tc-large-split", "--executor"],
    );
    refused(
        &["serve", "--gpu-tc-large-split", "8"],
        &["--gpu-tc-large-split", "--model"],
    );
}

#[test]
fn an_unwritable_json_path_fails_before_the_run() {
    // Nothing listens on port 1: a run would fail to connect; the path must fail first.
    refused(
        &[
            "load",
            "--target",
            "127.0.0.1:1",
            "--requests",
            "1",
            "--json",
            "/nonexistent/x.json",
        ],
        &["--json", "/nonexistent/x.json"],
    );
    refused(
        &["demo", "--json", "/nonexistent/x.json"],
        &["--json", "/nonexistent/x.json"],
    );
}

#[test]
fn listen_and_target_take_host_names_and_bare_ports() {
    // A host name and `:PORT` parse (and resolve); the run then fails only at connecting.
    for target in ["localhost:1", ":1"] {
        let out = bgs(&["load", "--target", target, "--requests", "1"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(err.contains("127.0.0.1:1"), "{target}: {err}");
    }
    refused(&["serve", "--listen", "7700"], &["--listen"]);
    refused(
        &["serve", "--listen", "no-such-host.invalid:7700"],
        &["--listen", "no-such-host.invalid"],
    );
}

#[test]
fn serve_listens_on_host_names_and_bare_ports() {
    use std::io::{BufRead, BufReader};
    for (listen, expect) in [("localhost:0", "127.0.0.1:"), (":0", "0.0.0.0:")] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_bgs"))
            .args(["serve", "--listen", listen, "--slots", "1"])
            .env("BGS_LOG", "warn")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let _ = child.kill();
        let _ = child.wait();
        assert!(
            line.starts_with(&format!("bgs: listening on {expect}")),
            "--listen {listen}: {line:?}"
        );
    }
}

#[test]
fn logs_to_a_pipe_carry_no_colour_codes() {
    use std::io::{BufRead, BufReader, Read};
    // `--executor auto` logs its choice at info level, whatever it finds.
    let mut child = Command::new(env!("CARGO_BIN_EXE_bgs"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--executor",
            "auto",
            "--slots",
            "1",
        ])
        .env("BGS_LOG", "info")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let _ = child.kill();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    let _ = child.wait();
    assert!(err.contains("executor auto"), "{err:?}");
    assert!(!err.contains('\x1b'), "colour codes in piped logs: {err:?}");
}

/// `bgs lab check FILE | head -0`: a printing command whose reader is gone ends by SIGPIPE
/// like any Unix filter, not with a panic ("failed printing to stdout") and exit code 101.
/// The pipe's read end is closed before the child starts, so its first write fails for sure.
#[test]
fn printing_commands_end_quietly_when_the_reader_goes_away() {
    use std::os::unix::process::ExitStatusExt;
    let (reader, writer) = rustix::pipe::pipe().expect("pipe");
    drop(reader);
    let file = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../experiments/transport-small.toml"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_bgs"))
        .args(["lab", "check", file])
        .stdout(std::process::Stdio::from(writer))
        .stderr(std::process::Stdio::piped())
        .output()
        .expect("run bgs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "bgs panicked: {err}");
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGPIPE),
        "ended by SIGPIPE ({:?}): {err}",
        out.status
    );
}
