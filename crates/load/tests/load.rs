//! End-to-end tests of the load generator against tiny in-test servers.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use bgs_load::client::FrameClient;
use bgs_load::{LoadConfig, LoadReport, golden_reference, make_payload, run};
use bgs_protocol::reply::{encode_reply, http_chunk, http_last_chunk, http_response_head};
use bgs_protocol::wire::gemm8_b;
use bgs_protocol::{Decoded, Framer, FramerConfig, Framing, Op, RequestHeader, Status};

/// How the test server misbehaves. Request ids are the load generator's `k`; the golden pass
/// runs on the first connection, which always behaves.
#[derive(Clone, Default)]
struct Behaviour {
    corrupt: Option<u32>,
    never_answer: Option<u32>,
    busy: Option<fn(u32) -> bool>,
    close_on: Option<u32>,
    /// Chunked HTTP replies for odd ids.
    chunked_odd: bool,
    /// Gemm8 results off by this much (breaks the golden check).
    bias: f32,
}

fn compute(op: Op, words: &[u32], bias: f32) -> Vec<u32> {
    let x: Vec<f32> = words.iter().map(|&w| f32::from_bits(w)).collect();
    match op {
        Op::Gemm8 => {
            let b = gemm8_b();
            let mut c = vec![0u32; 64];
            for i in 0..8 {
                for j in 0..8 {
                    let v: f32 = (0..8).map(|k| x[i * 8 + k] * b[k * 8 + j]).sum();
                    c[i * 8 + j] = (v + bias).to_bits();
                }
            }
            c
        }
        Op::Fft32 => golden_reference(op, words)
            .iter()
            .map(|&v| (v as f32).to_bits())
            .collect(),
        _ => words.to_vec(),
    }
}

fn serve_conn(mut s: TcpStream, index: usize, b: Arc<Behaviour>) {
    let mut framer = Framer::new(FramerConfig::default());
    let mut buf = Vec::new();
    let mut tmp = [0u8; 8192];
    let mut out = Vec::new();
    loop {
        let n = match s.read(&mut tmp) {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        buf.extend_from_slice(&tmp[..n]);
        loop {
            let (consumed, reply) = match framer.decode(&buf) {
                Decoded::NeedMore => break,
                Decoded::Reject { .. } => return,
                Decoded::Request { consumed, request } => {
                    let h = request.header;
                    let mut words = vec![0u32; h.words as usize];
                    bgs_protocol::wire::words_from_le(request.payload, &mut words);
                    (consumed, (h, words, request.framing))
                }
            };
            buf.drain(..consumed);
            let (h, words, framing) = reply;
            let id = h.request_id;
            let main = index > 0;
            if main && b.close_on == Some(id) {
                return;
            }
            if main && b.never_answer == Some(id) {
                continue;
            }
            let op = Op::from_u16(h.op).unwrap();
            let (status, mut result) = if main && b.busy.is_some_and(|f| f(id)) {
                (Status::Busy, Vec::new())
            } else {
                (Status::Ok, compute(op, &words, b.bias))
            };
            if main && b.corrupt == Some(id) {
                result[3] ^= 1;
            }
            let mut frame = Vec::new();
            encode_reply(&mut frame, status, id, 0, &result);
            match framing {
                Framing::Binary => out.extend_from_slice(&frame),
                Framing::Http { .. } => {
                    let code = status.http_status();
                    if b.chunked_odd && id % 2 == 1 {
                        http_response_head(&mut out, code, None, false);
                        http_chunk(&mut out, &frame);
                        http_last_chunk(&mut out);
                    } else {
                        http_response_head(&mut out, code, Some(frame.len()), false);
                        out.extend_from_slice(&frame);
                    }
                }
            }
        }
        if !out.is_empty() {
            if s.write_all(&out).is_err() {
                return;
            }
            out.clear();
        }
    }
}

fn server(b: Behaviour) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let b = Arc::new(b);
    std::thread::spawn(move || {
        for (i, s) in l.incoming().enumerate() {
            let Ok(s) = s else { return };
            s.set_nodelay(true).unwrap();
            let b = Arc::clone(&b);
            std::thread::spawn(move || serve_conn(s, i, b));
        }
    });
    addr
}

fn cfg(addr: SocketAddr, op: Op) -> LoadConfig {
    LoadConfig {
        target: addr,
        op,
        rate: 5000.0,
        connections: 8,
        duration: None,
        requests: Some(2000),
        warmup: Duration::from_millis(100),
        timeout: Duration::from_secs(5),
        distinct_payloads: 16,
        seed: 7,
        ..LoadConfig::default()
    }
}

fn assert_adds_up(r: &LoadReport) {
    assert_eq!(r.counts.total(), r.scheduled, "{r}");
    assert_eq!(r.warmup_counts.total(), r.warmup_scheduled, "{r}");
    assert_eq!(r.failures, r.counts.failures());
}

#[test]
fn clean_run_all_ok() {
    let addr = server(Behaviour::default());
    let r = run(&cfg(addr, Op::Gemm8)).unwrap();
    assert_adds_up(&r);
    assert_eq!(r.scheduled, 2000);
    assert_eq!(r.warmup_scheduled, 500);
    assert_eq!(r.counts.ok, 2000, "{r}");
    assert_eq!(r.warmup_counts.ok, 500);
    assert!(r.is_clean());
    let l = r.latency.unwrap();
    assert_eq!(l.count, 2000);
    assert!(l.p50_us > 0.0 && l.p50_us <= l.p99_us && l.p99_us <= l.max_us);
    assert!(r.offered_rate > 1000.0 && r.offered_rate < 6000.0, "{r}");
    assert_eq!(r.request_bytes, 2500 * (24 + 256));
    assert_eq!(r.reply_bytes, 2500 * (24 + 256));
    // The server is this process: discovery finds it.
    assert_eq!(r.server_cpu.as_ref().unwrap().pid, std::process::id());
    assert!(r.host_cpu.is_some() && r.client_cpu.is_some());
    let json = serde_json::to_string(&r).unwrap();
    assert!(json.contains("\"ok\":2000"));
    assert!(r.to_string().contains("p99"));
}

#[test]
fn echo_and_fft_with_two_threads() {
    let addr = server(Behaviour::default());
    let c = LoadConfig {
        op: Op::Echo,
        words: 5,
        threads: 2,
        connections: 5,
        requests: Some(500),
        warmup: Duration::ZERO,
        ..cfg(addr, Op::Echo)
    };
    let r = run(&c).unwrap();
    assert_adds_up(&r);
    assert_eq!(r.counts.ok, 500, "{r}");
    assert_eq!(r.warmup_scheduled, 0);
    let r = run(&LoadConfig {
        requests: Some(300),
        threads: 3,
        ..cfg(addr, Op::Fft32)
    })
    .unwrap();
    assert_adds_up(&r);
    assert_eq!(r.counts.ok, 300, "{r}");
}

#[test]
fn corrupted_reply_is_wrong() {
    let addr = server(Behaviour {
        corrupt: Some(1234),
        ..Behaviour::default()
    });
    let r = run(&cfg(addr, Op::Gemm8)).unwrap();
    assert_adds_up(&r);
    assert_eq!(r.counts.wrong, 1, "{r}");
    assert_eq!(r.counts.ok, 1999);
    assert_eq!(r.failures, 1);
    assert!(r.failure_samples[0].contains("request 1234"), "{r}");
    assert!(!r.is_clean());
}

#[test]
fn unanswered_request_times_out() {
    // Request 700 is measured (warm-up is 0..500); later ones on its connection are answered.
    let addr = server(Behaviour {
        never_answer: Some(700),
        ..Behaviour::default()
    });
    let c = LoadConfig {
        timeout: Duration::from_millis(500),
        ..cfg(addr, Op::Echo)
    };
    let r = run(&c).unwrap();
    assert_adds_up(&r);
    assert_eq!(r.counts.timed_out, 1, "{r}");
    assert_eq!(r.counts.ok, 1999, "{r}");
}

#[test]
fn busy_is_not_a_failure() {
    let addr = server(Behaviour {
        busy: Some(|id| id % 10 == 3),
        ..Behaviour::default()
    });
    let r = run(&cfg(addr, Op::Gemm8)).unwrap();
    assert_adds_up(&r);
    assert_eq!(r.counts.busy, 200, "{r}");
    assert_eq!(r.warmup_counts.busy, 50);
    assert_eq!(r.counts.ok, 1800);
    assert_eq!(r.failures + r.warmup_failures, 0);
}

#[test]
fn closed_connection_fails_its_requests() {
    let addr = server(Behaviour {
        close_on: Some(1000),
        ..Behaviour::default()
    });
    let c = LoadConfig {
        connections: 4,
        ..cfg(addr, Op::Echo)
    };
    let r = run(&c).unwrap();
    assert_adds_up(&r);
    // Request 1000 is on connection 0, which then fails every later request it was given.
    assert!(r.counts.conn_failed >= (2500 - 1000) / 4, "{r}");
    assert_eq!(r.counts.ok + r.counts.conn_failed, 2000, "{r}");
}

#[test]
fn http_mode_content_length_chunked_and_busy() {
    let addr = server(Behaviour {
        chunked_odd: true,
        busy: Some(|id| id % 100 == 42),
        ..Behaviour::default()
    });
    let c = LoadConfig {
        http: true,
        ..cfg(addr, Op::Gemm8)
    };
    let r = run(&c).unwrap();
    assert_adds_up(&r);
    assert_eq!(r.counts.busy, 20, "{r}");
    assert_eq!(r.counts.ok, 1980, "{r}");
    assert_eq!(r.failures + r.warmup_failures, 0, "{r}");
}

#[test]
fn golden_reference_failure_stops_the_run() {
    let addr = server(Behaviour {
        bias: 0.01,
        ..Behaviour::default()
    });
    let e = run(&cfg(addr, Op::Gemm8)).unwrap_err();
    assert!(format!("{e:#}").contains("reference check"), "{e:#}");
}

#[test]
fn blocking_client_frames_and_http() {
    let addr = server(Behaviour {
        chunked_odd: true,
        ..Behaviour::default()
    });
    let mut c = FrameClient::connect(addr).unwrap();
    let p = make_payload(Op::Gemm8, 64, 3, 0);
    let r = c
        .request(&RequestHeader::new(Op::Gemm8, 9, 64, 1), &p)
        .unwrap();
    assert_eq!(r.header.request_id, 9);
    assert_eq!(r.words.len(), 64);
    // Bad magic: the test server closes the connection.
    c.send_raw(b"XXXXXXXXXXXXXXXXXXXXXXXX").unwrap();
    c.expect_closed(Duration::from_secs(2)).unwrap();

    let mut c = FrameClient::connect(addr).unwrap();
    for id in [2u32, 3] {
        let resp = c
            .http_request(&RequestHeader::new(Op::Echo, id, 2, 0), &[5, 6])
            .unwrap();
        assert_eq!(resp.status, 200);
        assert_eq!(resp.frames.len(), 1);
        assert_eq!(resp.frames[0].words, vec![5, 6]);
        let chunked = resp.header("transfer-encoding") == Some("chunked");
        assert_eq!(chunked, id % 2 == 1);
    }
    let e = c.read_reply(Duration::from_millis(50)).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
    let e = c.expect_closed(Duration::from_millis(50)).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
}

#[test]
fn closed_loop_checks_every_reply_and_counts_them_all() {
    let addr = server(Behaviour::default());
    let mut c = cfg(addr, Op::Gemm8);
    c.requests = None;
    c.duration = Some(Duration::from_millis(400));
    c.connections = 4;
    let r = bgs_load::run_closed(&c).unwrap();
    println!("{r}");
    assert_adds_up(&r);
    assert_eq!(r.failures + r.warmup_failures, 0, "{r}");
    assert!(r.counts.ok > 0 && r.latency.is_some(), "{r}");
    assert!((r.achieved_rate - r.counts.ok as f64 / r.measured_interval_s).abs() < 1e-6);
    // A request count is refused: closed loop measures how many requests fit in a duration.
    assert!(bgs_load::run_closed(&cfg(addr, Op::Gemm8)).is_err());
    // A corrupted reply is wrong, as in the open loop (the connection is then abandoned).
    let bad = server(Behaviour {
        corrupt: Some(300),
        ..Behaviour::default()
    });
    let mut c = cfg(bad, Op::Gemm8);
    c.requests = None;
    c.duration = Some(Duration::from_millis(400));
    c.connections = 1;
    let r = bgs_load::run_closed(&c).unwrap();
    assert_eq!(r.counts.wrong + r.warmup_counts.wrong, 1, "{r}");
}
