//! `nvidia-smi -q -x`, the fallback GPU source where NVML cannot be loaded: a small reader for
//! the subset of XML that answer uses (elements, text, attributes, the declaration, a DOCTYPE,
//! the five predefined entities), and the mapping of one `<gpu>` element to the facts NVML gives.
//!
//! Values are read as `nvidia-smi` spells them (`16x`, `52 C`, `78.45 W`, `Active` /
//! `Not Active`, `Yes` / `No`); `N/A` and `[Not Supported]` mean the GPU does not report that
//! field, `[Unknown Error]` (and any unreadable value) means it could not be read.

/// One XML element.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Element {
    pub name: String,
    pub attributes: Vec<(String, String)>,
    pub children: Vec<Element>,
    /// The element's own text, trimmed (text between children is joined).
    pub text: String,
}

impl Element {
    pub fn child(&self, name: &str) -> Option<&Element> {
        self.children.iter().find(|c| c.name == name)
    }

    /// The text at a path of child names.
    pub fn text_at(&self, path: &[&str]) -> Option<&str> {
        let mut e = self;
        for name in path {
            e = e.child(name)?;
        }
        Some(e.text.as_str())
    }

    pub fn attribute(&self, name: &str) -> Option<&str> {
        self.attributes
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Deepest nesting accepted (the real answer is 6 deep).
const MAX_DEPTH: usize = 32;

fn unescape(text: &str) -> String {
    text.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&amp;", "&")
}

/// Parses a document into its root element.
pub fn parse(xml: &str) -> Result<Element, String> {
    let mut stack: Vec<Element> = vec![Element::default()];
    let mut rest = xml;
    while let Some(lt) = rest.find('<') {
        let text = rest[..lt].trim();
        if !text.is_empty() {
            let top = stack.last_mut().expect("the document element");
            if !top.text.is_empty() {
                top.text.push(' ');
            }
            top.text.push_str(&unescape(text));
        }
        rest = &rest[lt..];
        if let Some(after) = rest.strip_prefix("<?") {
            rest = &after[after.find("?>").ok_or("unterminated <?")? + 2..];
            continue;
        }
        if let Some(after) = rest.strip_prefix("<!--") {
            rest = &after[after.find("-->").ok_or("unterminated comment")? + 3..];
            continue;
        }
        if let Some(after) = rest.strip_prefix("<!") {
            rest = &after[after.find('>').ok_or("unterminated <!")? + 1..];
            continue;
        }
        let gt = rest.find('>').ok_or("unterminated tag")?;
        let tag = &rest[1..gt];
        rest = &rest[gt + 1..];
        if let Some(name) = tag.strip_prefix('/') {
            let done = stack.pop().ok_or("unbalanced end tag")?;
            if done.name != name.trim() || stack.is_empty() {
                return Err(format!(
                    "end tag </{}> does not close <{}>",
                    name.trim(),
                    done.name
                ));
            }
            stack.last_mut().expect("checked").children.push(done);
            continue;
        }
        let (tag, closed) = match tag.strip_suffix('/') {
            Some(t) => (t, true),
            None => (tag, false),
        };
        let mut parts = tag.splitn(2, char::is_whitespace);
        let name = parts.next().unwrap_or("").to_owned();
        if name.is_empty() {
            return Err("a tag without a name".into());
        }
        let attributes = parse_attributes(parts.next().unwrap_or(""));
        let element = Element {
            name,
            attributes,
            ..Element::default()
        };
        if closed {
            stack.last_mut().expect("open").children.push(element);
        } else {
            if stack.len() > MAX_DEPTH {
                return Err(format!("nested deeper than {MAX_DEPTH}"));
            }
            stack.push(element);
        }
    }
    if stack.len() != 1 {
        return Err(format!(
            "<{}> is not closed",
            stack.last().map_or("", |e| e.name.as_str())
        ));
    }
    let mut document = stack.pop().expect("one");
    match document.children.len() {
        1 => Ok(document.children.remove(0)),
        n => Err(format!("{n} root elements")),
    }
}

fn parse_attributes(mut text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    while let Some(eq) = text.find('=') {
        let name = text[..eq].trim().to_owned();
        let after = text[eq + 1..].trim_start();
        let Some(quote) = after.chars().next().filter(|c| *c == '"' || *c == '\'') else {
            break;
        };
        let Some(end) = after[1..].find(quote) else {
            break;
        };
        out.push((name, unescape(&after[1..=end])));
        text = &after[end + 2..];
    }
    out
}

/// A field as `nvidia-smi` prints it.
#[derive(Clone, Debug, PartialEq)]
pub enum Field<T> {
    Value(T),
    /// `N/A`, `[Not Supported]`, or absent: the GPU does not report it.
    NotReported,
    /// `[Unknown Error]`, or a value that does not read: nothing is known.
    Unknown,
}

fn word(text: Option<&str>) -> Field<&str> {
    match text.map(str::trim) {
        None | Some("" | "N/A" | "[N/A]" | "Not Supported" | "[Not Supported]") => {
            Field::NotReported
        }
        Some(t) if t.contains("Unknown Error") || t.starts_with('[') => Field::Unknown,
        Some(t) => Field::Value(t),
    }
}

/// A number with an optional unit after it (`16x`, `52 C`, `78.45 W`, `81559 MiB`).
pub fn number<T: std::str::FromStr>(text: Option<&str>) -> Field<T> {
    match word(text) {
        Field::Value(t) => {
            let digits =
                t.trim_end_matches(|c: char| c.is_ascii_alphabetic() || c == ' ' || c == '%');
            digits.parse().map_or(Field::Unknown, Field::Value)
        }
        Field::NotReported => Field::NotReported,
        Field::Unknown => Field::Unknown,
    }
}

/// `Yes`/`No`, `Active`/`Not Active`, `Enabled`/`Disabled`.
pub fn flag(text: Option<&str>) -> Field<bool> {
    match word(text) {
        Field::Value("Yes" | "Active" | "Enabled" | "True") => Field::Value(true),
        Field::Value("No" | "Not Active" | "Disabled" | "False") => Field::Value(false),
        Field::Value(_) | Field::Unknown => Field::Unknown,
        Field::NotReported => Field::NotReported,
    }
}

pub fn text(text: Option<&str>) -> Field<String> {
    match word(text) {
        Field::Value(t) => Field::Value(t.to_owned()),
        Field::NotReported => Field::NotReported,
        Field::Unknown => Field::Unknown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_xml_subset() {
        let doc = parse(
            "<?xml version=\"1.0\" ?>\n<!DOCTYPE x SYSTEM \"x.dtd\">\n<!-- c -->\
             <a><gpu id=\"00:06.0\"><n>1 &amp; 2</n><e/></gpu><gpu id='b'>  </gpu></a>",
        )
        .unwrap();
        assert_eq!(doc.name, "a");
        assert_eq!(doc.children.len(), 2);
        assert_eq!(doc.children[0].attribute("id"), Some("00:06.0"));
        assert_eq!(doc.children[0].text_at(&["n"]), Some("1 & 2"));
        assert_eq!(doc.children[1].attribute("id"), Some("b"));
        assert!(parse("<a><b></a>").is_err());
        assert!(parse("<a>").is_err());
        assert!(parse("<a></a><b></b>").is_err());
        assert!(parse(&"<a>".repeat(100)).is_err());
    }

    #[test]
    fn fields_as_nvidia_smi_spells_them() {
        assert_eq!(number::<u32>(Some("16x")), Field::Value(16));
        assert_eq!(number::<f64>(Some("78.45 W")), Field::Value(78.45));
        assert_eq!(number::<u64>(Some("0 %")), Field::Value(0));
        assert_eq!(number::<u32>(Some("N/A")), Field::NotReported);
        assert_eq!(number::<u32>(None), Field::NotReported);
        assert_eq!(number::<u32>(Some("[Unknown Error]")), Field::Unknown);
        assert_eq!(number::<u32>(Some("lots")), Field::Unknown);
        assert_eq!(flag(Some("Not Active")), Field::Value(false));
        assert_eq!(flag(Some("Yes")), Field::Value(true));
        assert_eq!(flag(Some("[Unknown Error]")), Field::Unknown);
        assert_eq!(flag(Some("[Not Supported]")), Field::NotReported);
    }
}
