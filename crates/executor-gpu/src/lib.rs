//! The GPU executor (skeleton: the implementation is in progress).

use std::path::PathBuf;
use std::sync::Arc;

use bgs_ring::RingRegion;

/// How requests are noticed and launched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dispatcher {
    /// A device-launched scheduler graph polls the ring and launches work graphs.
    DeviceLaunch,
    /// A host thread polls the ring and launches graphs from the host (for comparison).
    HostLaunch,
}

/// Settings of the GPU executor.
#[derive(Debug, Clone)]
pub struct GpuExecutorConfig {
    /// Work-graph slots (requests executing at once).
    pub slots: usize,
    /// Dispatcher kind.
    pub dispatcher: Dispatcher,
    /// CUDA device ordinal.
    pub device: usize,
    /// Where CUDA libraries live (else `CUDA_HOME`, `/usr/local/cuda`, the loader's path).
    pub cuda_home: Option<PathBuf>,
    /// Kernel cache directory.
    pub cache_dir: Option<PathBuf>,
}

impl Default for GpuExecutorConfig {
    fn default() -> Self {
        GpuExecutorConfig {
            slots: 16,
            dispatcher: Dispatcher::DeviceLaunch,
            device: 0,
            cuda_home: None,
            cache_dir: None,
        }
    }
}

/// Why the GPU executor cannot run.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// Not implemented yet.
    #[error("the GPU executor is not implemented in this build")]
    NotBuilt,
}

/// What `probe` found.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    /// Device name.
    pub name: String,
}

/// Check that a usable GPU and the CUDA libraries are present.
pub fn probe(_cfg: &GpuExecutorConfig) -> Result<DeviceInfo, GpuError> {
    Err(GpuError::NotBuilt)
}

/// The running GPU executor.
#[derive(Debug)]
pub struct GpuExecutor {
    slots: usize,
}

impl GpuExecutor {
    /// Start the dispatcher over `region`.
    pub fn start(_region: Arc<RingRegion>, _cfg: &GpuExecutorConfig) -> Result<Self, GpuError> {
        Err(GpuError::NotBuilt)
    }

    /// Slots.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Stop the dispatcher and release the device.
    pub fn shutdown(self) -> Result<(), GpuError> {
        Ok(())
    }
}
