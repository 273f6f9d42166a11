//! kubectl's label-selector syntax (`a=b,c!=d,e in (f,g),h,!i`) turned into a [`LabelSelector`],
//! which matches labels locally ([`LabelSelector::matches`]) and writes the query string back
//! ([`LabelSelector::to_query`]). Shared by the plugin (a NetworkTest's `--selector`) and the
//! controller (`--node-selector`, checked when it starts and matched against Nodes that may have
//! left its selection).
//!
//! [`parse`] reads the string as the API server does (`labels.Parse` of k8s.io/apimachinery: the
//! same tokens, whitespace and grammar, so a selector means one thing here and there); [`check`]
//! also checks keys and values as the API server will. The forms the API server reads
//! specially are kept: an empty value in a set (`a in (b,)`, `a notin (,b)`; `a in ()` is the
//! set holding only the empty value), no space needed before `(` (`a in(b)`), tabs and newlines
//! as spaces, and a key given twice (`a=b,a=c`, which selects nothing). Set-based `>`/`<`
//! (integer comparisons the API server accepts in label selectors, and nothing else does) have
//! no [`LabelSelector`] form and are refused by [`parse`], saying so.

use std::collections::BTreeMap;

use crate::crd::common::{LabelSelector, LabelSelectorRequirement, SelectorOperator};

/// Parses `selector`; an empty string selects everything. The error says what is wrong where.
pub fn parse(selector: &str) -> Result<LabelSelector, String> {
    Parser::new(selector).selector()
}

/// The Nodes (or any objects) `selector` does not select, as one selector the API server can
/// list with, when there is one: a selector of one requirement turned around (`k=v` → `k!=v`,
/// `k in (..)` → `k notin (..)`, `k` → `!k`, and back). `None` for the empty selector (it
/// selects everything) and for two or more requirements (their complement is an "or", which a
/// label selector cannot say).
pub fn complement(selector: &LabelSelector) -> Option<LabelSelector> {
    let requirement = match (
        selector.match_labels.iter().next(),
        selector.match_expressions.as_slice(),
    ) {
        (Some((key, value)), []) if selector.match_labels.len() == 1 => LabelSelectorRequirement {
            key: key.clone(),
            operator: SelectorOperator::NotIn,
            values: vec![value.clone()],
        },
        (None, [one]) => {
            let operator = match one.operator {
                SelectorOperator::In => SelectorOperator::NotIn,
                SelectorOperator::NotIn => SelectorOperator::In,
                SelectorOperator::Exists => SelectorOperator::DoesNotExist,
                SelectorOperator::DoesNotExist => SelectorOperator::Exists,
            };
            LabelSelectorRequirement {
                operator,
                ..one.clone()
            }
        }
        _ => return None,
    };
    Some(LabelSelector {
        match_expressions: vec![requirement],
        ..LabelSelector::default()
    })
}

/// Checks `selector`'s keys and values as the API server checks a label selector: keys are
/// qualified names (`[prefix/]name`), values label values. The error names the bad part.
pub fn check(selector: &LabelSelector) -> Result<(), String> {
    let pairs = selector
        .match_labels
        .iter()
        .map(|(k, v)| (k, std::slice::from_ref(v)))
        .chain(
            selector
                .match_expressions
                .iter()
                .map(|r| (&r.key, r.values.as_slice())),
        );
    for (key, values) in pairs {
        // One key and one value at a time: the key checked beside an empty value (always valid).
        for value in std::iter::once("").chain(values.iter().map(String::as_str)) {
            let labels: BTreeMap<String, String> = [(key.clone(), value.to_owned())].into();
            let errors = crate::crd::node_class::check_labels("selector", &labels);
            if let Some(error) = errors.first() {
                return Err(error.message.clone());
            }
        }
    }
    Ok(())
}

/// One token of the selector syntax, as the API server's lexer cuts them.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Token {
    /// A key or a value: a run of characters that are neither blanks nor one of `=!(),<>`.
    Word(String),
    /// `in`, `notin`: keywords where an operator is due, words anywhere else (a key or value
    /// may be `in`).
    In,
    NotIn,
    /// `!` before a key.
    Not,
    /// `=` and `==`.
    Equals,
    NotEquals,
    /// `>` and `<`: valid for the API server, refused here (see the module doc).
    Compare(char),
    Open,
    Close,
    Comma,
    End,
}

impl Token {
    /// `in` and `notin` read as words: every place but an operator's.
    fn into_word(self) -> Token {
        match self {
            Token::In => Token::Word("in".into()),
            Token::NotIn => Token::Word("notin".into()),
            other => other,
        }
    }
}

/// The API server's blanks (`labels.isWhitespace`).
fn is_blank(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\r' | '\n')
}

fn is_special(c: char) -> bool {
    matches!(c, '=' | '!' | '(' | ')' | ',' | '<' | '>')
}

/// Cuts `text` into tokens, each with the byte offset where it starts (for error messages).
fn lex(text: &str) -> Vec<(Token, usize)> {
    let mut tokens = Vec::new();
    let mut chars = text.char_indices().peekable();
    loop {
        while chars.next_if(|(_, c)| is_blank(*c)).is_some() {}
        let Some((at, c)) = chars.next() else {
            tokens.push((Token::End, text.len()));
            return tokens;
        };
        let token = match c {
            '=' | '!' if chars.next_if(|(_, c)| *c == '=').is_some() => {
                if c == '!' {
                    Token::NotEquals
                } else {
                    Token::Equals
                }
            }
            '=' => Token::Equals,
            '!' => Token::Not,
            '(' => Token::Open,
            ')' => Token::Close,
            ',' => Token::Comma,
            '<' | '>' => Token::Compare(c),
            _ => {
                let mut end = at + c.len_utf8();
                while let Some((i, c)) = chars.next_if(|(_, c)| !is_blank(*c) && !is_special(*c)) {
                    end = i + c.len_utf8();
                }
                match &text[at..end] {
                    "in" => Token::In,
                    "notin" => Token::NotIn,
                    word => Token::Word(word.to_owned()),
                }
            }
        };
        tokens.push((token, at));
    }
}

/// A recursive-descent reading of the API server's grammar (`labels.Parser`):
///
/// ```text
/// selector    := "" | requirement ("," requirement)*
/// requirement := "!" KEY | KEY [ ("in" | "notin") "(" values ")" | ("=" | "==" | "!=") [VALUE] ]
/// values      := VALUE? ("," VALUE?)*      (an empty place is the empty value)
/// ```
struct Parser<'a> {
    text: &'a str,
    tokens: Vec<(Token, usize)>,
    next: usize,
}

impl<'a> Parser<'a> {
    fn new(text: &'a str) -> Self {
        Self {
            text,
            tokens: lex(text),
            next: 0,
        }
    }

    /// The next token, `in`/`notin` read as words.
    fn peek(&self) -> Token {
        self.tokens[self.next].0.clone().into_word()
    }

    /// Takes the next token as it is (`in`/`notin` as keywords).
    fn take_raw(&mut self) -> Token {
        let token = self.tokens[self.next].0.clone();
        if token != Token::End {
            self.next += 1;
        }
        token
    }

    /// Takes the next token, `in`/`notin` read as words.
    fn take(&mut self) -> Token {
        self.take_raw().into_word()
    }

    /// The text from the last token taken on, for error messages.
    fn here(&self) -> String {
        let at = self.tokens[self.next.saturating_sub(1)].1;
        format!("at {:?}", &self.text[at..])
    }

    fn selector(mut self) -> Result<LabelSelector, String> {
        let mut out = LabelSelector::default();
        match self.peek() {
            Token::End => return Ok(out),
            Token::Comma => {
                self.take();
                return Err(format!(
                    "empty requirement before the first comma ({})",
                    self.here()
                ));
            }
            _ => {}
        }
        loop {
            self.requirement(&mut out)?;
            match self.take() {
                Token::End => return Ok(out),
                Token::Comma => match self.peek() {
                    Token::Comma => {
                        self.take();
                        return Err(format!(
                            "empty requirement (two commas in a row?) {}",
                            self.here()
                        ));
                    }
                    Token::End => {
                        return Err("empty requirement after the last comma".into());
                    }
                    _ => {}
                },
                Token::Word(_) => {
                    return Err(format!(
                        "a value has no spaces, and requirements are separated by commas ({})",
                        self.here()
                    ));
                }
                Token::Close => {
                    return Err(format!(
                        "unbalanced parentheses: a ')' without its '(' ({})",
                        self.here()
                    ));
                }
                _ => {
                    return Err(format!(
                        "expected ',' or the end after a requirement ({})",
                        self.here()
                    ));
                }
            }
        }
    }

    /// Reads one requirement into `out`.
    fn requirement(&mut self, out: &mut LabelSelector) -> Result<(), String> {
        let negated = self.peek() == Token::Not;
        if negated {
            self.take();
        }
        let Token::Word(key) = self.take() else {
            return Err(format!(
                "a requirement has no valid label key ({}); write `key`, `!key`, `key=value`, \
                 `key!=value` or `key in (a,b)`",
                self.here()
            ));
        };
        let expression = |operator, values| LabelSelectorRequirement {
            key: key.clone(),
            operator,
            values,
        };
        if negated {
            // `!key` takes nothing after it; what follows is refused by the caller.
            out.match_expressions
                .push(expression(SelectorOperator::DoesNotExist, vec![]));
            return Ok(());
        }
        if matches!(self.peek(), Token::End | Token::Comma) {
            out.match_expressions
                .push(expression(SelectorOperator::Exists, vec![]));
            return Ok(());
        }
        match self.take_raw() {
            op @ (Token::In | Token::NotIn) => {
                let values = self.values()?;
                let operator = if op == Token::In {
                    SelectorOperator::In
                } else {
                    SelectorOperator::NotIn
                };
                out.match_expressions.push(expression(operator, values));
            }
            Token::Equals => {
                let value = self.exact_value()?;
                // A key given twice is two requirements for the API server (together they
                // select nothing when the values differ); the second goes where a key may repeat.
                match out.match_labels.get(&key) {
                    None => {
                        out.match_labels.insert(key.clone(), value);
                    }
                    Some(first) if *first == value => {}
                    Some(_) => out
                        .match_expressions
                        .push(expression(SelectorOperator::In, vec![value])),
                }
            }
            Token::NotEquals => {
                let value = self.exact_value()?;
                out.match_expressions
                    .push(expression(SelectorOperator::NotIn, vec![value]));
            }
            Token::Compare(c) => {
                return Err(format!(
                    "the integer comparison {c:?} ({}) is not supported here; use =, !=, in, \
                     notin, `key` or `!key`",
                    self.here()
                ));
            }
            _ => {
                return Err(format!(
                    "{key:?} is followed by no operator ({}); write `{key}`, `!{key}`, \
                     `{key}=value`, `{key}!=value` or `{key} in (a,b)` (a key has no spaces)",
                    self.here()
                ));
            }
        }
        Ok(())
    }

    /// `(a,b)` after `in`/`notin`. An empty place is the empty value, as for the API server:
    /// `()` and `(,)` are {""}, `(a,)` and `(,a)` are {a, ""}, `(a,,b)` is {a, "", b}.
    fn values(&mut self) -> Result<Vec<String>, String> {
        let unclosed = || "unbalanced parentheses: a '(' without its ')'".to_owned();
        if self.take() != Token::Open {
            return Err(format!("write the values as (a,b) ({})", self.here()));
        }
        let mut values: Vec<String> = Vec::new();
        // A set, as the API server's: each value once.
        let add = |values: &mut Vec<String>, value: String| {
            if !values.contains(&value) {
                values.push(value);
            }
        };
        match self.peek() {
            Token::Close => add(&mut values, String::new()),
            Token::Word(_) | Token::Comma => loop {
                match self.take() {
                    Token::Word(value) => {
                        add(&mut values, value);
                        match self.peek() {
                            Token::Comma => {}
                            Token::Close => break,
                            Token::End => return Err(unclosed()),
                            _ => {
                                self.take();
                                return Err(format!("expected ',' or ')' ({})", self.here()));
                            }
                        }
                    }
                    Token::Comma => {
                        // The API server's `parseIdentifiersList`, place for place.
                        if values.is_empty() {
                            add(&mut values, String::new());
                        }
                        match self.peek() {
                            Token::Close => {
                                add(&mut values, String::new());
                                break;
                            }
                            Token::Comma => {
                                self.take();
                                add(&mut values, String::new());
                            }
                            _ => {}
                        }
                    }
                    Token::End => return Err(unclosed()),
                    _ => return Err(format!("expected a value or ',' ({})", self.here())),
                }
            },
            Token::End => return Err(unclosed()),
            _ => {
                self.take();
                return Err(format!("expected a value, ',' or ')' ({})", self.here()));
            }
        }
        // The ')' seen above.
        self.take();
        Ok(values)
    }

    /// The value after `=`, `==` or `!=`; none (at a comma or the end) is the empty value.
    fn exact_value(&mut self) -> Result<String, String> {
        if matches!(self.peek(), Token::End | Token::Comma) {
            return Ok(String::new());
        }
        match self.take() {
            Token::Word(value) => {
                // `pool=gpu!`: the API server ends the value at the `!` and refuses what
                // follows; the value the user meant is the clearer thing to name.
                let at = self.tokens[self.next - 1].1;
                let (after, after_at) = &self.tokens[self.next];
                if *after_at == at + value.len() && !matches!(after, Token::Comma | Token::End) {
                    let meant: String = self.text[at..]
                        .chars()
                        .take_while(|c| !is_blank(*c) && *c != ',')
                        .collect();
                    return Err(format!(
                        "{meant:?} is not a valid label value: a value is letters, digits, \
                         '-', '_' and '.', beginning and ending with a letter or digit"
                    ));
                }
                Ok(value)
            }
            _ => Err(format!("expected a value ({})", self.here())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn expression(key: &str, operator: SelectorOperator, values: &[&str]) -> LabelSelector {
        LabelSelector {
            match_expressions: vec![LabelSelectorRequirement {
                key: key.into(),
                operator,
                values: values.iter().map(|v| (*v).to_owned()).collect(),
            }],
            ..LabelSelector::default()
        }
    }

    #[test]
    fn parsed_selectors_match_as_the_api_server_matches() {
        let s = parse("pool=gpu,zone in (a,b),tier!=web,!spot").unwrap();
        assert!(s.matches(&labels(&[("pool", "gpu"), ("zone", "a")])));
        assert!(s.matches(&labels(&[("pool", "gpu"), ("zone", "b"), ("tier", "db")])));
        // Each requirement fails on its own.
        assert!(!s.matches(&labels(&[("zone", "a")])));
        assert!(!s.matches(&labels(&[("pool", "cpu"), ("zone", "a")])));
        assert!(!s.matches(&labels(&[("pool", "gpu"), ("zone", "c")])));
        assert!(!s.matches(&labels(&[("pool", "gpu"), ("zone", "a"), ("tier", "web")])));
        assert!(!s.matches(&labels(&[("pool", "gpu"), ("zone", "a"), ("spot", "")])));
        let exists = parse("nodekeeper.dev/managed").unwrap();
        assert!(exists.matches(&labels(&[("nodekeeper.dev/managed", "")])));
        assert!(!exists.matches(&labels(&[])));
        assert!(parse("").unwrap().matches(&labels(&[])));
    }

    /// What `labels.Parse` of k8s.io/apimachinery makes of each form (its lexer and
    /// `parseIdentifiersList`), read here the same way.
    #[test]
    fn selectors_are_read_as_the_api_server_reads_them() {
        use SelectorOperator::{DoesNotExist, Exists, In, NotIn};
        for (text, want) in [
            // An empty place in a set is the empty value.
            ("pool notin (gpu,)", expression("pool", NotIn, &["gpu", ""])),
            ("pool in (,gpu)", expression("pool", In, &["", "gpu"])),
            ("pool in (a,,b)", expression("pool", In, &["a", "", "b"])),
            ("pool in (,,a)", expression("pool", In, &["", "a"])),
            ("pool in ()", expression("pool", In, &[""])),
            ("pool in (,)", expression("pool", In, &[""])),
            ("pool in (a,a)", expression("pool", In, &["a"])),
            // No space before the parenthesis; tabs and newlines are blanks.
            ("pool in(a)", expression("pool", In, &["a"])),
            ("pool notin(a)", expression("pool", NotIn, &["a"])),
            ("pool\tin\t(a, b)", expression("pool", In, &["a", "b"])),
            ("\n pool\t!=\tgpu ", expression("pool", NotIn, &["gpu"])),
            ("pool !=", expression("pool", NotIn, &[""])),
            // `in` and `notin` are words where no operator is due.
            ("in in (notin)", expression("in", In, &["notin"])),
            ("!in", expression("in", DoesNotExist, &[])),
            ("notin", expression("notin", Exists, &[])),
        ] {
            assert_eq!(parse(text), Ok(want), "{text:?}");
        }
        let exact = parse("pool = gpu,zone==").unwrap();
        assert_eq!(
            exact.match_labels,
            labels(&[("pool", "gpu"), ("zone", "")]),
            "{exact:?}"
        );
        // `notin (gpu,)` keeps a node whose pool label is empty out, as the API server does.
        let s = parse("pool notin (gpu,)").unwrap();
        assert!(!s.matches(&labels(&[("pool", "")])));
        assert!(!s.matches(&labels(&[("pool", "gpu")])));
        assert!(s.matches(&labels(&[("pool", "cpu")])));
        assert!(s.matches(&labels(&[])));
        // A key given twice: two requirements, which no node meets when the values differ.
        let twice = parse("a=b,a=c").unwrap();
        assert!(!twice.matches(&labels(&[("a", "b")])));
        assert!(!twice.matches(&labels(&[("a", "c")])));
        assert_eq!(parse("a=b,a=b").unwrap(), parse("a=b").unwrap());
        // The query string written back reads back the same: the watch and the local match
        // hold one selector.
        for text in [
            "pool notin (gpu,)",
            "pool in ()",
            "pool in (a,,b),zone=,!spot,ssd",
            "a=b,a=c",
            "pool!=",
        ] {
            let parsed = parse(text).unwrap();
            assert_eq!(parse(&parsed.to_query()), Ok(parsed), "{text:?}");
        }
    }

    #[test]
    fn what_the_api_server_refuses_is_refused_and_said_plainly() {
        for (bad, needle) in [
            ("a=b,,c", "empty requirement"),
            (",a", "empty requirement"),
            ("a,", "empty requirement"),
            ("zone in a,b", "write the values as (a,b)"),
            ("zone in (a", "unbalanced"),
            ("zone in (", "unbalanced"),
            ("zone in (a))", "unbalanced"),
            ("zone in (a,,)", "expected a value"),
            ("zone in (,,)", "expected a value"),
            ("zone in ((a))", "expected a value"),
            ("zone in (a b)", "expected ',' or ')'"),
            ("a>1", "integer comparison '>'"),
            ("a < 1", "integer comparison '<'"),
            ("=x", "no valid label key"),
            ("!a=b", "expected ',' or the end"),
            ("!!a", "no valid label key"),
            ("a=b=c", "\"b=c\" is not a valid label value"),
            ("pool=gpu!", "\"gpu!\" is not a valid label value"),
            ("a = b =c", "expected ',' or the end"),
            ("a=(b)", "expected a value"),
            ("a!b", "followed by no operator"),
            ("pool=gpu pool", "no spaces"),
        ] {
            let error = parse(bad).expect_err(bad);
            assert!(error.contains(needle), "{bad}: {error}");
        }
    }

    #[test]
    fn one_requirement_is_turned_around_and_two_are_not() {
        for (text, other) in [
            ("pool=gpu", "pool!=gpu"),
            ("pool!=gpu", "pool in (gpu)"),
            ("pool in (a,b)", "pool notin (a,b)"),
            ("pool notin (a,)", "pool in (a,)"),
            ("pool", "!pool"),
            ("!pool", "pool"),
        ] {
            let selector = parse(text).unwrap();
            let turned = complement(&selector).expect(text);
            assert_eq!(turned, parse(other).unwrap(), "{text}");
            // Exactly the label sets the one selects, the other does not.
            for set in [
                labels(&[]),
                labels(&[("pool", "gpu")]),
                labels(&[("pool", "")]),
                labels(&[("pool", "a")]),
                labels(&[("pool", "c")]),
                labels(&[("zone", "gpu")]),
            ] {
                assert_ne!(
                    selector.matches(&set),
                    turned.matches(&set),
                    "{text} {set:?}"
                );
            }
        }
        for text in ["", "pool=gpu,zone=a", "pool,!spot"] {
            assert_eq!(complement(&parse(text).unwrap()), None, "{text:?}");
        }
    }

    #[test]
    fn keys_and_values_are_checked_as_the_api_server_checks_them() {
        for good in [
            "a=b",
            "nodekeeper.dev/e2e-group=g-1",
            "a=",
            "zone in (a,b),!spot",
            "zone notin (a,)",
            "",
        ] {
            assert_eq!(check(&parse(good).unwrap()), Ok(()), "{good}");
        }
        for (bad, needle) in [
            ("Nodekeeper.Dev/x=y", "label key"),
            ("a=-b", "label value"),
            ("zone in (a,b_),x", "label value"),
            ("role=worker;x", "label value"),
        ] {
            let error = parse(bad)
                .and_then(|s| check(&s))
                .expect_err(bad)
                .to_string();
            assert!(error.contains(needle), "{bad}: {error}");
        }
    }
}
