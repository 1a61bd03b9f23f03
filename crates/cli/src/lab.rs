//! `bgs lab`: run controlled comparisons from experiment files and report on them
//! (`docs/lab.md`; the harness itself is the `bgs-lab` crate).

use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use bgs_lab::{Experiment, RunOptions};
use clap::Subcommand;

#[derive(clap::Args, Debug, Clone)]
pub struct LabArgs {
    #[command(subcommand)]
    command: LabCommand,
}

#[derive(Subcommand, Debug, Clone)]
enum LabCommand {
    /// Run an experiment (paired, counterbalanced blocks), then write its report.
    Run {
        /// The experiment file (TOML).
        file: PathBuf,
        /// Results directory (raw per-run records go to DIR/runs as they complete).
        #[arg(long)]
        out: PathBuf,
        /// Finish an interrupted run in DIR: runs whose record exists are skipped.
        #[arg(long)]
        resume: bool,
        /// Confirmation: re-run the cells of `[confirm]` with its new seeds.
        #[arg(long)]
        confirm: bool,
        /// Confirmation: pick the cells from this screen's results with `[confirm] rule`.
        #[arg(long, requires = "confirm")]
        confirm_from: Option<PathBuf>,
        /// Do not write the report at the end.
        #[arg(long)]
        no_report: bool,
    },
    /// Write DIR/report.md, CSV, JSON and SVG plots from the raw records in DIR.
    Report {
        /// Results directory of `bgs lab run`.
        dir: PathBuf,
    },
    /// Validate an experiment file and print its cells and run order.
    Check {
        /// The experiment file.
        file: PathBuf,
    },
}

pub fn run(args: &LabArgs) -> Result<()> {
    match &args.command {
        LabCommand::Check { file } => {
            let e = Experiment::load(file)?;
            let (cells, runs) = bgs_lab::run::plan(&e, None);
            println!(
                "{}: valid; {} cell(s), {} condition(s), {} blocks, {} runs",
                file.display(),
                cells.len(),
                e.conditions.len(),
                e.blocks,
                runs.len()
            );
            for c in &cells {
                println!("  cell {}", c.id);
            }
            if let Some(c) = cells.first() {
                for (i, cond) in e.conditions.iter().enumerate() {
                    println!(
                        "  {}: bgs serve {} {} | bgs load {}",
                        cond.name,
                        e.server.args.join(" "),
                        cond.args.join(" "),
                        bgs_lab::run::load_args(&e, c, i, e.seed_of(0, None)).join(" ")
                    );
                }
            }
            Ok(())
        }
        LabCommand::Report { dir } => {
            let a = bgs_lab::write_report(dir)?;
            print_summary(&a);
            println!("wrote {}", dir.join("report.md").display());
            Ok(())
        }
        LabCommand::Run {
            file,
            out,
            resume,
            confirm,
            confirm_from,
            no_report,
        } => {
            let source = std::fs::read_to_string(file)
                .with_context(|| format!("reading {}", file.display()))?;
            let e = Experiment::parse(&source).with_context(|| file.display().to_string())?;
            let confirm_cells = if *confirm {
                let Some(cf) = &e.confirm else {
                    bail!("--confirm: {} has no [confirm] section", file.display());
                };
                if !cf.cells.is_empty() {
                    Some(cf.cells.clone())
                } else {
                    let Some(screen) = confirm_from else {
                        bail!(
                            "--confirm: [confirm] has a rule but no cells; give --confirm-from SCREEN_DIR"
                        );
                    };
                    let a = bgs_lab::report::analyse(screen)?;
                    let rule = cf.rule.as_deref().unwrap_or("lowest:cpu_ratio_upper");
                    let picked = bgs_lab::report::pick_cells(&a, rule, cf.count.unwrap_or(3))?;
                    eprintln!("lab: confirming cells {picked:?} (rule {rule})");
                    Some(picked)
                }
            } else {
                None
            };
            let opts = RunOptions {
                bgs: std::env::current_exe().context("locating the bgs binary")?,
                out: out.clone(),
                confirm_cells,
                resume: *resume,
                progress: std::io::stderr().is_terminal(),
                log: true,
            };
            let recs = bgs_lab::run(&e, &source, &opts)?;
            let invalid = recs.iter().filter(|r| !r.valid).count();
            eprintln!(
                "lab: {} runs written to {} ({invalid} invalid)",
                recs.len(),
                out.join("runs").display()
            );
            if !*no_report {
                let a = bgs_lab::write_report(out)?;
                print_summary(&a);
                println!("wrote {}", out.join("report.md").display());
            }
            Ok(())
        }
    }
}

fn print_summary(a: &bgs_lab::Analysis) {
    for c in &a.cells {
        if let Some(v) = &c.verdict {
            println!("cell {}: criterion {}", c.cell.id, v.outcome);
        }
    }
}
