//! kubectl's label-selector syntax (`a=b,c!=d,e in (f,g),h,!i`) turned into a [`LabelSelector`],
//! which matches labels locally ([`LabelSelector::matches`]) and writes the query string back
//! ([`LabelSelector::to_query`]). Shared by the plugin (a NetworkTest's `--selector`) and the
//! controller (`--node-selector`, checked when it starts and matched against Nodes that may have
//! left its selection).
//!
//! [`parse`] only splits the string into requirements; [`check`] also checks keys and values as
//! the API server will. Set-based `>`/`<` (integer comparisons the API server accepts in label
//! selectors, and nothing else does) have no [`LabelSelector`] form and are refused by [`check`].

use std::collections::BTreeMap;

use crate::crd::common::{LabelSelector, LabelSelectorRequirement, SelectorOperator};

/// Parses `selector`; an empty string selects everything. The error says what is wrong with
/// which part.
pub fn parse(selector: &str) -> Result<LabelSelector, String> {
    let mut out = LabelSelector::default();
    for term in split_terms(selector)? {
        let term = term.trim();
        if term.is_empty() {
            return Err("empty requirement (two commas in a row?)".into());
        }
        let requirement = |key: &str, operator, values: Vec<String>| {
            let key = key.trim();
            if key.is_empty() || key.contains(char::is_whitespace) {
                return Err(format!("{term:?} has no valid label key"));
            }
            Ok(LabelSelectorRequirement {
                key: key.to_owned(),
                operator,
                values,
            })
        };
        if let Some(key) = term.strip_prefix('!') {
            out.match_expressions
                .push(requirement(key, SelectorOperator::DoesNotExist, vec![])?);
        } else if let Some((key, values)) = set_term(term, " notin ") {
            out.match_expressions
                .push(requirement(key, SelectorOperator::NotIn, values?)?);
        } else if let Some((key, values)) = set_term(term, " in ") {
            out.match_expressions
                .push(requirement(key, SelectorOperator::In, values?)?);
        } else if let Some((key, value)) = term.split_once("!=") {
            out.match_expressions.push(requirement(
                key,
                SelectorOperator::NotIn,
                vec![value.trim().to_owned()],
            )?);
        } else if let Some((key, value)) = term.split_once("==").or_else(|| term.split_once('=')) {
            let key = requirement(key, SelectorOperator::Exists, vec![])?.key;
            let value = value.trim();
            if value.contains(char::is_whitespace) {
                return Err(format!("{term:?}: a value has no spaces"));
            }
            if out
                .match_labels
                .insert(key.clone(), value.to_owned())
                .is_some()
            {
                return Err(format!("label {key:?} given twice"));
            }
        } else {
            out.match_expressions
                .push(requirement(term, SelectorOperator::Exists, vec![])?);
        }
    }
    Ok(out)
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

/// Splits on commas outside parentheses.
fn split_terms(selector: &str) -> Result<Vec<&str>, String> {
    if selector.trim().is_empty() {
        return Ok(Vec::new());
    }
    let mut terms = Vec::new();
    let (mut depth, mut start) = (0i32, 0usize);
    for (i, c) in selector.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                terms.push(&selector[start..i]);
                start = i + 1;
            }
            _ => {}
        }
        if !(0..=1).contains(&depth) {
            return Err("unbalanced parentheses".into());
        }
    }
    if depth != 0 {
        return Err("unbalanced parentheses".into());
    }
    terms.push(&selector[start..]);
    Ok(terms)
}

/// `key in (a,b)` → (`key`, [a, b]).
fn set_term<'a>(term: &'a str, op: &str) -> Option<(&'a str, Result<Vec<String>, String>)> {
    let (key, rest) = term.split_once(op)?;
    let rest = rest.trim();
    let values = rest
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .map(|inner| {
            inner
                .split(',')
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
                .collect::<Vec<_>>()
        })
        .filter(|v| !v.is_empty())
        .ok_or_else(|| format!("{term:?}: write the values as ({})", "a,b"));
    Some((key, values))
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

    #[test]
    fn keys_and_values_are_checked_as_the_api_server_checks_them() {
        for good in [
            "a=b",
            "nodekeeper.dev/e2e-group=g-1",
            "a=",
            "zone in (a,b),!spot",
            "",
        ] {
            assert_eq!(check(&parse(good).unwrap()), Ok(()), "{good}");
        }
        for (bad, needle) in [
            ("pool=gpu pool", "no spaces"),
            ("Nodekeeper.Dev/x=y", "label key"),
            ("a=-b", "label value"),
            ("zone in (a,b_),x", "label value"),
            ("a>1", "label key"),
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
