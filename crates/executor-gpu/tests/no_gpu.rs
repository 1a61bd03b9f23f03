//! Error paths without a usable GPU (CI and the development machine have none).

use std::sync::Arc;

use bgs_executor_gpu::{GpuError, GpuExecutor, GpuExecutorConfig, probe};
use bgs_ring::{RingConfig, RingRegion};

fn has_driver() -> bool {
    // SAFETY: only tries to dlopen libcuda.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

#[test]
fn probe_without_driver_names_libcuda() {
    if has_driver() {
        println!("NOTICE: a CUDA driver is present; the no-driver path is not testable here");
        return;
    }
    let e = probe(&GpuExecutorConfig::default()).unwrap_err();
    assert!(matches!(e, GpuError::MissingDriver(_)), "{e:?}");
    assert!(e.to_string().contains("libcuda"), "{e}");
}

#[test]
fn start_without_driver_is_an_error_not_a_panic() {
    let region = Arc::new(
        RingRegion::new(RingConfig {
            request_slots: 8,
            completion_slots: 8,
        })
        .unwrap(),
    );
    if has_driver() {
        return;
    }
    let e = GpuExecutor::start(region, &GpuExecutorConfig::default()).unwrap_err();
    assert!(e.to_string().contains("libcuda"), "{e}");
}

#[test]
fn bad_slot_counts_are_refused_first() {
    let region = Arc::new(
        RingRegion::new(RingConfig {
            request_slots: 8,
            completion_slots: 8,
        })
        .unwrap(),
    );
    for slots in [0, 65] {
        let cfg = GpuExecutorConfig {
            slots,
            ..Default::default()
        };
        let e = GpuExecutor::start(region.clone(), &cfg).unwrap_err();
        assert!(matches!(e, GpuError::Config(_)), "{e:?}");
    }
}
