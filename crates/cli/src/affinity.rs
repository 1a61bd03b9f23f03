//! `--cpus LIST`: pin this process (all threads it starts afterwards) to a set of CPUs, so
//! that client and server can run on disjoint CPUs when CPU per request is measured.

use anyhow::{Context, Result, bail};

/// Parse `0,2-3` into CPU numbers.
pub fn parse_cpu_list(list: &str) -> Result<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.trim().parse()?, b.trim().parse()?);
                if a > b {
                    bail!("bad CPU range {part}");
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(part.parse().with_context(|| format!("bad CPU {part:?}"))?),
        }
    }
    if cpus.is_empty() {
        bail!("empty CPU list");
    }
    Ok(cpus)
}

/// Pin the calling thread (and threads it creates later) to `list`.
pub fn pin(list: &str) -> Result<()> {
    let cpus = parse_cpu_list(list)?;
    let mut set = rustix::thread::CpuSet::new();
    for &c in &cpus {
        if c >= rustix::thread::CpuSet::MAX_CPU {
            bail!("CPU {c} is out of range");
        }
        set.set(c);
    }
    rustix::thread::sched_setaffinity(None, &set)
        .with_context(|| format!("pinning to CPUs {list}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_lists_and_ranges() {
        assert_eq!(super::parse_cpu_list("0,2-4").unwrap(), vec![0, 2, 3, 4]);
        assert!(super::parse_cpu_list("3-1").is_err());
        assert!(super::parse_cpu_list("x").is_err());
    }
}
