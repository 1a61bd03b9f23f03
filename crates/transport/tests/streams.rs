//! Streamed replies through real rings and real sockets, for the native transport and the
//! kernel transport's `--reply loop` and `--reply executor-sqe` (root: BPF and io_uring): a
//! fake executor thread streams frames with `stream != 0` under a credit window, as the
//! generation executor will.
//!
//! The fake executor answers `generate` (op 3) with `param` token frames (`seq` = token index,
//! payload `[k, ...]`: the request's payload word 1 pads each frame with that many more words)
//! and a final end-of-stream frame (`[1, tokens]`); payload word 0 is a delay per token in
//! milliseconds. `echo` gets a one-shot reply. It keeps each stream's frames in flight
//! (published minus acknowledged) at most [`WINDOW`], ends the streams of a connection whose
//! `OP_CANCEL` arrives with a final `cancelled` frame, and records what it saw.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bgs_protocol::reply::encode_http_request;
use bgs_protocol::{FramerConfig, Op, ReplyHeader, RequestHeader, Status, encode_request};
use bgs_ring::{MAX_STREAMS, OP_CANCEL, OP_REJECT, RingConfig, RingRegion};
use bgs_transport::conn::ConnLimits;
use bgs_transport::kernel::{KernelConfig, KernelTransport, ReplyMode};
use bgs_transport::{NativeConfig, NativeTransport, ShutdownHandle, TransportStats};

/// Frames of one stream the fake executor keeps unacknowledged at most.
const WINDOW: u32 = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Native,
    /// The native transport holding token frames up to this many milliseconds
    /// (`NativeConfig::stream_coalesce`).
    NativeCoalesce(u64),
    KernelLoop,
    /// `--reply executor-sqe` with adaptive submission (the default).
    KernelSqe,
    /// `--reply executor-sqe` through the SQPOLL ring only (`sqpoll_above` 0).
    KernelSqpoll,
}

/// What the fake executor saw.
#[derive(Debug, Default)]
struct Obs {
    /// Cancel markers per connection token.
    cancels: HashMap<u64, u32>,
    /// Connection token of each request id.
    conn_of: HashMap<u32, u64>,
    /// Frames published per request id.
    published: HashMap<u32, u32>,
    /// Most frames in flight seen per request id.
    max_inflight: HashMap<u32, u32>,
    /// Request ids that stood at the window with frames still to produce.
    stalled: HashMap<u32, u32>,
    /// When a stream published its final frame: the published count of every other stream.
    at_final: HashMap<u32, Vec<(u32, u32)>>,
    /// Frames published per stream index (all streams that used it).
    per_index: Vec<u64>,
    /// Malformed request-ring entries (a cancel marker with fields other than conn and op).
    bad_markers: u32,
}

struct Stream {
    conn: u64,
    conn_seq: u32,
    id: u32,
    route: u32,
    idx: usize,
    tokens: u32,
    next: u32,
    pad: u32,
    delay: Duration,
    next_at: Instant,
    published: u32,
    base_acks: u32,
    ended: bool,
}

struct Exec {
    region: Arc<RingRegion>,
    waker: Option<Arc<dyn Fn() + Send + Sync>>,
    obs: Arc<Mutex<Obs>>,
    streams: Vec<Stream>,
    free: Vec<usize>,
}

impl Exec {
    fn push(&self, f: impl Fn(&mut bgs_ring::CompletionEntry)) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.region.completions().try_push(&f).is_err() {
            assert!(Instant::now() < deadline, "completion ring full for 10 s");
            std::thread::yield_now();
        }
        let ring = self.region.completions();
        if ring.has_sleepers() {
            ring.notify();
            if let Some(w) = &self.waker {
                w();
            }
        }
    }

    fn acks(&self, idx: usize) -> u32 {
        self.region.stream_acks()[idx].load(Ordering::Acquire)
    }

    /// Publish the next frame of stream `i`: a token, or the final frame with `status`.
    fn frame(&mut self, i: usize, status: Option<Status>) {
        let s = &self.streams[i];
        let (st, final_, words): (Status, bool, Vec<u32>) = match status {
            Some(Status::Cancelled) => (Status::Cancelled, true, vec![]),
            Some(st) => (st, true, vec![1, s.tokens]),
            None => {
                let mut w = vec![s.next];
                w.extend((0..s.pad).map(|j| s.next ^ j));
                (Status::Token, false, w)
            }
        };
        let (conn, conn_seq, id, route, stream_seq) = (s.conn, s.conn_seq, s.id, s.route, s.next);
        let stream = s.idx as u32 + 1;
        self.push(|e| {
            e.conn = conn;
            e.conn_seq = conn_seq;
            e.status = st as u16;
            e.final_ = u16::from(final_);
            e.request_id = id;
            e.words = words.len() as u32;
            e.stream_seq = stream_seq;
            e.route = route;
            e.stream = stream;
            e.payload[..words.len()].copy_from_slice(&words);
        });
        let s = &mut self.streams[i];
        s.published += 1;
        if final_ {
            s.ended = true;
        } else {
            s.next += 1;
        }
        let mut o = self.obs.lock().unwrap();
        o.per_index[s.idx] += 1;
        *o.published.entry(s.id).or_default() += 1;
        if final_ {
            let others = self
                .streams
                .iter()
                .filter(|t| t.id != id)
                .map(|t| (t.id, t.published))
                .collect();
            o.at_final.insert(id, others);
        }
    }

    fn take_requests(&mut self) -> bool {
        let mut got = false;
        while let Some(e) = self.region.requests().try_pop(|e| e.clone()) {
            got = true;
            if e.op == OP_CANCEL {
                let mut o = self.obs.lock().unwrap();
                *o.cancels.entry(e.conn).or_default() += 1;
                let mut clean = e.clone();
                clean.conn = 0;
                clean.op = 0;
                if clean != bgs_ring::RequestEntry::default() {
                    o.bad_markers += 1;
                }
                drop(o);
                for i in 0..self.streams.len() {
                    if self.streams[i].conn == e.conn && !self.streams[i].ended {
                        self.frame(i, Some(Status::Cancelled));
                    }
                }
                continue;
            }
            self.obs
                .lock()
                .unwrap()
                .conn_of
                .insert(e.request_id, e.conn);
            if e.op == Op::Generate as u16 {
                let idx = self.free.pop().expect("a free stream index");
                let p = e.payload();
                self.streams.push(Stream {
                    conn: e.conn,
                    conn_seq: e.conn_seq,
                    id: e.request_id,
                    route: e.route,
                    idx,
                    tokens: e.param,
                    next: 0,
                    pad: p.get(1).copied().unwrap_or(0),
                    delay: Duration::from_millis(u64::from(p.first().copied().unwrap_or(0))),
                    next_at: Instant::now(),
                    published: 0,
                    base_acks: self.acks(idx),
                    ended: false,
                });
            } else {
                let mut words = e.payload().to_vec();
                let status = if e.op == Op::Echo as u16 {
                    Status::Ok
                } else if e.op == OP_REJECT {
                    // A rejection BPF placed in the connection's order.
                    words.clear();
                    u16::try_from(e.param)
                        .ok()
                        .and_then(Status::from_u16)
                        .unwrap()
                } else {
                    Status::UnknownOp
                };
                self.push(|c| {
                    c.conn = e.conn;
                    c.conn_seq = e.conn_seq;
                    c.status = status as u16;
                    c.final_ = 1;
                    c.request_id = e.request_id;
                    c.words = words.len() as u32;
                    c.stream_seq = 0;
                    c.route = e.route;
                    c.stream = 0;
                    c.payload[..words.len()].copy_from_slice(&words);
                });
            }
        }
        got
    }

    fn step(&mut self) -> bool {
        let mut did = false;
        let now = Instant::now();
        for i in 0..self.streams.len() {
            loop {
                let s = &self.streams[i];
                if s.ended {
                    break;
                }
                let inflight = s.published - self.acks(s.idx).wrapping_sub(s.base_acks);
                {
                    let mut o = self.obs.lock().unwrap();
                    let m = o.max_inflight.entry(s.id).or_default();
                    *m = (*m).max(inflight);
                    if inflight >= WINDOW {
                        *o.stalled.entry(s.id).or_default() += 1;
                    }
                }
                if inflight >= WINDOW || now < s.next_at {
                    break;
                }
                let status = (s.next == s.tokens).then_some(Status::EndOfStream);
                let delay = s.delay;
                self.frame(i, status);
                did = true;
                if !delay.is_zero() {
                    self.streams[i].next_at = now + delay;
                    break;
                }
            }
        }
        // A stream index is reused only once every frame of its stream was acknowledged.
        let mut k = 0;
        while k < self.streams.len() {
            let s = &self.streams[k];
            if s.ended && self.acks(s.idx).wrapping_sub(s.base_acks) == s.published {
                self.free.push(s.idx);
                self.streams.swap_remove(k);
            } else {
                k += 1;
            }
        }
        did
    }

    fn run(mut self, stop: &AtomicBool) {
        while !stop.load(Ordering::Acquire) {
            let a = self.take_requests();
            let b = self.step();
            if !a && !b {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }
}

struct Server {
    kind: Kind,
    addr: SocketAddr,
    handle: ShutdownHandle,
    transport: std::thread::JoinHandle<()>,
    stop: Arc<AtomicBool>,
    exec: std::thread::JoinHandle<()>,
    obs: Arc<Mutex<Obs>>,
    region: Arc<RingRegion>,
    /// The native transport's counters once it stopped.
    native_stats: Arc<Mutex<Option<TransportStats>>>,
}

fn framer() -> FramerConfig {
    FramerConfig {
        max_words: 256,
        ..FramerConfig::default()
    }
}

fn start(kind: Kind, limits: ConnLimits) -> Server {
    let native_stats = Arc::new(Mutex::new(None));
    let (addr, handle, region, waker, transport): (_, _, _, _, std::thread::JoinHandle<()>) =
        match kind {
            Kind::Native | Kind::NativeCoalesce(_) => {
                let region = Arc::new(
                    RingRegion::new(RingConfig {
                        request_slots: 4096,
                        completion_slots: 4096,
                    })
                    .unwrap(),
                );
                let cfg = NativeConfig {
                    listen: "127.0.0.1:0".parse().unwrap(),
                    limits,
                    framer: framer(),
                    stream_coalesce: match kind {
                        Kind::NativeCoalesce(ms) => Duration::from_millis(ms),
                        _ => Duration::ZERO,
                    },
                    ..NativeConfig::default()
                };
                let t = NativeTransport::bind(cfg, Some(region.clone())).unwrap();
                let (addr, handle, waker) = (t.local_addr(), t.shutdown_handle(), t.waker());
                let out = native_stats.clone();
                let th = std::thread::spawn(move || {
                    *out.lock().unwrap() = Some(t.run().unwrap());
                });
                (addr, handle, region, Some(waker), th)
            }
            Kind::KernelLoop | Kind::KernelSqe | Kind::KernelSqpoll => {
                let reply = if kind == Kind::KernelLoop {
                    ReplyMode::Loop {
                        timer: Duration::from_micros(60),
                    }
                } else {
                    ReplyMode::ExecutorSqe {
                        watchdog: Duration::from_micros(50),
                        sqpoll_idle_ms: 10,
                        sqpoll_cpu: None,
                        sqpoll_above: if kind == Kind::KernelSqpoll {
                            0
                        } else {
                            bgs_transport::kernel::DEFAULT_SQPOLL_ABOVE
                        },
                    }
                };
                let cfg = KernelConfig {
                    listen: "127.0.0.1:0".parse().unwrap(),
                    reply,
                    framer: framer(),
                    max_connections: 64,
                    executor_wakes: true,
                    completion_watch: false,
                    stats_every: None,
                    // Room for the flood test's requests: few busy answers, so its replies
                    // are large.
                    request_slots: 4096,
                    completion_slots: 16384,
                    gpu_sends: false,
                    limits,
                    cancel_markers: true,
                    wake_timeout: None,
                };
                let t = KernelTransport::bind(cfg).expect("kernel transport (root)");
                let (addr, handle, waker) = (t.local_addr(), t.shutdown_handle(), t.waker());
                let region = t.region();
                let th = std::thread::spawn(move || {
                    let stats = t.run().unwrap();
                    eprintln!("{stats}");
                });
                (addr, handle, region, waker, th)
            }
        };
    let obs = Arc::new(Mutex::new(Obs {
        per_index: vec![0; MAX_STREAMS],
        ..Obs::default()
    }));
    let exec = Exec {
        region: region.clone(),
        waker,
        obs: obs.clone(),
        streams: Vec::new(),
        free: (0..MAX_STREAMS).rev().collect(),
    };
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let exec = std::thread::spawn(move || exec.run(&stop2));
    Server {
        kind,
        addr,
        handle,
        transport,
        stop,
        exec,
        obs,
        region,
        native_stats,
    }
}

impl Server {
    fn obs(&self) -> std::sync::MutexGuard<'_, Obs> {
        self.obs.lock().unwrap()
    }

    /// Every frame published with a stream was acknowledged exactly once: the counters of
    /// every stream index equal what was published through it (waits for late acks).
    fn check_acks_balance(&self) {
        let acks = |s: &Self| -> Vec<u64> {
            s.region
                .stream_acks()
                .iter()
                .map(|a| u64::from(a.load(Ordering::Acquire)))
                .collect()
        };
        wait_for("acks to balance", Duration::from_secs(10), || {
            acks(self) == self.obs().per_index
        });
        let total: u64 = self.obs().per_index.iter().sum();
        assert!(total > 0, "the test streamed something");
    }

    /// Wait until every connection this test opened got its cancel marker; then each must
    /// have exactly one.
    fn check_one_cancel_per_connection(&self, conns: usize) {
        wait_for(
            "a cancel marker per connection",
            Duration::from_secs(10),
            || self.obs().cancels.len() >= conns,
        );
        // Late duplicates would show up within a few loop iterations.
        std::thread::sleep(Duration::from_millis(50));
        let o = self.obs();
        assert_eq!(o.cancels.len(), conns, "{:?}", o.cancels);
        assert!(o.cancels.values().all(|&n| n == 1), "{:?}", o.cancels);
        assert_eq!(o.bad_markers, 0, "cancel markers carry only conn and op");
        for conn in o.conn_of.values() {
            assert!(
                o.cancels.contains_key(conn),
                "connection {conn:#x} has no marker"
            );
        }
    }

    /// Stop the server; the native transport's counters (None for the kernel transport).
    fn stop(self) -> Option<TransportStats> {
        self.handle.shutdown();
        self.transport.join().unwrap();
        self.stop.store(true, Ordering::Release);
        self.exec.join().unwrap();
        self.native_stats.lock().unwrap().take()
    }
}

fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let end = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn generate(id: u32, tokens: u32, delay_ms: u32, pad: u32) -> Vec<u8> {
    let mut out = Vec::new();
    encode_request(
        &mut out,
        &RequestHeader::new(Op::Generate, id, 2, tokens),
        &[delay_ms, pad],
    );
    out
}

fn echo(id: u32) -> Vec<u8> {
    let mut out = Vec::new();
    encode_request(&mut out, &RequestHeader::new(Op::Echo, id, 1, 0), &[id]);
    out
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s
}

/// A small receive buffer (set before connecting, so the window is small from the start)
/// keeps what TCP itself can absorb small.
fn connect_small_rcvbuf(addr: SocketAddr) -> TcpStream {
    let sock = rustix::net::socket(
        rustix::net::AddressFamily::INET,
        rustix::net::SocketType::STREAM,
        None,
    )
    .unwrap();
    rustix::net::sockopt::set_socket_recv_buffer_size(&sock, 4096).unwrap();
    rustix::net::connect(&sock, &addr).unwrap();
    let s = TcpStream::from(sock);
    s.set_nodelay(true).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s
}

fn read_frame(s: &mut impl Read) -> (ReplyHeader, Vec<u32>) {
    let mut h = [0u8; 24];
    s.read_exact(&mut h).unwrap();
    let h = ReplyHeader::decode(&h);
    let mut p = vec![0u8; h.words as usize * 4];
    s.read_exact(&mut p).unwrap();
    let w = p
        .chunks(4)
        .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    (h, w)
}

/// Read a whole stream of request `id` (`tokens` tokens padded by `pad` words) and check it.
fn read_stream(s: &mut impl Read, id: u32, tokens: u32, pad: u32) {
    for k in 0..tokens {
        let (h, w) = read_frame(s);
        assert_eq!(
            (h.request_id, h.status, h.seq),
            (id, Status::Token as u16, k),
            "token {k} of request {id}"
        );
        assert_eq!(w.len(), 1 + pad as usize);
        assert_eq!(w[0], k);
    }
    let (h, w) = read_frame(s);
    assert_eq!(
        (h.request_id, h.status, h.seq),
        (id, Status::EndOfStream as u16, tokens)
    );
    assert_eq!(w, vec![1, tokens]);
}

fn expect_eof(s: &mut TcpStream) {
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty(), "no bytes after the last reply");
}

/// An HTTP response: the head (lower-cased) and the body, de-chunked.
fn read_http(s: &mut TcpStream) -> (String, Vec<u8>) {
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        s.read_exact(&mut b).unwrap();
        head.push(b[0]);
    }
    let head = String::from_utf8(head).unwrap().to_ascii_lowercase();
    let mut body = Vec::new();
    if head.contains("transfer-encoding: chunked") {
        loop {
            let mut line = Vec::new();
            while !line.ends_with(b"\r\n") {
                s.read_exact(&mut b).unwrap();
                line.push(b[0]);
            }
            let n =
                usize::from_str_radix(std::str::from_utf8(&line[..line.len() - 2]).unwrap(), 16)
                    .unwrap();
            let mut chunk = vec![0u8; n + 2];
            s.read_exact(&mut chunk).unwrap();
            assert_eq!(&chunk[n..], b"\r\n");
            if n == 0 {
                break;
            }
            // One frame per chunk.
            let h = ReplyHeader::decode(&chunk);
            assert_eq!(24 + h.words as usize * 4, n);
            body.extend_from_slice(&chunk[..n]);
        }
    } else {
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        body.resize(len, 0);
        s.read_exact(&mut body).unwrap();
    }
    (head, body)
}

fn in_order(kind: Kind) {
    let server = start(kind, ConnLimits::default());
    // Binary: two streams with a one-shot reply between them, pipelined.
    let mut a = connect(server.addr);
    let mut req = generate(1, 50, 0, 0);
    req.extend(echo(2));
    req.extend(generate(3, 30, 0, 3));
    a.write_all(&req).unwrap();
    read_stream(&mut a, 1, 50, 0);
    let (h, w) = read_frame(&mut a);
    assert_eq!((h.request_id, h.status, w), (2, 0, vec![2]));
    read_stream(&mut a, 3, 30, 3);
    a.shutdown(Shutdown::Write).unwrap();
    expect_eof(&mut a);
    // HTTP: each stream is one chunked response with a frame per chunk; keep-alive, twice.
    let mut b = connect(server.addr);
    for id in [10, 11] {
        let mut req = Vec::new();
        encode_http_request(&mut req, "test", &generate(id, 40, 0, 0));
        b.write_all(&req).unwrap();
        let (head, body) = read_http(&mut b);
        assert!(head.starts_with("http/1.1 200"), "{head}");
        read_stream(&mut body.as_slice(), id, 40, 0);
    }
    drop(b);
    server.check_one_cancel_per_connection(2);
    server.check_acks_balance();
    assert!(
        server.obs().max_inflight.values().all(|&m| m <= WINDOW),
        "the fake executor keeps its window"
    );
    server.stop();
}

fn pipelined_stream_is_held(kind: Kind) {
    let limits = ConnLimits {
        max_inflight: 64,
        max_unsent: 1024,
    };
    let server = start(kind, limits);
    let mut a = connect(server.addr);
    // Request 1 streams slowly; request 2 could stream at once, but its frames must wait for
    // request 1 to finish, in the transport's buffers: within the connection's limit.
    let mut req = generate(1, 20, 5, 0);
    req.extend(generate(2, 400, 0, 0));
    a.write_all(&req).unwrap();
    read_stream(&mut a, 1, 20, 0);
    read_stream(&mut a, 2, 400, 0);
    let o = server.obs();
    let held = o.at_final[&1]
        .iter()
        .find(|(id, _)| *id == 2)
        .map(|&(_, n)| n)
        .expect("request 2 was streaming when request 1 ended");
    // 28-byte frames acknowledged while what the connection buffers stays within 1024 bytes,
    // plus a window of unacknowledged ones.
    let bound = 1024 / 28 + 1 + WINDOW;
    assert!(
        held <= bound,
        "{held} frames of request 2 produced while request 1 streamed (bound {bound})"
    );
    assert!(o.stalled.contains_key(&2), "request 2 ran out of credit");
    drop(o);
    drop(a);
    server.check_one_cancel_per_connection(1);
    server.check_acks_balance();
    server.stop();
}

fn stopped_reader(kind: Kind) {
    let limits = ConnLimits {
        max_inflight: 64,
        max_unsent: 16 * 1024,
    };
    let server = start(kind, limits);
    let mut a = connect_small_rcvbuf(server.addr);
    // Three pipelined streams of 4096 tokens of 1 KiB each: far more than the socket buffers
    // take (up to the 4 MiB of tcp_wmem's default maximum on the server's side).
    let (tokens, pad) = (4096, 255);
    let ids = [7, 8, 9];
    for id in ids {
        a.write_all(&generate(id, tokens, 0, pad)).unwrap();
    }
    let published = |s: &Server| -> u32 {
        let o = s.obs();
        ids.iter()
            .map(|id| o.published.get(id).copied().unwrap_or(0))
            .sum()
    };
    // Nobody reads: the transport stops acknowledging and the executor stalls at its window.
    let mut last = 0;
    let mut stable_since = Instant::now();
    wait_for("the streams to stall", Duration::from_secs(20), || {
        let n = published(&server);
        if n != last {
            last = n;
            stable_since = Instant::now();
        }
        !server.obs().stalled.is_empty() && stable_since.elapsed() > Duration::from_millis(300)
    });
    let stalled_at = published(&server);
    let total = 3 * (tokens + 1);
    assert!(
        stalled_at < total,
        "stalled after {stalled_at} frames, before the end"
    );
    eprintln!("{kind:?}: stalled after {stalled_at} of {total} frames");
    // Reading resumes the streams: every frame arrives, in order.
    for id in ids {
        read_stream(&mut a, id, tokens, pad);
    }
    // The fake executor counts a frame after pushing it into the ring, so the client can hold
    // the last frame before the count moves: wait for the count itself (it failed on CI when
    // read at once, 12,290 of 12,291).
    wait_for(
        "every frame counted as published",
        Duration::from_secs(10),
        || published(&server) >= total,
    );
    assert_eq!(published(&server), total);
    assert!(ids.iter().all(|id| server.obs().max_inflight[id] <= WINDOW));
    drop(a);
    server.check_one_cancel_per_connection(1);
    server.check_acks_balance();
    server.stop();
}

fn ended_connections_cancel(kind: Kind) {
    let server = start(kind, ConnLimits::default());
    // EOF while a stream runs: the stream ends early with a cancelled frame, in order, and
    // the server closes after it.
    let mut a = connect(server.addr);
    a.write_all(&generate(1, 1000, 5, 0)).unwrap();
    for k in 0..3 {
        let (h, _) = read_frame(&mut a);
        assert_eq!(
            (h.request_id, h.seq, h.status),
            (1, k, Status::Token as u16)
        );
    }
    a.shutdown(Shutdown::Write).unwrap();
    let mut k = 3;
    loop {
        let (h, w) = read_frame(&mut a);
        assert_eq!((h.request_id, h.seq), (1, k));
        if h.status == Status::Cancelled as u16 {
            assert!(w.is_empty());
            break;
        }
        assert_eq!(h.status, Status::Token as u16);
        k += 1;
    }
    assert!(k < 1000, "cancelled, not finished");
    expect_eof(&mut a);
    // A reset while a stream runs.
    let b = connect(server.addr);
    (&b).write_all(&generate(2, 1000, 5, 0)).unwrap();
    wait_for(
        "the second stream to start",
        Duration::from_secs(10),
        || server.obs().published.get(&2).copied().unwrap_or(0) > 2,
    );
    rustix::net::sockopt::set_socket_linger(&b, Some(Duration::ZERO)).unwrap();
    drop(b);
    // A connection the server closes after a closing error (bad magic).
    let mut c = connect(server.addr);
    c.write_all(&echo(3)).unwrap();
    c.write_all(b"XXXXXXXXXXXXXXXXXXXXXXXX").unwrap();
    let (h, _) = read_frame(&mut c);
    assert_eq!((h.request_id, h.status), (3, 0));
    let (h, _) = read_frame(&mut c);
    assert_eq!(h.status, Status::BadMagic as u16);
    expect_eof(&mut c);
    drop(c);
    // One that only asked for one-shot replies and closed normally.
    let mut d = connect(server.addr);
    d.write_all(&echo(4)).unwrap();
    read_frame(&mut d);
    drop(d);
    server.check_one_cancel_per_connection(4);
    wait_for("the reset stream to end", Duration::from_secs(10), || {
        server.obs().at_final.contains_key(&2)
    });
    assert!(server.obs().published[&2] < 1000, "cancelled, not finished");
    server.check_acks_balance();
    let kind = server.kind;
    server.stop();
    eprintln!("{kind:?}: ok");
}

fn big_echo(id: u32) -> Vec<u8> {
    let mut out = Vec::new();
    let words: Vec<u32> = (0..256).map(|k| id ^ k).collect();
    encode_request(&mut out, &RequestHeader::new(Op::Echo, id, 256, 0), &words);
    out
}

/// A client pipelines 40,000 requests whose replies (40 MiB, or at least 5 MiB should nine in
/// ten of them find the ring full and be answered busy) it does not read at first. The native transport stops reading it (its buffers stay within the limits) and
/// answers everything once it reads; the kernel transport cannot stop BPF from framing, so it
/// aborts the connection once it holds more than `overflow_bound` reply bytes for it.
fn flood(kind: Kind) {
    let server = start(kind, ConnLimits::default());
    const N: u32 = 40_000;
    let mut a = connect_small_rcvbuf(server.addr);
    let mut w = a.try_clone().unwrap();
    let writer = std::thread::spawn(move || {
        let mut sent = 0;
        for id in 0..N {
            if w.write_all(&big_echo(id)).is_err() {
                break;
            }
            sent += 1;
        }
        let _ = w.shutdown(Shutdown::Write);
        sent
    });
    if matches!(kind, Kind::Native | Kind::NativeCoalesce(_)) {
        std::thread::sleep(Duration::from_millis(300));
    } else {
        // Without a reader every reply stays in the server: once the stage holds more than
        // its bound it aborts the connection, which publishes its cancel marker.
        wait_for("the abort", Duration::from_secs(30), || {
            !server.obs().cancels.is_empty()
        });
    }
    let mut got = 0;
    let mut h = [0u8; 24];
    let mut p = vec![0u8; 1024];
    let ended_early = loop {
        if got == N {
            break false;
        }
        if a.read_exact(&mut h).is_err() {
            break true;
        }
        let hd = ReplyHeader::decode(&h);
        // The kernel transport admits by ring capacity: a full request ring answers busy.
        let busy = !matches!(kind, Kind::Native | Kind::NativeCoalesce(_))
            && hd.status == Status::Busy as u16;
        let want = if busy { (got, 21, 0) } else { (got, 0, 256) };
        assert_eq!((hd.request_id, hd.status, hd.words), want);
        if a.read_exact(&mut p[..hd.words as usize * 4]).is_err() {
            break true;
        }
        got += 1;
    };
    let sent = writer.join().unwrap();
    match kind {
        Kind::Native | Kind::NativeCoalesce(_) => {
            assert!(
                !ended_early,
                "every request answered: the stream ended after {got} of {N} replies ({sent} sent)"
            );
            assert_eq!(sent, N);
            expect_eof(&mut a);
        }
        Kind::KernelLoop | Kind::KernelSqe | Kind::KernelSqpoll => {
            assert!(ended_early, "aborted, after {got} replies");
            assert!(got < N);
        }
    }
    drop(a);
    server.check_one_cancel_per_connection(1);
    server.stop();
}

#[test]
fn native_flooding_client_is_paused_and_fully_answered() {
    flood(Kind::Native);
}

#[test]
fn kernel_flooding_client_is_aborted_over_the_buffering_bound() {
    flood(Kind::KernelLoop);
}

#[test]
fn native_streams_arrive_in_order_binary_and_http() {
    in_order(Kind::Native);
}

#[test]
fn kernel_streams_arrive_in_order_binary_and_http() {
    in_order(Kind::KernelLoop);
}

#[test]
fn native_pipelined_stream_is_held_within_the_limit() {
    pipelined_stream_is_held(Kind::Native);
}

#[test]
fn kernel_pipelined_stream_is_held_within_the_limit() {
    pipelined_stream_is_held(Kind::KernelLoop);
}

#[test]
fn native_reader_that_stops_stalls_the_stream_until_it_reads() {
    stopped_reader(Kind::Native);
}

#[test]
fn kernel_reader_that_stops_stalls_the_stream_until_it_reads() {
    stopped_reader(Kind::KernelLoop);
}

#[test]
fn native_ended_connections_publish_one_cancel_each() {
    ended_connections_cancel(Kind::Native);
}

#[test]
fn kernel_ended_connections_publish_one_cancel_each() {
    ended_connections_cancel(Kind::KernelLoop);
}

#[test]
fn kernel_sqe_streams_arrive_in_order_binary_and_http() {
    in_order(Kind::KernelSqe);
}

#[test]
fn kernel_sqe_reader_that_stops_stalls_the_stream_until_it_reads() {
    stopped_reader(Kind::KernelSqe);
}

#[test]
fn kernel_sqe_ended_connections_publish_one_cancel_each() {
    ended_connections_cancel(Kind::KernelSqe);
}

#[test]
fn kernel_sqpoll_only_streams_arrive_in_order_binary_and_http() {
    in_order(Kind::KernelSqpoll);
}

#[test]
fn kernel_sqpoll_only_reader_that_stops_stalls_the_stream_until_it_reads() {
    stopped_reader(Kind::KernelSqpoll);
}

// Holding token frames to coalesce their writes (`NativeConfig::stream_coalesce`): every test
// above must hold with a hold of a few steps, and the holds themselves behave as documented.

#[test]
fn native_coalescing_streams_arrive_in_order_binary_and_http() {
    in_order(Kind::NativeCoalesce(5));
}

#[test]
fn native_coalescing_pipelined_stream_is_held_within_the_limit() {
    pipelined_stream_is_held(Kind::NativeCoalesce(5));
}

#[test]
fn native_coalescing_reader_that_stops_stalls_the_stream_until_it_reads() {
    stopped_reader(Kind::NativeCoalesce(5));
}

#[test]
fn native_coalescing_ended_connections_publish_one_cancel_each() {
    ended_connections_cancel(Kind::NativeCoalesce(5));
}

/// With a hold far longer than the stream: the first token goes out at once, the other
/// tokens wait, and the final frame takes them all in one write.
#[test]
fn native_coalescing_writes_first_token_at_once_and_the_rest_with_the_final_frame() {
    let server = start(Kind::NativeCoalesce(10_000), ConnLimits::default());
    let mut a = connect(server.addr);
    let t0 = Instant::now();
    // 30 tokens, one every 2 ms (the first at once): the stream takes ~60 ms.
    a.write_all(&generate(1, 30, 2, 0)).unwrap();
    let (h, w) = read_frame(&mut a);
    assert_eq!((h.request_id, h.seq, w), (1, 0, vec![0]));
    let first = Instant::now();
    // The rest: tokens 1..30 and the final frame, all in order.
    for k in 1..30 {
        let (h, w) = read_frame(&mut a);
        assert_eq!(
            (h.request_id, h.status, h.seq, w),
            (1, Status::Token as u16, k, vec![k])
        );
    }
    // The 29 tokens after the first take >= 58 ms to produce: a first token held with them
    // would arrive with them (in the same write: no gap at all).
    let gap = first.elapsed();
    assert!(
        gap > Duration::from_millis(10),
        "token 1 came {gap:?} after token 0: the first token was held"
    );
    let (h, w) = read_frame(&mut a);
    assert_eq!(
        (h.request_id, h.status, h.seq, w),
        (1, Status::EndOfStream as u16, 30, vec![1, 30])
    );
    // Well before the 10 s hold: the final frame flushed what waited.
    assert!(t0.elapsed() < Duration::from_secs(8), "{:?}", t0.elapsed());
    drop(a);
    server.check_one_cancel_per_connection(1);
    server.check_acks_balance();
    let stats = server.stop().expect("native stats");
    // One write for the first token, one for everything else (a partial write would add
    // one; the 31 frames are 868 bytes).
    assert!(stats.writes <= 3, "{} writes for one stream", stats.writes);
    assert!(stats.writes_held >= 1, "{stats}");
    assert_eq!(stats.replies, 31);
}

/// A held frame leaves when its hold ends, without waiting for the next frame.
#[test]
fn native_coalescing_hold_ends_on_time_without_a_later_frame() {
    let server = start(Kind::NativeCoalesce(20), ConnLimits::default());
    let mut a = connect(server.addr);
    // 3 tokens 400 ms apart: token 1 is held for 20 ms, long before token 2 is published.
    a.write_all(&generate(1, 3, 400, 0)).unwrap();
    let mut at = Vec::new();
    for k in 0..3 {
        let (h, _) = read_frame(&mut a);
        assert_eq!((h.seq, h.status), (k, Status::Token as u16));
        at.push(Instant::now());
    }
    let (h, _) = read_frame(&mut a);
    assert_eq!((h.seq, h.status), (3, Status::EndOfStream as u16));
    // Token 1 arrived alone, ~400 ms after token 0 and ~400 ms before token 2: had it waited
    // for a later frame it would arrive with token 2.
    let gap = at[2] - at[1];
    assert!(
        gap > Duration::from_millis(200),
        "token 1 arrived {gap:?} before token 2: it waited for it"
    );
    drop(a);
    let stats = server.stop().expect("native stats");
    assert!(stats.writes_held >= 2, "{stats}");
}

/// A client writes a batch of requests, then ends its byte stream (FIN) at about the moment it
/// starts reading. The native transport may then learn of the FIN in the same wake-up in which
/// a write makes room for more input, while frames it already read are still held back by the
/// limits: those frames must still be answered (a read of end-of-stream must not drop them).
/// Many connections make the coincidence likely; every one must get every reply.
#[test]
fn native_half_close_while_input_is_held_back_answers_everything() {
    let limits = ConnLimits {
        max_inflight: 8,
        max_unsent: 4 * 1024,
    };
    let server = start(Kind::Native, limits);
    const CONNS: u32 = 24;
    const PER_CONN: u32 = 48;
    let clients: Vec<_> = (0..CONNS)
        .map(|c| {
            let addr = server.addr;
            std::thread::spawn(move || {
                let mut s = connect_small_rcvbuf(addr);
                let mut batch = Vec::new();
                for k in 0..PER_CONN {
                    batch.extend_from_slice(&big_echo(c * PER_CONN + k));
                }
                s.write_all(&batch).unwrap();
                // Let the server fill the socket and hold the rest back.
                std::thread::sleep(Duration::from_millis(20 + u64::from(c % 4) * 5));
                s.shutdown(Shutdown::Write).unwrap();
                let mut h = [0u8; 24];
                let mut p = vec![0u8; 1024];
                for k in 0..PER_CONN {
                    s.read_exact(&mut h)
                        .unwrap_or_else(|e| panic!("connection {c}: reply {k}: {e}"));
                    let hd = ReplyHeader::decode(&h);
                    assert_eq!(
                        (hd.request_id, hd.status, hd.words),
                        (c * PER_CONN + k, 0, 256)
                    );
                    s.read_exact(&mut p[..1024]).unwrap();
                }
                expect_eof(&mut s);
            })
        })
        .collect();
    for c in clients {
        c.join().unwrap();
    }
    server.check_one_cancel_per_connection(CONNS as usize);
    server.stop();
}
