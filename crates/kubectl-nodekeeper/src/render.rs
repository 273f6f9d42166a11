//! Output: aligned plain-text tables (coloured only on a terminal), and JSON/YAML for scripts.
//! Rendering is pure (`String` out) so the layout is tested without a cluster.

use std::io::{IsTerminal as _, Write as _};

use serde::Serialize;

use crate::cli::OutputFormat;
use crate::error::Error;

/// Where output goes and how it looks.
#[derive(Clone, Copy, Debug)]
pub struct Output {
    pub format: OutputFormat,
    /// ANSI colours: only when stdout is a terminal and `NO_COLOR` is unset.
    pub color: bool,
    /// Live progress on stderr: only when stderr is a terminal.
    pub progress: bool,
}

impl Output {
    pub fn new(format: OutputFormat) -> Output {
        let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
        Output {
            format,
            color: std::io::stdout().is_terminal() && !no_color,
            progress: std::io::stderr().is_terminal(),
        }
    }

    /// Plain output, as when piped.
    pub fn plain(format: OutputFormat) -> Output {
        Output {
            format,
            color: false,
            progress: false,
        }
    }

    pub fn wide(&self) -> bool {
        self.format == OutputFormat::Wide
    }

    /// Serialises `value` for `-o json|yaml`; `None` for the table formats.
    pub fn structured<T: Serialize>(&self, value: &T) -> Option<String> {
        match self.format {
            OutputFormat::Json => Some(
                serde_json::to_string_pretty(value).expect("JSON values always serialise") + "\n",
            ),
            OutputFormat::Yaml => {
                Some(serde_yaml::to_string(value).expect("JSON values always serialise"))
            }
            OutputFormat::Table | OutputFormat::Wide => None,
        }
    }

    /// Colours `text` when colour is on.
    pub fn paint(&self, text: &str, color: Option<Color>) -> String {
        match color {
            Some(c) if self.color => format!("\x1b[{}m{text}\x1b[0m", c.code()),
            _ => text.to_owned(),
        }
    }
}

/// Writes `text` to stdout.
pub fn print(text: &str) -> Result<(), Error> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(Error::WriteOutput)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Color {
    Green,
    Yellow,
    Red,
    Bold,
}

impl Color {
    fn code(self) -> &'static str {
        match self {
            Color::Green => "32",
            Color::Yellow => "33",
            Color::Red => "31",
            Color::Bold => "1",
        }
    }
}

/// The colour of a verdict (`ok`, `warning`, `critical`) or condition status word.
pub fn verdict_color(word: &str) -> Option<Color> {
    match word {
        "ok" | "True" | "Succeeded" | "yes" => Some(Color::Green),
        "warning" | "Unknown" | "Pending" | "Running" | "not evaluated" => Some(Color::Yellow),
        "critical" | "False" | "Failed" => Some(Color::Red),
        _ => None,
    }
}

/// The controller's verdict words as a person reads them.
pub fn verdict_word(verdict: &str) -> &str {
    match verdict {
        "unspecified" | "" => "not evaluated",
        other => other,
    }
}

/// One table cell: text and an optional colour.
#[derive(Clone, Debug)]
pub struct Cell {
    pub text: String,
    pub color: Option<Color>,
}

impl<T: Into<String>> From<T> for Cell {
    fn from(text: T) -> Cell {
        Cell {
            text: text.into(),
            color: None,
        }
    }
}

impl Cell {
    /// A cell coloured by its own word (see [`verdict_color`]).
    pub fn verdict(word: &str) -> Cell {
        Cell {
            text: word.to_owned(),
            color: verdict_color(word),
        }
    }
}

/// Columns separated by three spaces, as kubectl prints them; the last column is not padded.
#[derive(Clone, Debug, Default)]
pub struct Table {
    headers: Vec<String>,
    rows: Vec<Vec<Cell>>,
}

impl Table {
    pub fn new(headers: &[&str]) -> Table {
        Table {
            headers: headers.iter().map(|h| (*h).to_owned()).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<Cell>) {
        debug_assert_eq!(cells.len(), self.headers.len(), "{:?}", self.headers);
        self.rows.push(cells);
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The table, or nothing when it has no rows (a [`section`] then says `(none)`).
    pub fn render_or_empty(&self, out: &Output) -> String {
        if self.is_empty() {
            String::new()
        } else {
            self.render(out)
        }
    }

    pub fn render(&self, out: &Output) -> String {
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.text.chars().count());
            }
        }
        let mut text = String::new();
        let header: Vec<Cell> = self
            .headers
            .iter()
            .map(|h| Cell::from(h.as_str()))
            .collect();
        for row in std::iter::once(&header).chain(&self.rows) {
            let mut line = String::new();
            for (i, (cell, width)) in row.iter().zip(&widths).enumerate() {
                let last = i + 1 == row.len();
                let pad = if last {
                    0
                } else {
                    width - cell.text.chars().count()
                };
                line.push_str(&out.paint(&cell.text, cell.color));
                if !last {
                    line.push_str(&" ".repeat(pad + 3));
                }
            }
            text.push_str(line.trim_end());
            text.push('\n');
        }
        text
    }
}

/// `Label:   value` lines with the values aligned.
pub fn key_values(pairs: &[(&str, String)]) -> String {
    let width = pairs.iter().map(|(k, _)| k.len() + 1).max().unwrap_or(0);
    let mut text = String::new();
    for (k, v) in pairs {
        text.push_str(&format!("{:<width$}   {v}", format!("{k}:")));
        text = text.trim_end().to_owned();
        text.push('\n');
    }
    text
}

/// A section title (bold on a terminal) followed by `body`, or by `(none)` when empty.
pub fn section(out: &Output, title: &str, body: &str) -> String {
    let body = if body.is_empty() { "(none)\n" } else { body };
    format!("\n{}\n{body}", out.paint(title, Some(Color::Bold)))
}

/// Microseconds as a person reads them: `850us`, `1.2ms`, `3.40s`.
pub fn micros(us: u64) -> String {
    if us < 1_000 {
        format!("{us}us")
    } else if us < 1_000_000 {
        format!("{:.1}ms", us as f64 / 1_000.0)
    } else {
        format!("{:.2}s", us as f64 / 1_000_000.0)
    }
}

/// A percentage with one decimal.
pub fn percent(p: f64) -> String {
    format!("{p:.1}%")
}

/// Unix milliseconds as RFC 3339 (UTC, seconds); `-` for 0.
pub fn unix_ms(ms: i64) -> String {
    if ms <= 0 {
        return "-".to_owned();
    }
    let time = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms.unsigned_abs());
    humantime::format_rfc3339_seconds(time).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align_on_plain_text_and_colour_only_when_asked() {
        let mut t = Table::new(&["NAME", "VERDICT", "MESSAGE"]);
        t.row(vec!["load".into(), Cell::verdict("ok"), "".into()]);
        t.row(vec![
            "memory-pressure".into(),
            Cell::verdict("critical"),
            "high".into(),
        ]);
        let plain = t.render(&Output::plain(OutputFormat::Table));
        assert_eq!(
            plain,
            "NAME              VERDICT    MESSAGE\n\
             load              ok\n\
             memory-pressure   critical   high\n"
        );
        let mut coloured = Output::plain(OutputFormat::Table);
        coloured.color = true;
        let text = t.render(&coloured);
        assert!(text.contains("\x1b[31mcritical\x1b[0m   high"), "{text:?}");
    }

    #[test]
    fn figures_read_well() {
        assert_eq!(micros(850), "850us");
        assert_eq!(micros(1_250), "1.2ms");
        assert_eq!(micros(3_400_000), "3.40s");
        assert_eq!(unix_ms(1_700_000_000_000), "2023-11-14T22:13:20Z");
        assert_eq!(unix_ms(0), "-");
        assert_eq!(
            key_values(&[("Node", "n1".into()), ("Address", "".into())]),
            "Node:      n1\nAddress:\n"
        );
    }
}
