//! Shared harness of the BPF receive-path tests: load a `KernelRx` on an ephemeral port, open
//! connections, read back what BPF published for each connection.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::Write;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bgs_bpf::{KernelRx, KernelRxConfig, socket_cookie};
use bgs_protocol::{Decoded, Framer, FramerConfig, Framing};
use bgs_ring::{OP_REJECT, RingRegion, route};

/// Root is needed. CI runs as root, so there a non-root run fails; developers get a notice.
pub fn root_or_skip(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    if std::env::var_os("CI").is_some() {
        panic!("{test}: the BPF tests need root and CI runs as root; refusing to skip");
    }
    eprintln!("NOTICE: {test} skipped: the BPF receive-path tests need root (id -u is not 0)");
    false
}

/// One thing the framer produced, in a form both sides can be compared in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Item {
    Req {
        op: u16,
        version: u16,
        request_id: u32,
        words: u32,
        param: u32,
        flags: u32,
        payload: Vec<u32>,
        http: bool,
        close: bool,
    },
    Reject {
        status: u16,
        request_id: u32,
        http: Option<u16>,
        close: bool,
    },
    /// A busy completion published by BPF (request ring full).
    Busy {
        request_id: u32,
        http: bool,
        close: bool,
    },
    /// A rejection answered directly in the completion ring (request ring full).
    DirectReject {
        status: u16,
        request_id: u32,
        route: u32,
    },
    Eof,
    Reset,
}

/// What the Rust framer yields for the whole stream, up to and including the first item that
/// closes the connection (a closing rejection, or an HTTP request without keep-alive: the
/// transports stop reading there).
pub fn reference(cfg: FramerConfig, stream: &[u8]) -> Vec<Item> {
    let mut f = Framer::new(cfg);
    let mut buf = stream;
    let mut out = Vec::new();
    loop {
        match f.decode(buf) {
            Decoded::NeedMore => break,
            Decoded::Request { consumed, request } => {
                let h = request.header;
                let (http, close) = match request.framing {
                    Framing::Binary => (false, false),
                    Framing::Http { keep_alive } => (true, !keep_alive),
                };
                out.push(Item::Req {
                    op: h.op,
                    version: h.version,
                    request_id: h.request_id,
                    words: h.words,
                    param: h.param,
                    flags: h.flags,
                    payload: request
                        .payload
                        .chunks_exact(4)
                        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
                        .collect(),
                    http,
                    close,
                });
                buf = &buf[consumed..];
                if close {
                    break;
                }
            }
            Decoded::Reject { consumed, reject } => {
                out.push(Item::Reject {
                    status: reject.status.map_or(0, |s| s as u16),
                    request_id: reject.request_id,
                    http: reject.http_status,
                    close: reject.close,
                });
                buf = &buf[consumed..];
                if reject.close {
                    break;
                }
            }
        }
    }
    out
}

pub struct Harness {
    pub rx: KernelRx,
    pub region: Arc<RingRegion>,
    /// Where BPF's own completions go.
    pub side: Arc<RingRegion>,
    pub listener: TcpListener,
    pub port: u16,
    pub framer: FramerConfig,
    /// Entries popped for connections other than the one being read.
    stash: BTreeMap<u64, Vec<(u32, Item)>>,
}

impl Harness {
    pub fn new(mut cfg: KernelRxConfig) -> Harness {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().unwrap().port();
        cfg.listen_port = port;
        let rx = KernelRx::load(&cfg).unwrap_or_else(|e| panic!("KernelRx::load: {e}"));
        let region = rx.region();
        let side = rx.side_region();
        Harness {
            rx,
            region,
            side,
            listener,
            port,
            framer: FramerConfig {
                max_words: cfg.max_words,
                max_http_head: cfg.max_http_head as usize,
            },
            stash: BTreeMap::new(),
        }
    }

    /// Connect; returns (client, accepted server socket, cookie).
    pub fn connect(&self) -> (TcpStream, TcpStream, u64) {
        let client = TcpStream::connect(("127.0.0.1", self.port)).expect("connect");
        client.set_nodelay(true).unwrap();
        let (server, _) = self.listener.accept().expect("accept");
        let cookie = socket_cookie(server.as_fd()).expect("SO_COOKIE");
        (client, server, cookie)
    }

    /// Pop everything published so far into the stash.
    pub fn pump(&mut self) {
        while let Some((conn, seq, item)) = self.region.requests().try_pop(|e| {
            let item = if e.op == OP_REJECT {
                Item::Reject {
                    status: e.param as u16,
                    request_id: e.request_id,
                    http: (e.route & route::HTTP != 0).then_some(
                        ((e.route >> route::HTTP_STATUS_SHIFT) & route::HTTP_STATUS_MASK) as u16,
                    ),
                    close: e.route & route::CLOSE != 0,
                }
            } else {
                Item::Req {
                    op: e.op,
                    version: e.version,
                    request_id: e.request_id,
                    words: e.words,
                    param: e.param,
                    flags: e.flags,
                    payload: e.payload().to_vec(),
                    http: e.route & route::HTTP != 0,
                    close: e.route & route::CLOSE != 0,
                }
            };
            (e.conn, e.conn_seq, item)
        }) {
            self.stash.entry(conn).or_default().push((seq, item));
        }
        // BPF never publishes into the executor's completion ring.
        assert!(self.region.completions().is_empty());
        while let Some((conn, seq, item)) = self.side.completions().try_pop(|e| {
            assert_eq!(e.final_, 1, "BPF completions are final");
            assert_eq!(e.words, 0, "BPF completions carry no payload");
            let item = if e.route & route::EOF != 0 {
                Item::Eof
            } else if e.route & route::RESET != 0 {
                Item::Reset
            } else if e.status == bgs_protocol::Status::Busy as u16 {
                Item::Busy {
                    request_id: e.request_id,
                    http: e.route & route::HTTP != 0,
                    close: e.route & route::CLOSE != 0,
                }
            } else {
                Item::DirectReject {
                    status: e.status,
                    request_id: e.request_id,
                    route: e.route,
                }
            };
            (e.conn, e.conn_seq, item)
        }) {
            self.stash.entry(conn).or_default().push((seq, item));
        }
    }

    /// Items of `cookie` until (and including) its EOF or RESET marker, sorted by conn_seq
    /// (asserting that conn_seq runs 0, 1, 2, ... without gaps).
    pub fn until_marker(&mut self, cookie: u64, timeout: Duration) -> Vec<Item> {
        let deadline = Instant::now() + timeout;
        loop {
            self.pump();
            let done = self
                .stash
                .get(&cookie)
                .is_some_and(|v| v.iter().any(|(_, i)| matches!(i, Item::Eof | Item::Reset)));
            if done {
                // Entries published before the marker are visible once it is (per producer
                // order); pump once more for request entries claimed just before.
                self.pump();
                let mut v = self.stash.remove(&cookie).unwrap();
                v.sort_by_key(|(s, _)| *s);
                for (i, (s, _)) in v.iter().enumerate() {
                    assert_eq!(*s as usize, i, "conn_seq gap for {cookie:#x}: {v:?}");
                }
                return v.into_iter().map(|(_, i)| i).collect();
            }
            assert!(
                Instant::now() < deadline,
                "no EOF/RESET marker for {cookie:#x} within {timeout:?}; got {:?}; counters {}",
                self.stash.get(&cookie),
                self.rx.counters()
            );
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Items of `cookie` seen so far (sorted by conn_seq), without waiting for a marker.
    pub fn take(&mut self, cookie: u64) -> Vec<(u32, Item)> {
        self.pump();
        let mut v = self.stash.remove(&cookie).unwrap_or_default();
        v.sort_by_key(|(s, _)| *s);
        v
    }

    /// Send `stream` in `chunks` (lengths; the rest goes last), sleeping `gap` between chunks,
    /// shut the write side, and return what BPF published (markers stripped after checking the
    /// EOF is last).
    pub fn run_case(&mut self, stream: &[u8], chunks: &[usize], gap: Duration) -> Vec<Item> {
        let (mut client, server, cookie) = self.connect();
        let mut rest = stream;
        for &c in chunks {
            let n = c.min(rest.len());
            if n == 0 {
                continue;
            }
            if client.write_all(&rest[..n]).is_err() {
                rest = &[];
                break;
            }
            rest = &rest[n..];
            if !gap.is_zero() {
                std::thread::sleep(gap);
            }
        }
        if !rest.is_empty() {
            let _ = client.write_all(rest);
        }
        let _ = client.shutdown(Shutdown::Write);
        let mut items = self.until_marker(cookie, Duration::from_secs(5));
        assert_eq!(
            items.pop(),
            Some(Item::Eof),
            "EOF marker last for {cookie:#x}"
        );
        self.rx.forget_connection(cookie);
        drop(server);
        drop(client);
        items
    }
}
