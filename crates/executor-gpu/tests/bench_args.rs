//! `bgs-gpu-bench` refuses numbers outside their documented ranges before touching a GPU.

use std::process::Command;

#[test]
fn out_of_range_numbers_are_refused() {
    for (args, flag) in [
        (&["rtt", "--slots", "100000"][..], "--slots"),
        (&["rtt", "--slots", "0"][..], "--slots"),
        (&["rtt", "--schedulers", "65"][..], "--schedulers"),
        (&["rtt", "--repeat", "257"][..], "--repeat"),
        (&["rtt", "--n", "0"][..], "--n"),
        (&["throughput", "--seconds", "1e9"][..], "--seconds"),
        (&["throughput", "--seconds", "NaN"][..], "--seconds"),
        (&["throughput", "--outstanding", "-1"][..], "--outstanding"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_bgs-gpu-bench"))
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(flag), "{args:?}: {err}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
}
