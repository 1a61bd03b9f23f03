//! `bgs serve --user`: started as root, the server serves as the unprivileged user, on every
//! transport (the kernel transport included: BPF attached, io_uring set up, then dropped).

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{Server, load_config, transports};

/// `id -u NAME` / `id -g NAME`.
fn id_of(flag: &str, name: &str) -> u32 {
    let out = Command::new("id").args([flag, name]).output().unwrap();
    assert!(out.status.success(), "id {flag} {name}");
    String::from_utf8(out.stdout)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Every thread of `pid` runs with all four uids `uid`, all four gids `gid`, and no
/// capability (permitted, effective, inheritable, ambient).
fn assert_dropped(pid: u32, uid: u32, gid: u32, what: &str) {
    let mut threads = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let path: PathBuf = task.unwrap().path().join("status");
        let Ok(status) = std::fs::read_to_string(&path) else {
            continue;
        };
        threads += 1;
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .unwrap_or_else(|| panic!("{what}: no {name} in {}", path.display()))
                .split_whitespace()
                .map(str::to_string)
                .collect::<Vec<_>>()
        };
        let ids =
            |name: &str| -> Vec<u32> { field(name).iter().map(|v| v.parse().unwrap()).collect() };
        assert_eq!(ids("Uid:"), [uid; 4], "{what}: {}", path.display());
        assert_eq!(ids("Gid:"), [gid; 4], "{what}: {}", path.display());
        assert!(!ids("Groups:").contains(&0), "{what}: group root kept");
        for cap in ["CapInh:", "CapPrm:", "CapEff:", "CapAmb:"] {
            let v = u64::from_str_radix(&field(cap)[0], 16).unwrap();
            assert_eq!(v, 0, "{what}: {cap} {v:#x} in {}", path.display());
        }
    }
    assert!(threads > 1, "{what}: the server's threads were checked");
}

#[test]
fn serves_as_nobody_on_every_transport() {
    let (uid, gid) = (id_of("-u", "nobody"), id_of("-g", "nobody"));
    for t in transports() {
        let mut args = t.clone();
        args.extend(["--user", "nobody"]);
        let mut server = Server::start(&args);
        // The address line is printed after the drop.
        assert_dropped(server.pid(), uid, gid, &format!("{t:?}"));
        for http in [false, true] {
            let mut cfg = load_config(server.addr, bgs_protocol::Op::Echo);
            cfg.requests = Some(500);
            cfg.http = http;
            let report = bgs_load::run(&cfg).expect("load run");
            assert_eq!(report.failures, 0, "{t:?} http={http}: {report}");
            assert_eq!(report.counts.ok, 500, "{t:?} http={http}: {report}");
        }
        assert_dropped(server.pid(), uid, gid, &format!("{t:?} after serving"));
        let (ok, err) = server.stop();
        assert!(ok, "{t:?}: server did not stop cleanly: {err}");
        assert!(err.contains("bgs: shut down"), "{t:?}: {err}");
    }
}

/// Generation after the drop: the model was loaded as root, the engine runs as nobody.
#[test]
fn generates_as_nobody_on_the_kernel_transport() {
    let dir = std::env::temp_dir().join(format!("bgs-user-test-{}", std::process::id()));
    let st = Command::new(env!("CARGO_BIN_EXE_bgs"))
        .args([
            "model",
            "synth",
            "--arch",
            "tiny-llama",
            "--seed",
            "5",
            "--out",
        ])
        .arg(&dir)
        .status()
        .unwrap();
    assert!(st.success(), "bgs model synth failed");
    let model = dir.to_str().unwrap();
    let mut server = Server::start(&[
        "--transport",
        "kernel",
        "--user",
        "nobody",
        "--model",
        model,
        "--api-listen",
        "off",
        "--slots",
        "4",
    ]);
    assert_dropped(
        server.pid(),
        id_of("-u", "nobody"),
        id_of("-g", "nobody"),
        "generate",
    );
    let mut cfg = load_config(server.addr, bgs_protocol::Op::Generate);
    cfg.rate = 200.0;
    cfg.requests = Some(40);
    cfg.connections = 4;
    cfg.distinct_payloads = 8;
    cfg.generate = bgs_load::GenerateConfig {
        prompt_tokens: 8,
        max_tokens: 12,
        ignore_eos: true,
        token_range: 256,
    };
    let report = bgs_load::run(&cfg).expect("load run");
    assert_eq!(report.failures, 0, "{report}");
    assert_eq!(report.counts.ok, 40, "{report}");
    assert_eq!(
        report.generate.as_ref().unwrap().tokens,
        40 * 12,
        "{report}"
    );
    let (ok, err) = server.stop();
    assert!(ok, "server did not stop cleanly: {err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A user that does not exist is refused before anything starts, in one line.
#[test]
fn an_unknown_user_is_refused_before_starting() {
    let out = Command::new(env!("CARGO_BIN_EXE_bgs"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--transport",
            "kernel",
            "--user",
            "no-such-user-bgs",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(out.stdout.is_empty(), "nothing started: {:?}", out.stdout);
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("--user \"no-such-user-bgs\": no such user"),
        "{err}"
    );
}
