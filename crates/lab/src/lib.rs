//! `bgs-lab`: controlled comparisons of server configurations.
//!
//! An experiment file ([`spec::Experiment`], `docs/lab.md`) names conditions (`bgs serve`
//! flags), a load (`bgs load` flags), CPU sets, the number of paired blocks and a success
//! criterion fixed in advance. [`run::run`] runs every block on fresh server processes in
//! counterbalanced order and writes one raw record per run; [`report::write_report`] turns the
//! records into statistics ([`stats`]: paired 95% intervals for differences and ratios), a
//! Markdown report, CSV, JSON and SVG plots. CPU is reported in every scope separately: server
//! process, softirq, whole host, load generator and the lab itself ([`metrics`]).

pub mod criterion;
pub mod metrics;
pub mod plot;
pub mod record;
pub mod report;
pub mod run;
pub mod spec;
pub mod stats;

pub use record::RunRecord;
pub use report::{Analysis, write_report};
pub use run::{RunOptions, run};
pub use spec::Experiment;
