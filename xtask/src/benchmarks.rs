//! `BENCHMARKS.md`: each benchmark owns one `## <name>` section (or one `### ` block inside it)
//! and rewrites only that.

use std::path::Path;

/// Replaces the `## <name>` section of `<root>/BENCHMARKS.md` with `section` (which starts with
/// that heading), appending it if the file has no such section yet.
pub fn write_section(root: &Path, name: &str, section: &str) -> anyhow::Result<()> {
    let path = root.join("BENCHMARKS.md");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|_| "# Benchmarks\n".to_owned());
    std::fs::write(&path, replace_section(&text, name, section))?;
    Ok(())
}

/// Replaces the `### <sub>` block inside the `## <name>` section (creating the section from
/// `intro`, which starts with its heading, when it is missing): for benchmarks that keep one
/// block per parameter, such as the fleet's `### N = 1000` and `### N = 10000`.
pub fn write_subsection(
    root: &Path,
    name: &str,
    intro: &str,
    sub: &str,
    block: &str,
) -> anyhow::Result<()> {
    let path = root.join("BENCHMARKS.md");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|_| "# Benchmarks\n".to_owned());
    let section = find_block(&text, "## ", name).unwrap_or(intro);
    let section = replace_block(section, "### ", sub, block);
    std::fs::write(&path, replace_block(&text, "## ", name, &section))?;
    Ok(())
}

/// `text` with its `## <name>` section (up to the next `## ` heading) replaced by `section`.
fn replace_section(text: &str, name: &str, section: &str) -> String {
    replace_block(text, "## ", name, section)
}

/// The block headed `<marker><title>`, up to the next heading with the same marker.
fn find_block<'a>(text: &'a str, marker: &str, title: &str) -> Option<&'a str> {
    let header = format!("{marker}{title}\n");
    let start = text.find(&header)?;
    let after = start + header.len();
    let end = text[after..]
        .find(&format!("\n{marker}"))
        .map_or(text.len(), |offset| after + offset + 1);
    Some(&text[start..end])
}

/// `text` with its `<marker><title>` block replaced by `block` (which starts with that
/// heading), or with `block` appended when there is none.
fn replace_block(text: &str, marker: &str, title: &str, block: &str) -> String {
    let Some(found) = find_block(text, marker, title) else {
        return format!("{}\n\n{}\n", text.trim_end(), block.trim_end());
    };
    let start = found.as_ptr() as usize - text.as_ptr() as usize;
    let rest = &text[start + found.len()..];
    if rest.is_empty() {
        format!("{}{}\n", &text[..start], block.trim_end())
    } else {
        format!("{}{}\n\n{}", &text[..start], block.trim_end(), rest)
    }
}

#[cfg(test)]
mod tests {
    use super::{find_block, replace_block, replace_section};

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
    fn replaces_only_the_named_block_inside_a_section() {
        let doc =
            "# B\n\n## fleet\n\nintro\n\n### N = 1\n\none\n\n### N = 2\n\ntwo\n\n## next\n\nx\n";
        let section = find_block(doc, "## ", "fleet").unwrap();
        assert_eq!(
            section,
            "## fleet\n\nintro\n\n### N = 1\n\none\n\n### N = 2\n\ntwo\n\n"
        );
        let section = replace_block(section, "### ", "N = 1", "### N = 1\n\nnew\n");
        assert_eq!(
            section,
            "## fleet\n\nintro\n\n### N = 1\n\nnew\n\n### N = 2\n\ntwo\n\n"
        );
        let section = replace_block(&section, "### ", "N = 3", "### N = 3\n\nthree\n");
        assert!(
            section.ends_with("two\n\n### N = 3\n\nthree\n"),
            "{section}"
        );
    }

    #[test]
    fn appends_a_missing_section() {
        let out = replace_section(DOC, "fleet", "## fleet\n\nfigures\n");
        assert_eq!(out, format!("{}\n## fleet\n\nfigures\n", DOC));
    }
}
