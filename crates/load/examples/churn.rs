//! Connection churn client: N cycles of connect / one gemm8 request / read the reply / close,
//! spread over a few threads, every reply checked by exact replay.
//!
//! `bgs load` keeps its connections open for the whole run, so it never exercises the accept
//! and close paths at rate; this does (bench/soak.sh runs it against each transport and then
//! checks the server's descriptors and BPF maps are back to baseline).
//!
//! Usage: cargo run --release -p bgs-load --example churn -- ADDR CYCLES [THREADS]
//! Prints one JSON line (cycles, ok, failures, seconds, first failure) and exits 1 on any
//! failure.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bgs_load::client::FrameClient;
use bgs_load::{check_reference, make_payload};
use bgs_protocol::reply::encode_request;
use bgs_protocol::{Op, RequestHeader};

/// Distinct payloads; each has a golden reply fetched (and checked against the f64 reference)
/// before the churn starts.
const DISTINCT: usize = 64;
const SEED: u64 = 1;

fn usage() -> ! {
    eprintln!("usage: churn ADDR CYCLES [THREADS]  (ADDR IP:PORT, CYCLES >= 1, THREADS 1..=64)");
    std::process::exit(2);
}

fn frame(id: u32, words: &[u32]) -> Vec<u8> {
    let mut v = Vec::with_capacity(24 + words.len() * 4);
    encode_request(
        &mut v,
        &RequestHeader::new(Op::Gemm8, id, words.len() as u32, 1),
        words,
    );
    v
}

/// One cycle: connect, send, read one reply, compare it with the golden reply, close.
fn cycle(addr: SocketAddr, id: u32, req: &[u8], golden: &[u32]) -> Result<(), String> {
    let mut c = FrameClient::connect(addr).map_err(|e| format!("connect: {e}"))?;
    c.send_raw(req).map_err(|e| format!("send: {e}"))?;
    let r = c
        .read_reply(bgs_load::client::DEFAULT_TIMEOUT)
        .map_err(|e| format!("read: {e}"))?;
    if r.header.status != 0 || r.header.request_id != id {
        return Err(format!(
            "reply status {} id {} (want status 0, id {id})",
            r.header.status, r.header.request_id
        ));
    }
    if r.words != golden {
        return Err(format!(
            "reply to request {id} differs from its golden reply"
        ));
    }
    // Dropping the client closes the connection (FIN from our side).
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 2 || args.len() > 3 {
        usage();
    }
    let addr: SocketAddr = args[0].parse().unwrap_or_else(|_| usage());
    let cycles: u64 = args[1]
        .parse()
        .ok()
        .filter(|n| *n >= 1)
        .unwrap_or_else(|| usage());
    let threads: u64 = match args.get(2) {
        Some(t) => t
            .parse()
            .ok()
            .filter(|n| (1..=64).contains(n))
            .unwrap_or_else(|| usage()),
        None => 4,
    };

    // Golden replies, each checked against the independent f64 reference, on one connection.
    let payloads: Vec<Vec<u32>> = (0..DISTINCT)
        .map(|i| make_payload(Op::Gemm8, 64, SEED, i))
        .collect();
    let mut setup = FrameClient::connect(addr).unwrap_or_else(|e| {
        eprintln!("churn: cannot connect to {addr}: {e}");
        std::process::exit(1);
    });
    let golden: Vec<Vec<u32>> = payloads
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let r = setup
                .request(&RequestHeader::new(Op::Gemm8, i as u32, 64, 1), p)
                .unwrap_or_else(|e| {
                    eprintln!("churn: golden request {i} failed: {e}");
                    std::process::exit(1);
                });
            if r.header.status != 0 {
                eprintln!("churn: golden request {i}: status {}", r.header.status);
                std::process::exit(1);
            }
            if let Err(e) = check_reference(Op::Gemm8, p, &r.words) {
                eprintln!("churn: golden reply {i} fails the f64 reference: {e}");
                std::process::exit(1);
            }
            r.words
        })
        .collect();
    drop(setup);
    let golden = Arc::new(golden);
    let reqs: Arc<Vec<Vec<u8>>> = Arc::new(
        payloads
            .iter()
            .enumerate()
            .map(|(i, p)| frame(i as u32, p))
            .collect(),
    );

    let next = Arc::new(AtomicU64::new(0));
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let first_failure: Arc<Mutex<Option<String>>> = Arc::new(Mutex::new(None));
    let start = Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (next, ok, failed, first_failure) = (
                next.clone(),
                ok.clone(),
                failed.clone(),
                first_failure.clone(),
            );
            let (golden, reqs) = (golden.clone(), reqs.clone());
            std::thread::spawn(move || {
                loop {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    if n >= cycles {
                        break;
                    }
                    let p = (n % DISTINCT as u64) as usize;
                    match cycle(addr, p as u32, &reqs[p], &golden[p]) {
                        Ok(()) => ok.fetch_add(1, Ordering::Relaxed),
                        Err(e) => {
                            let mut f = first_failure.lock().unwrap();
                            f.get_or_insert_with(|| format!("cycle {n}: {e}"));
                            failed.fetch_add(1, Ordering::Relaxed)
                        }
                    };
                }
            })
        })
        .collect();
    for h in handles {
        h.join().expect("churn thread panicked");
    }
    let secs = start.elapsed().as_secs_f64();
    let (ok, failed) = (ok.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
    let first = first_failure.lock().unwrap().clone();
    println!(
        "{{\"cycles\": {cycles}, \"threads\": {threads}, \"ok\": {ok}, \"failures\": {failed}, \
         \"seconds\": {secs:.3}, \"cycles_per_sec\": {:.1}, \"first_failure\": {}}}",
        cycles as f64 / secs,
        match first {
            Some(f) => format!("{f:?}"),
            None => "null".into(),
        }
    );
    if failed > 0 || ok != cycles {
        std::process::exit(1);
    }
}
