//! Error paths without a usable GPU (CI and the development machine have none): a clear
//! error, never a panic; model and option errors come before any device work.

use bgs_model::synth::{DType, SynthArch, synth_config, synth_weights, synth_weights_for};
use bgs_model_gpu::{GpuModel, GpuModelError, GpuModelOptions};

fn has_driver() -> bool {
    // SAFETY: only tries to dlopen libcuda.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

#[test]
fn new_without_driver_names_libcuda() {
    if has_driver() {
        println!("NOTICE: a CUDA driver is present; the no-driver path is not testable here");
        return;
    }
    let (cfg, w) = synth_weights(SynthArch::TinyQwen2, 1, DType::F32);
    let e = GpuModel::new(cfg, &w, &GpuModelOptions::default()).unwrap_err();
    assert!(
        matches!(
            e,
            GpuModelError::Gpu(bgs_executor_gpu::GpuError::MissingDriver(_))
        ),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(msg.contains("libcuda"), "{msg}");
    assert!(!msg.contains('\n'), "one line: {msg}");
    // The resident step loop needs a device-launchable model: the same error, not a panic.
    let (cfg, w) = synth_weights(SynthArch::TinyQwen2, 1, DType::F32);
    let o = GpuModelOptions {
        device_launch: true,
        ..GpuModelOptions::default()
    };
    let e = GpuModel::new(cfg, &w, &o).unwrap_err();
    assert!(e.to_string().contains("libcuda"), "{e}");
}

#[test]
fn bad_options_and_models_are_refused_before_the_device() {
    let (cfg, w) = synth_weights(SynthArch::TinyLlama, 1, DType::F32);
    let bad = |o: GpuModelOptions| GpuModel::new(cfg.clone(), &w, &o).unwrap_err();
    let cases = [
        (
            GpuModelOptions {
                max_batched_tokens: 1024,
                ..Default::default()
            },
            "max_batched_tokens",
        ),
        (
            GpuModelOptions {
                block_size: 0,
                ..Default::default()
            },
            "block_size",
        ),
        (
            GpuModelOptions {
                max_seqs: 0,
                ..Default::default()
            },
            "max_seqs",
        ),
        (
            GpuModelOptions {
                num_blocks: Some(0),
                ..Default::default()
            },
            "num_blocks",
        ),
        (
            GpuModelOptions {
                kv_memory_fraction: 0.0,
                ..Default::default()
            },
            "kv_memory_fraction",
        ),
        (
            GpuModelOptions {
                device_launch: true,
                use_graphs: false,
                ..Default::default()
            },
            "device_launch needs use_graphs",
        ),
    ];
    for (o, want) in cases {
        let e = bad(o);
        assert!(matches!(e, GpuModelError::Config(_)), "{e:?}");
        assert!(e.to_string().contains(want), "{e}");
    }
    // The invariant option runs every projection in the fused form, which needs whole
    // 16-byte chunks per row: refused with the reason, before the device.
    let mut odd = synth_config(SynthArch::TinyLlama);
    odd.hidden_size = 60;
    let (odd, ow) = synth_weights_for(odd, 1, DType::Bf16);
    let inv = GpuModelOptions {
        batch_invariant_gemm: true,
        ..Default::default()
    };
    let e = GpuModel::new(odd.clone(), &ow, &inv).unwrap_err();
    assert!(matches!(e, GpuModelError::Config(_)), "{e:?}");
    assert!(e.to_string().contains("hidden_size 60"), "{e}");
    // Without it the fused form is simply not used: no refusal on that account.
    let fused = GpuModelOptions {
        fused_max_tokens: 2,
        ..Default::default()
    };
    if let Err(e) = GpuModel::new(odd, &ow, &fused) {
        assert!(!matches!(e, GpuModelError::Config(_)), "{e:?}");
    }
    // A head dimension the attention kernel does not handle.
    let mut big = cfg.clone();
    big.head_dim = 256;
    let e = GpuModel::new(big, &w, &GpuModelOptions::default()).unwrap_err();
    assert!(e.to_string().contains("head_dim 256"), "{e}");
    // Weights that do not match the config.
    let (other, _) = synth_weights(SynthArch::TinyQwen2, 1, DType::F32);
    let e = GpuModel::new(other, &w, &GpuModelOptions::default()).unwrap_err();
    assert!(matches!(e, GpuModelError::Config(_)), "{e:?}");
}
