//! `bgs serve --admin-listen`: glue between the serve path and `bgs-admin`. Every method is a
//! no-op without `--admin-listen`, so the serve path calls them unconditionally.

use std::io::Write;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use bgs_admin::{Admin, AdminServer, Sources};

/// Readiness components of `bgs serve`.
pub const TRANSPORT: &str = "transport";
pub const EXECUTOR: &str = "executor";
pub const BPF: &str = "bpf";
/// For `--model`: expected from the start, [`AdminHook::up`] once the model is loaded.
pub const MODEL: &str = "model";

/// The admin endpoints of one `bgs serve`, if enabled.
#[derive(Debug, Default)]
pub struct AdminHook {
    admin: Option<Admin>,
    /// Serves until this hook is dropped, at the end of `bgs serve`.
    _server: Option<AdminServer>,
}

impl AdminHook {
    /// Start the endpoints (before anything else is up, so `/readyz` says what it waits for)
    /// and declare the components readiness waits for.
    pub fn start(listen: Option<SocketAddr>, components: &[&'static str]) -> Result<Self> {
        let Some(listen) = listen else {
            return Ok(AdminHook::default());
        };
        let admin = Admin::new();
        admin.expect(components);
        let server = admin
            .spawn(listen)
            .with_context(|| format!("--admin-listen {listen}"))?;
        let mut out = std::io::stdout().lock();
        writeln!(
            out,
            "bgs: admin listening on {} (/healthz, /readyz, /metrics)",
            server.addr()
        )?;
        out.flush()?;
        // Test hook: hold startup here so that tests can see `/readyz` answer 503 before the
        // server is ready (startup otherwise takes a few milliseconds).
        if let Some(ms) = std::env::var("BGS_TEST_HOLD_STARTUP_MS")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
        {
            std::thread::sleep(Duration::from_millis(ms));
        }
        Ok(AdminHook {
            admin: Some(admin),
            _server: Some(server),
        })
    }

    /// A component is up.
    pub fn up(&self, component: &'static str) {
        if let Some(a) = &self.admin {
            a.up(component);
        }
    }

    /// Hand metric sources over.
    pub fn sources(&self, f: impl FnOnce(&mut Sources)) {
        if let Some(a) = &self.admin {
            a.sources(f);
        }
    }

    /// Shutdown began: `/readyz` answers 503 from now on.
    pub fn stopping(&self) {
        if let Some(a) = &self.admin {
            a.stopping();
        }
    }

    /// Install the SIGINT/SIGTERM handling: mark the server not ready at once, and stop the
    /// transport after `grace` (a second signal stops it at once). Without a grace period the
    /// signals go straight to the transport's shutdown pipe (and set the readiness flag from
    /// the handler, so that `/readyz` flips even while the transport drains).
    pub fn install_signals(
        &self,
        shutdown: &bgs_transport::ShutdownHandle,
        grace: Duration,
    ) -> Result<()> {
        use signal_hook::consts::{SIGINT, SIGTERM};
        let flag = self.admin.as_ref().map(Admin::stopping_flag);
        if grace.is_zero() {
            for sig in [SIGINT, SIGTERM] {
                if let Some(flag) = &flag {
                    signal_hook::flag::register(sig, flag.clone())
                        .context("installing signal handlers")?;
                }
                signal_hook::low_level::pipe::register(sig, shutdown.signal_pipe()?)
                    .context("installing signal handlers")?;
            }
            return Ok(());
        }
        let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])
            .context("installing signal handlers")?;
        let shutdown = shutdown.clone();
        std::thread::Builder::new()
            .name("bgs-signals".into())
            .spawn(move || {
                if signals.forever().next().is_none() {
                    return;
                }
                if let Some(flag) = &flag {
                    flag.store(true, Ordering::Relaxed);
                }
                eprintln!(
                    "bgs: shutdown requested: not ready; stopping in {:.1} s (signal again to stop now)",
                    grace.as_secs_f64()
                );
                let end = Instant::now() + grace;
                while Instant::now() < end {
                    if signals.pending().next().is_some() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                shutdown.shutdown();
            })
            .context("starting the signal thread")?;
        Ok(())
    }
}
