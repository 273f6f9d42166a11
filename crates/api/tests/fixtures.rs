//! The CR fixtures under `tests/fixtures/` against the Rust types: valid ones parse and pass
//! `validate()`; invalid ones are refused by `validate()` or name a rule that exists in the
//! generated CRDs. (Acceptance by the real API server is tested in `tests/tests/crds.rs`.)

use std::fs;
use std::path::{Path, PathBuf};

use nodekeeper_api::crd::{
    self, FieldError, NetworkTest, NodeClass, NodeMaintenance, NodeNetworkConfig, NodeSet,
};

fn fixtures(dir: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(dir);
    let mut files: Vec<PathBuf> = fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no fixtures in {}", dir.display());
    files
}

/// Parses a fixture into its kind and runs the Rust-side validation there is for that kind.
fn parse_and_validate(value: serde_json::Value) -> Result<Result<(), Vec<FieldError>>, String> {
    let kind = value["kind"].as_str().unwrap_or_default().to_string();
    let parsed = match kind.as_str() {
        "NetworkTest" => serde_json::from_value::<NetworkTest>(value).map(|_| Ok(())),
        "NodeNetworkConfig" => {
            serde_json::from_value::<NodeNetworkConfig>(value).map(|o| o.spec.validate())
        }
        "NodeMaintenance" => {
            serde_json::from_value::<NodeMaintenance>(value).map(|o| o.spec.validate())
        }
        "NodeClass" => serde_json::from_value::<NodeClass>(value).map(|_| Ok(())),
        "NodeSet" => serde_json::from_value::<NodeSet>(value).map(|o| o.spec.validate()),
        other => return Err(format!("unknown kind {other:?}")),
    };
    parsed.map_err(|e| e.to_string())
}

fn read(path: &Path) -> (String, serde_json::Value) {
    let text = fs::read_to_string(path).unwrap();
    let value: serde_json::Value =
        serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{}: not YAML: {e}", path.display()));
    (text, value)
}

#[test]
fn valid_fixtures_parse_and_validate() {
    for path in fixtures("valid") {
        let (_, value) = read(&path);
        match parse_and_validate(value) {
            Ok(Ok(())) => {}
            Ok(Err(errors)) => panic!("{}: {}", path.display(), crd::format_field_errors(&errors)),
            Err(e) => panic!("{}: does not parse: {e}", path.display()),
        }
    }
}

#[test]
fn invalid_fixtures_say_what_rejects_them() {
    let crds = serde_json::to_string(&crd::all()).unwrap();
    for path in fixtures("invalid") {
        let (text, value) = read(&path);
        let mut lines = text.lines();
        let expect = lines
            .next()
            .and_then(|l| l.strip_prefix("# expect: "))
            .unwrap_or_else(|| panic!("{}: first line must be `# expect: …`", path.display()));
        let caught_by = lines
            .next()
            .and_then(|l| l.strip_prefix("# caught-by: "))
            .unwrap_or_else(|| panic!("{}: second line must be `# caught-by: …`", path.display()));
        let outcome = parse_and_validate(value);
        match caught_by {
            "validate" => {
                let errors = outcome
                    .unwrap_or_else(|e| panic!("{}: does not parse: {e}", path.display()))
                    .expect_err(&format!("{}: validate() accepted it", path.display()));
                let text = crd::format_field_errors(&errors);
                assert!(text.contains(expect), "{}: {text}", path.display());
            }
            "schema" => {
                // A CEL rule's message must exist verbatim in the generated CRDs; the other
                // expectations are the API server's own OpenAPI messages.
                let generic = [
                    "in body should",
                    "Unsupported value",
                    "Required value",
                    "Duplicate value",
                ];
                if !generic.iter().any(|g| expect.contains(g)) {
                    let escaped = serde_json::to_string(expect).unwrap();
                    let escaped = &escaped[1..escaped.len() - 1];
                    assert!(
                        crds.contains(escaped),
                        "{}: no rule in deploy/crds says {expect:?}",
                        path.display()
                    );
                }
                // Serde refuses unknown enum values and missing fields as well.
                if expect.contains("Unsupported value") || expect.contains("Required value") {
                    assert!(outcome.is_err(), "{}: serde accepted it", path.display());
                }
            }
            other => panic!("{}: unknown caught-by {other:?}", path.display()),
        }
    }
}
