//! Overload: offered load far above what the executor can do, with a tiny ring. Every request
//! gets its answer or a busy frame, in order; none is lost.

mod common;

use std::time::Duration;

use bgs_load::client::FrameClient;
use bgs_protocol::reply::encode_request;
use bgs_protocol::{Op, RequestHeader, Status};
use common::{Server, load_config, with_each_transport};

#[test]
fn overload_answers_every_request_or_busy() {
    for args in with_each_transport(&["--ring-slots", "2", "--slots", "1"]) {
        let server = Server::start(&args);

        // One connection, 200 pipelined heavy requests in one write: more than the ring and
        // the in-flight limit hold. Each is answered (ok or busy) exactly once, in order.
        let mut c = FrameClient::connect(server.addr).unwrap();
        let mut burst = Vec::new();
        for id in 0..200u32 {
            let h = RequestHeader::new(Op::Gemm8, id, 64, 256);
            encode_request(&mut burst, &h, &[0x3f80_0000; 64]);
        }
        c.send_raw(&burst).unwrap();
        let (mut ok, mut busy) = (0, 0);
        for id in 0..200u32 {
            let r = c.read_reply(Duration::from_secs(20)).unwrap();
            assert_eq!(r.header.request_id, id, "replies in request order");
            match Status::from_u16(r.header.status) {
                Some(Status::Ok) => ok += 1,
                Some(Status::Busy) => busy += 1,
                other => panic!("unexpected status {other:?}"),
            }
        }
        assert!(ok > 0 && busy > 0, "ok {ok} busy {busy}");

        // Open-loop load far above capacity over many connections.
        let mut cfg = load_config(server.addr, Op::Gemm8);
        cfg.repeat = 256;
        cfg.rate = 30_000.0;
        cfg.connections = 64;
        cfg.requests = Some(30_000);
        cfg.warmup = Duration::from_millis(100);
        let report = bgs_load::run(&cfg).expect("load run");
        println!("{report}");
        assert_eq!(report.failures + report.warmup_failures, 0, "{report}");
        assert_eq!(
            report.counts.ok + report.counts.busy,
            report.scheduled,
            "{report}"
        );
        assert!(
            report.counts.busy > 0,
            "the ring must have overflowed: {report}"
        );
    }
}
