//! What every transport owes the executor besides replies (docs/ring.md, ring layout v2):
//! credit acknowledgements for streamed completions and a cancel marker when a connection
//! ends.
//!
//! - Every completion with `stream != 0` is acknowledged exactly once
//!   ([`RingRegion::ack_stream`]) when the transport has disposed of it: encoded into the
//!   connection's buffers within its limits, or dropped. While a connection holds more unsent
//!   bytes than its limit, the acknowledgements of its streamed frames are withheld
//!   ([`Withheld`]) and given when writes drain, so the executor, which keeps each stream's
//!   unacknowledged frames under a window, stops producing for a reader that does not read.
//! - When a connection ends (EOF, reset, error, or closed by the server) the transport
//!   publishes one `OP_CANCEL` request entry with the connection's token
//!   ([`publish_cancel`]), so that the executor ends and frees that connection's streams.

use bgs_ring::{OP_CANCEL, RequestEntry, RingRegion};

/// Publish the cancel marker of connection `conn` into the request ring: `conn` set, `op` =
/// [`OP_CANCEL`], every other field zero. Returns false when the ring is full (the caller
/// keeps the marker and retries: it must not be lost). The caller notifies the ring.
pub fn publish_cancel(region: &RingRegion, conn: u64) -> bool {
    region
        .requests()
        .try_push(|e| {
            *e = RequestEntry::default();
            e.conn = conn;
            e.op = OP_CANCEL;
        })
        .is_ok()
}

/// Acknowledge `n` disposed-of completions of credit stream `stream` (the completion's
/// `stream` field, index + 1; 0 and out-of-range values are ignored, as by
/// [`RingRegion::ack_stream`]).
pub fn ack(region: &RingRegion, stream: u32, n: u32) {
    region.ack_stream(stream, n);
}

/// Acknowledgements a connection owes but holds back while it is over its unsent-bytes
/// limit: `(conn_seq, stream, count)`, consecutive frames of one item merged.
#[derive(Debug, Default)]
pub struct Withheld {
    entries: Vec<(u32, u32, u32)>,
}

impl Withheld {
    /// Nothing is withheld.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Acknowledgements withheld in all.
    pub fn count(&self) -> u64 {
        self.entries.iter().map(|e| u64::from(e.2)).sum()
    }

    /// Hold back one acknowledgement of stream `stream` for a frame of item `conn_seq`.
    pub fn push(&mut self, conn_seq: u32, stream: u32) {
        match self.entries.last_mut() {
            Some((s, st, n)) if *s == conn_seq && *st == stream => *n += 1,
            _ => self.entries.push((conn_seq, stream, 1)),
        }
    }

    /// Give the acknowledgements whose item `may_ack` allows now; returns how many.
    pub fn release(
        &mut self,
        mut may_ack: impl FnMut(u32) -> bool,
        mut ack: impl FnMut(u32, u32),
    ) -> u64 {
        let mut given = 0;
        self.entries.retain(|&(seq, stream, n)| {
            if may_ack(seq) {
                ack(stream, n);
                given += u64::from(n);
                false
            } else {
                true
            }
        });
        given
    }

    /// Give every acknowledgement of stream `stream` (its final frame arrived: nothing more
    /// will be produced for it, so holding them back no longer bounds anything, and the
    /// executor can reuse the stream once all are in). Returns how many.
    pub fn release_stream(&mut self, stream: u32, mut ack: impl FnMut(u32, u32)) -> u64 {
        self.release_where(|_, s| s == stream, &mut ack)
    }

    /// Give every acknowledgement (the connection ended: its frames are dropped).
    pub fn release_all(&mut self, mut ack: impl FnMut(u32, u32)) -> u64 {
        self.release_where(|_, _| true, &mut ack)
    }

    fn release_where(
        &mut self,
        mut pick: impl FnMut(u32, u32) -> bool,
        ack: &mut impl FnMut(u32, u32),
    ) -> u64 {
        let mut given = 0;
        self.entries.retain(|&(seq, stream, n)| {
            if pick(seq, stream) {
                ack(stream, n);
                given += u64::from(n);
                false
            } else {
                true
            }
        });
        given
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bgs_ring::RingConfig;
    use std::sync::atomic::Ordering;

    #[test]
    fn withheld_merges_and_releases_exactly_once() {
        let mut w = Withheld::default();
        w.push(3, 7);
        w.push(3, 7);
        w.push(4, 8);
        w.push(3, 7);
        assert_eq!(w.count(), 4);
        let mut acked = Vec::new();
        assert_eq!(w.release(|seq| seq == 4, |s, n| acked.push((s, n))), 1);
        assert_eq!(acked, vec![(8, 1)]);
        assert_eq!(w.release_stream(7, |s, n| acked.push((s, n))), 3);
        assert_eq!(acked, vec![(8, 1), (7, 2), (7, 1)]);
        assert!(w.is_empty());
        assert_eq!(w.release_all(|_, _| panic!("nothing left")), 0);
    }

    #[test]
    fn cancel_markers_and_acks_land_in_the_region() {
        let region = RingRegion::new(RingConfig {
            request_slots: 2,
            completion_slots: 2,
        })
        .unwrap();
        // Dirty the slot first: the marker must not carry old fields.
        region
            .requests()
            .try_push(|e| {
                e.conn = 9;
                e.op = 1;
                e.words = 3;
                e.param = 4;
                e.route = 5;
            })
            .unwrap();
        region.requests().try_pop(|_| ()).unwrap();
        assert!(publish_cancel(&region, 0x1234_0000_0005));
        let e = region.requests().try_pop(|e| e.clone()).unwrap();
        let mut want = RequestEntry::default();
        want.conn = 0x1234_0000_0005;
        want.op = OP_CANCEL;
        assert_eq!(e, want);
        assert!(publish_cancel(&region, 1));
        assert!(publish_cancel(&region, 2));
        assert!(!publish_cancel(&region, 3), "full: the caller keeps it");
        ack(&region, 1, 2);
        ack(&region, 512, 1);
        ack(&region, 0, 1);
        ack(&region, 513, 1);
        let acks = region.stream_acks();
        assert_eq!(acks[0].load(Ordering::Acquire), 2);
        assert_eq!(acks[511].load(Ordering::Acquire), 1);
        assert_eq!(
            acks.iter().map(|a| a.load(Ordering::Acquire)).sum::<u32>(),
            3
        );
    }
}
