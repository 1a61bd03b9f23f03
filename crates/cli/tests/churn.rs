//! Churn: many connect/send/close cycles, some closing mid-frame, some with requests in
//! flight. Afterwards the server's descriptors are back to baseline, nothing sits in
//! CLOSE_WAIT, and it still serves.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use bgs_load::client::FrameClient;
use bgs_protocol::reply::encode_request;
use bgs_protocol::{Op, RequestHeader};
use common::{Server, is_kernel, with_each_transport};

fn gemm(id: u32) -> Vec<u8> {
    let mut v = Vec::new();
    encode_request(
        &mut v,
        &RequestHeader::new(Op::Gemm8, id, 64, 4),
        &[0x3f80_0000; 64],
    );
    v
}

fn cycle(addr: SocketAddr, i: u32) {
    let Ok(mut s) = TcpStream::connect(addr) else {
        panic!("connect failed at cycle {i}");
    };
    s.set_nodelay(true).unwrap();
    match i % 5 {
        // A full exchange.
        0 => {
            s.write_all(&gemm(i)).unwrap();
            let mut buf = [0u8; 24 + 256];
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            s.read_exact(&mut buf).unwrap();
        }
        // Close in the middle of a frame.
        1 => {
            let f = gemm(i);
            s.write_all(&f[..(i as usize % (f.len() - 1)) + 1]).unwrap();
        }
        // Close with pipelined requests in flight, replies unread.
        2 => {
            let burst: Vec<u8> = (0..8).flat_map(|k| gemm(i * 8 + k)).collect();
            s.write_all(&burst).unwrap();
        }
        // Connect and close at once.
        3 => {}
        // Half-close: the replies owed are still delivered, then the server closes.
        _ => {
            s.write_all(&gemm(i)).unwrap();
            s.shutdown(std::net::Shutdown::Write).unwrap();
            let mut all = Vec::new();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            s.read_to_end(&mut all).unwrap();
            assert_eq!(all.len(), 24 + 256, "cycle {i}");
        }
    }
}

#[test]
fn churn_leaves_no_descriptors_close_wait_or_stale_entries() {
    for args in with_each_transport(&[]) {
        // The kernel transport is held to 20,000 cycles (the paper's system leaked sockets
        // until its sockhash filled); the native one to 10,000.
        let per_thread: u32 = if is_kernel(&args) { 5000 } else { 2500 };
        let mut server = Server::start(&args);
        // One exchange first so lazily created descriptors exist before the baseline.
        let mut c = FrameClient::connect(server.addr).unwrap();
        c.request(&RequestHeader::new(Op::Echo, 1, 1, 0), &[1])
            .unwrap();
        drop(c);
        assert!(server.wait_for(Duration::from_secs(5), |s| s.close_wait_count() == 0));
        std::thread::sleep(Duration::from_millis(100));
        let baseline = server.fd_count();

        let addr = server.addr;
        let threads: Vec<_> = (0..4u32)
            .map(|t| {
                std::thread::spawn(move || {
                    for k in 0..per_thread {
                        cycle(addr, t * per_thread + k);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }

        let settled = server.wait_for(Duration::from_secs(10), |s| {
            s.fd_count() <= baseline && s.close_wait_count() == 0
        });
        assert!(
            settled,
            "fds {} (baseline {baseline}), CLOSE_WAIT {}",
            server.fd_count(),
            server.close_wait_count()
        );
        let mut c = FrameClient::connect(server.addr).unwrap();
        let r = c
            .request(&RequestHeader::new(Op::Echo, 2, 2, 0), &[7, 8])
            .unwrap();
        assert_eq!((r.header.status, r.words), (0, vec![7, 8]));
        drop(c);
        assert!(server.wait_for(Duration::from_secs(10), |s| s.fd_count() <= baseline));
        // The counts printed at shutdown are about BPF's maps, which lose a connection when
        // its socket reaches TCP_CLOSE; that can come after the descriptor is gone (the
        // peer's last ACK). Wait for that state, not just for the descriptors.
        let closed = server.wait_for(Duration::from_secs(10), |s| s.connection_sockets() == 0);
        assert!(
            closed,
            "{} sockets of the port still hold state",
            server.connection_sockets()
        );
        let (ok, stderr) = server.stop();
        assert!(ok, "{stderr}");
        if is_kernel(&args) {
            // Printed at shutdown before the remaining connections are closed: with every
            // client gone, the BPF maps must hold nothing.
            assert!(
                stderr.contains("sockhash 0 entries, 0 connection states"),
                "{stderr}"
            );
        }
    }
}
