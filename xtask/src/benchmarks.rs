//! `BENCHMARKS.md`: each benchmark owns one `## <name>` section and rewrites only that.

use std::path::Path;

/// Replaces the `## <name>` section of `<root>/BENCHMARKS.md` with `section` (which starts with
/// that heading), appending it if the file has no such section yet.
pub fn write_section(root: &Path, name: &str, section: &str) -> anyhow::Result<()> {
    let path = root.join("BENCHMARKS.md");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|_| "# Benchmarks\n".to_owned());
    std::fs::write(&path, replace_section(&text, name, section))?;
    Ok(())
}

/// `text` with its `## <name>` section (up to the next `## ` heading) replaced by `section`.
fn replace_section(text: &str, name: &str, section: &str) -> String {
    let header = format!("## {name}\n");
    let Some(start) = text.find(&header) else {
        return format!("{}\n\n{}\n", text.trim_end(), section.trim_end());
    };
    let after = start + header.len();
    match text[after..].find("\n## ") {
        Some(offset) => format!(
            "{}{}\n\n{}",
            &text[..start],
            section.trim_end(),
            &text[after + offset + 1..]
        ),
        None => format!("{}{}\n", &text[..start], section.trim_end()),
    }
}

#[cfg(test)]
mod tests {
    use super::replace_section;

    const DOC: &str = "# Benchmarks\n\n## agent\n\nold agent\n\n## netconf\n\nold netconf\n";

    #[test]
    fn replaces_only_the_named_section() {
        let out = replace_section(DOC, "agent", "## agent\n\nnew agent\n");
        assert_eq!(
            out,
            "# Benchmarks\n\n## agent\n\nnew agent\n\n## netconf\n\nold netconf\n"
        );
        let out = replace_section(DOC, "netconf", "## netconf\n\nnew netconf\n");
        assert_eq!(
            out,
            "# Benchmarks\n\n## agent\n\nold agent\n\n## netconf\n\nnew netconf\n"
        );
    }

    #[test]
    fn appends_a_missing_section() {
        let out = replace_section(DOC, "fleet", "## fleet\n\nfigures\n");
        assert_eq!(out, format!("{}\n## fleet\n\nfigures\n", DOC));
    }
}
