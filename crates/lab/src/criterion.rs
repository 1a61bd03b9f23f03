//! The success criterion: a small boolean expression over comparison statistics, written in
//! the experiment file before the run.
//!
//! ```text
//! expr       := and ("or" and)*
//! and        := factor ("and" factor)*
//! factor     := "(" expr ")" | comparison
//! comparison := STAT ("<" | "<=" | ">" | ">=") NUMBER
//! STAT       := METRIC "_" ("ratio" | "ratio_lower" | "ratio_upper" | "diff" | "diff_lower"
//!               | "diff_upper" | "baseline" | "treatment")
//! ```
//! METRIC is one of [`crate::metrics::METRICS`]. A comparison whose statistic is not a number
//! (too few valid blocks, a zero in a ratio) is *undecided*, and so is the whole criterion
//! unless the rest decides it regardless.

use anyhow::{Result, bail};
use serde::Serialize;

use crate::metrics::METRICS;

const SUFFIXES: &[&str] = &[
    "ratio_lower",
    "ratio_upper",
    "ratio",
    "diff_lower",
    "diff_upper",
    "diff",
    "baseline",
    "treatment",
];

/// Split `cpu_ratio_upper` into (`cpu`, `ratio_upper`) if it names a known statistic.
pub fn split_stat(s: &str) -> Option<(&str, &str)> {
    for suf in SUFFIXES {
        if let Some(m) = s.strip_suffix(suf).and_then(|m| m.strip_suffix('_'))
            && METRICS.iter().any(|d| d.name == m)
        {
            return Some((m, suf));
        }
    }
    None
}

/// True if `s` names a statistic.
pub fn is_stat(s: &str) -> bool {
    split_stat(s).is_some()
}

/// A comparison operator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Cmp {
    /// `<`
    Lt,
    /// `<=`
    Le,
    /// `>`
    Gt,
    /// `>=`
    Ge,
}

impl Cmp {
    fn symbol(self) -> &'static str {
        match self {
            Cmp::Lt => "<",
            Cmp::Le => "<=",
            Cmp::Gt => ">",
            Cmp::Ge => ">=",
        }
    }
    fn holds(self, a: f64, b: f64) -> bool {
        match self {
            Cmp::Lt => a < b,
            Cmp::Le => a <= b,
            Cmp::Gt => a > b,
            Cmp::Ge => a >= b,
        }
    }
}

/// A parsed criterion.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub enum Expr {
    /// STAT CMP NUMBER.
    Cmp(String, Cmp, f64),
    /// All of.
    And(Vec<Expr>),
    /// Any of.
    Or(Vec<Expr>),
}

/// One comparison as evaluated: the numbers that decided it.
#[derive(Clone, Debug, Serialize)]
pub struct Evaluated {
    /// The comparison as written.
    pub text: String,
    /// The statistic's value (NaN: not computable).
    pub value: f64,
    /// Some(true/false), or None when undecided.
    pub holds: Option<bool>,
}

fn tokenize(s: &str) -> Result<Vec<String>> {
    let mut out = Vec::new();
    let cs: Vec<char> = s.chars().collect();
    let mut i = 0;
    while i < cs.len() {
        let c = cs[i];
        if c.is_whitespace() {
            i += 1;
        } else if c == '(' || c == ')' {
            out.push(c.to_string());
            i += 1;
        } else if c == '<' || c == '>' {
            if cs.get(i + 1) == Some(&'=') {
                out.push(format!("{c}="));
                i += 2;
            } else {
                out.push(c.to_string());
                i += 1;
            }
        } else if c.is_ascii_alphanumeric() || c == '_' || c == '.' || c == '-' || c == '+' {
            let start = i;
            while i < cs.len() && (cs[i].is_ascii_alphanumeric() || "_.-+".contains(cs[i])) {
                i += 1;
            }
            out.push(cs[start..i].iter().collect());
        } else {
            bail!("unexpected character {c:?}");
        }
    }
    Ok(out)
}

struct Parser {
    toks: Vec<String>,
    pos: usize,
}

impl Parser {
    fn peek(&self) -> Option<&str> {
        self.toks.get(self.pos).map(String::as_str)
    }
    fn next(&mut self) -> Option<String> {
        let t = self.toks.get(self.pos).cloned();
        self.pos += 1;
        t
    }
    fn expr(&mut self) -> Result<Expr> {
        let mut v = vec![self.and()?];
        while self.peek() == Some("or") {
            self.pos += 1;
            v.push(self.and()?);
        }
        Ok(if v.len() == 1 {
            v.remove(0)
        } else {
            Expr::Or(v)
        })
    }
    fn and(&mut self) -> Result<Expr> {
        let mut v = vec![self.factor()?];
        while self.peek() == Some("and") {
            self.pos += 1;
            v.push(self.factor()?);
        }
        Ok(if v.len() == 1 {
            v.remove(0)
        } else {
            Expr::And(v)
        })
    }
    fn factor(&mut self) -> Result<Expr> {
        match self.next() {
            Some(t) if t == "(" => {
                let e = self.expr()?;
                if self.next().as_deref() != Some(")") {
                    bail!("missing ')'");
                }
                Ok(e)
            }
            Some(stat) => {
                if !is_stat(&stat) {
                    bail!(
                        "{stat:?} is not a statistic (METRIC_ratio, _ratio_lower, _ratio_upper, \
                         _diff, _diff_lower, _diff_upper, _baseline or _treatment; metrics: {})",
                        METRICS
                            .iter()
                            .map(|m| m.name)
                            .collect::<Vec<_>>()
                            .join(", ")
                    );
                }
                let cmp = match self.next().as_deref() {
                    Some("<") => Cmp::Lt,
                    Some("<=") => Cmp::Le,
                    Some(">") => Cmp::Gt,
                    Some(">=") => Cmp::Ge,
                    other => bail!("after {stat}: expected <, <=, > or >=, got {other:?}"),
                };
                let num = self.next().unwrap_or_default();
                let v: f64 = num
                    .parse()
                    .map_err(|_| anyhow::anyhow!("after {stat}: {num:?} is not a number"))?;
                Ok(Expr::Cmp(stat, cmp, v))
            }
            None => bail!("unexpected end of expression"),
        }
    }
}

impl Expr {
    /// Parse an expression.
    pub fn parse(s: &str) -> Result<Expr> {
        let toks = tokenize(s)?;
        if toks.is_empty() {
            bail!("empty expression");
        }
        let mut p = Parser { toks, pos: 0 };
        let e = p.expr()?;
        if let Some(t) = p.peek() {
            bail!("unexpected {t:?}");
        }
        Ok(e)
    }

    /// Evaluate with `lookup(stat) -> value`. Returns Some(met) or None (undecided), and every
    /// comparison with its number.
    pub fn eval(&self, lookup: &dyn Fn(&str) -> f64) -> (Option<bool>, Vec<Evaluated>) {
        let mut log = Vec::new();
        let r = self.eval_into(lookup, &mut log);
        (r, log)
    }

    fn eval_into(&self, lookup: &dyn Fn(&str) -> f64, log: &mut Vec<Evaluated>) -> Option<bool> {
        match self {
            Expr::Cmp(stat, cmp, bound) => {
                let value = lookup(stat);
                let holds = (!value.is_nan()).then(|| cmp.holds(value, *bound));
                log.push(Evaluated {
                    text: format!("{stat} {} {bound}", cmp.symbol()),
                    value,
                    holds,
                });
                holds
            }
            // Three-valued logic: false wins an `and`, true wins an `or`.
            Expr::And(v) => {
                let rs: Vec<Option<bool>> = v.iter().map(|e| e.eval_into(lookup, log)).collect();
                if rs.contains(&Some(false)) {
                    Some(false)
                } else if rs.contains(&None) {
                    None
                } else {
                    Some(true)
                }
            }
            Expr::Or(v) => {
                let rs: Vec<Option<bool>> = v.iter().map(|e| e.eval_into(lookup, log)).collect();
                if rs.contains(&Some(true)) {
                    Some(true)
                } else if rs.contains(&None) {
                    None
                } else {
                    Some(false)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_evaluates_the_papers_criterion() {
        let e = Expr::parse(
            "(cpu_ratio_upper < 0.90 and p99_ratio_upper <= 1.05 or \
             p99_ratio_upper < 0.90 and cpu_ratio_upper <= 1.05) and throughput_ratio >= 0.98",
        )
        .unwrap();
        let vals = |cpu: f64, p99: f64, tp: f64| {
            move |s: &str| match s {
                "cpu_ratio_upper" => cpu,
                "p99_ratio_upper" => p99,
                "throughput_ratio" => tp,
                _ => f64::NAN,
            }
        };
        assert_eq!(e.eval(&vals(0.85, 1.0, 1.0)).0, Some(true));
        assert_eq!(e.eval(&vals(1.0, 0.8, 0.99)).0, Some(true));
        assert_eq!(e.eval(&vals(0.95, 1.0, 1.0)).0, Some(false));
        assert_eq!(e.eval(&vals(0.85, 1.0, 0.9)).0, Some(false));
        // NaN throughput: undecided, unless another part already fails.
        assert_eq!(e.eval(&vals(0.85, 1.0, f64::NAN)).0, None);
        assert_eq!(e.eval(&vals(0.95, 1.2, f64::NAN)).0, Some(false));
        let (_, log) = e.eval(&vals(0.85, 1.0, 1.0));
        assert_eq!(log[0].text, "cpu_ratio_upper < 0.9");
        assert_eq!(log[0].value, 0.85);
    }

    #[test]
    fn rejects_bad_expressions() {
        for bad in [
            "",
            "cpu_ratio_upper",
            "cpu_ratio_upper < x",
            "cpu_ratio_uper < 1",
            "(cpu_ratio < 1",
            "cpu_ratio < 1 and",
            "cpu_ratio < 1 junk",
            "cpu_ratio == 1",
        ] {
            assert!(Expr::parse(bad).is_err(), "{bad:?} parsed");
        }
        assert_eq!(split_stat("p99_diff_upper"), Some(("p99", "diff_upper")));
        assert_eq!(split_stat("host_cpu_ratio"), Some(("host_cpu", "ratio")));
    }
}
