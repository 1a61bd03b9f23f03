//! `bgs serve --admin-listen`: liveness, readiness through startup and shutdown, and the
//! metrics page checked by a strict OpenMetrics text parser against the replies a client
//! actually received.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use bgs_protocol::reply::encode_request;
use bgs_protocol::{HEADER_LEN, Op, ReplyHeader, RequestHeader, Status};

/// A `bgs serve` child with the admin endpoints on.
struct Served {
    child: Child,
    stdout: BufReader<ChildStdout>,
    admin: SocketAddr,
}

impl Served {
    /// Start the server; returns once the admin line is printed (the transport may not be up).
    fn start(extra: &[&str], hold_startup_ms: Option<u64>) -> Served {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_bgs"));
        cmd.args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .args(extra)
        .env("BGS_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
        if let Some(ms) = hold_startup_ms {
            cmd.env("BGS_TEST_HOLD_STARTUP_MS", ms.to_string());
        }
        let mut child = cmd.spawn().expect("spawn bgs serve");
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let line = read_line(&mut stdout);
        assert!(line.starts_with("bgs: admin listening on "), "{line:?}");
        let admin = line.split_whitespace().nth(4).unwrap().parse().unwrap();
        Served {
            child,
            stdout,
            admin,
        }
    }

    /// Wait for the transport's address line.
    fn listening(&mut self) -> SocketAddr {
        let line = read_line(&mut self.stdout);
        assert!(line.starts_with("bgs: listening on "), "{line:?}");
        line.split_whitespace().nth(3).unwrap().parse().unwrap()
    }

    fn get(&self, path: &str) -> (u16, String) {
        http_get(self.admin, path)
    }

    fn sigterm(&self) {
        let pid = rustix::process::Pid::from_raw(self.child.id() as i32).unwrap();
        rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    }

    /// Wait for the process to exit; true if it exited successfully within `limit`.
    fn wait_exit(&mut self, limit: Duration) -> bool {
        let end = Instant::now() + limit;
        while Instant::now() < end {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s.success();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn read_line(r: &mut impl BufRead) -> String {
    let mut line = String::new();
    r.read_line(&mut line).expect("read a line from bgs serve");
    line
}

/// A minimal HTTP/1.1 GET (one request per connection); returns status code and body.
fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect to the admin port");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read the admin reply");
    let text = String::from_utf8(raw).expect("UTF-8 reply");
    let (head, body) = text.split_once("\r\n\r\n").expect("header end");
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("status code");
    assert!(
        !head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked"),
        "the test client does not decode chunked bodies: {head}"
    );
    (code, body.to_string())
}

/// Poll `path` until it answers `code`, up to `limit`; returns the last answer.
fn wait_for_code(admin: SocketAddr, path: &str, code: u16, limit: Duration) -> (u16, String) {
    let end = Instant::now() + limit;
    loop {
        let r = http_get(admin, path);
        if r.0 == code || Instant::now() >= end {
            return r;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One binary request of `op` with `words` payload words, answered on `s`; returns the status.
fn request(s: &mut TcpStream, op: Op, id: u32, words: usize) -> Status {
    send(s, op, id, words);
    let (h, _) = read_reply(s);
    assert_eq!(h.request_id, id);
    Status::from_u16(h.status).expect("a known status")
}

fn send(s: &mut TcpStream, op: Op, id: u32, words: usize) {
    let mut out = Vec::new();
    encode_request(&mut out, &header(op, id, words), &vec![0u32; words]);
    s.write_all(&out).unwrap();
}

fn header(op: Op, id: u32, words: usize) -> RequestHeader {
    RequestHeader {
        magic: bgs_protocol::wire::REQUEST_MAGIC,
        version: bgs_protocol::wire::VERSION,
        op: op as u16,
        request_id: id,
        words: words as u32,
        param: 1,
        flags: 0,
    }
}

fn read_reply(s: &mut TcpStream) -> (ReplyHeader, Vec<u8>) {
    let mut h = [0u8; HEADER_LEN];
    s.read_exact(&mut h).expect("reply header");
    let h = ReplyHeader::decode(&h);
    let mut payload = vec![0u8; h.words as usize * 4];
    s.read_exact(&mut payload).expect("reply payload");
    (h, payload)
}

#[test]
fn readiness_follows_startup_and_shutdown() {
    // Startup is held 1.5 s after the admin endpoints come up, before the transport binds.
    let mut srv = Served::start(&["--shutdown-grace", "3"], Some(1500));
    assert_eq!(srv.get("/healthz"), (200, "ok\n".into()));
    let (code, body) = srv.get("/readyz");
    assert_eq!(code, 503, "{body}");
    assert_eq!(body, "starting: waiting for transport, executor\n");
    let metrics = parse(&srv.get("/metrics").1).expect("valid metrics while starting");
    assert_eq!(metrics.value("bgs_ready", &[]), Some(0.0));

    let addr = srv.listening();
    assert_eq!(
        wait_for_code(srv.admin, "/readyz", 200, Duration::from_secs(10)),
        (200, "ready\n".into())
    );
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    assert_eq!(request(&mut c, Op::Gemm8, 1, 64), Status::Ok);

    srv.sigterm();
    let (code, body) = wait_for_code(srv.admin, "/readyz", 503, Duration::from_secs(2));
    assert_eq!((code, body.as_str()), (503, "shutting down\n"));
    assert_eq!(srv.get("/healthz"), (200, "ok\n".into()));
    // The grace period still serves: readiness went first so a balancer stops sending.
    assert_eq!(request(&mut c, Op::Echo, 2, 4), Status::Ok);
    let metrics = parse(&srv.get("/metrics").1).expect("valid metrics while stopping");
    assert_eq!(metrics.value("bgs_ready", &[]), Some(0.0));
    drop(c);
    assert!(
        srv.wait_exit(Duration::from_secs(15)),
        "clean exit after the grace period"
    );
}

#[test]
fn metrics_are_valid_and_count_what_clients_saw() {
    // A tiny request ring makes a pipelined burst get some busy replies, so more than one
    // status shows up; the test counts whatever each reply says.
    let mut srv = Served::start(
        &["--ring-slots", "2", "--slots", "1", "--max-inflight", "256"],
        None,
    );
    let addr = srv.listening();
    wait_for_code(srv.admin, "/readyz", 200, Duration::from_secs(10));
    let before = parse(&srv.get("/metrics").1).expect("valid metrics");
    check_families(&before);
    check_histogram(&before);
    assert_eq!(before.value("bgs_ready", &[]), Some(1.0));
    assert_eq!(before.value("bgs_executor_slots", &[]), Some(1.0));
    assert_eq!(before.value("bgs_request_ring_capacity", &[]), Some(2.0));
    assert_eq!(before.value("bgs_connections_open", &[]), Some(0.0));
    assert_eq!(before.family("bgs_requests").samples.len(), 0);

    let mut seen: BTreeMap<(&'static str, &'static str), u64> = BTreeMap::new();
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut id = 0;
    for (op, words, n) in [(Op::Gemm8, 64, 40), (Op::Echo, 8, 25), (Op::Fft32, 64, 15)] {
        for _ in 0..n {
            id += 1;
            let st = request(&mut c, op, id, words);
            *seen
                .entry((op.name(), bgs_admin::status_label(st as u16)))
                .or_default() += 1;
        }
    }
    // A pipelined burst: 200 requests in one write.
    let mut burst = Vec::new();
    for k in 0..200u32 {
        encode_request(&mut burst, &header(Op::Gemm8, 1000 + k, 64), &[0u32; 64]);
    }
    c.write_all(&burst).unwrap();
    for _ in 0..200 {
        let (h, _) = read_reply(&mut c);
        let st = Status::from_u16(h.status).unwrap();
        *seen
            .entry(("gemm8", bgs_admin::status_label(st as u16)))
            .or_default() += 1;
    }
    let answered: u64 = seen.values().sum();
    assert_eq!(answered, 280);

    let during = parse(&srv.get("/metrics").1).expect("valid metrics");
    check_families(&during);
    check_histogram(&during);
    assert_eq!(during.value("bgs_connections_open", &[]), Some(1.0));
    let mut counted: BTreeMap<(String, String), u64> = BTreeMap::new();
    for s in &during.family("bgs_requests").samples {
        assert_eq!(s.name, "bgs_requests_total");
        let keys: Vec<&str> = s.labels.keys().map(String::as_str).collect();
        assert_eq!(keys, ["op", "status"], "label set of {s:?}");
        counted.insert(
            (s.labels["op"].clone(), s.labels["status"].clone()),
            s.value as u64,
        );
    }
    let expected: BTreeMap<(String, String), u64> = seen
        .iter()
        .map(|((o, s), n)| ((o.to_string(), s.to_string()), *n))
        .collect();
    assert_eq!(
        counted, expected,
        "bgs_requests_total matches the replies received"
    );
    assert_eq!(
        during.value("bgs_request_duration_seconds_count", &[]),
        Some(answered as f64)
    );
    assert!(
        during
            .value("bgs_request_duration_seconds_sum", &[])
            .unwrap()
            > 0.0
    );
    let published = during
        .value("bgs_request_ring_published_total", &[])
        .unwrap();
    let busy = seen
        .iter()
        .filter(|((_, s), _)| *s == "busy")
        .map(|(_, n)| *n)
        .sum::<u64>();
    assert_eq!(
        published,
        (answered - busy) as f64,
        "every non-busy request went through the ring"
    );
    assert_eq!(
        during.value("bgs_executor_requests_total", &[]),
        Some(published)
    );
    assert!(
        during.value("process_cpu_seconds_total", &[]).unwrap()
            >= before.value("process_cpu_seconds_total", &[]).unwrap()
    );
    drop(c);
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let m = parse(&srv.get("/metrics").1).expect("valid metrics");
        if m.value("bgs_connections_open", &[]) == Some(0.0) {
            break;
        }
        assert!(
            Instant::now() < end,
            "connection count never went back to 0"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    srv.sigterm();
    assert!(srv.wait_exit(Duration::from_secs(15)));
}

/// Every family the operations guide documents for the native transport + CPU executor,
/// with its type.
fn check_families(m: &Exposition) {
    for (name, ty) in [
        ("bgs_ready", "gauge"),
        ("bgs_requests", "counter"),
        ("bgs_connections_open", "gauge"),
        ("bgs_request_duration_seconds", "histogram"),
        ("bgs_request_ring_occupancy", "gauge"),
        ("bgs_request_ring_capacity", "gauge"),
        ("bgs_completion_ring_occupancy", "gauge"),
        ("bgs_completion_ring_capacity", "gauge"),
        ("bgs_request_ring_published", "counter"),
        ("bgs_completion_ring_published", "counter"),
        ("bgs_executor_slots", "gauge"),
        ("bgs_executor_busy_slots", "gauge"),
        ("bgs_executor_live_requests", "gauge"),
        ("bgs_executor_requests", "counter"),
        ("bgs_executor_completions", "counter"),
        ("bgs_executor_streams", "counter"),
        ("bgs_executor_cancels", "counter"),
        ("process_cpu_seconds", "counter"),
        ("process_resident_memory_bytes", "gauge"),
    ] {
        let f = m
            .families
            .get(name)
            .unwrap_or_else(|| panic!("no family {name}"));
        assert_eq!(f.ty, ty, "type of {name}");
        assert!(!f.help.is_empty(), "{name} has help text");
    }
}

/// Buckets sorted by bound, cumulative, ending at +Inf equal to `_count`.
fn check_histogram(m: &Exposition) {
    let f = m.family("bgs_request_duration_seconds");
    let mut bounds = Vec::new();
    for s in f.samples.iter().filter(|s| s.name.ends_with("_bucket")) {
        let le = &s.labels["le"];
        let b = if le == "+Inf" {
            f64::INFINITY
        } else {
            le.parse::<f64>().expect("numeric le")
        };
        bounds.push((b, s.value));
    }
    assert!(bounds.len() > 2);
    for w in bounds.windows(2) {
        assert!(w[0].0 < w[1].0, "bucket bounds ascend: {bounds:?}");
        assert!(w[0].1 <= w[1].1, "buckets are cumulative: {bounds:?}");
    }
    let last = bounds.last().unwrap();
    assert_eq!(last.0, f64::INFINITY);
    assert_eq!(
        Some(last.1),
        m.value("bgs_request_duration_seconds_count", &[])
    );
}

// ---- a strict OpenMetrics text parser (the subset prometheus-client writes) ----

#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

#[derive(Debug, Default)]
struct Family {
    ty: String,
    help: String,
    samples: Vec<Sample>,
}

#[derive(Debug, Default)]
struct Exposition {
    families: HashMap<String, Family>,
}

impl Exposition {
    fn family(&self, name: &str) -> &Family {
        self.families
            .get(name)
            .unwrap_or_else(|| panic!("no family {name}"))
    }

    /// The value of the sample `name` with exactly these labels.
    fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let want: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.families
            .values()
            .flat_map(|f| &f.samples)
            .find(|s| s.name == name && s.labels == want)
            .map(|s| s.value)
    }
}

fn valid_name(n: &str) -> bool {
    let mut c = n.chars();
    c.next()
        .is_some_and(|f| f.is_ascii_alphabetic() || f == '_' || f == ':')
        && c.all(|x| x.is_ascii_alphanumeric() || x == '_' || x == ':')
}

/// Suffixes a sample of a family of type `ty` may carry.
fn suffixes(ty: &str) -> &'static [&'static str] {
    match ty {
        "counter" => &["_total", "_created"],
        "gauge" => &[""],
        "histogram" => &["_bucket", "_sum", "_count", "_created"],
        _ => &[],
    }
}

fn parse(text: &str) -> Result<Exposition, String> {
    let mut exp = Exposition::default();
    let mut current: Option<String> = None;
    let mut seen_samples = std::collections::HashSet::new();
    let mut lines = text.split('\n').peekable();
    let mut eof = false;
    while let Some(line) = lines.next() {
        if eof {
            if line.is_empty() && lines.peek().is_none() {
                break;
            }
            return Err(format!("content after # EOF: {line:?}"));
        }
        if line == "# EOF" {
            eof = true;
            continue;
        }
        if let Some(rest) = line.strip_prefix("# ") {
            let (kind, rest) = rest
                .split_once(' ')
                .ok_or(format!("bad comment {line:?}"))?;
            let (name, arg) = rest
                .split_once(' ')
                .ok_or(format!("bad comment {line:?}"))?;
            if !valid_name(name) {
                return Err(format!("bad family name {name:?}"));
            }
            match kind {
                "HELP" => {
                    if exp.families.contains_key(name) {
                        return Err(format!("family {name} described twice"));
                    }
                    exp.families.insert(
                        name.to_string(),
                        Family {
                            help: arg.to_string(),
                            ..Family::default()
                        },
                    );
                    current = Some(name.to_string());
                }
                "TYPE" => {
                    if current.as_deref() != Some(name) {
                        return Err(format!("TYPE {name} without its HELP just before"));
                    }
                    if suffixes(arg).is_empty() {
                        return Err(format!("unknown type {arg:?} for {name}"));
                    }
                    let f = exp.families.get_mut(name).unwrap();
                    if !f.ty.is_empty() {
                        return Err(format!("TYPE {name} twice"));
                    }
                    f.ty = arg.to_string();
                }
                "UNIT" => {}
                _ => return Err(format!("unknown comment {line:?}")),
            }
            continue;
        }
        if line.is_empty() || line.starts_with('#') {
            return Err(format!("unexpected line {line:?}"));
        }
        // name{labels} value
        let (name_labels, value) = line.rsplit_once(' ').ok_or(format!("no value: {line:?}"))?;
        let value = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v
                .parse::<f64>()
                .map_err(|_| format!("bad value in {line:?}"))?,
        };
        let (name, labels) = match name_labels.split_once('{') {
            None => (name_labels, BTreeMap::new()),
            Some((n, l)) => (
                n,
                parse_labels(
                    l.strip_suffix('}')
                        .ok_or(format!("unclosed labels: {line:?}"))?,
                )?,
            ),
        };
        if !valid_name(name) {
            return Err(format!("bad sample name {name:?}"));
        }
        let fam_name = current
            .clone()
            .ok_or(format!("sample before any family: {line:?}"))?;
        let fam = exp.families.get_mut(&fam_name).unwrap();
        let suffix = name
            .strip_prefix(fam_name.as_str())
            .ok_or(format!("sample {name} outside its family {fam_name}"))?;
        if !suffixes(&fam.ty).contains(&suffix) {
            return Err(format!("sample {name} does not fit {} {fam_name}", fam.ty));
        }
        if fam.ty == "histogram" && suffix == "_bucket" && !labels.contains_key("le") {
            return Err(format!("bucket without le: {line:?}"));
        }
        if fam.ty == "counter" && (value.is_nan() || value < 0.0) {
            return Err(format!("negative or NaN counter: {line:?}"));
        }
        if !seen_samples.insert(format!("{name}{labels:?}")) {
            return Err(format!("duplicate sample {line:?}"));
        }
        fam.samples.push(Sample {
            name: name.to_string(),
            labels,
            value,
        });
    }
    if !eof {
        return Err("no # EOF".into());
    }
    for (name, f) in &exp.families {
        if f.ty.is_empty() {
            return Err(format!("family {name} has no TYPE"));
        }
    }
    Ok(exp)
}

fn parse_labels(s: &str) -> Result<BTreeMap<String, String>, String> {
    let mut out = BTreeMap::new();
    let mut rest = s;
    while !rest.is_empty() {
        let (k, after) = rest
            .split_once("=\"")
            .ok_or(format!("bad label in {s:?}"))?;
        if !valid_name(k) {
            return Err(format!("bad label name {k:?}"));
        }
        let mut v = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next() {
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => v.push('\n'),
                    Some((_, c @ ('\\' | '"'))) => v.push(c),
                    _ => return Err(format!("bad escape in {s:?}")),
                },
                Some((_, c)) => v.push(c),
                None => return Err(format!("unterminated label value in {s:?}")),
            }
        };
        if out.insert(k.to_string(), v).is_some() {
            return Err(format!("label {k} twice in {s:?}"));
        }
        rest = &after[end + 1..];
        if let Some(r) = rest.strip_prefix(',') {
            rest = r;
        } else if !rest.is_empty() {
            return Err(format!("junk after label value in {s:?}"));
        }
    }
    Ok(out)
}

#[test]
fn parser_rejects_malformed_expositions() {
    let good = "# HELP a_b x\n# TYPE a_b counter\na_b_total{k=\"v\"} 1\n# EOF\n";
    assert!(parse(good).is_ok());
    for bad in [
        "# HELP a_b x\n# TYPE a_b counter\na_b_total 1\n", // no EOF
        "# HELP a_b x\n# TYPE a_b counter\na_b 1\n# EOF\n", // counter without _total
        "# HELP a_b x\n# TYPE a_b gauge\na_c 1\n# EOF\n",  // outside its family
        "# HELP a_b x\n# TYPE a_b gauge\na_b{k=\"v} 1\n# EOF\n", // unterminated label
        "# HELP a_b x\n# TYPE a_b gauge\na_b 1\na_b 2\n# EOF\n", // duplicate sample
        "# HELP a_b x\n# TYPE a_b histogram\na_b_bucket 1\n# EOF\n", // bucket without le
        "# HELP a_b x\n# TYPE a_b counter\na_b_total -1\n# EOF\n", // negative counter
        "# HELP a_b x\n# TYPE a_b gauge\na_b 1\n# EOF\nx 1\n", // after EOF
        "# HELP a_b x\na_b 1\n# EOF\n",                    // no TYPE
    ] {
        assert!(parse(bad).is_err(), "accepted {bad:?}");
    }
}

/// `bgs_requests_total` as `(op, status) -> count`, checking each sample's label set.
fn requests_by_op_status(m: &Exposition) -> BTreeMap<(String, String), u64> {
    let mut counted = BTreeMap::new();
    for s in &m.family("bgs_requests").samples {
        assert_eq!(s.name, "bgs_requests_total");
        let keys: Vec<&str> = s.labels.keys().map(String::as_str).collect();
        assert_eq!(keys, ["op", "status"], "label set of {s:?}");
        counted.insert(
            (s.labels["op"].clone(), s.labels["status"].clone()),
            s.value as u64,
        );
    }
    counted
}

#[test]
fn kernel_transport_readiness_and_bpf_metrics() {
    for reply in ["loop", "executor-sqe"] {
        // A request ring of 2 slots and one executor slot: the pipelined burst below gets
        // busy replies from BPF itself (through the side ring), which count too.
        let mut srv = Served::start(
            &[
                "--transport",
                "kernel",
                "--reply",
                reply,
                "--ring-slots",
                "2",
                "--slots",
                "1",
            ],
            Some(500),
        );
        let (code, body) = srv.get("/readyz");
        assert_eq!(
            (code, body.as_str()),
            (503, "starting: waiting for bpf, transport, executor\n")
        );
        let addr = srv.listening();
        wait_for_code(srv.admin, "/readyz", 200, Duration::from_secs(10));
        let before = parse(&srv.get("/metrics").1).expect("valid metrics");
        assert_eq!(before.family("bgs_requests").samples.len(), 0, "{reply}");
        check_histogram(&before);
        let mut c = TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut seen: BTreeMap<(String, String), u64> = BTreeMap::new();
        let mut count = |op: Op, st: u16| {
            *seen
                .entry((
                    op.name().to_string(),
                    bgs_admin::status_label(st).to_string(),
                ))
                .or_default() += 1;
        };
        for id in 1..=50 {
            assert_eq!(request(&mut c, Op::Gemm8, id, 64), Status::Ok);
            count(Op::Gemm8, Status::Ok as u16);
        }
        for id in 51..=70 {
            assert_eq!(request(&mut c, Op::Echo, id, 8), Status::Ok);
            count(Op::Echo, Status::Ok as u16);
        }
        let mut burst = Vec::new();
        for k in 0..100u32 {
            encode_request(&mut burst, &header(Op::Echo, 1000 + k, 8), &[0u32; 8]);
        }
        c.write_all(&burst).unwrap();
        for _ in 0..100 {
            let (h, _) = read_reply(&mut c);
            count(Op::Echo, h.status);
        }
        let answered: u64 = seen.values().sum();
        let busy: u64 = seen
            .iter()
            .filter(|((_, s), _)| s == "busy")
            .map(|(_, n)| *n)
            .sum();
        let m = parse(&srv.get("/metrics").1).expect("valid metrics");
        assert_eq!(
            requests_by_op_status(&m),
            seen,
            "{reply}: bgs_requests_total matches the replies received"
        );
        check_histogram(&m);
        assert_eq!(
            m.value("bgs_request_duration_seconds_count", &[]),
            Some(answered as f64),
            "{reply}"
        );
        assert!(m.value("bgs_request_duration_seconds_sum", &[]).unwrap() > 0.0);
        assert_eq!(m.value("bgs_bpf_busy_total", &[]), Some(busy as f64));
        for (name, ty) in [
            ("bgs_ready", "gauge"),
            ("bgs_requests", "counter"),
            ("bgs_request_duration_seconds", "histogram"),
            ("bgs_connections_open", "gauge"),
            ("bgs_bpf_frames", "counter"),
            ("bgs_bpf_requests", "counter"),
            ("bgs_bpf_busy", "counter"),
            ("bgs_bpf_rejects_by_status", "counter"),
            ("bgs_request_ring_occupancy", "gauge"),
            ("bgs_completion_ring_occupancy", "gauge"),
            ("bgs_executor_requests", "counter"),
            ("process_cpu_seconds", "counter"),
        ] {
            assert_eq!(m.family(name).ty, ty, "{reply}: type of {name}");
        }
        let published = (answered - busy) as f64;
        assert_eq!(
            m.value("bgs_bpf_requests_total", &[]),
            Some(published),
            "{reply}"
        );
        assert_eq!(
            m.value("bgs_request_ring_published_total", &[]),
            Some(published)
        );
        assert_eq!(m.value("bgs_executor_requests_total", &[]), Some(published));
        // One gauge (from the sockhash), not a second one from the request counters.
        assert_eq!(m.family("bgs_connections_open").samples.len(), 1);
        assert_eq!(m.value("bgs_connections_open", &[]), Some(1.0), "{reply}");
        drop(c);
        let end = Instant::now() + Duration::from_secs(10);
        while parse(&srv.get("/metrics").1)
            .unwrap()
            .value("bgs_connections_open", &[])
            != Some(0.0)
        {
            assert!(
                Instant::now() < end,
                "{reply}: connection count never went back to 0"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        srv.sigterm();
        assert!(
            srv.wait_exit(Duration::from_secs(15)),
            "{reply}: clean exit"
        );
    }
}

/// With `--user nobody` the admin endpoints, BPF counters (map reads through descriptors
/// opened as root) and request metrics keep working after the drop, and the server is ready
/// only once it dropped.
#[test]
fn kernel_transport_admin_works_after_dropping_privileges() {
    let mut srv = Served::start(
        &[
            "--transport",
            "kernel",
            "--reply",
            "executor-sqe",
            "--user",
            "nobody",
        ],
        None,
    );
    let addr = srv.listening();
    wait_for_code(srv.admin, "/readyz", 200, Duration::from_secs(10));
    let pid = srv.child.id();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let uid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .to_string();
    assert_ne!(uid, "0", "ready only after the drop");
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    for id in 1..=10 {
        assert_eq!(request(&mut c, Op::Fft32, id, 64), Status::Ok);
    }
    let m = parse(&srv.get("/metrics").1).expect("valid metrics");
    assert_eq!(
        m.value("bgs_requests_total", &[("op", "fft32"), ("status", "ok")]),
        Some(10.0)
    );
    assert_eq!(m.value("bgs_bpf_requests_total", &[]), Some(10.0));
    assert_eq!(m.value("bgs_connections_open", &[]), Some(1.0));
    drop(c);
    srv.sigterm();
    assert!(srv.wait_exit(Duration::from_secs(15)), "clean exit");
}
