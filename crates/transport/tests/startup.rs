//! The kernel transport's start-up, as root (BPF, io_uring): a client that connects in a tight
//! loop while the server starts must be served from the first connection that succeeds.
//!
//! The BPF `sock_ops` program puts connections into the sockhash at handshake time. If the
//! port listened before the program was attached, a connection made in between was accepted
//! but never entered the sockhash: its requests were never framed and it hung forever. Start
//! the server many times with a client hammering its port, and require every first request to
//! be answered.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bgs_protocol::{FramerConfig, Op, ReplyHeader, RequestHeader, Status};
use bgs_ring::RingRegion;
use bgs_transport::kernel::{KernelConfig, KernelTransport, ReplyMode};

/// Answers every request with an echo, like an executor (the stage polls: no waker).
fn responder(region: Arc<RingRegion>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Acquire) {
        let mut got = false;
        while let Some(r) = region.requests().try_pop(|e| {
            (
                e.conn,
                e.conn_seq,
                e.request_id,
                e.route,
                e.payload[..e.words as usize].to_vec(),
            )
        }) {
            got = true;
            let (conn, seq, id, route, words) = r;
            let deadline = Instant::now() + Duration::from_secs(10);
            while region
                .completions()
                .try_push(|c| {
                    c.conn = conn;
                    c.conn_seq = seq;
                    c.status = Status::Ok as u16;
                    c.final_ = 1;
                    c.request_id = id;
                    c.words = words.len() as u32;
                    c.stream_seq = 0;
                    c.route = route;
                    c.stream = 0;
                    c.payload[..words.len()].copy_from_slice(&words);
                })
                .is_err()
            {
                assert!(Instant::now() < deadline, "completion ring full for 10 s");
                std::thread::yield_now();
            }
            region.completions().notify();
        }
        if !got {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

/// A port that was free a moment ago (the test binds it again right away).
fn free_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// Connect in a tight loop until it succeeds (or `give_up` is set), then send one request and
/// return its reply.
fn eager_client(addr: SocketAddr, id: u32, give_up: &AtomicBool) -> Option<ReplyHeader> {
    let mut s = loop {
        match TcpStream::connect(addr) {
            Ok(s) => break s,
            Err(e) if e.kind() == ErrorKind::ConnectionRefused => {
                if give_up.load(Ordering::Acquire) {
                    return None;
                }
                std::hint::spin_loop();
            }
            Err(e) => panic!("connect: {e}"),
        }
    };
    let mut req = Vec::new();
    bgs_protocol::encode_request(&mut req, &RequestHeader::new(Op::Echo, id, 1, 0), &[id]);
    s.write_all(&req).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut h = [0u8; 28];
    match s.read_exact(&mut h) {
        Ok(()) => {}
        Err(e) => panic!(
            "request {id}: the connection made while the server started got no reply ({e}): \
             it was accepted before the BPF programs were attached"
        ),
    }
    let head: [u8; 24] = h[..24].try_into().unwrap();
    let header = ReplyHeader::decode(&head);
    assert_eq!(u32::from_le_bytes(h[24..].try_into().unwrap()), id);
    Some(header)
}

fn start_once(round: u32, reply: ReplyMode) {
    let addr = free_port();
    let give_up = Arc::new(AtomicBool::new(false));
    let g = give_up.clone();
    let client = std::thread::spawn(move || eager_client(addr, round, &g));
    // Let the client spin on the closed port first.
    std::thread::sleep(Duration::from_millis(5));
    let transport = KernelTransport::bind(KernelConfig {
        listen: addr,
        reply,
        framer: FramerConfig::default(),
        max_connections: 64,
        executor_wakes: false,
        completion_watch: false,
        stats_every: None,
        request_slots: 256,
        completion_slots: 1024,
        gpu_sends: false,
        limits: bgs_transport::conn::ConnLimits::default(),
        cancel_markers: true,
        wake_timeout: None,
    })
    .expect("kernel transport (root)");
    let stop = Arc::new(AtomicBool::new(false));
    let responder = {
        let (region, stop) = (transport.region(), stop.clone());
        std::thread::spawn(move || responder(region, stop))
    };
    let handle = transport.shutdown_handle();
    let server = std::thread::spawn(move || transport.run().unwrap());
    // The client connects once the port listens; it gives up only if it never does.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !client.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    give_up.store(true, Ordering::Release);
    let reply = client.join().unwrap();
    handle.shutdown();
    let stats = server.join().unwrap();
    stop.store(true, Ordering::Release);
    responder.join().unwrap();
    let h = reply.expect("the client connected");
    assert_eq!((h.status, h.request_id, h.words), (0, round, 1));
    assert_eq!(stats.accepts, 1, "{stats}");
}

#[test]
fn connections_made_while_the_server_starts_are_served() {
    for round in 0..10 {
        start_once(
            round,
            ReplyMode::Loop {
                timer: Duration::from_micros(60),
            },
        );
    }
    for round in 10..15 {
        start_once(
            round,
            ReplyMode::ExecutorSqe {
                watchdog: Duration::from_micros(50),
                sqpoll_idle_ms: 10,
                sqpoll_cpu: None,
                sqpoll_above: bgs_transport::kernel::DEFAULT_SQPOLL_ABOVE,
            },
        );
    }
    // The SQPOLL ring only (the paper's path): every reply an SQE.
    for round in 15..18 {
        start_once(
            round,
            ReplyMode::ExecutorSqe {
                watchdog: Duration::from_micros(50),
                sqpoll_idle_ms: 10,
                sqpoll_cpu: None,
                sqpoll_above: 0,
            },
        );
    }
}

/// A connection BPF refuses at its handshake (its sockhash and state map are full) is reset
/// at accept, not left open with nobody reading it: every client gets its reply or a reset.
#[test]
fn connections_bpf_refuses_are_reset_not_left_hanging() {
    // max_connections 1: the maps hold 2 * 1 + 256 = 258 connections.
    const CLIENTS: u32 = 300;
    let transport = KernelTransport::bind(KernelConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        reply: ReplyMode::Loop {
            timer: Duration::from_micros(60),
        },
        framer: FramerConfig::default(),
        max_connections: 1,
        executor_wakes: false,
        completion_watch: false,
        stats_every: None,
        request_slots: 1024,
        completion_slots: 4096,
        gpu_sends: false,
        limits: bgs_transport::conn::ConnLimits::default(),
        cancel_markers: true,
        wake_timeout: None,
    })
    .expect("kernel transport (root)");
    let addr = transport.local_addr();
    let stop = Arc::new(AtomicBool::new(false));
    let responder = {
        let (region, stop) = (transport.region(), stop.clone());
        std::thread::spawn(move || responder(region, stop))
    };
    let handle = transport.shutdown_handle();
    let server = std::thread::spawn(move || transport.run().unwrap());
    let is_reset = |e: &std::io::Error| {
        matches!(
            e.kind(),
            ErrorKind::ConnectionReset | ErrorKind::BrokenPipe | ErrorKind::UnexpectedEof
        )
    };
    // All connections stay open until every one has its answer, so the maps stay full.
    let (mut served, mut reset) = (0u64, 0u64);
    let mut conns = Vec::new();
    for id in 0..CLIENTS {
        let mut s = TcpStream::connect(addr).unwrap();
        let mut req = Vec::new();
        bgs_protocol::encode_request(&mut req, &RequestHeader::new(Op::Echo, id, 1, 0), &[id]);
        match s.write_all(&req) {
            Ok(()) => conns.push((id, s)),
            // Refused and reset before the request went out.
            Err(e) if is_reset(&e) => reset += 1,
            Err(e) => panic!("connection {id}: {e}"),
        }
    }
    for (id, s) in conns.iter_mut() {
        let id = *id;
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut h = [0u8; 28];
        match s.read_exact(&mut h) {
            Ok(()) => {
                let head: [u8; 24] = h[..24].try_into().unwrap();
                let r = ReplyHeader::decode(&head);
                assert_eq!((r.status, r.request_id), (0, id));
                served += 1;
            }
            Err(e) if is_reset(&e) => reset += 1,
            Err(e) => panic!("connection {id}: neither served nor refused ({e})"),
        }
    }
    drop(conns);
    handle.shutdown();
    let stats = server.join().unwrap();
    stop.store(true, Ordering::Release);
    responder.join().unwrap();
    eprintln!("{served} served, {reset} reset\n{stats}");
    assert_eq!(served + reset, u64::from(CLIENTS));
    assert!(served >= 200, "{served} served");
    assert!(reset > 0, "the maps never filled");
    assert_eq!(stats.untracked, reset, "{stats}");
    assert_eq!(stats.bpf.conns_refused, reset, "{stats}");
}

/// The server's end of the connection whose peer is `client` (a socket this process holds:
/// the transport's accepted descriptor), once the transport has accepted it.
fn accepted_socket(server: SocketAddr, client: SocketAddr) -> Option<std::os::fd::OwnedFd> {
    for e in std::fs::read_dir("/proc/self/fd").ok()?.flatten() {
        let Some(fd) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        // SAFETY: a descriptor this process holds; it is only duplicated here (a closed or
        // reused number fails or yields another object, which the address checks reject).
        let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        let Ok(dup) = rustix::io::fcntl_dupfd_cloexec(borrowed, 0) else {
            continue;
        };
        let local = rustix::net::getsockname(&dup)
            .ok()
            .and_then(|a| SocketAddr::try_from(a).ok());
        let peer = rustix::net::getpeername(&dup)
            .ok()
            .flatten()
            .and_then(|a| SocketAddr::try_from(a).ok());
        if local == Some(server) && peer == Some(client) {
            return Some(dup);
        }
    }
    None
}

/// Replies leave without Nagle's wait: the transport's accepted connections have TCP_NODELAY
/// (a stream's second token frame otherwise waited for the client's delayed ACK of the first,
/// ~40 ms on loopback), for both reply paths.
#[test]
fn accepted_connections_have_tcp_nodelay() {
    for reply in [
        ReplyMode::Loop {
            timer: Duration::from_micros(60),
        },
        ReplyMode::ExecutorSqe {
            watchdog: Duration::from_micros(50),
            sqpoll_idle_ms: 10,
            sqpoll_cpu: None,
            sqpoll_above: bgs_transport::kernel::DEFAULT_SQPOLL_ABOVE,
        },
    ] {
        let transport = KernelTransport::bind(KernelConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            reply,
            framer: FramerConfig::default(),
            max_connections: 64,
            executor_wakes: false,
            completion_watch: false,
            stats_every: None,
            request_slots: 256,
            completion_slots: 1024,
            gpu_sends: false,
            limits: bgs_transport::conn::ConnLimits::default(),
            cancel_markers: true,
            wake_timeout: None,
        })
        .expect("kernel transport (root)");
        let addr = transport.local_addr();
        let handle = transport.shutdown_handle();
        let server = std::thread::spawn(move || transport.run().unwrap());
        let client = TcpStream::connect(addr).unwrap();
        let client_addr = client.local_addr().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let accepted = loop {
            if let Some(fd) = accepted_socket(addr, client_addr) {
                break fd;
            }
            assert!(
                Instant::now() < deadline,
                "the connection was never accepted"
            );
            std::thread::sleep(Duration::from_millis(1));
        };
        assert!(
            rustix::net::sockopt::tcp_nodelay(&accepted).unwrap(),
            "{reply:?}: the accepted connection has Nagle on"
        );
        drop(accepted);
        drop(client);
        handle.shutdown();
        server.join().unwrap();
    }
}
