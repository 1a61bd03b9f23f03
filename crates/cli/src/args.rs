//! Argument parsers shared by the subcommands: every number has a range (written in its
//! `--help` line) and is rejected before anything starts when it is outside it; addresses
//! accept host names and `:PORT`; flags that do nothing in a combination are refused.

use std::fmt::Display;
use std::net::{SocketAddr, ToSocketAddrs};
use std::str::FromStr;

use clap::ArgMatches;
use clap::parser::ValueSource;

/// An integer in `lo..=hi`.
pub fn int<T>(lo: T, hi: T) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync + 'static
where
    T: FromStr + PartialOrd + Display + Copy + Send + Sync + 'static,
    T::Err: Display,
{
    move |s: &str| {
        let v: T = s
            .trim()
            .parse()
            .map_err(|e| format!("{e} (expected an integer in {lo}..={hi})"))?;
        if v < lo || v > hi {
            return Err(format!("{v} is outside {lo}..={hi}"));
        }
        Ok(v)
    }
}

/// A power of two in `lo..=hi`.
pub fn pow2(lo: u32, hi: u32) -> impl Fn(&str) -> Result<u32, String> + Clone + Send + Sync {
    let range = int(lo, hi);
    move |s: &str| {
        let v = range(s)?;
        if !v.is_power_of_two() {
            return Err(format!("{v} is not a power of two ({lo}..={hi})"));
        }
        Ok(v)
    }
}

/// A finite number with `lo < v <= hi`.
pub fn positive(hi: f64) -> impl Fn(&str) -> Result<f64, String> + Clone + Send + Sync {
    move |s: &str| {
        let v: f64 = s.trim().parse().map_err(|e| format!("{e}"))?;
        if !(v.is_finite() && v > 0.0 && v <= hi) {
            return Err(format!("{s} is outside 0 < value <= {hi}"));
        }
        Ok(v)
    }
}

/// A finite number with `0 <= v <= hi`.
pub fn non_negative(hi: f64) -> impl Fn(&str) -> Result<f64, String> + Clone + Send + Sync {
    move |s: &str| {
        let v: f64 = s.trim().parse().map_err(|e| format!("{e}"))?;
        if !(v.is_finite() && (0.0..=hi).contains(&v)) {
            return Err(format!("{s} is outside 0..={hi}"));
        }
        Ok(v)
    }
}

/// `--listen`: `IP:PORT`, `HOST:PORT` (resolved; the first IPv4 address wins, else the first
/// address) or `:PORT`, which means every IPv4 interface (`0.0.0.0:PORT`).
pub fn listen_addr(s: &str) -> Result<SocketAddr, String> {
    address(s, "0.0.0.0")
}

/// `--target`: like [`listen_addr`], but `:PORT` means this host (`127.0.0.1:PORT`).
pub fn target_addr(s: &str) -> Result<SocketAddr, String> {
    address(s, "127.0.0.1")
}

fn address(s: &str, bare_port_host: &str) -> Result<SocketAddr, String> {
    let s = s.trim();
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(a);
    }
    let Some((host, port)) = s.rsplit_once(':') else {
        return Err(format!("{s:?} is not HOST:PORT, IP:PORT or :PORT"));
    };
    let port: u16 = port
        .parse()
        .map_err(|_| format!("{port:?} is not a port number (0..=65535)"))?;
    let host = if host.is_empty() {
        bare_port_host
    } else {
        host
    };
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {host:?}: {e}"))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| format!("{host:?} resolves to no address"))
}

/// Whether the flag with field name `id` was given on the command line (not defaulted).
pub fn given(m: &ArgMatches, id: &str) -> bool {
    m.value_source(id) == Some(ValueSource::CommandLine)
}

/// The first flag of `flags` (field names) that was given, as `--flag-name`.
pub fn first_given(m: &ArgMatches, flags: &[&str]) -> Option<String> {
    flags
        .iter()
        .find(|id| given(m, id))
        .map(|id| format!("--{}", id.replace('_', "-")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges() {
        let slots = int(1usize, 512);
        assert_eq!(slots("512"), Ok(512));
        assert!(slots("0").is_err());
        assert!(slots("100000").unwrap_err().contains("1..=512"));
        assert!(slots("-1").is_err());
        assert!(slots("x").is_err());
        let p = pow2(2, 65536);
        assert_eq!(p("4096"), Ok(4096));
        assert!(p("1000").unwrap_err().contains("power of two"));
        assert!(p("131072").is_err());
        let rate = positive(1e7);
        assert_eq!(rate("1e3"), Ok(1000.0));
        for bad in ["0", "-1", "1e12", "NaN", "inf"] {
            assert!(rate(bad).is_err(), "{bad}");
        }
        assert_eq!(non_negative(10.0)("0"), Ok(0.0));
    }

    #[test]
    fn addresses() {
        assert_eq!(
            listen_addr(":7700").unwrap(),
            "0.0.0.0:7700".parse().unwrap()
        );
        assert_eq!(
            target_addr(":7700").unwrap(),
            "127.0.0.1:7700".parse().unwrap()
        );
        assert_eq!(
            listen_addr("localhost:7700").unwrap(),
            "127.0.0.1:7700".parse().unwrap()
        );
        assert_eq!(
            listen_addr("[::1]:80").unwrap(),
            "[::1]:80".parse().unwrap()
        );
        assert!(listen_addr("7700").is_err());
        assert!(listen_addr("localhost:99999").is_err());
    }
}
