//! `op generate` end to end against a fake streaming server: deterministic tokens, several
//! streams interleaved on a binary connection, HTTP chunked responses one after another.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use bgs_load::{GenerateConfig, LoadConfig, LoadReport, make_prompt, run};
use bgs_protocol::reply::{encode_reply, http_chunk, http_last_chunk, http_response_head};
use bgs_protocol::{HEADER_LEN, Op, RequestHeader, Status};

/// Token ids below this are EOS in the fake model (about 2 % of draws).
const EOS_BELOW: u32 = 10;

/// The fake model: a token stream that depends on every prompt token and the position only.
fn model(prompt: &[u32], max: u32, ignore_eos: bool) -> (Vec<u32>, [u32; 2]) {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &t in prompt {
        h = (h ^ u64::from(t)).wrapping_mul(0x0100_0000_01b3);
    }
    let mut out = Vec::new();
    for i in 0..max {
        let mut z = h ^ u64::from(i).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 31)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        let t = ((z ^ (z >> 29)) % 512) as u32;
        if !ignore_eos && t < EOS_BELOW {
            let n = out.len() as u32;
            return (out, [0, n]);
        }
        out.push(t);
    }
    let n = out.len() as u32;
    (out, [1, n])
}

/// How the fake server misbehaves on connections other than the first (the golden pass).
#[derive(Clone, Copy, Default)]
struct Behaviour {
    /// (request id, token index) whose token is changed.
    corrupt: Option<(u32, u32)>,
    /// Request ids answered busy.
    busy: Option<fn(u32) -> bool>,
    /// A request id whose stream is cancelled after 2 tokens.
    cancel: Option<u32>,
    /// A request id answered bad param.
    bad_param: Option<u32>,
    /// Every generate request, golden pass included, is answered unknown op.
    unknown_op: bool,
}

/// What a stream will send.
enum Plan {
    Tokens {
        tokens: Vec<u32>,
        fin: [u32; 2],
    },
    /// The final status after `after` tokens.
    Fail {
        status: Status,
        after: u32,
    },
}

struct Stream {
    id: u32,
    http: bool,
    plan: Plan,
    sent: u32,
    corrupt_at: Option<u32>,
    head_sent: bool,
}

#[derive(Default)]
struct Shared {
    queue: VecDeque<Stream>,
    eof: bool,
}

/// Read requests (binary frames or HTTP POSTs carrying one) and queue their streams.
fn reader(mut s: TcpStream, main: bool, b: Behaviour, sh: Arc<(Mutex<Shared>, Condvar)>) {
    let mut buf: Vec<u8> = Vec::new();
    let mut tmp = [0u8; 8192];
    loop {
        // Parse every complete request in the buffer.
        loop {
            let (http, frame_at, total) = if buf.starts_with(b"POST") {
                let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                    break;
                };
                let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map(|v| v.trim().parse().unwrap())
                    .unwrap();
                if buf.len() < end + 4 + len {
                    break;
                }
                (true, end + 4, end + 4 + len)
            } else {
                if buf.len() < HEADER_LEN {
                    break;
                }
                let h = RequestHeader::decode(&buf);
                let total = HEADER_LEN + h.words as usize * 4;
                if buf.len() < total {
                    break;
                }
                (false, 0, total)
            };
            let h = RequestHeader::decode(&buf[frame_at..]);
            let prompt: Vec<u32> = buf[frame_at + HEADER_LEN..total]
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            buf.drain(..total);
            assert_eq!(h.op, Op::Generate as u16);
            let id = h.request_id;
            let fail = |status, after| Plan::Fail { status, after };
            let plan = if b.unknown_op {
                fail(Status::UnknownOp, 0)
            } else if main && b.busy.is_some_and(|f| f(id)) {
                fail(Status::Busy, 0)
            } else if main && b.cancel == Some(id) {
                fail(Status::Cancelled, 2)
            } else if main && b.bad_param == Some(id) {
                fail(Status::BadParam, 0)
            } else {
                let (tokens, fin) = model(&prompt, h.param, h.flags & 1 != 0);
                Plan::Tokens { tokens, fin }
            };
            let corrupt_at = b.corrupt.filter(|&(c, _)| main && c == id).map(|c| c.1);
            let (m, cv) = &*sh;
            m.lock().unwrap().queue.push_back(Stream {
                id,
                http,
                plan,
                sent: 0,
                corrupt_at,
                head_sent: false,
            });
            cv.notify_one();
        }
        match s.read(&mut tmp) {
            Ok(0) | Err(_) => break,
            Ok(n) => buf.extend_from_slice(&tmp[..n]),
        }
    }
    let (m, cv) = &*sh;
    m.lock().unwrap().eof = true;
    cv.notify_one();
}

/// Advance `st` by one frame into `out`; true when the stream is finished.
fn step(st: &mut Stream, out: &mut Vec<u8>) -> bool {
    let mut frame = Vec::new();
    let done = match &st.plan {
        Plan::Tokens { tokens, fin } => {
            if (st.sent as usize) < tokens.len() {
                let mut t = tokens[st.sent as usize];
                if st.corrupt_at == Some(st.sent) {
                    t ^= 1;
                }
                encode_reply(&mut frame, Status::Token, st.id, st.sent, &[t]);
                st.sent += 1;
                false
            } else {
                encode_reply(&mut frame, Status::EndOfStream, st.id, st.sent, fin);
                true
            }
        }
        Plan::Fail { status, after } => {
            if st.sent < *after {
                encode_reply(&mut frame, Status::Token, st.id, st.sent, &[st.sent]);
                st.sent += 1;
                false
            } else {
                encode_reply(&mut frame, *status, st.id, 0, &[]);
                true
            }
        }
    };
    if !st.http {
        out.extend_from_slice(&frame);
        return done;
    }
    // HTTP: a stream that fails before its first token is a Content-Length response.
    if !st.head_sent {
        st.head_sent = true;
        if let Plan::Fail { status, after: 0 } = st.plan {
            http_response_head(out, status.http_status(), Some(frame.len()), false);
            out.extend_from_slice(&frame);
            return true;
        }
        http_response_head(out, 200, None, false);
    }
    http_chunk(out, &frame);
    if done {
        http_last_chunk(out);
    }
    done
}

/// Emit one frame per active stream per round: binary streams interleave, HTTP responses go
/// one after another (only the oldest advances).
fn writer(mut s: TcpStream, sh: Arc<(Mutex<Shared>, Condvar)>) {
    let mut out = Vec::new();
    loop {
        {
            let (m, cv) = &*sh;
            let mut g = m.lock().unwrap();
            while g.queue.is_empty() && !g.eof {
                g = cv.wait(g).unwrap();
            }
            if g.queue.is_empty() {
                return;
            }
            let mut i = 0;
            while i < g.queue.len() {
                let http = g.queue[i].http;
                if http && i > 0 {
                    break;
                }
                if step(&mut g.queue[i], &mut out) {
                    g.queue.remove(i);
                    if http {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        }
        if s.write_all(&out).is_err() {
            return;
        }
        out.clear();
        std::thread::sleep(Duration::from_micros(100));
    }
}

fn server(b: Behaviour) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for (i, s) in l.incoming().enumerate() {
            let Ok(s) = s else { return };
            s.set_nodelay(true).unwrap();
            let sh = Arc::new((Mutex::new(Shared::default()), Condvar::new()));
            let w = s.try_clone().unwrap();
            let sh2 = Arc::clone(&sh);
            std::thread::spawn(move || writer(w, sh2));
            std::thread::spawn(move || reader(s, i > 0, b, sh));
        }
    });
    addr
}

const PROMPTS: usize = 16;
const SEED: u64 = 11;

fn cfg(addr: SocketAddr, http: bool, g: GenerateConfig) -> LoadConfig {
    LoadConfig {
        target: addr,
        op: Op::Generate,
        rate: 2000.0,
        connections: 4,
        pipeline: 8,
        duration: None,
        requests: Some(300),
        warmup: Duration::from_millis(50),
        timeout: Duration::from_secs(10),
        distinct_payloads: PROMPTS,
        seed: SEED,
        http,
        generate: g,
        ..LoadConfig::default()
    }
}

/// Tokens the fake model generates for measured requests `warmup..warmup + n`.
fn expected_tokens(g: &GenerateConfig, warmup: u64, n: u64) -> u64 {
    (warmup..warmup + n)
        .map(|k| {
            let p = make_prompt(SEED, (k % PROMPTS as u64) as usize, g.prompt_tokens, 256);
            model(&p, g.max_tokens, g.ignore_eos).0.len() as u64
        })
        .sum()
}

fn assert_adds_up(r: &LoadReport) {
    assert_eq!(r.counts.total(), r.scheduled, "{r}");
    assert_eq!(r.warmup_counts.total(), r.warmup_scheduled, "{r}");
    assert_eq!(r.failures, r.counts.failures());
}

fn clean_run(http: bool, ignore_eos: bool) {
    let g = GenerateConfig {
        prompt_tokens: 8,
        max_tokens: 24,
        ignore_eos,
        token_range: 256,
    };
    let addr = server(Behaviour::default());
    // Two I/O threads once, to cover merging the per-thread generation statistics.
    let threads = if ignore_eos && !http { 2 } else { 1 };
    let r = run(&LoadConfig {
        threads,
        ..cfg(addr, http, g)
    })
    .unwrap();
    assert_adds_up(&r);
    assert!(r.is_clean(), "{r}");
    assert_eq!(r.config.threads, threads);
    assert_eq!((r.scheduled, r.warmup_scheduled), (300, 100));
    assert_eq!(r.counts.ok, 300, "{r}");
    let gr = r.generate.as_ref().unwrap();
    assert_eq!(gr.completed, 300);
    let want = expected_tokens(&g, 100, 300);
    assert_eq!(gr.tokens, want, "{r}");
    if ignore_eos {
        assert_eq!(want, 300 * 24);
    } else {
        // The fake model ends some streams with EOS before 24 tokens.
        assert!(want < 300 * 24, "{want}");
    }
    assert_eq!(gr.final_statuses.get("end_of_stream"), Some(&300));
    assert_eq!(gr.final_statuses.len(), 1, "{:?}", gr.final_statuses);
    let ttft = gr.ttft.unwrap();
    let with_tokens = 300 - gen_empty_streams(&g, 100, 300);
    assert_eq!(ttft.count, with_tokens);
    assert_eq!(gr.inter_token.unwrap().count, want - with_tokens);
    // A short run: both windows hold every measured request with a token.
    assert_eq!(gr.ttft_first_10s.unwrap().count, with_tokens);
    assert_eq!(gr.ttft_last_10s.unwrap().count, with_tokens);
    assert!(ttft.p50_us <= r.latency.unwrap().p50_us, "{r}");
    assert!(gr.tokens_per_s > 0.0);
    assert!(r.client_cpu.is_some());
    let json = serde_json::to_value(&r).unwrap();
    assert_eq!(json["generate"]["tokens"], want);
    assert_eq!(json["config"]["generate"]["max_tokens"], 24);
    assert_eq!(json["counts"]["cancelled"], 0);
    let text = r.to_string();
    assert!(text.contains("ttft") && text.contains("tokens"), "{text}");
}

/// Measured streams whose golden stream has no token (EOS first).
fn gen_empty_streams(g: &GenerateConfig, warmup: u64, n: u64) -> u64 {
    (warmup..warmup + n)
        .filter(|k| {
            let p = make_prompt(SEED, (k % PROMPTS as u64) as usize, g.prompt_tokens, 256);
            model(&p, g.max_tokens, g.ignore_eos).0.is_empty()
        })
        .count() as u64
}

#[test]
fn binary_streams_replay_exactly() {
    clean_run(false, true);
    clean_run(false, false);
}

#[test]
fn http_chunked_streams_replay_exactly() {
    clean_run(true, true);
    clean_run(true, false);
}

#[test]
fn corrupted_token_is_caught() {
    let g = GenerateConfig {
        prompt_tokens: 8,
        max_tokens: 16,
        ignore_eos: true,
        token_range: 256,
    };
    for http in [false, true] {
        let addr = server(Behaviour {
            corrupt: Some((250, 5)),
            ..Behaviour::default()
        });
        let r = run(&cfg(addr, http, g)).unwrap();
        assert_adds_up(&r);
        assert_eq!(r.counts.wrong, 1, "{r}");
        assert_eq!(r.counts.ok, 299, "{r}");
        assert_eq!(r.failures, 1);
        let s = &r.failure_samples[0];
        assert!(s.contains("request 250") && s.contains("token 5"), "{s}");
        assert!(!r.is_clean());
        // The faulty stream's timings after the fault are left out.
        let gr = r.generate.unwrap();
        assert_eq!(gr.tokens, 300 * 16);
        assert_eq!(gr.inter_token.unwrap().count, 300 * 15 - 11);
    }
}

#[test]
fn busy_cancelled_and_bad_param_are_counted() {
    let g = GenerateConfig {
        prompt_tokens: 4,
        max_tokens: 8,
        ignore_eos: true,
        token_range: 256,
    };
    for http in [false, true] {
        let addr = server(Behaviour {
            busy: Some(|id| id % 10 == 3),
            cancel: Some(201),
            bad_param: Some(305),
            ..Behaviour::default()
        });
        let r = run(&cfg(addr, http, g)).unwrap();
        assert_adds_up(&r);
        assert_eq!(r.counts.busy, 30, "{r}");
        assert_eq!(r.warmup_counts.busy, 10, "{r}");
        assert_eq!(r.counts.cancelled, 1, "{r}");
        assert_eq!(r.counts.error, 1, "{r}");
        assert_eq!(r.counts.ok, 268, "{r}");
        assert_eq!(r.failures, 2);
        assert_eq!(r.warmup_failures, 0);
        let gr = r.generate.as_ref().unwrap();
        let f = &gr.final_statuses;
        assert_eq!(f.get("busy"), Some(&30), "{f:?}");
        assert_eq!(f.get("cancelled"), Some(&1), "{f:?}");
        assert_eq!(f.get("bad_param"), Some(&1), "{f:?}");
        assert_eq!(f.get("end_of_stream"), Some(&268), "{f:?}");
        // The cancelled stream's two tokens were received as well.
        assert_eq!(gr.tokens, 268 * 8 + 2);
        assert!(
            r.failure_samples
                .iter()
                .any(|s| s.contains("request 305") && s.contains("BadParam")),
            "{r}"
        );
    }
}

#[test]
fn server_without_generate_fails_the_golden_pass() {
    let addr = server(Behaviour {
        unknown_op: true,
        ..Behaviour::default()
    });
    let e = run(&cfg(addr, false, GenerateConfig::default())).unwrap_err();
    let msg = format!("{e:#}");
    assert!(
        msg.contains("prompt 0") && msg.contains("UnknownOp"),
        "{msg}"
    );
}

#[test]
fn bad_generate_config_is_refused() {
    let addr = SocketAddr::from(([127, 0, 0, 1], 9));
    let c = cfg(
        addr,
        false,
        GenerateConfig {
            prompt_tokens: 0,
            ..GenerateConfig::default()
        },
    );
    let e = run(&c).unwrap_err();
    assert!(format!("{e}").contains("prompt tokens"), "{e}");
}
