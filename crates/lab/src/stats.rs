//! Paired statistics over blocks: means, 95% intervals for differences and for ratios.
//!
//! Every block runs each condition once, so block *i* gives a pair (baseline_i, treatment_i).
//! - **Difference**: d_i = treatment_i − baseline_i; the interval is the paired t interval
//!   mean(d) ± t(0.975, n−1) · sd(d) / √n.
//! - **Ratio**: the paired log-ratio t interval, exponentiated: l_i = ln(treatment_i /
//!   baseline_i), interval exp(mean(l) ± t · sd(l) / √n), point exp(mean(l)) (the geometric
//!   mean of the per-block ratios). It needs every value to be positive; otherwise the ratio
//!   is undefined (NaN), never silently computed from the remaining blocks.
//!
//! The intervals are nominal (no correction for the number of cells or metrics looked at).

use serde::Serialize;
use statrs::distribution::{ContinuousCDF, StudentsT};

/// Two-sided 95% critical value of Student's t with `df` degrees of freedom (NaN for df 0).
pub fn t_quantile_975(df: usize) -> f64 {
    t_quantile(0.975, df)
}

/// The `p` quantile of Student's t with `df` degrees of freedom (NaN for df 0).
pub fn t_quantile(p: f64, df: usize) -> f64 {
    if df == 0 {
        return f64::NAN;
    }
    match StudentsT::new(0.0, 1.0, df as f64) {
        Ok(t) => t.inverse_cdf(p),
        Err(_) => f64::NAN,
    }
}

/// Arithmetic mean (NaN when empty).
pub fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        f64::NAN
    } else {
        xs.iter().sum::<f64>() / xs.len() as f64
    }
}

/// Sample standard deviation (n − 1 in the denominator; NaN below two values).
pub fn sd(xs: &[f64]) -> f64 {
    if xs.len() < 2 {
        return f64::NAN;
    }
    let m = mean(xs);
    (xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (xs.len() - 1) as f64).sqrt()
}

/// A point estimate with a 95% interval.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Interval {
    /// Point estimate.
    pub point: f64,
    /// Lower 95% bound.
    pub lower: f64,
    /// Upper 95% bound.
    pub upper: f64,
    /// Pairs used.
    pub n: usize,
}

impl Interval {
    /// All NaN: not computable.
    pub fn undefined(n: usize) -> Self {
        Interval {
            point: f64::NAN,
            lower: f64::NAN,
            upper: f64::NAN,
            n,
        }
    }
}

/// One-sample t interval of the mean of `xs`.
pub fn mean_interval(xs: &[f64]) -> Interval {
    let n = xs.len();
    if n == 0 || xs.iter().any(|x| !x.is_finite()) {
        return Interval::undefined(n);
    }
    let m = mean(xs);
    if n < 2 {
        return Interval {
            point: m,
            lower: f64::NAN,
            upper: f64::NAN,
            n,
        };
    }
    let half = t_quantile_975(n - 1) * sd(xs) / (n as f64).sqrt();
    Interval {
        point: m,
        lower: m - half,
        upper: m + half,
        n,
    }
}

/// Paired difference `treatment − baseline` with its 95% t interval. The slices are the
/// per-block values in block order and must have the same length.
pub fn paired_diff(baseline: &[f64], treatment: &[f64]) -> Interval {
    if baseline.len() != treatment.len() {
        return Interval::undefined(0);
    }
    let d: Vec<f64> = baseline.iter().zip(treatment).map(|(b, t)| t - b).collect();
    mean_interval(&d)
}

/// Paired ratio `treatment / baseline`: the log-ratio t interval, exponentiated.
pub fn paired_ratio(baseline: &[f64], treatment: &[f64]) -> Interval {
    if baseline.len() != treatment.len() {
        return Interval::undefined(0);
    }
    let n = baseline.len();
    if baseline
        .iter()
        .chain(treatment)
        .any(|v| v.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) || !v.is_finite())
    {
        return Interval::undefined(n);
    }
    let l: Vec<f64> = baseline
        .iter()
        .zip(treatment)
        .map(|(b, t)| (t / b).ln())
        .collect();
    let i = mean_interval(&l);
    Interval {
        point: i.point.exp(),
        lower: i.lower.exp(),
        upper: i.upper.exp(),
        n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol
    }

    #[test]
    fn t_quantiles_match_tables() {
        // Standard two-sided 95% critical values.
        for (df, want) in [
            (1, 12.706_204_736),
            (2, 4.302_652_730),
            (4, 2.776_445_105),
            (9, 2.262_157_163),
            (30, 2.042_272_456),
        ] {
            let got = t_quantile_975(df);
            assert!(close(got, want, 1e-6), "df {df}: {got} vs {want}");
        }
        assert!(close(t_quantile(0.5, 7), 0.0, 1e-9));
        assert!(t_quantile_975(0).is_nan());
    }

    #[test]
    fn paired_interval_worked_by_hand() {
        // d = 2, 4, 3, 5, 1: mean 3, sd sqrt(10/4) = 1.5811388, se = 0.7071068,
        // t(0.975, 4) = 2.7764451, half-width 1.9632432.
        let b = [10.0, 10.0, 10.0, 10.0, 10.0];
        let t = [12.0, 14.0, 13.0, 15.0, 11.0];
        let i = paired_diff(&b, &t);
        assert_eq!(i.n, 5);
        assert!(close(i.point, 3.0, 1e-12));
        assert!(close(i.lower, 3.0 - 1.963_243_2, 1e-6), "{i:?}");
        assert!(close(i.upper, 3.0 + 1.963_243_2, 1e-6), "{i:?}");
        // A single pair has a point but no interval.
        let one = paired_diff(&[1.0], &[2.0]);
        assert_eq!(one.point, 1.0);
        assert!(one.lower.is_nan());
        assert!(paired_diff(&[1.0], &[1.0, 2.0]).point.is_nan());
    }

    #[test]
    fn ratio_interval_worked_by_hand() {
        // Ratios 2 and 8: logs ln2 and ln8 = 3 ln2, mean 2 ln2 (point 4), sd = sqrt(2) ln2,
        // se = ln2, t(0.975, 1) = 12.7062047: interval exp(2 ln2 ± 12.7062047 ln2).
        let i = paired_ratio(&[1.0, 1.0], &[2.0, 8.0]);
        let l2 = std::f64::consts::LN_2;
        assert!(close(i.point, 4.0, 1e-12));
        assert!(close(i.lower.ln(), 2.0 * l2 - 12.706_204_736 * l2, 1e-6));
        assert!(close(i.upper.ln(), 2.0 * l2 + 12.706_204_736 * l2, 1e-6));
        // Identical ratios: zero width.
        let same = paired_ratio(&[2.0, 4.0, 8.0], &[1.0, 2.0, 4.0]);
        assert!(close(same.point, 0.5, 1e-12) && close(same.lower, 0.5, 1e-12));
        // A zero makes the ratio undefined rather than computed from the rest.
        assert!(paired_ratio(&[0.0, 1.0], &[1.0, 1.0]).point.is_nan());
        assert!(paired_ratio(&[f64::NAN, 1.0], &[1.0, 1.0]).upper.is_nan());
    }
}
