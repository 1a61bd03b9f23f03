//! Every shipped experiment file parses and validates, and expands to at least one run.

#[test]
fn shipped_experiments_are_valid() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../experiments");
    let mut n = 0;
    for ent in std::fs::read_dir(&dir).unwrap() {
        let p = ent.unwrap().path();
        if p.extension().is_none_or(|x| x != "toml") {
            continue;
        }
        let e = bgs_lab::Experiment::load(&p).unwrap_or_else(|err| panic!("{err:#}"));
        let (cells, runs) = bgs_lab::run::plan(&e, None);
        assert!(!cells.is_empty() && runs.len() == cells.len() * e.blocks * e.conditions.len());
        n += 1;
    }
    assert!(n >= 5, "only {n} experiment files");
}
