//! Bad input against a live server while a well-behaved client runs alongside with zero
//! failures. Every case checks the documented reply and whether the connection stays open.

mod common;

use std::io::Write;
use std::net::{Shutdown, SocketAddr};
use std::time::Duration;

use bgs_load::client::FrameClient;
use bgs_protocol::reply::encode_request;
use bgs_protocol::{Op, RequestHeader, Status};
use common::{Server, load_config, with_each_transport};

const T: Duration = Duration::from_secs(5);

fn frame(h: &RequestHeader, words: &[u32]) -> Vec<u8> {
    let mut v = Vec::new();
    encode_request(&mut v, h, words);
    v
}

fn echo(id: u32) -> Vec<u8> {
    frame(&RequestHeader::new(Op::Echo, id, 1, 0), &[id])
}

/// Send `bytes`, expect one error frame with `status` and `id`, then a close or an open
/// connection that still answers.
fn expect_error(addr: SocketAddr, bytes: &[u8], status: Status, id: u32, closes: bool) {
    let mut c = FrameClient::connect(addr).unwrap();
    c.send_raw(bytes).unwrap();
    let r = c.read_reply(T).unwrap();
    assert_eq!(r.header.status, status as u16, "{status:?}: {r:?}");
    assert_eq!(r.header.request_id, id, "{status:?}");
    if closes {
        c.expect_closed(T)
            .expect("connection closed after a framing error");
    } else {
        let h = RequestHeader::new(Op::Echo, 77, 1, 0);
        let r = c.request(&h, &[42]).unwrap();
        assert_eq!((r.header.status, r.words.as_slice()), (0, &[42][..]));
    }
}

fn http_raw(addr: SocketAddr, raw: &[u8]) -> (FrameClient, bgs_load::client::HttpResponse) {
    let mut c = FrameClient::connect(addr).unwrap();
    c.send_raw(raw).unwrap();
    let r = c.read_http_response(T).unwrap();
    (c, r)
}

fn run_cases(addr: SocketAddr) {
    let good = RequestHeader::new(Op::Echo, 9, 1, 0);

    // Wrong magic, wrong version, too many words, nonzero flags: error frame, then close.
    let mut h = good;
    h.magic = 0x1234_5678;
    expect_error(addr, &frame(&h, &[1]), Status::BadMagic, 0, true);
    let mut h = good;
    h.version = 2;
    expect_error(addr, &frame(&h, &[1]), Status::BadVersion, 0, true);
    let h = RequestHeader::new(Op::Echo, 10, 65, 0);
    expect_error(
        addr,
        &frame(&h, &[0; 65]),
        Status::PayloadTooLarge,
        10,
        true,
    );
    let mut h = good;
    h.flags = 4;
    h.request_id = 11;
    expect_error(addr, &frame(&h, &[1]), Status::BadFlags, 11, true);

    // Unknown op and bad params: error frame, connection stays open.
    let mut h = good;
    h.op = 99;
    h.request_id = 12;
    expect_error(addr, &frame(&h, &[1]), Status::UnknownOp, 12, false);
    let h = RequestHeader::new(Op::Generate, 13, 1, 8);
    expect_error(addr, &frame(&h, &[1]), Status::UnknownOp, 13, false);
    let h = RequestHeader::new(Op::Gemm8, 14, 64, 257);
    expect_error(addr, &frame(&h, &[0; 64]), Status::BadParam, 14, false);
    let h = RequestHeader::new(Op::Fft32, 15, 3, 1);
    expect_error(addr, &frame(&h, &[0; 3]), Status::BadParam, 15, false);
    // Repeat 0 means 1: a valid request.
    let mut c = FrameClient::connect(addr).unwrap();
    let r = c
        .request(&RequestHeader::new(Op::Gemm8, 16, 64, 0), &[0; 64])
        .unwrap();
    assert_eq!(r.header.status, 0);
    assert_eq!(r.words, vec![0; 64]);

    // Requests before a framing error on the same connection are answered first, in order.
    let mut c = FrameClient::connect(addr).unwrap();
    let mut bytes: Vec<u8> = (1..=3).flat_map(echo).collect();
    bytes.extend(b"\xffgarbage");
    c.send_raw(&bytes).unwrap();
    for id in 1..=3 {
        let r = c.read_reply(T).unwrap();
        assert_eq!((r.header.status, r.header.request_id), (0, id));
    }
    assert_eq!(
        c.read_reply(T).unwrap().header.status,
        Status::BadMagic as u16
    );
    c.expect_closed(T).unwrap();

    // Random garbage: bad magic and close (binary mode), or 400 and close (looks like HTTP).
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut garbage = vec![0u8; 300];
    for b in garbage.iter_mut() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        *b = seed as u8;
    }
    garbage[0] = 0x01;
    expect_error(addr, &garbage, Status::BadMagic, 0, true);
    garbage[0] = b'Q';
    garbage[1..20].copy_from_slice(b"UUX / HTTP/1.1\r\nx\r\n");
    garbage.extend(b"\r\n\r\n");
    let (mut c, r) = http_raw(addr, &garbage);
    assert_eq!(r.status, 400);
    c.expect_closed(T).unwrap();

    // Truncated frame then EOF: complete requests answered, the partial one dropped, closed.
    let mut c = FrameClient::connect(addr).unwrap();
    let mut bytes = echo(21);
    bytes.extend(&echo(22)[..10]);
    c.send_raw(&bytes).unwrap();
    c.stream().shutdown(Shutdown::Write).unwrap();
    let r = c.read_reply(T).unwrap();
    assert_eq!(r.header.request_id, 21);
    c.expect_closed(T).unwrap();

    // HTTP: no Content-Length → 411 and close.
    let (mut c, r) = http_raw(addr, b"POST /v1/submit HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_eq!(r.status, 411);
    c.expect_closed(T).unwrap();
    // Oversized Content-Length → 413 with a status-19 frame, and close.
    let (mut c, r) = http_raw(
        addr,
        b"POST /v1/submit HTTP/1.1\r\nContent-Length: 100000\r\n\r\n",
    );
    assert_eq!(r.status, 413);
    assert_eq!(r.frames[0].header.status, Status::PayloadTooLarge as u16);
    c.expect_closed(T).unwrap();
    // Headers over 8 KiB → 431 and close.
    let mut big = b"POST /v1/submit HTTP/1.1\r\nX-Fill: ".to_vec();
    big.extend(std::iter::repeat_n(b'a', 9000));
    big.extend(b"\r\n\r\n");
    let (mut c, r) = http_raw(addr, &big);
    assert_eq!(r.status, 431);
    c.expect_closed(T).unwrap();
    // Other path → 404, other method → 405; both keep the connection.
    let (mut c, r) = http_raw(addr, b"GET /nope HTTP/1.1\r\n\r\n");
    assert_eq!(r.status, 404);
    c.send_raw(b"GET /v1/submit HTTP/1.1\r\n\r\n").unwrap();
    assert_eq!(c.read_http_response(T).unwrap().status, 405);
    // A good HTTP request on the same connection, then a semantic error (400 + frame, open).
    let r = c
        .http_request(&RequestHeader::new(Op::Echo, 31, 2, 0), &[3, 4])
        .unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.frames[0].words, vec![3, 4]);
    let r = c
        .http_request(&RequestHeader::new(Op::Gemm8, 32, 1, 0), &[3])
        .unwrap();
    assert_eq!(r.status, 400);
    assert_eq!(r.frames[0].header.status, Status::BadParam as u16);
    assert_eq!(r.frames[0].header.request_id, 32);
    // Pipelined HTTP requests are answered in order.
    let mut raw = Vec::new();
    for id in 40..45 {
        bgs_protocol::reply::encode_http_request(&mut raw, "x", &echo(id));
    }
    c.send_raw(&raw).unwrap();
    for id in 40..45 {
        let r = c.read_http_response(T).unwrap();
        assert_eq!((r.status, r.frames[0].header.request_id), (200, id));
    }
}

#[test]
fn bad_input_does_not_disturb_a_well_behaved_client() {
    for args in with_each_transport(&[]) {
        let server = Server::start(&args);
        // A client that sends half a header and holds the connection open.
        let mut holder = FrameClient::connect(server.addr).unwrap();
        holder.send_raw(&echo(1)[..12]).unwrap();

        let mut cfg = load_config(server.addr, Op::Gemm8);
        cfg.requests = None;
        cfg.duration = Some(Duration::from_secs(4));
        cfg.rate = 1500.0;
        let bg = std::thread::spawn(move || bgs_load::run(&cfg));
        std::thread::sleep(Duration::from_millis(300));
        run_cases(server.addr);
        let report = bg.join().unwrap().expect("background load");
        assert_eq!(report.failures, 0, "{report}");
        assert!(report.counts.ok > 1000, "{report}");

        // The holder got nothing (its frame is incomplete) and is still connected: finishing
        // the frame gets it answered.
        let mut rest = echo(1)[12..].to_vec();
        holder.stream().write_all(&rest).unwrap();
        rest.clear();
        let r = holder.read_reply(T).unwrap();
        assert_eq!((r.header.status, r.header.request_id), (0, 1));
    }
}
