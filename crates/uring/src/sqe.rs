//! Submission queue entries and their builders.
//!
//! Every builder returns a fully zero-initialised [`Sqe`] with only the fields of its opcode set,
//! so the kernel's "reserved fields must be zero" checks pass. Builders that hand the kernel a
//! pointer are `unsafe fn`: the kernel reads or writes that memory *after* the builder returns,
//! at some point between the push and the entry's CQE, so the caller must keep it valid (and,
//! for reads into it, not touch it) until the CQE for `user_data` has been reaped.

use std::fmt;
use std::os::fd::RawFd;
use std::sync::atomic::AtomicU32;

use rustix::io_uring::{
    FutexWaitFlags, IoringAcceptFlags, IoringOp, IoringSqeFlags, Timespec, addr3_struct,
    io_uring_ptr, io_uring_sqe, io_uring_user_data,
};
use rustix::net::{SendFlags, Shutdown, SocketFlags};

/// `FUTEX_BITSET_MATCH_ANY` for 32-bit futexes: the mask that matches every waker.
const FUTEX_MATCH_ANY_U32: u64 = u32::MAX as u64;

/// One 64-byte submission queue entry (`struct io_uring_sqe`), as written into the ring.
#[derive(Clone, Copy, Default)]
#[repr(transparent)]
pub struct Sqe(pub io_uring_sqe);

impl Sqe {
    /// A zeroed entry with `opcode`, `fd` and `user_data` set.
    fn new(opcode: IoringOp, fd: RawFd, user_data: u64) -> Sqe {
        let mut sqe = io_uring_sqe {
            opcode,
            fd,
            ..Default::default()
        };
        sqe.user_data = io_uring_user_data::from_u64(user_data);
        Sqe(sqe)
    }

    /// The entry's `user_data`, echoed in its CQE(s).
    pub fn user_data(&self) -> u64 {
        self.0.user_data.u64_()
    }

    /// The entry's opcode.
    pub fn opcode(&self) -> IoringOp {
        self.0.opcode
    }

    /// Adds `IOSQE_*` flags (for example `IO_LINK` to order two entries, or `CQE_SKIP_SUCCESS`).
    #[must_use]
    pub fn with_flags(mut self, flags: IoringSqeFlags) -> Sqe {
        self.0.flags |= flags;
        self
    }
}

impl fmt::Debug for Sqe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sqe")
            .field("opcode", &self.0.opcode)
            .field("flags", &self.0.flags)
            .field("fd", &self.0.fd)
            .field("user_data", &self.user_data())
            .finish_non_exhaustive()
    }
}

/// `IORING_OP_NOP`: completes with `res == 0`.
pub fn nop(user_data: u64) -> Sqe {
    Sqe::new(IoringOp::Nop, -1, user_data)
}

/// `IORING_OP_SEND` of `len` bytes at `ptr` on socket `fd` with `MSG_NOSIGNAL` (a peer that has
/// gone away yields `-EPIPE` in the CQE instead of a `SIGPIPE`).
///
/// The CQE's `res` is the number of bytes sent, which can be less than `len` on a stream socket
/// whose send buffer filled up; use [`send_with_flags`] with `MSG_WAITALL` to have the kernel
/// retry the rest instead.
///
/// # Safety
/// `ptr..ptr+len` must stay valid for reads and unmodified until the CQE for `user_data` has been
/// reaped (the kernel may read it at any point before posting that CQE).
pub unsafe fn send(fd: RawFd, ptr: *const u8, len: u32, user_data: u64) -> Sqe {
    // SAFETY: the caller's contract is forwarded unchanged.
    unsafe { send_with_flags(fd, ptr, len, SendFlags::NOSIGNAL, user_data) }
}

/// `IORING_OP_SEND` with explicit `MSG_*` flags (`flags` replaces the default `MSG_NOSIGNAL`;
/// include it yourself). With `MSG_WAITALL` a short send is continued by the kernel and the CQE
/// reports the full length or an error.
///
/// # Safety
/// As for [`send`].
pub unsafe fn send_with_flags(
    fd: RawFd,
    ptr: *const u8,
    len: u32,
    flags: SendFlags,
    user_data: u64,
) -> Sqe {
    let mut sqe = Sqe::new(IoringOp::Send, fd, user_data);
    sqe.0.addr_or_splice_off_in.addr = io_uring_ptr::new(ptr.cast_mut().cast());
    sqe.0.len.len = len;
    sqe.0.op_flags.send_flags = flags;
    sqe
}

/// `IORING_OP_ACCEPT` in multishot mode on listening socket `listen_fd`: one CQE per accepted
/// connection (`res` = the new fd, created with `SOCK_NONBLOCK | SOCK_CLOEXEC`) while the CQE has
/// `IORING_CQE_F_MORE` set; a CQE without `F_MORE` ends the request (resubmit it).
///
/// The accepted descriptors belong to whoever reaps the CQEs: close them (for example with
/// [`close`]) or they leak.
pub fn accept_multishot(listen_fd: RawFd, user_data: u64) -> Sqe {
    let mut sqe = Sqe::new(IoringOp::Accept, listen_fd, user_data);
    sqe.0.ioprio.accept_flags = IoringAcceptFlags::MULTISHOT;
    sqe.0.op_flags.accept_flags = SocketFlags::NONBLOCK | SocketFlags::CLOEXEC;
    sqe
}

/// One-shot `IORING_OP_POLL_ADD`: completes when `fd` is readable (`POLLIN`); the CQE's `res`
/// holds the ready events.
pub fn poll_readable(fd: RawFd, user_data: u64) -> Sqe {
    let mut sqe = Sqe::new(IoringOp::PollAdd, fd, user_data);
    // POLLIN (0x1): the io_uring ABI takes the poll mask as a plain 32-bit word here.
    sqe.0.op_flags.poll32_events = 0x1;
    sqe
}

/// Multishot `IORING_OP_POLL_ADD` (`IORING_POLL_ADD_MULTI`): a CQE each time `fd` is woken
/// readable, flagged `IORING_CQE_F_MORE` while the poll stays armed; one without the flag
/// means it ended and must be re-armed. It reports wake-ups, not the level: whatever made the
/// descriptor readable must be consumed before the next wake-up can be told apart.
pub fn poll_readable_multishot(fd: RawFd, user_data: u64) -> Sqe {
    let mut sqe = poll_readable(fd, user_data);
    // IORING_POLL_ADD_MULTI (1 << 0) in the length field.
    sqe.0.len.len = 1;
    sqe
}

/// `IORING_OP_CLOSE` of `fd`.
///
/// The ring takes over the descriptor: nothing else may use (or close) `fd` after this entry is
/// pushed, since the number can be reused by a new descriptor as soon as the close runs.
pub fn close(fd: RawFd, user_data: u64) -> Sqe {
    Sqe::new(IoringOp::Close, fd, user_data)
}

/// `IORING_OP_SHUTDOWN` of socket `fd` (`how`: read, write or both).
pub fn shutdown(fd: RawFd, how: Shutdown, user_data: u64) -> Sqe {
    let mut sqe = Sqe::new(IoringOp::Shutdown, fd, user_data);
    sqe.0.len.len = how as u32;
    sqe
}

/// `IORING_OP_READ` of up to `len` bytes from `fd` into `ptr`, at the file's current position
/// (offset -1; position-less files such as eventfds, pipes and sockets ignore it).
///
/// # Safety
/// `ptr..ptr+len` must stay valid for writes, and must not be read or written by anything else,
/// until the CQE for `user_data` has been reaped.
pub unsafe fn read(fd: RawFd, ptr: *mut u8, len: u32, user_data: u64) -> Sqe {
    let mut sqe = Sqe::new(IoringOp::Read, fd, user_data);
    sqe.0.addr_or_splice_off_in.addr = io_uring_ptr::new(ptr.cast());
    sqe.0.len.len = len;
    sqe.0.off_or_addr2.off = u64::MAX;
    sqe
}

/// `IORING_OP_FUTEX_WAIT` (Linux 6.7+) on a private 32-bit futex: completes with `res == 0` when
/// woken, or `-EAGAIN` at once if `*addr != expected` when the kernel looks.
///
/// # Safety
/// `addr` must stay valid until the CQE for `user_data` has been reaped.
pub unsafe fn futex_wait(addr: *const AtomicU32, expected: u32, user_data: u64) -> Sqe {
    let mut sqe = Sqe::new(
        IoringOp::FutexWait,
        (FutexWaitFlags::SIZE_U32 | FutexWaitFlags::PRIVATE).bits() as RawFd,
        user_data,
    );
    sqe.0.addr_or_splice_off_in.addr = io_uring_ptr::new(addr.cast_mut().cast());
    sqe.0.off_or_addr2.off = u64::from(expected);
    let mut addr3 = addr3_struct::default();
    addr3.addr3 = FUTEX_MATCH_ANY_U32;
    sqe.0.addr3_or_cmd.addr3 = addr3;
    sqe
}

/// `IORING_OP_FUTEX_WAKE` (Linux 6.7+): wakes up to `count` waiters of a private 32-bit futex;
/// `res` is the number woken. (A bad address only yields `-EFAULT`; the kernel never writes it.)
pub fn futex_wake(addr: *const AtomicU32, count: u32, user_data: u64) -> Sqe {
    let mut sqe = Sqe::new(
        IoringOp::FutexWake,
        (FutexWaitFlags::SIZE_U32 | FutexWaitFlags::PRIVATE).bits() as RawFd,
        user_data,
    );
    sqe.0.addr_or_splice_off_in.addr = io_uring_ptr::new(addr.cast_mut().cast());
    sqe.0.off_or_addr2.off = u64::from(count);
    let mut addr3 = addr3_struct::default();
    addr3.addr3 = FUTEX_MATCH_ANY_U32;
    sqe.0.addr3_or_cmd.addr3 = addr3;
    sqe
}

/// `IORING_OP_TIMEOUT`, relative, pure (no completion count): completes with `res == -ETIME`
/// after `*ts` (or `-ECANCELED` if cancelled).
///
/// # Safety
/// `ts` must stay valid until the entry has been *submitted* (the kernel copies it at submission;
/// keeping it until the CQE is the simple rule). With SQPOLL, submission happens asynchronously,
/// so keep it until the CQE.
pub unsafe fn timeout(ts: *const Timespec, user_data: u64) -> Sqe {
    let mut sqe = Sqe::new(IoringOp::Timeout, -1, user_data);
    sqe.0.addr_or_splice_off_in.addr = io_uring_ptr::new(ts.cast_mut().cast());
    sqe.0.len.len = 1;
    sqe.0.off_or_addr2.off = 0;
    sqe
}

/// `IORING_OP_ASYNC_CANCEL` of the (first) request whose `user_data` is `target`; for example to
/// end a multishot accept. `res` is 0, `-ENOENT` or `-EALREADY`.
pub fn cancel(target: u64, user_data: u64) -> Sqe {
    let mut sqe = Sqe::new(IoringOp::AsyncCancel, -1, user_data);
    sqe.0.addr_or_splice_off_in.user_data = io_uring_user_data::from_u64(target);
    sqe
}
