//! Provenance attached to every results file: date, machine, command, git revision.

use serde_json::{Value, json};

/// The git revision this binary was built from (`-dirty` when the tree had changes).
pub const GIT_REV: &str = env!("BGS_GIT_REV");

fn read_trim(path: &str) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
}

/// A description of this machine.
pub fn machine() -> Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    // The machine's CPUs, not this process's affinity (`--cpus` pins the load generator).
    let cpus = cpuinfo
        .lines()
        .filter(|l| l.starts_with("processor"))
        .count();
    let allowed = std::thread::available_parallelism().map_or(0, |n| n.get());
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map(|m| m.trim().to_string());
    json!({
        "hostname": read_trim("/proc/sys/kernel/hostname"),
        "kernel": read_trim("/proc/sys/kernel/osrelease"),
        "cpus": cpus,
        "cpus_allowed": allowed,
        "cpu_model": model,
    })
}

/// Wrap a report with provenance.
pub fn with_metadata(report: Value) -> Value {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    json!({
        "date_unix": now,
        "date_utc": utc(now),
        "git_revision": GIT_REV,
        "machine": machine(),
        "command": std::env::args().collect::<Vec<_>>(),
        "report": report,
    })
}

/// `YYYY-MM-DDTHH:MM:SSZ` for a Unix time (civil-from-days, proleptic Gregorian).
pub fn utc(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn utc_formats_known_dates() {
        assert_eq!(super::utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(super::utc(1_796_083_200), "2026-12-01T00:00:00Z");
        assert_eq!(super::utc(951_782_400), "2000-02-29T00:00:00Z");
    }
}
