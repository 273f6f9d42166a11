//! Golden files of the piped (plain) output: `tests/golden/<name>.txt`. Run the unit tests with
//! `NODEKEEPER_UPDATE_GOLDEN=1` to rewrite them after an intended change, and review the diff.

use std::path::Path;

pub fn check(name: &str, actual: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(format!("{name}.txt"));
    if std::env::var_os("NODEKEEPER_UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, actual).expect("write golden file");
        return;
    }
    let expected =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    assert!(
        !actual.contains('\x1b'),
        "piped output has escape codes: {actual:?}"
    );
    pretty_assertions::assert_eq!(actual, expected, "{name}: the piped output changed");
}
