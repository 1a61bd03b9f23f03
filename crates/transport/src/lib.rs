//! Transports own connections and bytes: they frame requests, admit them into the request
//! ring, and send replies back in request order on the same connection.
//!
//! [`conn::ConnState`] is the per-connection state machine shared by every transport (framing,
//! admission, ordering, reply encoding); it does no I/O and is tested on its own. [`native`] is
//! the one-thread timed-epoll transport (the paper's comparator), with a floor mode that
//! answers echo itself so the cost of TCP alone can be measured. [`credit`] is what every
//! transport owes the executor besides replies: credit acknowledgements for streamed
//! completions and one cancel marker per ended connection.

pub mod conn;
pub mod credit;
pub mod kernel;
pub mod native;
mod pace;
pub mod stats;

pub use native::{NativeConfig, NativeTransport, ShutdownHandle};
pub use stats::{RequestMetrics, TransportStats};
