//! GPU-written SENDs (`KernelConfig::gpu_sends`) end to end on loopback, as root (BPF, io_uring).
//!
//! No GPU here: a CPU thread plays the device with only what a GPU executor is given, the
//! `TxDesc` (the send table, and the raw memory and offsets of its own io_uring ring), and
//! behaves as the GPU's publish kernel and reaper do: it takes requests from the request ring,
//! finishes them in a shuffled order, puts a reply on the wire itself (reply in the entry's
//! send buffer, SEND SQE in its ring, SQ tail published) when the connection is registered and
//! the turn names the reply, else pushes the completion for the host's reply stage and, if
//! the stage sleeps, queues a private FUTEX_WAKE on the completion ring's doorbell; its reaper
//! consumes its ring's CQ and passes the turn on every SEND completion.
//!
//! Streams: the device sends only final one-shot replies (`stream == 0 && final_`); a
//! `generate` request (op 3, `param` tokens) is streamed through the completion ring with a
//! credit stream under a window of 16 frames, all of it for the host's stage, as a generating
//! GPU will. Cancel markers (`OP_CANCEL`) are never answered: they end the connection's
//! streams with a cancelled frame.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bgs_protocol::{FramerConfig, Op, ReplyHeader, RequestHeader, Status, encode_reply};
use bgs_ring::tx::{
    TX_BUF_BYTES, TX_EMPTY, TX_HEADER_BYTES, TX_TOMBSTONE, TX_UD_SEND, TX_UD_WAKE, TxDesc, TxEntry,
    TxHeader, TxTable,
};
use bgs_ring::{OP_CANCEL, RegionHeader, RingRegion, route};
use bgs_transport::conn::ConnLimits;
use bgs_transport::kernel::{
    GpuTx, KernelConfig, KernelMonitor, KernelStats, KernelTransport, ReplyMode,
};
use bgs_uring::sys::SendFlags;
use bgs_uring::{Sqe, futex_wake, send_with_flags};

const MSG_WAITALL: u32 = 0x100;
/// Request ids with this bit are always handed to the host's reply stage, as a GPU does with
/// replies it may not send itself (HTTP, closing), whatever the turn: so the test does not
/// depend on scheduling to exercise deferred replies and the FUTEX_WAKEs that go with them.
const DEFER: u32 = 1 << 30;

fn config(reply: ReplyMode) -> KernelConfig {
    KernelConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        reply,
        framer: FramerConfig::default(),
        max_connections: 256,
        executor_wakes: false,
        // As `bgs serve` sets it for the GPU (`--gpu-completion-wake paced`): it wakes the
        // stage while the GPU's sends are paused (adaptive submission); unused otherwise.
        completion_watch: true,
        stats_every: None,
        request_slots: 1024,
        completion_slots: 16384,
        gpu_sends: true,
        limits: ConnLimits::default(),
        // The stand-in GPU skips them, as the GPU executor will once it streams.
        cancel_markers: true,
        wake_timeout: None,
    }
}

/// `sqpoll_above`: 0, the GPU sends whenever the turn allows (the paper's path); else the
/// reply rate from which it does, paused below it (adaptive submission).
fn sqe_mode(sqpoll_above: u32) -> ReplyMode {
    ReplyMode::ExecutorSqe {
        watchdog: Duration::from_micros(50),
        sqpoll_idle_ms: 10,
        sqpoll_cpu: None,
        sqpoll_above,
    }
}

#[derive(Debug)]
struct Req {
    conn: u64,
    seq: u32,
    id: u32,
    route: u32,
    op: u16,
    param: u32,
    words: Vec<u32>,
}

/// Frames of one stream the device keeps unacknowledged at most.
const WINDOW: u32 = 16;

/// A `generate` request the device streams.
#[derive(Debug)]
struct DevStream {
    conn: u64,
    seq: u32,
    id: u32,
    idx: usize,
    tokens: u32,
    next: u32,
    published: u32,
    base_acks: u32,
    ended: bool,
}

/// The stand-in for the GPU (see the file docs).
struct Device {
    desc: TxDesc,
    table: Arc<TxTable>,
    region: Arc<RingRegion>,
    bufs_offset: usize,
    entries_offset: usize,
    /// The SQ tail as published (the device is the only producer).
    sq_tail: u32,
    cq_head: u32,
    /// Bytes of the SEND in flight per entry.
    lens: HashMap<u32, i32>,
    pending: Vec<Req>,
    rng: u64,
    sends: u64,
    deferred: u64,
    wakes: u64,
    /// Sleepers the FUTEX_WAKEs woke (their CQEs' results), readable while the device runs.
    woken: Arc<AtomicU64>,
    errors: u64,
    streams: Vec<DevStream>,
    free: Vec<usize>,
    /// Frames published per credit stream index.
    per_index: Vec<u64>,
    /// Cancel markers per connection.
    cancels: HashMap<u64, u32>,
    /// Connections that sent requests.
    conns: std::collections::HashSet<u64>,
}

impl Device {
    fn new(
        desc: TxDesc,
        table: Arc<TxTable>,
        region: Arc<RingRegion>,
        woken: Arc<AtomicU64>,
    ) -> Self {
        // SAFETY: the header at the start of the table block; its geometry is written once
        // by the host before the descriptor is handed out.
        let h = unsafe { &*desc.table.cast::<TxHeader>() };
        let mut d = Device {
            desc,
            table,
            region,
            bufs_offset: h.bufs_offset as usize,
            entries_offset: h.entries_offset as usize,
            sq_tail: 0,
            cq_head: 0,
            lens: HashMap::new(),
            pending: Vec::new(),
            rng: 0x9e37_79b9_7f4a_7c15,
            sends: 0,
            deferred: 0,
            wakes: 0,
            woken,
            errors: 0,
            streams: Vec::new(),
            free: (0..bgs_ring::MAX_STREAMS).rev().collect(),
            per_index: vec![0; bgs_ring::MAX_STREAMS],
            cancels: HashMap::new(),
            conns: std::collections::HashSet::new(),
        };
        d.sq_tail = d.word(desc.sq_tail).load(Ordering::Acquire);
        d.cq_head = d.word(desc.cq_head).load(Ordering::Acquire);
        d
    }

    fn word(&self, off: u32) -> &AtomicU32 {
        assert!(off as usize + 4 <= self.desc.rings_len && off.is_multiple_of(4));
        // SAFETY: an aligned u32 of the ring region (offset from the kernel), accessed
        // atomically by us and the kernel.
        unsafe { AtomicU32::from_ptr(self.desc.rings.add(off as usize).cast()) }
    }

    fn entry_fd(&self, idx: u32) -> i32 {
        let off = self.entries_offset + idx as usize * size_of::<TxEntry>();
        // SAFETY: entry `idx` of the table block; `fd` is written by the host before the
        // cookie (release) that our lookup acquired.
        unsafe {
            std::ptr::read_volatile(&raw const (*self.desc.table.add(off).cast::<TxEntry>()).fd)
        }
    }

    fn submit(&mut self, sqe: &Sqe) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self
            .sq_tail
            .wrapping_sub(self.word(self.desc.sq_head).load(Ordering::Acquire))
            >= self.desc.sq_entries
        {
            assert!(Instant::now() < deadline, "the GPU ring's SQ never drained");
            std::thread::yield_now();
        }
        let slot = (self.sq_tail & (self.desc.sq_entries - 1)) as usize;
        assert!((slot + 1) * 64 <= self.desc.sqes_len);
        // SAFETY: slot < sq_entries inside the SQE array; the kernel consumed it (head).
        unsafe {
            self.desc
                .sqes
                .cast::<bgs_uring::sys::io_uring_sqe>()
                .add(slot)
                .write(sqe.0)
        };
        self.sq_tail = self.sq_tail.wrapping_add(1);
        self.word(self.desc.sq_tail)
            .store(self.sq_tail, Ordering::Release);
    }

    fn next_rand(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    /// A one-shot reply (`stream == 0 && final_`): the only kind the device sends itself.
    fn finish(&mut self, r: Req) {
        let host_only = route::HTTP | route::CLOSE | route::NO_FRAME | route::EOF | route::RESET;
        if r.route & host_only == 0
            && r.id & DEFER == 0
            && !self.table.gpu_sends_paused()
            && let Some(idx) = self.table.lookup(r.conn)
            && self.table.next_seq(idx) == r.seq
        {
            let mut bytes = Vec::new();
            encode_reply(&mut bytes, Status::Ok, r.id, 0, &r.words);
            assert!(bytes.len() <= TX_BUF_BYTES);
            let off = self.bufs_offset + idx as usize * TX_BUF_BYTES;
            assert!(off + TX_BUF_BYTES <= self.desc.table_len);
            // SAFETY: entry idx's send buffer lies inside the table block (checked above).
            let buf = unsafe { self.desc.table.add(off) };
            // SAFETY: only the holder of the entry's turn writes its buffer, and the previous
            // SEND from it completed before the turn came back; `bytes` fits (checked above).
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf, bytes.len()) };
            let fd = self.entry_fd(idx);
            let ud = (TX_UD_SEND << 56) | (u64::from(idx) << 32) | u64::from(r.seq);
            // SAFETY: the buffer stays untouched until the SEND's CQE passes the turn.
            let sqe = unsafe {
                send_with_flags(
                    fd,
                    buf,
                    bytes.len() as u32,
                    SendFlags::from_bits_retain(MSG_WAITALL) | SendFlags::NOSIGNAL,
                    ud,
                )
            };
            self.lens.insert(idx, bytes.len() as i32);
            self.submit(&sqe);
            self.table.gpu_sends_word().fetch_add(1, Ordering::Release);
            self.sends += 1;
            return;
        }
        self.hand_over(|c| {
            c.conn = r.conn;
            c.conn_seq = r.seq;
            c.status = Status::Ok as u16;
            c.final_ = 1;
            c.request_id = r.id;
            c.words = r.words.len() as u32;
            c.stream_seq = 0;
            c.route = r.route;
            c.stream = 0;
            c.payload[..r.words.len()].copy_from_slice(&r.words);
        });
    }

    /// Publish the next frame of stream `i` for the stage (never sent by the device: it
    /// carries credit, `stream != 0`): a token, the end of the stream, or `cancelled`.
    fn stream_frame(&mut self, i: usize, cancelled: bool) {
        let s = &self.streams[i];
        let (status, final_, words) = if cancelled {
            (Status::Cancelled, true, vec![])
        } else if s.next == s.tokens {
            (Status::EndOfStream, true, vec![1, s.tokens])
        } else {
            (Status::Token, false, vec![s.next])
        };
        let (conn, seq, id, next, stream) = (s.conn, s.seq, s.id, s.next, s.idx as u32 + 1);
        self.hand_over(|c| {
            c.conn = conn;
            c.conn_seq = seq;
            c.status = status as u16;
            c.final_ = u16::from(final_);
            c.request_id = id;
            c.words = words.len() as u32;
            c.stream_seq = next;
            c.route = 0;
            c.stream = stream;
            c.payload[..words.len()].copy_from_slice(&words);
        });
        let s = &mut self.streams[i];
        s.published += 1;
        self.per_index[s.idx] += 1;
        if final_ {
            s.ended = true;
        } else {
            s.next += 1;
        }
    }

    fn acks(&self, idx: usize) -> u32 {
        self.region.stream_acks()[idx].load(Ordering::Acquire)
    }

    /// Advance every stream as far as its credit allows; retire streams whose frames were
    /// all acknowledged.
    fn step_streams(&mut self) {
        for i in 0..self.streams.len() {
            loop {
                let s = &self.streams[i];
                let inflight = s.published - self.acks(s.idx).wrapping_sub(s.base_acks);
                if s.ended || inflight >= WINDOW {
                    break;
                }
                self.stream_frame(i, false);
            }
        }
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
    }

    /// Push a completion for the host's reply stage (and wake it if it sleeps).
    fn hand_over(&mut self, fill: impl Fn(&mut bgs_ring::CompletionEntry)) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.region.completions().try_push(&fill).is_err() {
            assert!(Instant::now() < deadline, "completion ring full for 10 s");
            std::thread::yield_now();
        }
        self.deferred += 1;
        // Not while the host pauses our sends: its SQPOLL thread sleeps then, and BPF's
        // completion watch wakes the stage.
        if !self.table.gpu_sends_paused() && self.region.completions().has_sleepers() {
            let off = std::mem::offset_of!(RegionHeader, completion_doorbell);
            // SAFETY: the completion ring's doorbell word in the live region header.
            let bell = unsafe { AtomicU32::from_ptr(self.region.as_ptr().add(off).cast()) };
            bell.fetch_add(1, Ordering::SeqCst);
            // A private futex (the SQPOLL thread shares our address space): the region is a
            // BPF map's mapping, on which shared futexes fail with EFAULT.
            let sqe = futex_wake(bell, i32::MAX as u32, TX_UD_WAKE << 56);
            self.submit(&sqe);
            self.wakes += 1;
        }
    }

    /// The reaper: the device is the only consumer of its ring's CQ.
    fn reap(&mut self) {
        let tail = self.word(self.desc.cq_tail).load(Ordering::Acquire);
        while self.cq_head != tail {
            let slot = (self.cq_head & (self.desc.cq_entries - 1)) as usize;
            let off = self.desc.cqes as usize + slot * 16;
            assert!(off + 16 <= self.desc.rings_len);
            // SAFETY: a CQE the kernel published (tail acquired) in the rings region.
            let (ud, res) = unsafe {
                let p = self.desc.rings.add(off);
                (
                    std::ptr::read_volatile(p.cast::<u64>()),
                    std::ptr::read_volatile(p.add(8).cast::<i32>()),
                )
            };
            if ud >> 56 == TX_UD_SEND {
                let idx = ((ud >> 32) & 0xff_ffff) as u32;
                let seq = ud as u32;
                if Some(&res) != self.lens.get(&idx) {
                    self.errors += 1;
                }
                self.table.pass_turn(idx, seq.wrapping_add(1));
            } else {
                assert_eq!(ud, TX_UD_WAKE << 56);
                assert!(res >= 0, "FUTEX_WAKE failed: {res}");
                self.woken.fetch_add(res as u64, Ordering::Relaxed);
            }
            self.cq_head = self.cq_head.wrapping_add(1);
        }
        self.word(self.desc.cq_head)
            .store(self.cq_head, Ordering::Release);
    }

    /// Take what the request ring holds: cancel markers end their connection's streams at
    /// once, streams start, one-shot requests wait in `pending`. Returns how many it took.
    fn take_requests(&mut self) -> usize {
        let mut got = 0;
        while let Some(r) = self.region.requests().try_pop(|e| Req {
            conn: e.conn,
            seq: e.conn_seq,
            id: e.request_id,
            route: e.route,
            op: e.op,
            param: e.param,
            words: e.payload[..e.words as usize].to_vec(),
        }) {
            got += 1;
            if r.op == OP_CANCEL {
                *self.cancels.entry(r.conn).or_default() += 1;
                for i in 0..self.streams.len() {
                    if self.streams[i].conn == r.conn && !self.streams[i].ended {
                        self.stream_frame(i, true);
                    }
                }
                continue;
            }
            assert_eq!(
                r.route & route::HTTP,
                0,
                "this test sends binary requests only"
            );
            self.conns.insert(r.conn);
            if r.op == Op::Generate as u16 {
                let idx = self.free.pop().expect("a free stream index");
                self.streams.push(DevStream {
                    conn: r.conn,
                    seq: r.seq,
                    id: r.id,
                    idx,
                    tokens: r.param,
                    next: 0,
                    published: 0,
                    base_acks: self.acks(idx),
                    ended: false,
                });
                continue;
            }
            self.pending.push(r);
        }
        got
    }

    fn run(mut self, stop: &AtomicBool) -> Self {
        while !stop.load(Ordering::Acquire) {
            let got = self.take_requests();
            // Finish in a shuffled order, keeping a few back while requests keep coming, so
            // replies of one connection complete out of order.
            let keep = if got > 0 { 3 } else { 0 };
            while self.pending.len() > keep {
                let k = (self.next_rand() % self.pending.len() as u64) as usize;
                let r = self.pending.swap_remove(k);
                self.finish(r);
            }
            self.step_streams();
            self.reap();
            if got == 0 {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
        // What the transport published before it stopped (its connections' cancel markers,
        // which the tests count) may still be in the ring: a loaded machine can keep this
        // thread off the CPU from the markers' publication until the stop.
        self.take_requests();
        self.reap();
        self
    }
}

/// CPU time (user + system, clock ticks) of this process's thread named `name`.
fn thread_ticks(name: &str) -> u64 {
    for t in std::fs::read_dir("/proc/self/task").unwrap() {
        let path = t.unwrap().path();
        if std::fs::read_to_string(path.join("comm")).unwrap().trim() == name {
            return thread_ticks_at(&path);
        }
    }
    panic!("no thread named {name}");
}

/// CPU time (clock ticks) of this process's threads whose name starts with `prefix`, and how
/// many there are.
fn threads_ticks(prefix: &str) -> (u64, usize) {
    let (mut ticks, mut n) = (0, 0);
    for t in std::fs::read_dir("/proc/self/task").unwrap() {
        let path = t.unwrap().path();
        let Ok(comm) = std::fs::read_to_string(path.join("comm")) else {
            continue;
        };
        if comm.trim().starts_with(prefix) {
            ticks += thread_ticks_at(&path);
            n += 1;
        }
    }
    (ticks, n)
}

fn thread_ticks_at(path: &std::path::Path) -> u64 {
    let stat = std::fs::read_to_string(path.join("stat")).unwrap();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap()
        .split_whitespace()
        .collect();
    // After the command: state is field 3, utime 14, stime 15.
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// What the process's descriptors are (`socket:[…]`, `anon_inode:[eventpoll]`, …).
fn fd_targets() -> Vec<String> {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .map(|t| t.display().to_string())
        .collect()
}

/// The tests of this file one at a time: they count the process's descriptors to see that the
/// server closed every connection, and a test running beside another would count the other's
/// sockets, rings and maps opening and closing.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    // A test that failed holding the lock poisons it; the next one still runs alone.
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Wait (up to 20 s) until the process holds no more descriptors than `base`; how many more
/// it held at the last look (and, when some are left, what every descriptor is, to tell a
/// connection the server kept from a descriptor it opened late).
fn fds_left_after(base: usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let left = fd_count().saturating_sub(base);
        if left == 0 || Instant::now() >= deadline {
            if left > 0 {
                eprintln!("{left} descriptors above {base}: {:?}", fd_targets());
            }
            return left;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn request(id: u32, words: &[u32]) -> Vec<u8> {
    let mut out = Vec::new();
    bgs_protocol::encode_request(
        &mut out,
        &RequestHeader::new(Op::Echo, id, words.len() as u32, 0),
        words,
    );
    out
}

/// One pipelining client: `rounds` × `pipe` echo requests, each reply checked (order, id,
/// payload); then FIN, and the server must close after the last reply.
fn client(addr: SocketAddr, c: u32, rounds: u32, pipe: u32) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut next = 0u32;
    for _ in 0..rounds {
        let mut batch = Vec::new();
        for k in 0..pipe {
            let n = next + k;
            batch.extend_from_slice(&request(c << 20 | n, &[n, c, n ^ c]));
        }
        s.write_all(&batch).unwrap();
        for k in 0..pipe {
            let n = next + k;
            let mut h = [0u8; 24];
            s.read_exact(&mut h).unwrap();
            let h = ReplyHeader::decode(&h);
            assert_eq!(
                h.request_id,
                c << 20 | n,
                "connection {c}: reply out of order"
            );
            assert_eq!(h.status, Status::Ok as u16);
            assert_eq!(h.words, 3);
            let mut p = [0u8; 12];
            s.read_exact(&mut p).unwrap();
            let w: Vec<u32> = p
                .chunks(4)
                .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            assert_eq!(w, vec![n, c, n ^ c]);
        }
        next += pipe;
    }
    end_client(s);
}

/// A client's end: FIN after its last request, and the server must close after the last reply.
fn end_client(mut s: TcpStream) {
    s.shutdown(Shutdown::Write).unwrap();
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty(), "no bytes after the last reply");
}

/// A client that sends requests and resets the connection without reading the replies.
fn resetting_client(addr: SocketAddr, c: u32) {
    let s = TcpStream::connect(addr).unwrap();
    let mut batch = Vec::new();
    for n in 0..16 {
        batch.extend_from_slice(&request(c << 20 | n, &[n]));
    }
    (&s).write_all(&batch).unwrap();
    std::thread::sleep(Duration::from_millis(5));
    rustix::net::sockopt::set_socket_linger(&s, Some(Duration::ZERO)).unwrap();
    drop(s);
}

struct Server {
    addr: SocketAddr,
    monitor: KernelMonitor,
    woken: Arc<AtomicU64>,
    handle: bgs_transport::ShutdownHandle,
    thread: std::thread::JoinHandle<KernelStats>,
    owner: Arc<GpuTx>,
    stop: Arc<AtomicBool>,
    device: std::thread::JoinHandle<Device>,
}

fn start(sqpoll_above: u32) -> Server {
    let transport =
        KernelTransport::bind(config(sqe_mode(sqpoll_above))).expect("kernel transport (root)");
    let desc = transport.gpu_tx().expect("a send table with gpu_sends");
    let owner = transport.gpu_tx_owner().unwrap();
    assert!(
        owner.shared_sqpoll(),
        "the GPU's ring attached to our SQPOLL thread"
    );
    assert_eq!(desc.table, owner.table().as_ptr());
    assert_eq!(desc.sq_entries, 4096);
    assert_eq!(desc.cq_entries, 16384);
    let woken = Arc::new(AtomicU64::new(0));
    let device = Device::new(
        desc,
        owner.table().clone(),
        transport.region(),
        woken.clone(),
    );
    let monitor = transport.monitor();
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let device = std::thread::spawn(move || device.run(&stop2));
    let addr = transport.local_addr();
    let handle = transport.shutdown_handle();
    let thread = std::thread::spawn(move || transport.run().unwrap());
    // The transport creates its epoll descriptors when it starts running: wait for all of
    // them, so that a test's count of descriptors taken now is the running server's (it
    // raced: one descriptor "left" at the end, an epoll the transport had opened after the
    // count). With adaptive submission there are two, the stage's (`StageWait`) and then the
    // watchdog's; waiting for the first one only still raced with the second.
    let epolls = if sqpoll_above > 0 { 2 } else { 1 };
    let deadline = Instant::now() + Duration::from_secs(10);
    while fd_targets()
        .iter()
        .filter(|t| *t == "anon_inode:[eventpoll]")
        .count()
        < epolls
    {
        assert!(
            Instant::now() < deadline,
            "the transport did not start in 10 s"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    Server {
        addr,
        monitor,
        woken,
        handle,
        thread,
        owner,
        stop,
        device,
    }
}

impl Server {
    /// Stop the transport, then the device (it uses the table and ring, which `owner` keeps
    /// alive after the transport is gone).
    fn stop(self) -> (KernelStats, Device, Arc<GpuTx>) {
        drop(self.monitor);
        self.handle.shutdown();
        let stats = self.thread.join().unwrap();
        self.stop.store(true, Ordering::Release);
        let device = self.device.join().unwrap();
        (stats, device, self.owner)
    }
}

#[test]
fn gpu_sends_and_host_sends_share_connections_in_order() {
    let _serial = serial();
    let server = start(0);
    // Idle, the stage sleeps on its futex instead of spinning (a shared futex on the BPF
    // map's memory would fail at once and never sleep).
    std::thread::sleep(Duration::from_millis(50));
    let before = thread_ticks("bgs-exec-sqe");
    std::thread::sleep(Duration::from_millis(500));
    let idle = thread_ticks("bgs-exec-sqe") - before;
    assert!(
        idle <= 10,
        "the idle stage thread used {idle} ticks in 500 ms"
    );
    let base_fds = fd_count();
    const CONNS: u32 = 16;
    const RESETS: u32 = 4;
    std::thread::scope(|s| {
        for c in 0..CONNS {
            let addr = server.addr;
            s.spawn(move || client(addr, c, 40, 8));
        }
        for c in 0..RESETS {
            let addr = server.addr;
            s.spawn(move || resetting_client(addr, 1000 + c));
        }
    });
    // Replies handed to a sleeping stage wake it: one more connection sends requests the
    // device always defers, one at a time with pauses in which the stage goes back to sleep,
    // until a FUTEX_WAKE has found it asleep (a wake can race with the end of the stage's
    // timed sleep and wake nobody, so one attempt proves nothing either way).
    let deferred_sent = {
        let mut s = TcpStream::connect(server.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut n = 0u32;
        // At least one request: it makes `deferred > 0` certain, and registers the connection
        // with the send table (one closed before its accept is reaped never is).
        while n == 0 || (server.woken.load(Ordering::Relaxed) == 0 && Instant::now() < deadline) {
            std::thread::sleep(Duration::from_millis(10));
            s.write_all(&request(DEFER | n, &[n])).unwrap();
            let mut h = [0u8; 24];
            s.read_exact(&mut h).unwrap();
            let h = ReplyHeader::decode(&h);
            assert_eq!((h.request_id, h.status, h.words), (DEFER | n, 0, 1));
            let mut p = [0u8; 4];
            s.read_exact(&mut p).unwrap();
            assert_eq!(u32::from_le_bytes(p), n);
            n += 1;
        }
        end_client(s);
        u64::from(n)
    };
    // Every connection is closed by the server: in turn after its EOF or reset. Then wait for
    // the state the assertions below are about, not just for the descriptors: BPF removes a
    // connection's entries when its socket reaches TCP_CLOSE, which can come after the
    // descriptor is gone (the peer's last ACK).
    let deadline = Instant::now() + Duration::from_secs(20);
    let fds_left = fds_left_after(base_fds);
    let maps_settled = |m: &KernelMonitor| m.sockhash_entries() == 0 && m.conn_states() == 0;
    while !maps_settled(&server.monitor) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
    let (stats, dev, owner) = server.stop();
    let woken = dev.woken.load(Ordering::Relaxed);
    eprintln!(
        "{stats}\ndevice: {} sends, {} deferred, {} wakes ({woken} woken), {} send errors; \
         {deferred_sent} requests sent to wake the stage",
        dev.sends, dev.deferred, dev.wakes, dev.errors
    );
    assert_eq!(fds_left, 0, "the server closes every connection");
    let r = &stats.reply;
    // The clients, the resetting clients and the connection of the wake-up requests.
    let total = u64::from(CONNS + RESETS) + 1;
    // A resetting client's reset can reach the stage before its accept (on a loaded machine
    // the accept takes longer than the client's 5 ms): such a connection is never registered
    // with the send table, and is counted as ended first instead. Every other one registers.
    assert_eq!(r.tx_refused, 0);
    assert_eq!(r.tx_registered + r.tx_ended_first, total);
    assert!(
        r.tx_registered > u64::from(CONNS),
        "every connection that outlived its accept registered ({} ended first)",
        r.tx_ended_first
    );
    assert_eq!(r.closed, total);
    assert_eq!(r.eof, u64::from(CONNS) + 1);
    assert_eq!(r.resets, u64::from(RESETS));
    assert_eq!(r.resets_forced, 0);
    assert_eq!(r.behind_turn, 0);
    assert!(dev.sends > 0, "the device sent replies");
    assert!(
        woken > 0,
        "the device's FUTEX_WAKEs reached the sleeping stage ({deferred_sent} tries)"
    );
    assert!(
        dev.deferred >= deferred_sent,
        "and handed replies to the stage"
    );
    assert!(r.frames > 0);
    // Every reply the device sent was skipped by the stage exactly once.
    assert_eq!(r.gpu_sent_skipped, dev.sends);
    let g = stats.gpu.expect("GPU counters in the stats");
    assert_eq!(g.sends, dev.sends);
    assert_eq!(stats.sockhash_entries, 0);
    assert_eq!(stats.conn_states, 0);
    assert_eq!(owner.ring().sq_dropped(), 0);
    assert_eq!(owner.ring().cq_overflow(), 0);
    // Every entry was tombstoned before its CLOSE: no live cookie is left in the table.
    let t = owner.table();
    let mut tombstones = 0;
    for i in 0..t.capacity() as usize {
        let off = TX_HEADER_BYTES + i * size_of::<TxEntry>();
        // SAFETY: entry i of the live table; nobody writes it any more.
        let cookie = unsafe { std::ptr::read_volatile(t.as_ptr().add(off).cast::<u64>()) };
        assert!(
            cookie == TX_EMPTY || cookie == TX_TOMBSTONE,
            "entry {i} still registered"
        );
        tombstones += usize::from(cookie == TX_TOMBSTONE);
    }
    assert!(tombstones > 0 && tombstones <= total as usize);
}

fn generate(id: u32, tokens: u32) -> Vec<u8> {
    let mut out = Vec::new();
    bgs_protocol::encode_request(
        &mut out,
        &RequestHeader::new(Op::Generate, id, 1, tokens),
        &[1],
    );
    out
}

/// A client whose pipelined batches mix one-shot requests (the device may send their
/// replies) with streams (the stage sends every frame): everything arrives in order.
fn mixed_client(addr: SocketAddr, c: u32, rounds: u32) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    for r in 0..rounds {
        let id = |k: u32| c << 20 | r << 4 | k;
        let plan = [(0, 0), (1, 30), (2, 0), (3, 20), (4, 0), (5, 0)];
        let mut batch = Vec::new();
        for &(k, tokens) in &plan {
            if tokens == 0 {
                batch.extend(request(id(k), &[k, c]));
            } else {
                batch.extend(generate(id(k), tokens));
            }
        }
        s.write_all(&batch).unwrap();
        for &(k, tokens) in &plan {
            let mut frame = || {
                let mut h = [0u8; 24];
                s.read_exact(&mut h).unwrap();
                let h = ReplyHeader::decode(&h);
                let mut p = vec![0u8; h.words as usize * 4];
                s.read_exact(&mut p).unwrap();
                let w: Vec<u32> = p
                    .chunks(4)
                    .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
                    .collect();
                assert_eq!(h.request_id, id(k), "connection {c}: reply out of order");
                (h, w)
            };
            if tokens == 0 {
                let (h, w) = frame();
                assert_eq!((h.status, w), (Status::Ok as u16, vec![k, c]));
                continue;
            }
            for t in 0..tokens {
                let (h, w) = frame();
                assert_eq!((h.status, h.seq, w), (Status::Token as u16, t, vec![t]));
            }
            let (h, w) = frame();
            assert_eq!(
                (h.status, h.seq, w),
                (Status::EndOfStream as u16, tokens, vec![1, tokens])
            );
        }
    }
    end_client(s);
}

#[test]
fn streams_stay_host_sent_between_gpu_sends() {
    let _serial = serial();
    let server = start(0);
    let base_fds = fd_count();
    const CONNS: u32 = 8;
    std::thread::scope(|s| {
        for c in 0..CONNS {
            let addr = server.addr;
            s.spawn(move || mixed_client(addr, c, 10));
        }
    });
    let fds_left = fds_left_after(base_fds);
    let (stats, dev, _owner) = server.stop();
    eprintln!(
        "{stats}\ndevice: {} sends, {} deferred, {} cancels",
        dev.sends,
        dev.deferred,
        dev.cancels.len()
    );
    assert_eq!(fds_left, 0, "the server closes every connection");
    let r = &stats.reply;
    assert_eq!(r.closed, u64::from(CONNS));
    assert_eq!(r.behind_turn, 0);
    assert!(dev.sends > 0, "the device sent one-shot replies");
    assert_eq!(r.gpu_sent_skipped, dev.sends);
    // Every streamed frame went through the stage and was acknowledged exactly once.
    let streamed: u64 = dev.per_index.iter().sum();
    assert_eq!(streamed, u64::from(CONNS) * 10 * (31 + 21));
    let acks: Vec<u64> = dev
        .region
        .stream_acks()
        .iter()
        .map(|a| u64::from(a.load(Ordering::Acquire)))
        .collect();
    assert_eq!(acks, dev.per_index);
    assert_eq!(r.acks, streamed);
    // One cancel marker per connection, none answered.
    assert_eq!(dev.conns.len(), CONNS as usize);
    for conn in &dev.conns {
        assert_eq!(dev.cancels.get(conn), Some(&1), "connection {conn:#x}");
    }
    assert_eq!(r.cancels, u64::from(CONNS));
}

#[test]
fn gpu_sends_need_the_executor_sqe_reply_path() {
    let _serial = serial();
    let e = KernelTransport::bind(config(ReplyMode::Loop {
        timer: Duration::from_micros(60),
    }))
    .unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    assert!(e.to_string().contains("executor-sqe"), "{e}");
}

/// A client that sends `n` echo requests one at a time, `gap` apart, and checks each reply.
fn paced_client(addr: SocketAddr, c: u32, n: u32, gap: Duration) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    for k in 0..n {
        s.write_all(&request(c << 20 | k, &[k, c])).unwrap();
        let mut h = [0u8; 24];
        s.read_exact(&mut h).unwrap();
        let h = ReplyHeader::decode(&h);
        assert_eq!((h.request_id, h.status, h.words), (c << 20 | k, 0, 2));
        let mut p = [0u8; 8];
        s.read_exact(&mut p).unwrap();
        assert_eq!(p[..4], k.to_le_bytes());
        std::thread::sleep(gap);
    }
    end_client(s);
}

/// Adaptive submission with GPU-written SENDs (issue 12, goal 3): below `--sqpoll-above` the
/// GPU's sends are paused, every reply goes through the stage (its own `send(2)`), BPF's
/// completion watch wakes the stage, and the SQPOLL thread, given no work, sleeps instead of
/// spinning through the gaps (as it did for the whole run before: about a core).
#[test]
fn paused_gpu_sends_leave_the_sqpoll_thread_asleep_at_low_rates() {
    let _serial = serial();
    let server = start(bgs_transport::kernel::DEFAULT_SQPOLL_ABOVE);
    let base_fds = fd_count();
    // Let the SQPOLL thread run out its idle time after the start-up SQEs (the accept).
    std::thread::sleep(Duration::from_millis(100));
    let (sqp_before, sqp_threads) = threads_ticks("iou-sqp");
    assert!(sqp_threads >= 1, "an SQPOLL thread in /proc/self/task");
    let stage_before = thread_ticks("bgs-exec-sqe");
    let t0 = Instant::now();
    const CONNS: u32 = 8;
    const EACH: u32 = 300;
    std::thread::scope(|s| {
        for c in 0..CONNS {
            let addr = server.addr;
            s.spawn(move || paced_client(addr, c, EACH, Duration::from_millis(2)));
        }
    });
    let elapsed = t0.elapsed();
    let sqp = threads_ticks("iou-sqp").0 - sqp_before;
    let stage = thread_ticks("bgs-exec-sqe") - stage_before;
    let fds_left = fds_left_after(base_fds);
    let (stats, dev, owner) = server.stop();
    // /proc's ticks are USER_HZ, 100 a second on Linux.
    let run_ticks = elapsed.as_secs_f64() * 100.0;
    eprintln!(
        "{stats}\ndevice: {} sends, {} deferred, {} wakes; {:.2} s: SQPOLL thread {sqp} ticks, \
         stage {stage} ticks ({run_ticks:.0} ticks of run)",
        dev.sends,
        dev.deferred,
        dev.wakes,
        elapsed.as_secs_f64()
    );
    assert_eq!(fds_left, 0, "the server closes every connection");
    let d = stats.direct.expect("adaptive submission counters");
    // About 3,500 replies a second, far below 50,000: paused from the start, never resumed.
    assert_eq!((d.gpu_resumed, d.gpu_paused), (0, 0));
    assert_eq!(dev.sends, 0, "the paused device sent nothing itself");
    assert_eq!(dev.wakes, 0, "and queued no FUTEX_WAKE on its ring");
    assert!(owner.table().gpu_sends_paused());
    let total = u64::from(CONNS * EACH);
    assert_eq!(dev.deferred, total, "every reply handed to the stage");
    assert_eq!(stats.reply.frames, total);
    assert!(d.sends >= total, "the stage sent them with send(2)");
    assert_eq!(stats.reply.closed, u64::from(CONNS));
    // Asleep, not spinning: a spinning SQPOLL thread takes every tick of the run.
    assert!(
        (sqp as f64) < run_ticks * 0.2,
        "the SQPOLL thread used {sqp} of {run_ticks:.0} ticks"
    );
    assert_eq!(owner.ring().sq_dropped(), 0);
}

/// From `--sqpoll-above` on, the GPU's sends resume (the stage wakes the SQPOLL thread), and
/// replies of one connection still leave in order while the sender changes under load; when
/// the load stops they pause again.
#[test]
fn gpu_sends_resume_from_the_rate_and_pause_below_it() {
    let _serial = serial();
    // 500 replies a second: 5 in a 10 ms window, which pipelining clients exceed at once.
    let server = start(500);
    let base_fds = fd_count();
    const CONNS: u32 = 16;
    std::thread::scope(|s| {
        for c in 0..CONNS {
            let addr = server.addr;
            s.spawn(move || client(addr, c, 60, 8));
        }
    });
    let fds_left = fds_left_after(base_fds);
    // Two quiet windows: the rate falls to 0 and the stage pauses the GPU again.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !server.owner.table().gpu_sends_paused() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let paused_after = server.owner.table().gpu_sends_paused();
    let (stats, dev, owner) = server.stop();
    eprintln!(
        "{stats}\ndevice: {} sends, {} deferred, {} wakes",
        dev.sends, dev.deferred, dev.wakes
    );
    assert_eq!(fds_left, 0, "the server closes every connection");
    let d = stats.direct.expect("adaptive submission counters");
    assert!(d.gpu_resumed >= 1, "resumed under load");
    assert!(dev.sends > 0, "and the device sent replies itself");
    assert_eq!(d.gpu_paused, d.gpu_resumed, "every resume ended in a pause");
    assert!(paused_after, "paused again once the load stopped");
    let r = &stats.reply;
    assert_eq!(r.gpu_sent_skipped, dev.sends);
    assert_eq!(r.behind_turn, 0);
    assert_eq!(r.closed, u64::from(CONNS));
    assert_eq!(owner.ring().sq_dropped(), 0);
    assert_eq!(owner.ring().cq_overflow(), 0);
}
